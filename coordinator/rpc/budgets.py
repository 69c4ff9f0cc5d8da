"""The coordinator's per-peer budgets: which limit each node RPC gets, from ``[admission]``.

:func:`configure_gate` configures the host's :class:`~echo.p2p.budget.Gate` (every handler of
the host is charged there before its request is read). The figures are far above what an honest
node asks (it registers once, asks for leases and reports its status every few seconds, submits
about a group a second) and far below what costs the coordinator real work.
"""

from __future__ import annotations

from echo.coordinator.config import AdmissionSection
from echo.p2p.budget import Gate, Limit
from echo.protocol import broadcast as b
from echo.protocol import ids

# Small requests are a few hundred bytes; their byte budget is 64 KiB per request of burst.
_SMALL = 64 * 1024


def node_limits(cfg: AdmissionSection) -> dict[str, Limit]:
    """The per-peer :class:`Limit` of each node RPC."""
    small = Limit(
        requests_per_s=cfg.requests_per_s,
        burst_requests=cfg.burst_requests,
        bytes_per_s=cfg.requests_per_s * _SMALL,
        burst_bytes=cfg.burst_requests * _SMALL,
    )
    register = Limit(
        requests_per_s=cfg.registers_per_minute / 60.0,
        burst_requests=max(1.0, cfg.registers_per_minute / 4),
        bytes_per_s=cfg.registers_per_minute / 60.0 * _SMALL,
        burst_bytes=max(1.0, cfg.registers_per_minute / 4) * _SMALL,
    )
    submit = Limit(
        requests_per_s=cfg.requests_per_s,
        burst_requests=cfg.burst_requests,
        bytes_per_s=cfg.submit_bytes_per_s,
        burst_bytes=cfg.submit_burst_bytes,
    )
    return {
        ids.PROTO_REGISTER: register,
        ids.PROTO_LEASE: small,
        ids.PROTO_STATUS: small,
        ids.PROTO_MANIFEST: small,
        ids.PROTO_BAD_PEER: small,
        ids.PROTO_SUBMIT: submit,
        b.PROTO_HAVE: small,
    }


def configure_gate(gate: Gate, cfg: AdmissionSection) -> Gate:
    """Give ``gate`` (a host's) the coordinator's limits and backoff from ``cfg``; returns it."""
    for rpc, limit in node_limits(cfg).items():
        gate.set_limit(rpc, limit)
    gate.prefix_factor = cfg.prefix_factor
    gate.loopback_is_network = cfg.loopback_is_network
    gate.backoff_base_s = cfg.backoff_s
    gate.backoff_max_s = cfg.max_backoff_s
    gate.resize(cfg.max_tracked_peers)
    return gate

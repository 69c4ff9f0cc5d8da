"""Can this node be dialled? Dial-backs on a fresh connection (the AutoNAT idea).

py-libp2p 0.8.1 ships ``libp2p.host.autonat``, but its server answers every request "OK" without
dialling: it dials back with ``host.connect``, which returns at once when a connection to the
peer exists -- and the request itself arrived on one. So the verdict would be "public" for every
node behind NAT. Here the dialling peer dials from a host of its own (:class:`DialBack`, a
throwaway identity with no connection to anyone), so a success proves that a stranger can open
a connection to the address and that the key behind it is the asker's (Noise).

As AutoNAT prescribes, only addresses on the IP the request came from are dialled (else a
dial-back service would dial anything for anyone): the advertised addresses on that IP, then
that IP with each advertised port (a port forwarded on the router). At most
:data:`MAX_CANDIDATES` dials, in parallel, :data:`DIAL_TIMEOUT_S` each, and requests are
budgeted per peer (:data:`DIALBACK_LIMIT`).

Owns: the prober host of :func:`open_dialback`. Raises nothing for a bad address (it is
skipped); :func:`ask_dialback` raises the :mod:`echo.p2p.rpc` errors of the request.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from echo.p2p.budget import Limit
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.protocol import messages as m
from echo.protocol.nat import (
    MAX_DIALBACK_ADDRS,
    PROTO_DIALBACK,
    DialBackReply,
    DialBackRequest,
    Verdict,
)

log = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0
MAX_CANDIDATES = 4
# A dial-back costs the server up to MAX_CANDIDATES dials: a few per minute per peer is plenty
# (a node asks once at join and when its addresses change).
DIALBACK_LIMIT = Limit(requests_per_s=0.1, burst_requests=4, bytes_per_s=2048, burst_bytes=8192)
_REQUEST_MAX = 4096
_REPLY_MAX = 2048


def observed_ip(host: EchoHost, peer_id: ID | str) -> str | None:
    """The remote IP of a live connection to ``peer_id`` (None without one or an address)."""
    pid = peer_id if isinstance(peer_id, ID) else ID.from_base58(peer_id)
    for conn in host.libp2p.get_network().connections.get(pid, []):
        try:
            remote = conn.muxed_conn.get_remote_address()
        except Exception:  # transports without addresses (tests' memory pipes)
            continue
        if remote:
            return str(ipaddress.ip_address(remote[0]))
    return None


def _ip_port(addr: str) -> tuple[str, int] | None:
    """(ip, tcp port) of an /ip4|ip6/.../tcp/... address, None for anything else."""
    try:
        ma = Multiaddr(addr)
        names = [p.name for p in ma.protocols()]
        family = "ip4" if "ip4" in names else "ip6" if "ip6" in names else None
        if family is None or "tcp" not in names:
            return None
        return str(ipaddress.ip_address(ma.value_for_protocol(family))), int(
            ma.value_for_protocol("tcp")
        )
    except Exception:  # malformed: skipped, as documented
        return None


def candidates(addrs: Sequence[str], observed: str) -> list[tuple[str, Verdict]]:
    """The addresses worth dialling for an asker seen from ``observed`` and what success means:
    advertised ones on that IP ("public"), then that IP with each advertised port
    ("forwarded"), without /p2p parts, at most :data:`MAX_CANDIDATES`."""
    out: list[tuple[str, Verdict]] = []
    ports: list[int] = []
    family = "ip6" if ":" in observed else "ip4"
    for addr in addrs[:MAX_DIALBACK_ADDRS]:
        parsed = _ip_port(addr)
        if parsed is None:
            continue
        ip, port = parsed
        if ip == observed:
            out.append((f"/{family}/{ip}/tcp/{port}", "public"))
        elif port not in ports:
            ports.append(port)
    seen = {a for a, _ in out}
    for port in ports:
        addr = f"/{family}/{observed}/tcp/{port}"
        if addr not in seen:
            out.append((addr, "forwarded"))
    return out[:MAX_CANDIDATES]


class DialBack:
    """Dials askers back from its own host (see the module docstring)."""

    def __init__(self, prober: EchoHost, timeout: float = DIAL_TIMEOUT_S) -> None:
        self.prober = prober
        self.timeout = timeout

    async def probe(
        self, peer_id: str, addrs: Sequence[str], observed: str | None
    ) -> DialBackReply:
        """Dial ``peer_id`` back on ``addrs`` (filtered by :func:`candidates`); never raises."""
        if observed is None:
            return DialBackReply(
                verdict="unknown", reachable=False, detail="no observed address to dial back"
            )
        cands = candidates(addrs, observed)
        if not cands:
            return DialBackReply(
                verdict="nat",
                reachable=False,
                observed_ip=observed,
                detail=f"no TCP address to try on {observed} (advertised: "
                + (", ".join(addrs[:3]) or "none")
                + ")",
            )
        won: list[tuple[str, Verdict]] = []
        errors: list[str] = []

        pid = ID.from_base58(peer_id)
        network = self.prober.libp2p.get_network()

        async def dial(addr: str, verdict: Verdict, cancel: trio.CancelScope) -> None:
            # The swarm's dial_addr dials exactly this address (host.connect would dial every
            # address the peerstore holds for the peer, and reuse a live connection).
            try:
                with trio.fail_after(self.timeout):
                    await network.dial_addr(Multiaddr(addr), pid)
            except trio.TooSlowError:
                errors.append(f"{addr}: no answer in {self.timeout:g} s")
                return
            except Exception as exc:  # refused, unreachable, wrong key: all mean "not this one"
                errors.append(f"{addr}: {type(exc).__name__}: {exc}"[:120])
                return
            won.append((addr, verdict))
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            for addr, verdict in cands:
                nursery.start_soon(dial, addr, verdict, nursery.cancel_scope)
        with trio.move_on_after(2):
            try:
                await network.close_peer(pid)
            except Exception:  # not connected, or already gone
                log.debug("dial-back disconnect from %s failed", peer_id[-8:], exc_info=True)
        if won:
            addr, verdict = won[0]
            return DialBackReply(verdict=verdict, reachable=True, observed_ip=observed, dialed=addr)
        on_ip = any(v == "public" for _, v in cands)
        return DialBackReply(
            verdict="unreachable" if on_ip else "nat",
            reachable=False,
            observed_ip=observed,
            detail=("; ".join(errors))[:250],
        )


@asynccontextmanager
async def open_dialback(
    listen: str = "/ip4/127.0.0.1/tcp/0", timeout: float = DIAL_TIMEOUT_S
) -> AsyncIterator[DialBack]:
    """A :class:`DialBack` with a prober host of a throwaway identity, for the block's duration.
    (It listens because py-libp2p hosts must; nobody is told the address.)"""
    async with open_host(Identity.generate(), [listen], pubsub=False) as prober:
        yield DialBack(prober, timeout)


def serve_dialback(host: EchoHost, dialback: DialBack) -> None:
    """Answer :data:`PROTO_DIALBACK` on ``host`` with ``dialback``, budgeted per peer."""
    host.gate.set_limit(PROTO_DIALBACK, DIALBACK_LIMIT)

    async def handle(peer_id: ID, data: bytes) -> bytes:
        req = m.decode(DialBackRequest, data)
        reply = await dialback.probe(str(peer_id), req.addrs, observed_ip(host, peer_id))
        return m.encode(reply)

    host.set_handler(
        PROTO_DIALBACK,
        handle,
        max_request=_REQUEST_MAX,
        max_response=_REPLY_MAX,
        handler_timeout=DIAL_TIMEOUT_S * 2 + 5,
    )


async def ask_dialback(
    host: EchoHost, server: ID | str, addrs: Sequence[str] | None = None, timeout: float = 20.0
) -> DialBackReply:
    """Ask ``server`` (connected or dialable) to dial ``host`` back on ``addrs`` (default: its
    listen addresses).

    :raises RpcError: the request failed (see :meth:`EchoHost.request`).
    :raises SchemaError: the reply is not a :class:`DialBackReply`.
    """
    mine = list(addrs if addrs is not None else host.listen_multiaddrs)[:MAX_DIALBACK_ADDRS]
    raw = await host.request(
        server,
        PROTO_DIALBACK,
        m.encode(DialBackRequest(addrs=mine)),
        timeout=timeout,
        max_response=_REPLY_MAX,
    )
    return m.decode(DialBackReply, raw)


__all__ = [
    "DialBack",
    "ask_dialback",
    "candidates",
    "observed_ip",
    "open_dialback",
    "serve_dialback",
]

"""What every attacker of :mod:`echo.tools.attackers` shares: its counters (:class:`Stats`),
the address its connections leave from (``--source-ip``), and the calls it makes of the
coordinator."""

from __future__ import annotations

import contextvars
import ipaddress
import itertools
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from echo.p2p.host import EchoHost
from echo.p2p.identity import Identity
from echo.p2p.rpc import RpcError
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.tools import peer_kit

# A refused connection (the coordinator's handshake rate and connection cap for the attackers'
# network) is tried again after this long: an attacker does not give up after one refusal.
RETRY_S = 2.0


class Stats:
    """Counters one attacker keeps, written to ``path`` every second (and at the end)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {
            "kind": kind,
            "requests": 0,
            "answered": 0,
            "errors": 0,
            "bytes_in": 0,
            "identities": 0,
            "leases_held": 0,
        }

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def count(self, table: str, key: str, n: int = 1) -> None:
        """One more ``key`` in the sub-table ``table`` (reasons, outcomes)."""
        t = self.data.setdefault(table, {})
        t[key] = t.get(key, 0) + n

    async def keep_written(self) -> None:
        while True:
            self.write()
            await trio.sleep(1.0)

    def write(self) -> None:
        elapsed = time.monotonic() - self.t0
        self.data["elapsed_s"] = round(elapsed, 1)
        self.data["identities_per_s"] = round(self.data["identities"] / max(elapsed, 1e-9), 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------- where connections come from

# The address this task's connections leave from (None: the kernel's choice). A context
# variable, so that a churn visit or a leech identity can have an address of its own while the
# others keep theirs: trio tasks inherit it from the task that started them, and a host's
# connections are opened from tasks its ``open_host`` block started.
SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("source", default=None)


def dial_from(source: str) -> Callable[[], str]:
    """Every TCP connection this process opens leaves from ``source`` (py-libp2p's TCP
    transport dials with ``trio.open_tcp_stream``, looked up on each dial). ``source`` is an
    address, or a network whose addresses are handed out in turn; returns the function that
    hands out the next one (always the same address for an address)."""
    net = ipaddress.ip_network(source, strict=False)
    hosts: Iterator[Any] = itertools.cycle(net.hosts()) if net.num_addresses > 1 else iter(())
    first = str(next(hosts)) if net.num_addresses > 1 else str(net.network_address)

    def next_address() -> str:
        return str(next(hosts)) if net.num_addresses > 1 else first

    SOURCE.set(first)
    real = trio.open_tcp_stream

    async def open_from(host, port, **kw):
        source_ip = SOURCE.get()
        if source_ip:
            kw.setdefault("local_address", source_ip)
        return await real(host, port, **kw)

    trio.open_tcp_stream = open_from
    return next_address


_next_source: Callable[[], str] | None = None


def use_source(source: str) -> None:
    """From now on, connections leave from ``source`` (``--source-ip``), and each fresh
    identity that calls :func:`new_source` takes the next address of its network."""
    global _next_source
    _next_source = dial_from(source)


def listen_addrs() -> list[str]:
    """Where a host listens: the address it dials from, as a machine there would (a node whose
    declared address is not the one it dials from is taken for one behind NAT, which changes
    how the coordinator treats it)."""
    return [f"/ip4/{SOURCE.get() or '127.0.0.1'}/tcp/0"]


def new_source() -> None:
    """The calling task (and what it starts) dials from the next address of ``--source-ip``'s
    network: a fresh identity from a network of its own."""
    if _next_source is not None:
        SOURCE.set(_next_source())


# ---------------------------------------------------------------- shared calls


def registration(ident: Identity, host: EchoHost, upload_bps: float = 0.0) -> bytes:
    big = m.Hardware(cpu_count=8, ram_bytes=1 << 34)
    addrs = host.listen_multiaddrs
    return peer_kit.registration(
        ident, addrs, software="attacker", upload_bps=upload_bps, hardware=big
    )


async def call_rpc(
    host: EchoHost, peer, proto: str, payload: bytes, stats: Stats, timeout: float = 10.0
) -> bytes | None:
    stats.add("requests")
    try:
        reply = await host.request(peer, proto, payload, timeout=timeout, max_response=16 << 20)
    except (RpcError, ProtocolError, OSError) as exc:
        stats.add("errors")
        # What refused us (a budget, an exclusion), numbers left out, for the summary.
        why = getattr(exc, "message", "") or type(exc).__name__
        stats.count("refusals", re.sub(r"[0-9.]+", "#", why)[:48])
        return None
    stats.add("answered")
    return reply


async def connect(host: EchoHost, addr: str, stats: Stats, tries: int = 1):
    """The peer at ``addr``, or None after ``tries`` refused dials (RETRY_S apart)."""
    for attempt in range(tries):
        if attempt:
            await trio.sleep(RETRY_S)
        try:
            return await host.connect(addr)
        except (RpcError, ValueError, OSError):
            stats.add("errors")
    return None


async def fetch_job_info(host: EchoHost, peer, ident: Identity, job_id: str, stats: Stats):
    """Register ``ident``; the job's JobInfo (None when refused or not listed)."""
    data = await call_rpc(host, peer, ids.PROTO_REGISTER, registration(ident, host), stats)
    if data is None:
        return None
    return next((j for j in m.decode(m.RegisterReply, data).jobs if j.job_id == job_id), None)


async def fetch_manifest(host: EchoHost, peer, job_id: str, stats: Stats) -> m.Manifest | None:
    """The job's newest signed manifest (its version and state digest are what a submission
    must name), unverified: the attacker has no reason to check the learner's signature."""
    data = await call_rpc(
        host,
        peer,
        ids.PROTO_MANIFEST,
        m.encode(m.ManifestRequest(job_id=job_id, version=-1)),
        stats,
    )
    if data is None:
        return None
    return signing.open_record(data, m.Manifest)[1]

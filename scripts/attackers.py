"""Attackers for benchmarks/attack.py: each kind runs as its own process against a live swarm.

Run as ``python scripts/attackers.py KIND --coordinator MADDR --job JOB --stats FILE [--peer
MADDR ...]``; the process attacks until SIGINT/SIGTERM and keeps FILE up to date with what it
did (JSON: requests, answers, errors, bytes). Kinds (issue 13, "Measure it"):

- ``hoard``: 16 fresh identities register and ask for every lease they can, never submitting;
- ``junk``: 8 streams of junk submissions from unregistered peers, a new identity whenever the
  coordinator closes one off;
- ``leech``: one identity pulls the current version's chunks from the learner and every
  ``--peer`` over and over, keeping nothing;
- ``liar``: a real node (it does a little honest work, 200 tokens/s) that claims a 100 GB/s
  uplink while it relays at 20 kB/s;
- ``gossip``: publishes junk on the versions topic to every ``--peer`` as fast as it can;
- ``churn`` (benchmarks/soak.py): ``--rate`` new identities a second, each registering, taking a
  lease it lets expire and sending one junk submission, then gone for good.

Only for loopback benchmarks: nothing here is part of the shipped programs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import trio

from echo.node.config import NodeConfig
from echo.node.errors import NodeError
from echo.node.worker import Node
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.lifecycle import run_until_signalled
from echo.p2p.rpc import RpcError
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError

HOARDERS = 16
JUNK_STREAMS = 8
JUNK_BYTES = 64 << 10
GOSSIP_BYTES = 2 << 10
LIAR_CLAIM_BPS = 1e11
LIAR_REAL_MBPS = 0.02
LIAR_TOKENS_PER_S = 200.0
# A refused connection (the coordinator's handshake rate and connection cap for the attackers'
# network) is tried again after this long: an attacker does not give up after one refusal.
RETRY_S = 2.0


class Stats:
    """Counters one attacker keeps, written to ``path`` every second (and at the end)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.data = (
            path,
            {
                "kind": kind,
                "requests": 0,
                "answered": 0,
                "errors": 0,
                "bytes_in": 0,
                "identities": 0,
                "leases_held": 0,
            },
        )

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    async def keep_written(self) -> None:
        while True:
            self.write()
            await trio.sleep(1.0)

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def _register(ident: Identity, host: EchoHost, upload_bps: float = 0.0) -> bytes:
    reg = m.Register(
        protocol_version=ids.PROTOCOL_VERSION,
        software="attacker",
        engine="torch",
        hardware=m.Hardware(cpu_count=8, ram_bytes=1 << 34),
        tokens_per_s=0.0,
        upload_bps=upload_bps,
        download_bps=0.0,
        timestamp=time.time(),
        addrs=host.listen_multiaddrs,
    )
    return signing.seal_record(ident.private_key, reg)


async def _call(host: EchoHost, peer, proto: str, payload: bytes, stats: Stats) -> bytes | None:
    stats.add("requests")
    try:
        reply = await host.request(peer, proto, payload, timeout=10, max_response=16 << 20)
    except (RpcError, ProtocolError, OSError):
        stats.add("errors")
        return None
    stats.add("answered")
    return reply


async def hoard(args, stats: Stats) -> None:
    """16 fresh identities, each asking for as many leases as it may, forever."""

    async def one(task_status=trio.TASK_STATUS_IGNORED) -> None:
        ident = Identity.generate()
        async with open_host(ident, pubsub=False) as host:
            stats.add("identities")
            task_status.started()
            peer, misses = None, 0
            while True:
                if peer is None:  # refused at the door (a prefix's handshake rate), or cut off
                    try:
                        peer = await host.connect(args.coordinator)
                    except (RpcError, OSError):
                        stats.add("errors")
                        await trio.sleep(1.0)
                        continue
                    misses = 0
                registered = await _call(
                    host, peer, ids.PROTO_REGISTER, _register(ident, host), stats
                )
                req = m.LeaseRequest(
                    job_id=args.job, max_leases=8, have_version=0, timestamp=time.time()
                )
                data = await _call(
                    host, peer, ids.PROTO_LEASE, signing.seal_record(ident.private_key, req), stats
                )
                wait = 1.0
                if data is not None:
                    reply = m.decode(m.LeaseReply, data)
                    stats.add("leases_held", len(reply.leases))
                    wait = max(0.5, min(reply.retry_after_s, 5.0))
                misses = 0 if registered is not None or data is not None else misses + 1
                if misses >= 5:
                    peer = None
                await trio.sleep(wait)

    async with trio.open_nursery() as nursery:
        for _ in range(HOARDERS):
            await nursery.start(one)


async def junk(args, stats: Stats) -> None:
    """8 unregistered streams of junk submissions; a fresh identity when one is shut out."""

    async def stream() -> None:
        while True:
            async with open_host(Identity.generate(), pubsub=False) as host:
                try:
                    peer = await host.connect(args.coordinator)
                except (RpcError, OSError):  # refused at the door: try again as someone else
                    stats.add("errors")
                    await trio.sleep(0.1)
                    continue
                stats.add("identities")
                failures = 0
                while failures < 5:  # closed off or backed off: come back as someone else
                    body = os.urandom(JUNK_BYTES)
                    failures = (
                        0
                        if await _call(host, peer, ids.PROTO_SUBMIT, body, stats)
                        else failures + 1
                    )

    async with trio.open_nursery() as nursery:
        for _ in range(JUNK_STREAMS):
            nursery.start_soon(stream)


async def leech(args, stats: Stats) -> None:
    """Pull the newest version's chunks from the learner and every ``--peer``, forever."""
    ident = Identity.generate()
    async with open_host(ident, pubsub=False) as host:
        while True:
            try:
                coord = await host.connect(args.coordinator)
                break
            except RpcError:
                stats.add("errors")
                await trio.sleep(RETRY_S)
        stats.add("identities")
        while True:
            reply = await _call(host, coord, ids.PROTO_REGISTER, _register(ident, host), stats)
            man = await _call(
                host,
                coord,
                ids.PROTO_MANIFEST,
                m.encode(m.ManifestRequest(job_id=args.job, version=-1)),
                stats,
            )
            if reply is None or man is None:
                await trio.sleep(1.0)
                continue
            job = next(j for j in m.decode(m.RegisterReply, reply).jobs if j.job_id == args.job)
            _, manifest = signing.open_record(man, m.Manifest)
            holders = []
            for addr in [*job.learner_addrs[:1], *args.peer]:
                try:
                    holders.append(await host.connect(addr))
                except (RpcError, ValueError, OSError):
                    stats.add("errors")
            for _ in range(20):  # then look for a newer version
                for holder in holders:
                    for ref in manifest.chunks:
                        got = await _call(
                            host,
                            holder,
                            ids.PROTO_CHUNK,
                            m.encode(m.ChunkRequest(sha256=ref.sha256)),
                            stats,
                        )
                        stats.add("bytes_in", len(got or b""))
                await trio.sleep(0)


class Liar(Node):
    """A real node that does honest work but claims an uplink it does not have."""

    def _register_record(self) -> m.Register:
        return super()._register_record().model_copy(update={"upload_bps": LIAR_CLAIM_BPS})


async def liar(args, stats: Stats) -> None:
    # It generates a little (enough to be placed in the job's relay tree), as a relay would.
    cfg = NodeConfig(
        coordinator=args.coordinator,
        data_dir=args.data_dir,
        engine="torch",
        threads=1,
        leases_at_once=1,
        max_upload_mbps=LIAR_REAL_MBPS,
        max_tokens_per_s=LIAR_TOKENS_PER_S,
    )
    stats.add("identities")
    while True:
        try:
            await Liar(cfg).run()
            return
        except BaseException as exc:  # refused at the door: try again, as an attacker would
            if not _refused(exc):
                raise
            stats.add("errors")
            await trio.sleep(RETRY_S)


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or every error a nursery gathered in it) says the coordinator could not
    be reached."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_refused(e) for e in exc.exceptions)
    return isinstance(exc, NodeError) and "cannot reach the coordinator" in str(exc)


async def gossip(args, stats: Stats) -> None:
    """Junk on the versions topic, to every ``--peer``, as fast as pubsub takes it."""
    async with open_host(Identity.generate()) as host:
        for addr in [args.coordinator, *args.peer]:
            try:
                await host.connect(addr)
            except (RpcError, ValueError, OSError):
                stats.add("errors")
        stats.add("identities")
        await host.subscribe(ids.TOPIC_VERSIONS)
        while True:
            stats.add("requests")
            try:
                await host.publish(ids.TOPIC_VERSIONS, os.urandom(GOSSIP_BYTES))
                stats.add("answered")
            except Exception:  # noqa: BLE001 (a junk publisher counts failures, whatever they are)
                stats.add("errors")
            await trio.sleep(0.002)


async def churn(args, stats: Stats) -> None:
    """Identities that come and go (benchmarks/soak.py): ``--rate`` a second, each registers,
    takes a lease it lets expire, sends one junk submission and is never heard from again."""
    async with trio.open_nursery() as nursery:
        while True:
            nursery.start_soon(_one_visit, args, stats)
            await trio.sleep(1.0 / args.rate)


async def _one_visit(args, stats: Stats) -> None:
    ident = Identity.generate()
    # Caught inside the host's block too: an error leaving it comes out of the host's nursery
    # as an ExceptionGroup, which ended the whole churn process (a soak lost its churn at 50 s).
    try:
        async with open_host(ident, pubsub=False) as host:
            try:
                peer = await host.connect(args.coordinator)
            except (RpcError, OSError):
                stats.add("errors")
                return
            stats.add("identities")
            await _call(host, peer, ids.PROTO_REGISTER, _register(ident, host), stats)
            req = m.LeaseRequest(
                job_id=args.job, max_leases=2, have_version=0, timestamp=time.time()
            )
            await _call(
                host, peer, ids.PROTO_LEASE, signing.seal_record(ident.private_key, req), stats
            )
            await _call(host, peer, ids.PROTO_SUBMIT, os.urandom(4096), stats)
    except (RpcError, OSError):
        stats.add("errors")


KINDS = {
    "hoard": hoard,
    "junk": junk,
    "leech": leech,
    "liar": liar,
    "gossip": gossip,
    "churn": churn,
}


def _dial_from(source_ip: str) -> None:
    """Every TCP connection this process opens leaves from ``source_ip`` (py-libp2p's TCP
    transport dials with ``trio.open_tcp_stream``, looked up on each dial)."""
    real = trio.open_tcp_stream

    async def open_from(host, port, **kw):
        kw.setdefault("local_address", source_ip)
        return await real(host, port, **kw)

    trio.open_tcp_stream = open_from


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--coordinator", required=True, help="the coordinator's multiaddr")
    ap.add_argument("--job", required=True, help="the job under attack")
    ap.add_argument("--stats", type=Path, required=True, help="JSON counters, kept up to date")
    ap.add_argument("--peer", action="append", default=[], help="an honest node's multiaddr")
    ap.add_argument("--data-dir", type=Path, default=None, help="the liar node's data dir")
    ap.add_argument("--rate", type=float, default=5.0, help="churn: new identities a second")
    ap.add_argument(
        "--source-ip",
        default=None,
        help="dial from this local address (127.0.0.2: another network than the honest nodes')",
    )
    args = ap.parse_args()
    if args.source_ip:
        _dial_from(args.source_ip)
    if args.kind == "liar" and args.data_dir is None:
        ap.error("liar needs --data-dir")
    stats = Stats(args.stats, args.kind)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stats.keep_written)
            await KINDS[args.kind](args, stats)

    try:
        run_until_signalled(run)
    finally:
        stats.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

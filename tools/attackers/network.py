"""Issue 13's attackers: strangers who hoard leases, send junk, leech chunks, lie about their
uplink, flood gossip and churn identities."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import trio

from echo.node.config import NodeConfig
from echo.node.errors import NodeError
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RpcError
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.tools.attackers.common import (
    RETRY_S,
    Stats,
    call_rpc,
    fetch_job_info,
    listen_addrs,
    new_source,
    registration,
)

HOARDERS = 16
JUNK_STREAMS = 8
JUNK_BYTES = 64 << 10
GOSSIP_BYTES = 2 << 10
LIAR_CLAIM_BPS = 1e11
LIAR_REAL_MBPS = 0.02
LIAR_TOKENS_PER_S = 200.0
# Several identities behind one address: the finding's 8 identities on one /24 pulled 4.6 GB in
# 10 s, 5x what one identity pulled; per-identity budgets alone do not stop that.
LEECH24_IDENTITIES = 8
# churn: visits in flight at once. On the attackers' one core a visit (a key, a Noise handshake,
# three calls) can take longer than 1/rate; beyond this many the next one waits, so what is
# reported as ``identities_per_s`` is the rate actually reached.
CHURN_IN_FLIGHT = 64


async def hoard(args, stats: Stats) -> None:
    """16 fresh identities, each asking for as many leases as it may, forever. Each says it
    holds the version the last reply named, so it is never told to update first."""

    async def one(task_status=trio.TASK_STATUS_IGNORED) -> None:
        ident = Identity.generate()
        async with open_host(ident, listen_addrs(), pubsub=False) as host:
            stats.add("identities")
            task_status.started()
            peer, misses, have = None, 0, 0
            while True:
                if peer is None:  # refused at the door (a prefix's handshake rate), or cut off
                    try:
                        peer = await host.connect(args.coordinator)
                    except (RpcError, OSError):
                        stats.add("errors")
                        await trio.sleep(1.0)
                        continue
                    misses = 0
                registered = await call_rpc(
                    host, peer, ids.PROTO_REGISTER, registration(ident, host), stats
                )
                req = m.LeaseRequest(
                    job_id=args.job, max_leases=8, have_version=have, timestamp=time.time()
                )
                data = await call_rpc(
                    host, peer, ids.PROTO_LEASE, signing.seal_record(ident.private_key, req), stats
                )
                wait = 1.0
                if data is not None:
                    reply = m.decode(m.LeaseReply, data)
                    stats.add("leases_held", len(reply.leases))
                    have = max(have, reply.current_version)
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
            async with open_host(Identity.generate(), listen_addrs(), pubsub=False) as host:
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
                        if await call_rpc(host, peer, ids.PROTO_SUBMIT, body, stats)
                        else failures + 1
                    )

    async with trio.open_nursery() as nursery:
        for _ in range(JUNK_STREAMS):
            nursery.start_soon(stream)


async def leech(args, stats: Stats) -> None:
    """Pull the newest version's chunks from the learner and every ``--peer``, forever."""
    await _leech_one(args, stats)


async def leech24(args, stats: Stats) -> None:
    """:data:`LEECH24_IDENTITIES` leeches at once, all from ``--source-ip`` (one network)."""
    async with trio.open_nursery() as nursery:
        for _ in range(LEECH24_IDENTITIES):
            nursery.start_soon(_leech_one, args, stats)


async def _leech_one(args, stats: Stats) -> None:
    ident = Identity.generate()
    async with open_host(ident, listen_addrs(), pubsub=False) as host:
        while True:
            try:
                coord = await host.connect(args.coordinator)
                break
            except (RpcError, OSError):
                stats.add("errors")
                await trio.sleep(RETRY_S)
        stats.add("identities")
        while True:
            reg = registration(ident, host)
            reply = await call_rpc(host, coord, ids.PROTO_REGISTER, reg, stats)
            man = await call_rpc(
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
                        got = await call_rpc(
                            host,
                            holder,
                            ids.PROTO_CHUNK,
                            m.encode(m.ChunkRequest(sha256=ref.sha256)),
                            stats,
                        )
                        stats.add("bytes_in", len(got or b""))
                await trio.sleep(0)


def _liar(cfg: NodeConfig, stats: Stats) -> Any:
    """The liar node (the node module, torch included, is imported only by the kinds that
    run a real node: the others start in a fraction of the time)."""
    from echo.node.policy import PolicyFollower
    from echo.node.worker import Node

    class Liar(Node):
        """A real node that does honest work but claims an uplink it does not have: at
        registration, and as its "measured" push rate in every status report."""

        def __init__(self, cfg: NodeConfig, stats: Stats) -> None:
            super().__init__(cfg)
            self.attack_stats = stats

        async def _submit(self, payload: bytes) -> m.SubmitReply | None:
            reply = await super()._submit(payload)
            if reply is not None:  # its honest work keeps it in the job's relay tree
                self.attack_stats.add("groups_accepted" if reply.accepted else "groups_rejected")
            return reply

        def _register_record(self) -> m.Register:
            return super()._register_record().model_copy(update={"upload_bps": LIAR_CLAIM_BPS})

        def _follower(self) -> PolicyFollower:
            follower = super()._follower()
            follower.measure_upload = lambda: LIAR_CLAIM_BPS  # type: ignore[method-assign]
            return follower

    return Liar(cfg, stats)


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
        listen=listen_addrs()[0],
    )
    stats.add("identities")
    stats.data.update(claimed_upload_bps=LIAR_CLAIM_BPS, groups_accepted=0)
    await run_node(lambda: _liar(cfg, stats), stats)


async def run_node(make: Callable[[], Any], stats: Stats) -> None:
    """Run the node ``make`` builds, again whenever the coordinator refuses it at the door."""
    while True:
        try:
            await make().run()
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
    async with open_host(Identity.generate(), listen_addrs()) as host:
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
    room = trio.CapacityLimiter(CHURN_IN_FLIGHT)
    next_at = trio.current_time()
    async with trio.open_nursery() as nursery:
        while True:
            token = object()  # the visit's hold on ``room``, released when it ends
            await room.acquire_on_behalf_of(token)
            nursery.start_soon(_one_visit, args, stats, room, token)
            next_at = max(next_at + 1.0 / args.rate, trio.current_time())
            await trio.sleep_until(next_at)


async def _one_visit(args, stats: Stats, room: trio.CapacityLimiter, token: object) -> None:
    new_source()
    ident = Identity.generate()
    # Caught inside the host's block too: an error leaving it comes out of the host's nursery
    # as an ExceptionGroup, which ended the whole churn process (a soak lost its churn at 50 s).
    try:
        async with open_host(ident, listen_addrs(), pubsub=False) as host:
            try:
                peer = await host.connect(args.coordinator)
            except (RpcError, OSError):
                stats.add("errors")
                return
            stats.add("identities")
            job = await fetch_job_info(host, peer, ident, args.job, stats)
            req = m.LeaseRequest(
                job_id=args.job,
                max_leases=2,
                # The job's version: an identity that says it holds an older one is only told
                # to update first, and never takes the lease it came for.
                have_version=max(0, job.current_version) if job is not None else 0,
                timestamp=time.time(),
            )
            data = await call_rpc(
                host, peer, ids.PROTO_LEASE, signing.seal_record(ident.private_key, req), stats
            )
            if data is not None:
                stats.add("leases_held", len(m.decode(m.LeaseReply, data).leases))
            await call_rpc(host, peer, ids.PROTO_SUBMIT, os.urandom(4096), stats)
    except (RpcError, OSError, ProtocolError):
        stats.add("errors")
    finally:
        room.release_on_behalf_of(token)

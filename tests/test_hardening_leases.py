"""Lease hoarding (issue 13, item 3): 16 fresh identities against the real coordinator service.

Identities are free, and each fresh one gets a lease. Fresh identities together hold only a
small allowance of the job's lease window, so a node with a record of valid work is still
served while they hoard; and a lease left to expire costs its holder (fewer leases, then none,
for ``expired_lease_window_s``).
"""

from __future__ import annotations

import time

import trio

from echo.protocol import ids
from echo.protocol import messages as m
from tests.conftest import learner_publish_v0, run_with_coordinator, submit_job
from tests.test_coordinator import group_for, open_lease

HOARDERS = 16


async def start(coord, client) -> str:
    """A running job of batch 4 (a lease window of 8) with version 0 published."""
    job_id = submit_job(coord, batch_groups=4)
    ident, _, report = learner_publish_v0(coord, job_id)
    learner = await client(ident)
    hello = m.LearnerHello(
        job_id=job_id,
        peer_id=str(learner.host.peer_id),
        addrs=learner.host.listen_multiaddrs,
        timestamp=time.time(),
    )
    await learner.call(ids.PROTO_LEARNER_HELLO, learner.seal(hello))
    ack = m.decode(m.StepAck, await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(report)))
    assert ack.ok
    return job_id


def test_sixteen_fresh_hoarders_cannot_stall_an_honest_node(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = await start(coord, client)
        honest = await client()
        await honest.register()
        # The honest node earns a record: one valid group.
        lease = open_lease(coord, (await honest.leases(job_id, 0, 1)).leases[0])
        assert (await honest.submit(honest.seal(group_for(lease)))).accepted
        hoarders = [await client() for _ in range(HOARDERS)]
        held = 0
        for h in hoarders:
            await h.register()
            held += len((await h.leases(job_id, 0, 8)).leases)
        assert 1 <= held <= 2  # a quarter of the window of 8, whatever their number
        got = (await honest.leases(job_id, 0, 8)).leases
        assert len(got) >= 1, "the hoarders took the whole window"

    run_with_coordinator(
        tmp_path, body, lease_quota_ramp=3, exclude_after_failures=100, lease_timeout_s=30
    )


def test_an_expired_lease_costs_its_holder(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = await start(coord, client)
        node = await client()
        await node.register()
        for _ in range(3):  # a record of three: quota 2 with a ramp of 3
            lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
            assert (await node.submit(node.seal(group_for(lease)))).accepted
        first = (await node.leases(job_id, 0, 8)).leases
        assert len(first) == 2
        # Let both expire (deadline 1 s; housekeeping runs every second).
        await trio.sleep(2.5)
        assert not coord.store.has_open_lease(str(node.host.peer_id))
        assert (await node.leases(job_id, 0, 8)).leases == []  # none for a while
        # Another node is not affected.
        other = await client()
        await other.register()
        assert len((await other.leases(job_id, 0, 8)).leases) == 1

    run_with_coordinator(
        tmp_path, body, lease_quota_ramp=3, exclude_after_failures=100, lease_timeout_s=1.0
    )


def test_each_hoarder_stalls_the_job_once_then_gets_nothing(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = await start(coord, client)
        hoarders = [await client() for _ in range(HOARDERS)]
        for h in hoarders:
            await h.register()
        expired_once: set[int] = set()
        for _ in range(HOARDERS):  # rounds: hoard, let expire
            held = [i for i, h in enumerate(hoarders) if (await h.leases(job_id, 0, 8)).leases]
            assert len(held) <= 2  # the fresh allowance
            assert not expired_once & set(held), "a hoarder got a lease after letting one expire"
            if not held:
                break
            expired_once |= set(held)
            await trio.sleep(3.2)  # deadline 2 s; housekeeping runs every second
        assert len(expired_once) == HOARDERS
        # Every hoarder is spent: a fresh honest node gets its lease from the fresh allowance.
        newcomer = await client()
        await newcomer.register()
        assert len((await newcomer.leases(job_id, 0, 8)).leases) == 1

    run_with_coordinator(
        # A round asks all 16 hoarders in turn: under load (a full test run on 2 cores) that
        # took more than a 0.5 s deadline, so the round's first leases expired before its end
        # and a third hoarder got one (held [0, 1, 14]). The deadline outlasts a round.
        tmp_path, body, lease_quota_ramp=3, exclude_after_failures=100, lease_timeout_s=2.0
    )

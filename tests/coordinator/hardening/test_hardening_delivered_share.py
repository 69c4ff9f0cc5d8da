"""A node's window follows what it delivered lately, and a returned lease costs what it held.

Two defences against stale-version hoarders (issue 26, finding 2), each against the real
coordinator service over real libp2p streams:

- In ``benchmarks/attack.py --quick`` nobody had ``proven_groups`` (24) accepted groups when the
  attack began, so the unproven share did not apply, and three hoarders that had bought a lease
  quota of 2 each with 3 honest groups held 5-6 of the job's window of 8 while the two honest
  nodes doing the work were told "buffer full". Now a node holds at most its share of the
  window by its share of the job's recent accepted groups (at least one lease).
- A lease returned with a rejected group (a stale version's) cost its node one lease for
  ``expired_lease_window_s`` (120 s), so a newcomer behind NAT (quota 1) whose first group came
  back stale under load had no lease for longer than the NAT swarm's job ran. Now it costs
  ``lease_term_factor`` times as long as the node held the lease, at least ``min_lease_s``: short
  for a group returned at once, long for a hoarder that sat on its lease for most of its term.
"""

from __future__ import annotations

import trio

from echo.protocol import reasons as R
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import (
    group_for,
    open_lease,
    publish_version,
    start_job,
)


async def _publish(coord, learner, job_id: str, version: int, train: bool) -> None:
    """The learner's real report of ``version``; with ``train``, it trained every group the
    coordinator buffered (taken as a batch first, as the learner's batch request does)."""
    trained = (
        [b.rollout.rollout_id for b in coord.store.take_batch(job_id, 4096, 0)] if train else []
    )
    await publish_version(learner, job_id, version, trained)


class _Swarm:
    """The learner's side of a test job: the version nodes work at, and its real reports."""

    def __init__(self, coord, learner, job_id: str) -> None:
        self.coord, self.learner, self.job_id, self.version = coord, learner, job_id, 0

    async def step(self, train: bool = True) -> None:
        self.version += 1
        await _publish(self.coord, self.learner, self.job_id, self.version, train)

    async def deliver(self, node, groups: int) -> None:
        """``groups`` accepted groups of ``node``, one lease at a time; the learner trains every
        4 (the window of 8 never fills with buffered groups)."""
        for i in range(groups):
            v = self.version
            lease = open_lease(self.coord, (await node.leases(self.job_id, v, 1)).leases[0])
            sub = group_for(lease, version=v, digest=f"digest-v{v}")
            assert (await node.submit(node.seal(sub))).accepted
            if i % 4 == 3:
                await self.step()
        await self.step()


def test_hoarders_with_a_bought_quota_hold_their_share_of_recent_deliveries(tmp_path) -> None:
    async def body(coord, client) -> None:
        # staleness 1: a window of 2 batches of 4 = 8, the quick benchmark's.
        job_id, learner = await start_job(coord, client, batch_groups=4, staleness=1, steps=100)
        swarm = _Swarm(coord, learner, job_id)
        honest = [await client() for _ in range(2)]
        hoarders = [await client() for _ in range(3)]
        for n in honest + hoarders:
            await n.register()
        # The record of the benchmark's attack phase: the honest nodes delivered most groups
        # (12 each: a quota of 5, not proven), each hoarder 3 while it earned its quota of 2.
        for n in hoarders:
            await swarm.deliver(n, 3)
        for n in honest:
            await swarm.deliver(n, 12)
        assert coord.store.buffered_count(job_id) == 0
        v = swarm.version
        held = [len((await h.leases(job_id, v, 8)).leases) for h in hoarders]
        # 2-3 of the 32 newest groups each: ceil(8 * 3 / 32) = 1 lease (their ramp allows 2).
        assert held == [1, 1, 1], f"hoarders hold {held} of the window of 8"
        got = [len((await n.leases(job_id, v, 8)).leases) for n in honest]
        assert got == [3, 2], f"the honest nodes got {got} of the 5 the hoarders left"
        # A newcomer is not locked out of the full window: strangers' share comes on top.
        newcomer = await client()
        await newcomer.register()
        assert len((await newcomer.leases(job_id, v, 8)).leases) == 1

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=3,
        exclude_after_failures=100,
        proven_groups=24,
    )


def test_a_returned_lease_costs_as_long_as_it_was_held(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, learner = await start_job(coord, client, batch_groups=4, staleness=1, steps=100)
        swarm = _Swarm(coord, learner, job_id)
        newcomer, hoarder = await client(), await client()
        await newcomer.register()
        await hoarder.register()
        await swarm.deliver(hoarder, 1)  # a quota of 1: one lease at a time, as the newcomer
        v = swarm.version
        held = open_lease(coord, (await hoarder.leases(job_id, v, 8)).leases[0])
        # The hoarder sits on its lease for most of its term (min_lease_s: it delivered at
        # once), returning it before the deadline so that the lease is still open.
        await trio.sleep(2.5)
        first = open_lease(coord, (await newcomer.leases(job_id, v, 8)).leases[0])
        await swarm.step(train=False)
        await swarm.step(train=False)  # v+2: a group of v is stale at S = 1
        # The newcomer's first group comes back stale at once, the hoarder's after 2.5 s.
        reply = await newcomer.submit(newcomer.seal(group_for(first, version=v)))
        assert reply.reason == R.STALE_VERSION
        reply = await hoarder.submit(hoarder.seal(group_for(held, version=v)))
        assert reply.reason == R.STALE_VERSION
        v = swarm.version
        # The newcomer held its lease well under 0.5 s: it waits min_lease_s (3 s), not 4x its
        # hold; the hoarder held its lease 2.5 s: lease_term_factor (4) times that, 10 s.
        assert (await newcomer.leases(job_id, v, 8)).leases == []
        assert (await hoarder.leases(job_id, v, 8)).leases == []
        await trio.sleep(4.0)
        got = (await newcomer.leases(job_id, v, 8)).leases
        assert len(got) == 1, "a newcomer's stale first group locked it out"
        assert (await hoarder.leases(job_id, v, 8)).leases == []
        await trio.sleep(3.0)  # 7 s after its return, over twice the newcomer's wait
        assert (await hoarder.leases(job_id, v, 8)).leases == [], "the hoarder's wait was short"

    run_with_coordinator(
        tmp_path,
        body,
        lease_quota_ramp=3,
        exclude_after_failures=100,
        min_lease_s=3.0,
    )

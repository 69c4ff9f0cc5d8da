"""Free lease hoarding (issue 26, finding 2): only an accepted group of a lease delivers it.

A stale-version submission is no failure of the node (``protocol/reasons.py``), and it costs
nothing to make: claim an old version and the check stops there. It used to close its lease as
"submitted", and since all leases of one grant share a deadline, one such submission forgave the
whole grant's expiries. Now a lease closed by any rejection, like one let expire, counts against
its node's quota until a group of its is accepted *after* it; a group accepted for a sibling of
the same grant forgives nothing either.
"""

from __future__ import annotations

import time

import trio

from echo.coordinator.store import Store
from echo.coordinator.store.rows import LeaseRow
from echo.protocol import reasons as R
from tests.conftest import STORED_GROUP, run_with_coordinator
from tests.coordinator.test_coordinator import (
    group_for,
    open_lease,
    publish_version,
    start_job,
)

WINDOW_S = 120.0


def _lease(store: Store, lease_id: str, node: str, deadline: float) -> None:
    store.add_leases(
        [LeaseRow(lease_id, "j", node, 0, 2, 8, 1, 0, deadline - 30, deadline, "open")]
    )


def _accept(store: Store, lease_id: str, node: str) -> None:
    store.accept_rollout(
        lease_id=lease_id,
        job_id="j",
        node_id=node,
        version=0,
        prompt_id=0,
        engine="torch",
        group=STORED_GROUP,
        rewards=[1.0, 0.0],
        tokens=4,
        content_hash=lease_id.encode(),
        envelope=b"",
    )


def _store(tmp_path) -> Store:
    store = Store.open(tmp_path / "db.sqlite")
    store.create_job("j", "t", {})
    store.upsert_node("n", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    return store


def test_a_rejected_submission_forgives_nothing_and_counts_itself(tmp_path) -> None:
    store = _store(tmp_path)
    now = time.time()
    for i in range(4):  # one grant: one deadline
        _lease(store, f"g{i}", "n", now + 0.5)
    # One of them comes back with a stale version: rejected (closed), not delivered.
    store.close_lease("g0")
    time.sleep(0.6)
    assert store.expire_leases(time.time()) == 3
    assert store.undelivered_lease_count("n", now - WINDOW_S) == 4
    # A retry of the rejected lease is still a duplicate (the lease stays "submitted").
    assert store.lease("g0").status == "submitted"
    store.close()


def test_an_accepted_sibling_forgives_nothing_a_later_accepted_group_forgives(tmp_path) -> None:
    store = _store(tmp_path)
    now = time.time()
    for i in range(3):
        _lease(store, f"g{i}", "n", now + 0.5)
    _accept(store, "g0", "n")  # delivered before its siblings' shared deadline
    time.sleep(0.6)
    store.expire_leases(time.time())
    assert store.undelivered_lease_count("n", now - WINDOW_S) == 2
    # An honest node that was once slow: its next accepted group forgives what came before.
    _lease(store, "later", "n", time.time() + 30)
    _accept(store, "later", "n")
    assert store.undelivered_lease_count("n", now - WINDOW_S) == 0
    # ... unless the learner's re-scoring rejected that group (it was not valid work).
    store._db.execute("UPDATE rollouts SET status='rejected' WHERE rollout_id='later'")
    assert store.undelivered_lease_count("n", now - WINDOW_S) == 2
    store.close()


def test_a_stale_version_hoarder_loses_the_window_and_an_honest_node_gets_it(tmp_path) -> None:
    """The issue's attack against the real coordinator: a node with accepted work takes the
    job's whole lease window, sends one stale-version submission and lets the rest expire."""

    async def body(coord, client) -> None:
        job_id, learner = await start_job(coord, client, batch_groups=4, staleness=1)
        hoarder, honest = await client(), await client()
        await hoarder.register()
        await honest.register()
        first = open_lease(coord, (await hoarder.leases(job_id, 0, 1)).leases[0])
        assert (await hoarder.submit(hoarder.seal(group_for(first)))).accepted
        held = [open_lease(coord, x) for x in (await hoarder.leases(job_id, 0, 8)).leases]
        assert len(held) == 7  # the window of 8, less the group it already has buffered
        await publish_version(learner, job_id, 1)
        await publish_version(learner, job_id, 2)
        # A group "of v0": two versions behind at S = 1, no work at all behind it.
        reply = await hoarder.submit(hoarder.seal(group_for(held[0], version=0)))
        assert not reply.accepted and reply.reason == R.STALE_VERSION
        await trio.sleep(2.6)  # the other 6 expire (deadline 1.5 s; housekeeping every 1 s)
        assert not coord.store.has_open_lease(str(hoarder.host.peer_id))
        # Each of the 7 leases it did not deliver takes one off its quota of 8 (before: the
        # stale submission forgave the grant, and it took the whole window again).
        again = [open_lease(coord, x) for x in (await hoarder.leases(job_id, 2, 8)).leases]
        assert len(again) <= 1, "a stale-version submission forgave the expired grant"
        for lease in again:  # the next cycle: one more stale group, and nothing is left
            reply = await hoarder.submit(hoarder.seal(group_for(lease, version=0)))
            assert reply.reason == R.STALE_VERSION
        assert (await hoarder.leases(job_id, 2, 8)).leases == []
        node = coord.store.node(str(hoarder.host.peer_id))
        assert node.failures == 0  # a stale version is still no failure of the node
        # The window (8, less the one buffered group) is the honest node's.
        assert len((await honest.leases(job_id, 2, 8)).leases) == 7

    run_with_coordinator(tmp_path, body, exclude_after_failures=100, lease_timeout_s=1.5)

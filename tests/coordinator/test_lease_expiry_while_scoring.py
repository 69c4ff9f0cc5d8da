"""A group that arrives in time is judged by when it arrived, not by when scoring let it be stored.

Under load a submission waits for a scoring slot (nodes short of a record share one), and the
coordinator's housekeeping can expire its lease meanwhile. That group was in time: it must be
stored, not answered ``duplicate`` (which counts against the node) with its lease left
``expired`` -- the flaky ``[fabricated_logprobs]``/``[swapped_prompt]`` failures of
tests/e2e/test_adversaries.py, where a first submission came back ``duplicate``.
"""

from __future__ import annotations

import time

import pytest
import trio

from echo.coordinator.store import Store, StoreError
from echo.coordinator.store.rows import LeaseRow
from echo.protocol import reasons as R
from tests.conftest import STORED_GROUP, run_with_coordinator
from tests.coordinator.test_coordinator import group_for, open_lease, start_job


async def _until(cond, what: str, timeout: float = 8.0) -> None:
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"no {what} within {timeout} s")


def test_lease_expiring_while_its_group_waits_for_scoring_still_takes_the_group(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
        node_id = str(node.host.peer_id)
        # A fresh node scores in the shared slot of the unproven: another node's group holds it.
        slot = coord.node_rpc.submissions.scoring.new
        holder = object()
        await slot.acquire_on_behalf_of(holder)
        replies = []

        async def submit() -> None:
            replies.append(await node.submit(node.seal(group_for(lease))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit)
            # Arrived in time, checked, and queued for scoring ...
            await _until(lambda: slot.statistics().tasks_waiting == 1, "queued for scoring")
            # ... while its deadline (1 s) passes and housekeeping (every second) expires it.
            await _until(lambda: coord.store.lease(lease.lease_id).status == "expired", "expiry")
            slot.release_on_behalf_of(holder)
        (reply,) = replies
        assert reply.accepted, (reply.reason, reply.detail)
        assert coord.store.lease(lease.lease_id).status == "submitted"
        assert coord.store.rollout_node(lease.lease_id) == node_id
        assert coord.store.rejection_counts(node_id) == {}
        # Stored once: the same group again is a duplicate (and its lease stays used).
        again = await node.submit(node.seal(group_for(lease)))
        assert not again.accepted and again.reason in (R.DUPLICATE, R.UNKNOWN_LEASE)

    run_with_coordinator(
        tmp_path, body, exclude_after_failures=100, lease_timeout_s=1.0, min_lease_s=1.0
    )


def test_a_group_arriving_after_its_deadline_is_still_refused(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
        await _until(lambda: coord.store.lease(lease.lease_id).status == "expired", "expiry")
        reply = await node.submit(node.seal(group_for(lease)))
        assert not reply.accepted and reply.reason == R.UNKNOWN_LEASE
        assert coord.store.lease(lease.lease_id).status == "expired"
        assert coord.store.rollout_node(lease.lease_id) is None

    run_with_coordinator(
        tmp_path, body, exclude_after_failures=100, lease_timeout_s=1.0, min_lease_s=1.0
    )


def _accept(store: Store, lease_id: str, received_at: float | None) -> None:
    store.accept_rollout(
        lease_id=lease_id,
        job_id="j",
        node_id="n",
        version=0,
        prompt_id=0,
        engine="torch",
        group=STORED_GROUP,
        rewards=[1.0, 0.0],
        tokens=4,
        content_hash=lease_id.encode(),
        envelope=b"",
        received_at=received_at,
    )


def test_the_store_takes_a_group_by_when_it_arrived(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    store.create_job("j", "t", {})
    store.upsert_node("n", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    deadline = time.time() - 5.0
    store.add_leases(
        [LeaseRow(i, "j", "n", 0, 2, 8, 1, 0, deadline - 30, deadline, "open") for i in "abc"]
    )
    assert store.expire_leases(time.time()) == 3
    _accept(store, "a", received_at=deadline)  # arrived by its deadline, expired since
    assert store.lease("a").status == "submitted" and store.rollout_node("a") == "n"
    with pytest.raises(StoreError, match=R.DUPLICATE):
        _accept(store, "a", received_at=deadline)  # once only
    for lease_id, received in (("b", deadline + 0.001), ("c", None)):  # late, or no arrival
        with pytest.raises(StoreError, match=R.DUPLICATE):
            _accept(store, lease_id, received_at=received)
        assert store.lease(lease_id).status == "expired" and store.rollout_node(lease_id) is None
    assert store.node("n").accepted == 1
    store.close()

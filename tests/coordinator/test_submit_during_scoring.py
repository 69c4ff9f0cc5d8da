"""What changes while a group is being scored: its lease expiring, its node being excluded.

A submission is checked when it arrives (node admitted, lease open and in time), then waits for
a scoring slot (under load; nodes short of a record share one) and is scored off the loop; only
then is it stored. Meanwhile housekeeping may expire its lease at the deadline, or a learner's
report of the node's earlier groups may exclude the node (which expires its leases too). Both
used to come back ``duplicate`` -- a first submission, its lease left ``expired`` -- the flaky
``[fabricated_logprobs]``/``[swapped_prompt]`` failures of tests/e2e/test_adversaries.py (there:
exclusion). Now the group that came in time is stored, and the excluded node's is refused as
``node_excluded`` and never stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import trio

from echo.coordinator.store import Store, StoreError
from echo.coordinator.store.rows import LeaseRow
from echo.protocol import messages as m
from echo.protocol import reasons as R
from tests.conftest import STORED_GROUP, run_with_coordinator
from tests.coordinator.test_coordinator import group_for, open_lease, start_job

SHORT_LEASES = dict(exclude_after_failures=100, lease_timeout_s=1.0, min_lease_s=1.0)


async def _until(cond: Callable[[], bool], what: str, timeout: float = 8.0) -> None:
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"no {what} within {timeout} s")


async def _submit_while_scoring_waits(coord, node, lease: m.Lease, meanwhile) -> m.SubmitReply:
    """Submit ``lease``'s group while another group holds the unproven nodes' one scoring slot
    (a fresh node scores there); once the group is checked and queued, await ``meanwhile()``,
    then free the slot; the node's reply."""
    slot = coord.node_rpc.submissions.scoring.new
    holder = object()
    await slot.acquire_on_behalf_of(holder)
    replies: list[m.SubmitReply] = []

    async def submit() -> None:
        replies.append(await node.submit(node.seal(group_for(lease))))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit)
        await _until(lambda: slot.statistics().tasks_waiting == 1, "group queued for scoring")
        await meanwhile()
        slot.release_on_behalf_of(holder)
    (reply,) = replies
    return reply


def test_a_lease_expiring_while_its_group_waits_for_scoring_still_takes_it(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        node_id = str(node.host.peer_id)
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])

        async def expire() -> None:  # deadline 1 s; housekeeping runs every second
            await _until(lambda: coord.store.lease(lease.lease_id).status == "expired", "expiry")

        reply = await _submit_while_scoring_waits(coord, node, lease, expire)
        assert reply.accepted, (reply.reason, reply.detail)
        assert coord.store.lease(lease.lease_id).status == "submitted"
        assert coord.store.rollout_node(lease.lease_id) == node_id
        assert coord.store.rejection_counts(node_id) == {}
        # Stored once: the node holds no open lease any more.
        again = await node.submit(node.seal(group_for(lease)))
        assert not again.accepted and again.reason == R.UNKNOWN_LEASE

    run_with_coordinator(tmp_path, body, **SHORT_LEASES)


def test_a_node_excluded_while_its_group_waits_for_scoring_is_refused_as_excluded(
    tmp_path,
) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        node_id = str(node.host.peer_id)
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])

        async def exclude() -> None:  # what a learner's report of its earlier groups does
            coord.store.set_excluded(node_id, True)
            assert coord.store.lease(lease.lease_id).status == "expired"

        reply = await _submit_while_scoring_waits(coord, node, lease, exclude)
        assert not reply.accepted
        assert reply.reason == R.NODE_EXCLUDED and "excluded" in reply.detail, reply
        assert coord.store.rollout_node(lease.lease_id) is None  # never stored, never trained
        assert coord.store.lease(lease.lease_id).status == "expired"
        assert coord.store.rejection_counts(node_id) == {R.NODE_EXCLUDED: 1}

    run_with_coordinator(tmp_path, body, exclude_after_failures=100)


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

    run_with_coordinator(tmp_path, body, **SHORT_LEASES)


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


def test_the_store_takes_a_group_by_when_it_arrived_unless_its_node_is_excluded(
    tmp_path,
) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    store.create_job("j", "t", {})
    store.upsert_node("n", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    deadline = time.time() - 5.0
    store.add_leases(
        [LeaseRow(i, "j", "n", 0, 2, 8, 1, 0, deadline - 30, deadline, "open") for i in "abcd"]
    )
    assert store.expire_leases(time.time()) == 4
    _accept(store, "a", received_at=deadline)  # arrived by its deadline, expired since
    assert store.lease("a").status == "submitted" and store.rollout_node("a") == "n"
    with pytest.raises(StoreError, match=R.DUPLICATE):
        _accept(store, "a", received_at=deadline)  # once only
    for lease_id, received in (("b", deadline + 0.001), ("c", None)):  # late, or no arrival
        with pytest.raises(StoreError, match=R.DUPLICATE):
            _accept(store, lease_id, received_at=received)
        assert store.lease(lease_id).status == "expired" and store.rollout_node(lease_id) is None
    store.set_excluded("n", True)
    with pytest.raises(StoreError, match=R.NODE_EXCLUDED):
        _accept(store, "d", received_at=deadline)  # in time, but its node is excluded
    assert store.lease("d").status == "expired" and store.rollout_node("d") is None
    assert store.node("n").accepted == 1
    store.close()

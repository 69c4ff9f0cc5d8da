"""A node waiting for a version's push stops waiting once a newer version of the job completed
first, or when its push stalls (node/policy.py ``until_overtaken``): found in the NAT swarm,
where a node behind NAT held v1 while v3..v30 arrived and missed the whole run waiting 30 s for
v2's lost push."""

from __future__ import annotations

import trio

from echo.node.policy import (
    BROADCAST_STALL_S,
    FIRST_CHUNK_MIN_S,
    first_chunk_wait,
    until_overtaken,
)
from echo.p2p.relay.transfer import Transfer
from echo.protocol import messages as m


def _transfer(job: str, version: int) -> Transfer:
    man = m.Manifest(job_id=job, version=version, base_version=-1, kind="anchor", total_size=1,
                     chunks=[m.ChunkRef(sha256=bytes(32), size=1)], tensor_digests={},
                     state_digest="d", anchor_version=version, created_at=0.0)
    return Transfer(man, b"", stripes=1)


def test_a_newer_completed_version_ends_the_wait_and_other_jobs_do_not() -> None:
    async def body() -> None:
        waiting, other_job, newer = _transfer("a", 2), _transfer("b", 9), _transfer("a", 3)
        transfers = {(t.job_id, t.version): t for t in (waiting, other_job, newer)}
        other_job.done.set()  # another job's newer version says nothing about this one
        with trio.move_on_after(0.5) as scope:
            await until_overtaken(transfers, waiting, scope)
        assert scope.cancelled_caught  # still waiting after 0.5 s: the deadline ended it
        newer.done.set()
        with trio.fail_after(2):
            with trio.CancelScope() as mine:
                await until_overtaken(transfers, waiting, mine)
                await trio.sleep_forever()  # cancelled by until_overtaken
        assert mine.cancelled_caught

    trio.run(body)


def test_the_wait_ends_quietly_when_the_version_itself_completes() -> None:
    async def body() -> None:
        waiting = _transfer("a", 2)
        transfers = {("a", 2): waiting}
        waiting.done.set()
        with trio.CancelScope() as scope:
            await until_overtaken(transfers, waiting, scope)
        assert not scope.cancel_called

    trio.run(body)


def test_a_push_that_stalls_is_given_up(monkeypatch) -> None:
    import echo.node.policy as policy

    monkeypatch.setattr(policy, "BROADCAST_STALL_S", 0.3)

    async def body() -> None:
        waiting = _transfer("a", 0)
        with trio.fail_after(2):
            with trio.CancelScope() as scope:
                await until_overtaken({("a", 0): waiting}, waiting, scope)
                await trio.sleep_forever()
        assert scope.cancelled_caught

    trio.run(body)


def test_a_push_that_never_began_is_given_up_after_the_first_chunk_wait() -> None:
    async def body() -> None:
        waiting = _transfer("a", 3)
        with trio.fail_after(2):
            with trio.CancelScope() as scope:
                await until_overtaken({("a", 3): waiting}, waiting, scope, first_chunk_s=0.2)
                await trio.sleep_forever()
        assert scope.cancelled_caught

    trio.run(body)


def test_the_first_chunk_wait_follows_what_earlier_pushes_took() -> None:
    def with_first_chunk_after(version: int, delay: float | None) -> Transfer:
        t = _transfer("a", version)
        if delay is not None:
            t.arrived_at.append(t.created + delay)
        return t

    waiting = _transfer("a", 5)
    # The job's first versions: no history, the stall bound.
    assert first_chunk_wait({("a", 5): waiting}, waiting) == BROADCAST_STALL_S
    early = {("a", v): with_first_chunk_after(v, None) for v in (1, 2)}
    # Earlier plans whose pushes never reached this node: the least wait.
    assert first_chunk_wait({**early, ("a", 5): waiting}, waiting) == FIRST_CHUNK_MIN_S
    # Pushes that began 1.5 s after their plan: three times that.
    slow = {("a", v): with_first_chunk_after(v, 1.5) for v in (1, 2)}
    assert first_chunk_wait({**slow, ("a", 5): waiting}, waiting) == 3 * 1.5
    # ... never more than the stall bound; another job's history counts for nothing.
    slower = {("a", v): with_first_chunk_after(v, 60.0) for v in (1, 2)}
    assert first_chunk_wait({**slower, ("a", 5): waiting}, waiting) == BROADCAST_STALL_S
    other = {("b", v): _transfer("b", v) for v in (1, 2)}
    assert first_chunk_wait({**other, ("a", 5): waiting}, waiting) == BROADCAST_STALL_S

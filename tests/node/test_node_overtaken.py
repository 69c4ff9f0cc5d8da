"""A node waiting for a version's push stops waiting once a newer version of the job completed
first, or when its push stalls (node/push_wait.py ``until_overtaken``): found in the NAT swarm,
where a node behind NAT held v1 while v3..v30 arrived and missed the whole run waiting 30 s for
v2's lost push."""

from __future__ import annotations

import trio

from echo.node.push_wait import until_overtaken
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
    import echo.node.push_wait as push_wait

    monkeypatch.setattr(push_wait, "BROADCAST_STALL_S", 0.3)

    async def body() -> None:
        waiting = _transfer("a", 0)
        with trio.fail_after(2):
            with trio.CancelScope() as scope:
                await until_overtaken({("a", 0): waiting}, waiting, scope)
                await trio.sleep_forever()
        assert scope.cancelled_caught

    trio.run(body)

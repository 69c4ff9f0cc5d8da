"""A node holding an older version gets leases only while its syncs keep its groups fresh.

Issue 32 (tests/e2e/test_nat_swarm.py, 2 runs of 8 failed on it): a node asks for leases holding
``c - 1``, within the lease window of ``c`` (staleness 2), is given leases, syncs to ``c`` before
it works, and that sync takes 2-8 s (a node behind NAT at one of its first versions) while the
learner publishes every half second: the group arrives when ``c + 3`` is out and is rejected as
stale. Every one of the 15 stale groups of 8 such runs was leased that way; no lease issued to a
node holding the newest version went stale (echo.coordinator.scheduling.lag). Against the real
coordinator over real streams; the versions' publication times and the times nodes reported
holding them are set in its store, so the job's pace and the nodes' syncs are what a test says.
"""

from __future__ import annotations

import time

from echo.coordinator.scheduling.lag import SYNCS_SAMPLED, versions_passed
from echo.coordinator.scheduling.leases import SYNC_FIRST_RETRY_S
from tests.conftest import run_with_coordinator
from tests.coordinator.hardening.test_hardening_loop_costs import _status
from tests.coordinator.test_coordinator import publish_version, start_job

PERIOD_S = 1.0  # the job's pace in the tests below: a version a second


async def _holds(coord, node, job_id: str, versions: range) -> None:
    """The node's real status reports: it held each of ``versions``."""
    for v in versions:
        await coord.node_rpc.handle_status(node.host.peer_id, _status(node, job_id, v))


def _timeline(coord, job_id: str, t0: float, lags: dict[str, dict[int, float]]) -> None:
    """Version v published at ``t0 + v * PERIOD_S``; node n first held v ``lags[n][v]`` after."""
    db = coord.store._db
    db.execute("UPDATE versions SET published_at=? + version * ? WHERE job_id=?",
               (t0, PERIOD_S, job_id))  # fmt: skip
    for node_id, by_version in lags.items():
        for v, lag in by_version.items():
            db.execute(
                "UPDATE node_versions SET at=? WHERE job_id=? AND node_id=? AND version=?",
                (t0 + v * PERIOD_S + lag, job_id, node_id, v),
            )


def test_a_node_whose_syncs_are_not_measured_gets_leases_only_holding_the_newest(
    tmp_path,
) -> None:
    """The NAT swarm's case: a newcomer one version behind was leased, and its first syncs were
    its slow ones. Now it is told to update first (soon: it syncs before it waits), and holding
    the newest version it gets its lease."""

    async def body(coord, client) -> None:
        job_id, learner = await start_job(coord, client, steps=20, staleness=2)
        for v in (1, 2):
            await publish_version(learner, job_id, v)
        node = await client()
        await node.register()
        await _holds(coord, node, job_id, range(1, 2))  # joined at v1
        reply = await node.leases(job_id, 1, 1)  # v1 is within the lease window of v2
        assert reply.leases == [], "a node with no measured sync was leased while behind"
        assert reply.message.startswith("update to v2 first"), reply.message
        assert "not measured" in reply.message, reply.message
        assert reply.retry_after_s == SYNC_FIRST_RETRY_S
        await _holds(coord, node, job_id, range(2, 3))
        reply = await node.leases(job_id, 2, 1)
        assert len(reply.leases) == 1, reply.message

    run_with_coordinator(tmp_path, body)


def test_a_node_behind_is_leased_while_its_sync_and_work_fit_the_window(tmp_path) -> None:
    """Two nodes with a record of syncs, both holding v5 when v6 is out (every version a second,
    staleness 2): the one that synced each version in 0.3 s gets its lease; the one whose syncs
    took 3.2 s once in its last four (3 versions would follow v6 before its group came) is told
    to update first, and gets its lease holding v6. Once its syncs are quick again over four
    versions it is leased while behind as well: the versions it follows are its probe."""

    async def body(coord, client) -> None:
        job_id, learner = await start_job(coord, client, steps=20, staleness=2)
        for v in range(1, 7):
            await publish_version(learner, job_id, v)
        fast, slow = await client(), await client()
        for n in (fast, slow):
            await n.register()
            await _holds(coord, n, job_id, range(1, 6))  # joined at v1, synced v2..v5
        t0 = time.time() - 30.0
        fast_id, slow_id = str(fast.host.peer_id), str(slow.host.peer_id)
        _timeline(coord, job_id, t0, {
            fast_id: {v: 0.3 for v in range(1, 6)},
            slow_id: {1: 0.3, 2: 0.4, 3: 3.2, 4: 0.3, 5: 0.3},
        })  # fmt: skip
        got = await fast.leases(job_id, 5, 1)
        assert len(got.leases) == 1, got.message
        refused = await slow.leases(job_id, 5, 1)
        assert refused.leases == [], "a node whose group would come 3 versions late was leased"
        assert refused.message.startswith("update to v6 first"), refused.message
        assert "outlast 3 versions" in refused.message, refused.message
        await _holds(coord, slow, job_id, range(6, 7))
        holding = await slow.leases(job_id, 6, 1)
        assert len(holding.leases) == 1, holding.message
        # Versions 7-10 come; the slow node syncs each in 0.3 s and holds v9 when v10 is out.
        for v in range(7, 11):
            await publish_version(learner, job_id, v)
        await _holds(coord, slow, job_id, range(7, 10))
        _timeline(coord, job_id, t0, {slow_id: {v: 0.3 for v in range(6, 10)}})
        again = await slow.leases(job_id, 9, 1)
        assert len(again.leases) == 1, again.message

    run_with_coordinator(tmp_path, body)


def test_versions_passed_counts_whole_periods_and_a_zero_period_passes_everything() -> None:
    assert versions_passed(3.2, 1.0) == 3
    assert versions_passed(2.9, 1.0) == 2  # v+3 not out yet: a group of v is still fresh
    assert versions_passed(0.0, 0.5) == 0
    assert versions_passed(0.1, 0.0) > 1000 and versions_passed(0.0, 0.0) == 0
    assert SYNCS_SAMPLED >= 3  # the NAT swarm's slow syncs came at a node's 2nd to 4th version

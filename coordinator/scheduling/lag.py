"""Whether a node that holds an older version than the job's newest would deliver in time.

A lease reply names the job's current version ``c``. A node that holds an older one (within the
lease's window) first syncs to ``c`` and only then generates (``echo.node.worker``), so its group
is sampled from ``c`` and arrives a sync and a group's work after ``c`` was published. The
coordinator rejects it as stale once more than ``staleness`` (S) newer versions are out by then
(``echo.coordinator.submissions.verify``). Where versions come every half second, a sync that
takes 2 s makes every such group stale.

That is where the NAT swarm's stale groups came from (issue 32, tests/e2e/test_nat_swarm.py):
in 8 runs with ``stale_version`` rejections, each of the 15 rejected groups was leased to a node
that held ``c - 1``, whose sync to ``c`` then took 2-8 s while versions came every 0.2-0.9 s;
none of the 866 leases issued to a node that already held ``c`` went stale. Most were a node
behind NAT at one of its first few versions in the job, while its relay parents were still being
dialled (its syncs before and after took 0.3-0.8 s); its earlier groups had been delivered in
0.1-0.6 s, so a node's delivery times do not foresee it.

:class:`SyncLag` therefore answers, for a node asking while it holds an older version, whether
a lease may go to it now: only once its syncs are measured (its last :data:`SYNCS_SAMPLED`
versions, from each publication to the node's report that it held it) and while, by its slowest
of them plus its median work time (issue to accepted group), at most S versions follow the one it
syncs to before its group arrives (at the job's recent pace). Otherwise it is told to update
first: it syncs anyway, and asks again holding the newest version, which this rule never refuses
(then only the work stands between lease and group). The estimate's margin is that slowest sync:
one period more (refusing at S versions) cost a node behind NAT every lease of a short job in one
NAT swarm run, whose last syncs took 0.8 s against 0.8 s periods but its slowest of four 1.8 s.
No probe lease is needed to rehabilitate a slow node: it keeps following versions while
it is told to update, and each one it reports is a new measurement.

The version a node holds is its own word (its lease request, its status reports): a node that
claims the newest is leased as before. The rule spares honest nodes work that would be thrown
away; the defences against nodes that waste leases on purpose are the quota's (issue 26).
"""

from __future__ import annotations

import math
import statistics
import sys

from echo.coordinator.store import Store

# How many of a node's newest versions its sync time is measured over (its first in the job left
# out), and the slowest counts: a node's slow syncs come in runs (a new relay parent, a stalled
# push), and in the NAT swarm a node's first versions after the one it joined with were where
# they came (its 2nd to 4th). A node with fewer measured gets leases only while it holds the newest
# version.
SYNCS_SAMPLED = 4
# How many of the job's newest version periods its step period is averaged over: the learner's
# pace changes within seconds (a burst of v1-v5 in 3.7 s at a job's start, from two batches
# leased at v0), so a longer memory would call a bursting job slow.
PERIODS_SAMPLED = 4
# How many of a node's newest accepted groups its work time (issue to acceptance) is the median
# of, as lease_terms.DELIVERIES_SAMPLED.
DELIVERIES_SAMPLED = 8


def versions_passed(seconds: float, period_s: float) -> int:
    """How many versions a job publishing one every ``period_s`` publishes in ``seconds``."""
    if period_s <= 0:  # versions published in the same instant: any wait is too long
        return sys.maxsize if seconds > 0 else 0
    return math.floor(seconds / period_s)


class SyncLag:
    """Measures nodes' syncs against their job's pace; see the module docstring."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def step_period(self, job_id: str) -> float | None:
        """Seconds between the job's recent versions (None: fewer than two published)."""
        times = self.store.publish_times(job_id, PERIODS_SAMPLED + 1)
        if len(times) < 2:
            return None
        return (times[0] - times[-1]) / (len(times) - 1)

    def refusal(self, job_id: str, node_id: str, staleness: int) -> str | None:
        """Why a node holding an older version than the job's newest gets no lease now (None:
        it may have one). A group of it is sampled from the newest version after the node's
        sync, and stale once more than ``staleness`` versions followed that one."""
        lags = self.store.sync_lags(job_id, node_id, SYNCS_SAMPLED)
        if len(lags) < SYNCS_SAMPLED:
            return f"its syncs are not measured yet ({len(lags)} of {SYNCS_SAMPLED} versions)"
        period = self.step_period(job_id)
        if period is None:
            return None
        took = self.store.delivery_times(node_id, DELIVERIES_SAMPLED)
        work = statistics.median(took) if took else 0.0
        k = versions_passed(max(lags) + work, period)
        if k <= staleness:
            return None
        return (
            f"a sync of {max(lags):.1f} s and {work:.1f} s of work outlast {k} versions of"
            f" {period:.2f} s (staleness {staleness})"
        )

"""Minting leases: how much work a node gets, and the signed leases that carry it.

:class:`Leases` owns the answer to a node's lease request once the node and the job are known to
be valid (:meth:`NodeRPC.handle_lease <echo.coordinator.rpc.node.NodeRPC.handle_lease>` checks
that): nothing while the job is not running or the node's weights are too old (or older than the
newest while its syncs are too slow for the job's pace, :mod:`~echo.coordinator.scheduling.lag`);
otherwise as many
leases as keep the job's buffer near its target without letting one node, especially a new one,
tie up more than its quota. Each lease carries its prompt's token ids, rendered here from the
coordinator's own copy of the task (nodes need no dataset) once: they are stored with the lease
before its signed copy leaves, and the accepted group takes them from there.
"""

from __future__ import annotations

import logging
import secrets
import time

from echo.coordinator.config import VerificationSection
from echo.coordinator.jobs.context import RunningJob
from echo.coordinator.metrics import Metrics
from echo.coordinator.scheduling.lag import SyncLag
from echo.coordinator.scheduling.lease_terms import LeaseTerms
from echo.coordinator.store import Store
from echo.coordinator.store.rows import JobRow, LeaseRow, NodeRow
from echo.p2p.identity import Identity
from echo.protocol import messages as m
from echo.protocol import signing

log = logging.getLogger("echo.coordinator")

# Leases ask the node to come back this soon when there is no work (the learner is busy).
IDLE_RETRY_S = 0.5
# ... when the job is not running (yet): it changes at a learner's pace, not a lease's.
NOT_RUNNING_RETRY_S = 2.0
# ... when the node must first fetch a newer version: soon, it is probably arriving.
UPDATE_FIRST_RETRY_S = 0.2
# ... when it must first sync to the newest version (its sync is too slow for the job's pace,
# echo.coordinator.scheduling.lag): it syncs before it waits this, so it may ask again at once.
SYNC_FIRST_RETRY_S = 0.05
# Nodes whose last "sync first" is remembered (for its log line); beyond this the memory starts
# over, which costs a repeated line, not a decision.
TOLD_KEPT = 4096


class Leases:
    """Answers lease requests of validated nodes; see the module docstring."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        identity: Identity,
        verification: VerificationSection,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.identity = identity
        self.verification = verification
        # Deadlines and the unproven nodes' share, both by the node's record.
        self.terms = LeaseTerms(store, verification)
        # Whether a node holding an older version syncs fast enough to deliver in time.
        self.sync_lag = SyncLag(store)
        # The version each node was last told to sync to first: logged once per node and
        # version, not per request (a node asks again every 0.05 s while it syncs).
        self._told: dict[str, int] = {}

    def grant(
        self, node: NodeRow, job: RunningJob, row: JobRow, req: m.LeaseRequest
    ) -> m.LeaseReply:
        """The reply to ``req``: signed new leases (stored first), or none and when to retry."""
        current = row.current_version
        if row.status != "running" or current < 0:
            return m.LeaseReply(
                leases=[],
                current_version=current,
                retry_after_s=NOT_RUNNING_RETRY_S,
                message=f"job is {row.status}",
            )
        # S = 0 (synchronous) and S = 1 both sample from the newest version only.
        min_version = max(0, current - max(1, job.spec.staleness) + 1)
        if req.have_version < min_version:
            return m.LeaseReply(
                leases=[],
                current_version=current,
                retry_after_s=UPDATE_FIRST_RETRY_S,
                message=f"update to v{current} first",
            )
        n = self._budget(row.job_id, node, job, req.max_leases)
        if n <= 0:
            return m.LeaseReply(
                leases=[],
                current_version=current,
                retry_after_s=IDLE_RETRY_S,
                message="buffer full",
            )
        if req.have_version < current:
            # It syncs to the newest version before it works: a slow sync makes the group stale.
            why = self.sync_lag.refusal(row.job_id, node.node_id, job.spec.staleness)
            if why is not None:
                if self._told.get(node.node_id) != current:
                    if len(self._told) >= TOLD_KEPT:  # identities are free: a bounded memory
                        self._told.clear()
                    self._told[node.node_id] = current
                    log.info("node %s holds v%d of v%d: no lease until it syncs (%s)",
                             node.node_id[-8:], req.have_version, current, why)  # fmt: skip
                return m.LeaseReply(
                    leases=[],
                    current_version=current,
                    retry_after_s=SYNC_FIRST_RETRY_S,
                    message=f"update to v{current} first: {why}",
                )
        now = time.time()
        term = self.terms.term_s(node.node_id)
        rows, sealed = [], []
        for prompt_id in self.store.next_prompt_ids(row.job_id, n):
            prompt = job.prompt_tokens(prompt_id)
            if not 0 < len(prompt) <= m.MAX_PROMPT_TOKENS:
                # A lease cannot carry it; skipping it costs one prompt, not the job.
                log.warning(
                    "job %s: prompt %d has %d tokens (a lease carries 1 to %d): skipped",
                    row.job_id,
                    prompt_id,
                    len(prompt),
                    m.MAX_PROMPT_TOKENS,
                )
                continue
            lease = m.Lease(
                lease_id=secrets.token_hex(12),
                job_id=row.job_id,
                node_id=node.node_id,
                prompt_id=prompt_id,
                prompt_tokens=m.pack_tokens(prompt),
                group_size=job.spec.group_size,
                sampling=m.SamplingSpec(
                    max_new_tokens=job.max_new_tokens,
                    temperature=job.spec.sampling.temperature,
                    top_p=job.spec.sampling.top_p,
                    seed=secrets.randbits(63),
                ),
                min_version=min_version,
                issued_at=now,
                deadline=now + term,
            )
            rows.append(
                LeaseRow(
                    lease_id=lease.lease_id,
                    job_id=lease.job_id,
                    node_id=lease.node_id,
                    prompt_id=prompt_id,
                    group_size=lease.group_size,
                    max_new_tokens=lease.sampling.max_new_tokens,
                    seed=lease.sampling.seed,
                    min_version=min_version,
                    issued_at=now,
                    deadline=lease.deadline,
                    status="open",
                    prompt_ids=tuple(prompt),
                )
            )
            sealed.append(signing.seal_record(self.identity.private_key, lease))
        if not rows:  # every prompt drawn was too long
            return m.LeaseReply(
                leases=[],
                current_version=current,
                retry_after_s=IDLE_RETRY_S,
                message="no prompt fits a lease",
            )
        self.store.add_leases(rows)
        self.metrics.leases_issued.inc(len(rows))
        return m.LeaseReply(leases=sealed, current_version=current, retry_after_s=0.0)

    def _budget(self, job_id: str, node: NodeRow, job: RunningJob, wanted: int) -> int:
        """How many new leases keep the buffer near its target without starving other nodes.

        A node's quota grows with its run of valid results (one more open lease per
        ``lease_quota_ramp`` valid groups): identities are free, so a fresh one, honest or not,
        cannot tie up more than one lease of the buffer before it has proven itself. Each lease
        the node let expire within ``expired_lease_window_s`` takes one off its quota (then it
        gets none until they age out; only a group accepted after them forgives them, see
        :meth:`~echo.coordinator.store.leases.LeaseTables.undelivered_lease_count`); one it
        returned with a rejected group (a stale version's included) for ``lease_term_factor``
        times as long as it held it, at least ``min_lease_s``: a newcomer behind NAT whose first
        group came back stale lost its only lease for 120 s. The quota is also bounded by the
        node's share of the job's recent deliveries (:meth:`LeaseTerms.share_cap`), and nodes
        without an accepted group (``fresh``) share ``fresh_lease_share`` of the window (unless
        ``lease_quota_ramp`` is 0): however many identities hoard, the rest of the window stays
        with nodes that have delivered. Nodes short of ``proven_groups`` share the same part of
        the window while a proven node is active (:meth:`LeaseTerms.unproven_room`): a few
        honest groups are cheap, and three identities that bought a quota of 2 each with them
        held 6 of a window of 8 (issue 26).
        """
        cfg = self.verification
        # Synchronously (S = 0) every group still unsampled when the learner steps is wasted:
        # lease one batch per version. Asynchronously, two keep the learner from waiting.
        per_version = 1 if job.spec.staleness == 0 else 2
        target = cfg.buffer_groups or per_version * job.spec.batch_groups
        in_flight = self.store.open_lease_count(job_id) + self.store.buffered_count(job_id)
        quota = cfg.max_open_leases_per_node
        if cfg.lease_quota_ramp:
            quota = min(quota, 1 + node.streak // cfg.lease_quota_ramp)
            # A record bought with a few groups is no claim on the window: what the node
            # delivered lately is (stale hoarders with quotas of 2 held 5 of 8, issue 26).
            share = self.terms.share_cap(job_id, node.node_id, target)
            if share is not None:
                quota = min(quota, share)
        now = time.time()
        quota -= self.store.undelivered_lease_count(
            node.node_id,
            now - cfg.expired_lease_window_s,
            now=now,
            returned_min_s=cfg.min_lease_s,
            returned_factor=cfg.lease_term_factor,
        )
        per_node = quota - self.store.open_lease_count(job_id, node.node_id)
        room = target - in_flight
        fresh = node.accepted == 0
        if fresh and cfg.lease_quota_ramp:  # ramp 0: the operator trusts identities at once
            # Their share only, not the window's room: workers fill the window without counting
            # strangers' leases (below), so a busy job's window is full whenever they have just
            # asked, and a newcomer measured against it never got a first lease (the NAT swarm:
            # a node behind NAT current within 1.5 s was told "buffer full" for 25 s).
            allowance = max(1, int(target * cfg.fresh_lease_share))
            room = allowance - self.store.open_lease_count_fresh(job_id)
        elif cfg.lease_quota_ramp:
            # Strangers' share comes on top of the window, not out of a worker's: a churn of
            # identities that let their leases expire held a quarter of it for 30 s at a time
            # and the learner waited for groups (benchmarks/attack.py, issue 26).
            room += self.store.open_lease_count_fresh(job_id)
        if room > 0 and per_node > 0:
            unproven = self.terms.unproven_room(job_id, node.accepted, target)
            if unproven is not None:
                room = min(room, unproven)
        return max(0, min(wanted, per_node, room))

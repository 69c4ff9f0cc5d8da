"""The submit path: a node's signed group verified, scored in its job's sandbox, and booked.

:class:`Submissions` owns what happens to one submission, cheapest first: strangers and nodes
without an open lease are answered from one indexed read
(:meth:`Submissions._untrusted`); a registered node's group goes through steps 1-4
(:func:`~echo.coordinator.submissions.verify.check_submission`), is scored in the job's sandbox
(:class:`~echo.coordinator.submissions.scoring.Scoring`, off the event loop), checked against the
rewards the node claimed, and stored, or rejected with a reason that is booked against the node and
closes its lease (:class:`~echo.coordinator.submissions.penalties.Penalties` decides exclusion).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from libp2p.peer.id import ID

from echo.coordinator.jobs.context import RunningJob
from echo.coordinator.metrics import Metrics
from echo.coordinator.rpc.common import admission
from echo.coordinator.scheduling.placement import Placement
from echo.coordinator.store import Store, StoreError
from echo.coordinator.store.rows import LeaseRow, NodeRow
from echo.coordinator.submissions.penalties import Penalties
from echo.coordinator.submissions.scoring import (
    TRUSTED_STREAK,
    NewNodesBusy,
    Scoring,
    outcome_summary,
)
from echo.coordinator.submissions.verify import (
    Accepted,
    Rejected,
    check_claimed_rewards,
    check_submission,
)
from echo.p2p.budget import Gate
from echo.p2p.conn_guard import ConnectionGuard
from echo.p2p.identity import public_key_from_peer_id
from echo.protocol import codec, limits
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.errors import ProtocolError
from echo.protocol.jobspec import JobSpec
from echo.tasks.sandbox import SandboxError, Score
from echo.tasks.scoring import has_advantage

log = logging.getLogger("echo.coordinator")

# Under skip_uniform_groups, at most this many batches of no-advantage groups per sampled version
# are set aside; the rest train (as zero-advantage groups), so a version always fills its batch,
# even from a policy that solves, or fails, every prompt.
UNIFORM_BATCHES = 4
# The refusal while new nodes' shared scoring budget is spent (not held against the node).
NEW_NODES_BUSY = "the coordinator is scoring as many new nodes' groups as it will now; try again"


def buffers(spec: JobSpec, rewards: list[float], uniform_so_far: Callable[[], int]) -> bool:
    """Whether an accepted group goes to the batch buffer: always, unless the job skips uniform
    groups, its rewards are all equal (no advantage) and fewer than UNIFORM_BATCHES batches of
    such groups were set aside for its version (``uniform_so_far``, asked only then)."""
    if not spec.skip_uniform_groups or has_advantage(rewards):
        return True
    return uniform_so_far() >= UNIFORM_BATCHES * spec.batch_groups


def submit_reply(store: Store, node_id: str, ok: bool, reason: str, detail: str) -> bytes:
    """The reply to a submission: its verdict and the node's running totals."""
    node = store.node(node_id)
    return m.encode(
        m.SubmitReply(
            accepted=ok,
            reason=reason,
            detail=detail[:250],
            accepted_total=node.accepted if node else 0,
            rejected_total=node.rejected if node else 0,
            rejected_by_reason=store.rejection_counts(node_id) if node else {},
        )
    )


class Submissions:
    """Groups submitted by nodes (see the module doc). ``gate`` and ``guard`` are the host's,
    set when :class:`~echo.coordinator.rpc.node.NodeRPC` is installed on it."""

    def __init__(
        self,
        store: Store,
        jobs: dict[str, RunningJob],
        metrics: Metrics,
        penalties: Penalties,
        placement: Placement | None = None,
        scoring: Scoring | None = None,
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.metrics = metrics
        self.penalties = penalties
        self.placement = placement
        # Rewards are recomputed in each job's sandbox, off the loop, charged to the sender.
        self.scoring = scoring or Scoring(metrics)
        # Strangers' submissions put them in backoff at the gate.
        self.gate: Gate | None = None
        # Nodes with accepted work are protected from idle reaping.
        self.guard: ConnectionGuard | None = None
        # Called with a node whose first group was just accepted (its dial-back waits for it).
        self.on_first_accepted: Callable[[str], None] | None = None

    async def handle(self, peer_id: ID, data: bytes) -> bytes:
        """Verify and store one group; the reply says accepted or the reason it was not.

        Cost before trust: a peer that is not a registered node, an excluded one, or one with no
        open lease is answered from one indexed read, before anything is decompressed,
        signature-checked or written (a stranger also serves a backoff). Raises nothing for
        bad input: every failure is a rejection reply, booked against the node (and its lease
        closed) when it is a registered node's.
        """
        node_id = str(peer_id)
        node = self.store.node(node_id)
        refused = self._untrusted(node_id, node)
        if refused is not None:
            return refused
        assert node is not None
        t0 = time.perf_counter()
        # The group's lease must be open and in time when it arrives; scoring may outlast the
        # deadline (waiting for a slot under load), and that delay is the coordinator's.
        received = time.time()
        # The lease check_submission looks up, kept so a rejection can close it without
        # parsing the submission a second time.
        seen: list[LeaseRow] = []

        def lookup_lease(lease_id: str) -> LeaseRow | None:
            row = self.store.lease(lease_id)
            if row is not None:
                seen.append(row)
            return row

        detail = ""
        try:
            if not self.penalties.rate_ok(node_id):
                raise Rejected(R.RATE_LIMITED, "too many submissions per minute")
            if self.scoring.budget_left(node_id) <= 0:
                raise Rejected(
                    R.RATE_LIMITED, "scoring budget spent: your last groups took long to score"
                )
            if node.streak < TRUSTED_STREAK and self.scoring.new_nodes_left() <= 0:
                raise Rejected(R.RATE_LIMITED, NEW_NODES_BUSY)
            if codec.is_zstd(data):
                try:
                    data = codec.decompress(data, max_output=limits.MAX_MESSAGE_BYTES)
                except ProtocolError as exc:
                    raise Rejected(R.MALFORMED, str(exc)) from None
            checked = check_submission(
                data,
                peer_key=public_key_from_peer_id(peer_id),
                node_key=node.public_key,
                lookup_lease=lookup_lease,
                jobs={k: j.ctx for k, j in self.jobs.items()},
                now=received,
            )
            if checked.lease.node_id != node_id:
                raise Rejected(R.LEASE_NOT_YOURS, "lease was issued to another node")
            scores = await self._score(node, checked.lease, checked.texts)
            detail = outcome_summary(scores)
            result = check_claimed_rewards(checked, [s.value for s in scores])
            self._store_accepted(node_id, data, result, received)
            if self.guard is not None:
                self.guard.protect(peer_id)
            if node.accepted == 0 and self.on_first_accepted is not None:
                self.on_first_accepted(node_id)
        except Rejected as rej:
            self._book_rejection(node_id, seen[0] if seen else None, rej)
            return submit_reply(self.store, node_id, False, rej.reason, rej.detail)
        finally:
            self.metrics.verify_seconds.observe(time.perf_counter() - t0)
        self.metrics.submissions.labels(result="accepted", reason="ok").inc()
        self.metrics.rollout_tokens.inc(result.tokens)
        if self.placement is not None:  # the node's delivered throughput, counted here
            self.placement.accepted(
                node_id, result.lease.job_id, len(result.submission.completions)
            )
        return submit_reply(self.store, node_id, True, "ok", detail)

    async def _score(self, node: NodeRow, lease: LeaseRow, texts: list[str]) -> list[Score]:
        """The group's scores from its job's sandbox (see :class:`Scoring`).

        :raises Rejected: UNSCORABLE when the job has ended meanwhile or its sandbox cannot
            start (not held against the node).
        """
        job = self.jobs.get(lease.job_id)
        if job is None:
            raise Rejected(R.JOB_MISMATCH, "job is not running")
        try:
            return await self.scoring.score(
                job.scorer,
                node.node_id,
                lease.prompt_id,
                texts,
                trusted=node.streak >= TRUSTED_STREAK,
                context=job.ctx.task.scoring_context(lease.prompt_id),
            )
        except NewNodesBusy:
            raise Rejected(R.RATE_LIMITED, NEW_NODES_BUSY) from None
        except SandboxError as exc:
            log.error("job %s cannot score: %s", lease.job_id, exc)
            raise Rejected(R.UNSCORABLE, "the coordinator cannot score this job now") from None

    def _untrusted(self, node_id: str, node: NodeRow | None) -> bytes | None:
        """The reply to a submission not worth reading (None: it is a registered, admitted node
        with an open lease). Writes nothing; strangers also serve a backoff."""
        refused = admission(node)
        if refused is not None:
            # Only a stranger serves a backoff: an excluded node keeps getting the clear answer
            # (one read, no write) it can show.
            (reason, detail), punish = refused, node is None
        elif not self.store.has_open_lease(node_id):
            reason, detail, punish = R.UNKNOWN_LEASE, "no open lease: ask for one first", False
        else:
            return None
        if punish and self.gate is not None:
            self.gate.punish(node_id)
        self.metrics.submissions.labels(result="refused", reason=reason).inc()
        log.debug("submission from %s refused unread: %s", node_id[-8:], reason)
        return submit_reply(self.store, node_id, False, reason, detail)

    def _book_rejection(self, node_id: str, lease: LeaseRow | None, rej: Rejected) -> None:
        """Record a registered node's rejected submission; close its lease unless a duplicate."""
        lease_id = job_id = ""
        if lease is not None and lease.node_id == node_id:
            lease_id, job_id = lease.lease_id, lease.job_id
            if rej.reason != R.DUPLICATE:
                self.store.close_lease(lease_id)
        self.store.record_rejection(
            job_id,
            node_id,
            lease_id,
            rej.reason,
            rej.detail,
            counts_against=rej.reason in R.COUNTS_AGAINST,
        )
        self.penalties.maybe_exclude(node_id)
        self.metrics.submissions.labels(result="rejected", reason=rej.reason).inc()
        log.info("rejected %s from %s: %s", lease_id or "?", node_id[-8:], rej)

    def _store_accepted(self, node_id: str, data: bytes, result: Accepted, received: float) -> None:
        """Store the verified group as the learner trains on it (a batch hands it out as
        stored), its envelope for audit, even if its lease expired after ``received`` (the
        group came in time), unless its node was excluded meanwhile (see
        ``Ledger.accept_rollout``);
        under the job's ``skip_uniform_groups``, one whose rewards are all equal is stored
        without being buffered (see :func:`buffers`)."""
        job = self.jobs.get(result.lease.job_id)
        buffered = job is None or buffers(
            job.spec,
            result.rewards,
            lambda: self.store.uniform_count(result.lease.job_id, result.submission.version),
        )
        try:
            self.store.accept_rollout(
                lease_id=result.lease.lease_id,
                job_id=result.lease.job_id,
                node_id=node_id,
                version=result.submission.version,
                prompt_id=result.lease.prompt_id,
                engine=result.submission.engine,
                group=result.training_group(),
                rewards=result.rewards,
                tokens=result.tokens,
                content_hash=result.content_hash,
                envelope=data,
                buffered=buffered,
                received_at=received,
            )
        except StoreError as exc:
            refused = admission(self.store.node(node_id))
            if str(exc) == R.NODE_EXCLUDED and refused is not None:
                # Excluded while this group was scored (a learner's report of its earlier
                # groups): the answer an excluded node stops on, not "duplicate".
                raise Rejected(*refused) from None
            raise Rejected(R.DUPLICATE, str(exc)) from None

"""Verification of submitted rollouts, steps 1-4 of DESIGN.md (everything that needs no model).

Fail closed and cheapest first (the node's admission was decided before, by
:func:`~echo.coordinator.rpc.common.admission`): size → envelope and signature → schema → node
key and lease → version window → group shape, tokens, log-probs and termination → weights
digest. This is the one place the node's packed arrays are decoded: :class:`Checked` carries
them on in the learner's form. Then the reward is recomputed from the decoded texts, in the
job's scoring sandbox (:mod:`echo.coordinator.submissions.scoring`: never in this process, never
on the event loop), and :func:`check_claimed_rewards` compares it with what the node claimed: a
node's reward is never used, and one that claims others is lying. Re-scoring under the claimed
version (step 5) happens at the learner, which computes those log-probs anyway.

:func:`check_submission` is pure over the jobs' :class:`JobContext` and the lease lookup passed
in, so it is benchmarked without a network (``benchmarks/verify.py``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from echo.coordinator.store.rows import LeaseRow
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol import signing
from echo.protocol.errors import ProtocolError, SchemaError, SignatureError
from echo.tasks.base import Task

# How far a claimed reward may differ from the recomputed one (float noise of a weighted sum).
REWARD_TOLERANCE = 1e-6


class Rejected(Exception):
    """A submission failed verification: ``reason`` is a code of :mod:`~echo.protocol.reasons`,
    ``detail`` says what was wrong for the node's operator."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class JobContext:
    """What verification needs to know about one job."""

    job_id: str
    task: Task
    decode: Callable[[list[int]], str]
    vocab_size: int
    eos_id: int
    staleness: int
    current_version: int = -1
    digests: dict[int, str] = field(default_factory=dict)  # version -> published state digest

    def prompt_key(self, prompt_id: int) -> bytes:
        """What a group's content hash binds it to: the task's row (``Task.row_id``), so the
        same completions to the same dataset row cannot be replayed in a later epoch under a
        new prompt id. Procedural prompts are each their own row, even where two ids render
        the same text: a converged policy answers those alike, honestly."""
        return b"row:" + self.task.row_id(prompt_id).encode()


@dataclass(frozen=True)
class Checked:
    """A submission that passed steps 1-4: the group, its lease, its decoded texts (what the
    sandbox scores), its completions as the learner trains on them (the one decoding of the
    node's arrays), how many tokens it holds and its content hash."""

    submission: m.Submission
    lease: LeaseRow
    texts: list[str]
    completions: list[m.TrainingCompletion]
    tokens: int
    content_hash: bytes


@dataclass(frozen=True)
class Accepted:
    """A checked submission with the rewards recomputed here."""

    submission: m.Submission
    lease: LeaseRow
    rewards: list[float]
    completions: list[m.TrainingCompletion]
    tokens: int
    content_hash: bytes

    def training_group(self) -> bytes:
        """The encoded TrainingGroup the learner is handed (stored once, when accepted): the
        prompt as the lease carried it, the verified completions, the recomputed rewards."""
        return m.encode(
            m.TrainingGroup.model_construct(
                rollout_id=self.lease.lease_id,
                node_id=self.lease.node_id,
                prompt_id=self.lease.prompt_id,
                prompt_tokens=list(self.lease.prompt_ids),
                version=self.submission.version,
                engine=self.submission.engine,
                rewards=self.rewards,
                completions=self.completions,
            )
        )


def check_claimed_rewards(checked: Checked, rewards: list[float]) -> Accepted:
    """The checked group with its recomputed ``rewards``.

    :raises Rejected: REWARD_MISMATCH when the node claimed rewards other than these.
    """
    claimed = checked.submission.claimed_rewards
    if claimed and (
        len(claimed) != len(rewards)
        or any(abs(a - b) > REWARD_TOLERANCE for a, b in zip(claimed, rewards, strict=True))
    ):
        raise Rejected(R.REWARD_MISMATCH, "claimed rewards differ from the recomputed ones")
    return Accepted(
        checked.submission,
        checked.lease,
        rewards,
        checked.completions,
        checked.tokens,
        checked.content_hash,
    )


def check_submission(
    data: bytes,
    *,
    peer_key: bytes,
    node_key: bytes,
    lookup_lease: Callable[[str], LeaseRow | None],
    jobs: dict[str, JobContext],
    now: float | None = None,
) -> Checked:
    """Run steps 1-4 on one signed submission from the peer whose key is ``peer_key``, a node
    registered with ``node_key`` and admitted (:func:`echo.coordinator.rpc.common.admission`
    decides that, before anything is read).

    Raises :class:`Rejected` with a reason code from :mod:`echo.protocol.reasons`; changes no
    state (the caller stores the outcome).
    """
    now = time.time() if now is None else now
    try:
        # The envelope first (SignatureError, or SchemaError for another kind), then its body
        # as a Submission (SchemaError).
        env, sub = signing.open_record(data, m.Submission, expected_signer=peer_key)
    except SignatureError as exc:
        raise Rejected(
            R.SIGNATURE if "bad signature" in str(exc) else R.WRONG_SIGNER, str(exc)
        ) from None
    except SchemaError as exc:
        raise Rejected(R.SCHEMA, str(exc)) from None
    except ProtocolError as exc:
        raise Rejected(R.MALFORMED, str(exc)) from None
    if env.signer != node_key:
        raise Rejected(R.WRONG_SIGNER, "not the registered node key")

    lease = lookup_lease(sub.lease_id)
    if lease is None:
        raise Rejected(R.UNKNOWN_LEASE, sub.lease_id)
    if lease.status == "submitted":
        raise Rejected(R.DUPLICATE, "lease already used")
    if lease.job_id != sub.job_id:
        raise Rejected(R.JOB_MISMATCH, f"lease is for job {lease.job_id}")
    ctx = jobs.get(lease.job_id)
    if ctx is None:
        raise Rejected(R.JOB_MISMATCH, "job is not running")
    if lease.status != "open" or now > lease.deadline:
        raise Rejected(R.LEASE_EXPIRED, f"deadline was {lease.deadline:.0f}")

    if sub.version > ctx.current_version:
        raise Rejected(R.FUTURE_VERSION, f"v{sub.version} > published v{ctx.current_version}")
    if ctx.current_version - sub.version > ctx.staleness:
        raise Rejected(
            R.STALE_VERSION,
            f"v{sub.version} is more than {ctx.staleness} behind v{ctx.current_version}",
        )
    if sub.version < lease.min_version:
        raise Rejected(R.BELOW_MIN_VERSION, f"lease needs v{lease.min_version}")
    if len(sub.completions) != lease.group_size:
        raise Rejected(
            R.INCOMPLETE_GROUP, f"{len(sub.completions)} of {lease.group_size} completions"
        )
    expected = ctx.digests.get(sub.version)
    if expected is not None and sub.state_digest != expected:
        raise Rejected(R.WRONG_WEIGHTS, f"state digest differs from v{sub.version}")

    texts: list[str] = []
    completions: list[m.TrainingCompletion] = []
    hasher = hashlib.sha256(lease.job_id.encode() + b"\x00" + ctx.prompt_key(lease.prompt_id))
    tokens = 0
    for i, comp in enumerate(sub.completions):
        try:
            ids = m.unpack_tokens(
                comp.token_ids, vocab_size=ctx.vocab_size, max_len=lease.max_new_tokens
            )
        except SchemaError as exc:
            raise Rejected(R.BAD_TOKENS, f"completion {i}: {exc}") from None
        try:
            lps = m.unpack_logprobs(comp.logprobs, max_len=lease.max_new_tokens)
        except SchemaError as exc:
            raise Rejected(R.BAD_LOGPROBS, f"completion {i}: {exc}") from None
        if lps.size != ids.size or ids.size == 0:
            raise Rejected(R.BAD_LOGPROBS, f"completion {i}: one log-prob per token required")
        eos_at = (ids == ctx.eos_id).nonzero()[0]
        if comp.finish_reason == "stop":
            if eos_at.size != 1 or eos_at[0] != ids.size - 1:
                raise Rejected(R.BAD_TERMINATION, f"completion {i}: 'stop' must end at one EOS")
        elif eos_at.size or ids.size != lease.max_new_tokens:
            raise Rejected(
                R.BAD_TERMINATION, f"completion {i}: 'length' must fill max_new_tokens without EOS"
            )
        ids_list = ids.tolist()
        texts.append(ctx.decode(ids_list[:-1] if comp.finish_reason == "stop" else ids_list))
        # Checked above: built without validating the lists again.
        completions.append(
            m.TrainingCompletion.model_construct(
                token_ids=ids_list,
                logprobs=lps.tolist(),
                finish_reason=comp.finish_reason,
            )
        )
        hasher.update(comp.token_ids)
        hasher.update(b"\x00")
        tokens += int(ids.size)
    return Checked(sub, lease, texts, completions, tokens, hasher.digest())

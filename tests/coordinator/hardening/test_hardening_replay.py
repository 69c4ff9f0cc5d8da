"""Replays across epochs (issue 26, finding 10): a group's content hash is bound to the prompt the
coordinator rendered, not to the prompt id, so completions accepted for a dataset row cannot be
accepted again for the same row under the id a later epoch gives it."""

from __future__ import annotations

import time
from pathlib import Path

from echo.coordinator.store.rows import LeaseRow
from echo.coordinator.submissions.verify import JobContext, check_submission
from echo.models.spec import ModelSpec, decode_completion
from echo.models.tokenizer import EOS_ID, VOCAB_SIZE
from echo.p2p.identity import Identity
from echo.protocol import messages as m
from echo.protocol import signing
from echo.tasks.registry import make_task

DATA = Path(__file__).parents[2] / "data" / "gsm8k_mini.jsonl"


def _submit(node: Identity, prompt_id: int, ctx: JobContext) -> bytes:
    now = time.time()
    lease = LeaseRow(
        f"lease-{prompt_id}", "job", node.peer_id_str, prompt_id, 2, 8, 0, 0, now, now + 60, "open"
    )
    comps = [
        m.CompletionRecord(
            token_ids=m.pack_tokens([5, 6, EOS_ID]),
            logprobs=m.pack_logprobs([-0.5] * 3),
            finish_reason="stop",
        )
    ] * 2
    sub = m.Submission(
        lease_id=lease.lease_id,
        job_id="job",
        version=0,
        engine="torch",
        state_digest="d",
        completions=comps,
        gen_seconds=0.1,
    )
    data = signing.seal_record(node.private_key, sub)
    key = node.public_key_bytes
    return check_submission(
        data,
        peer_key=key,
        node_key=key,
        lookup_lease={lease.lease_id: lease}.get,
        jobs={"job": ctx},
    ).content_hash


def _ctx(task) -> JobContext:
    spec = ModelSpec()
    return JobContext(
        job_id="job",
        task=task,
        decode=lambda ids: decode_completion(spec, ids),
        vocab_size=VOCAB_SIZE,
        eos_id=EOS_ID,
        staleness=2,
        current_version=0,
        digests={0: "d"},
    )


def test_the_same_completions_for_the_same_row_in_a_later_epoch_hash_the_same() -> None:
    node = Identity.generate()
    task = make_task("dataset", {"path": str(DATA)})
    ctx = _ctx(task)
    rows = len(task.load().train)
    pid = 3
    later = next(p for p in range(rows, 3 * rows) if task.row_id(p) == task.row_id(pid))
    first = _submit(node, pid, ctx)
    assert _submit(node, later, ctx) == first  # the store's unique content hash refuses it
    other = next(p for p in range(rows) if task.row_id(p) != task.row_id(pid))
    assert _submit(node, other, ctx) != first  # another row is other content


def test_procedural_prompts_with_the_same_text_are_distinct_rows() -> None:
    """``1+2=`` leased twice is two problems: a converged policy's identical answers to both
    are honest work, not a replay."""
    node = Identity.generate()
    task = make_task("addition", {"max_operand": 3})
    same = [p for p in range(200) if task.prompt(p) == task.prompt(0)]
    assert len(same) > 1
    ctx = _ctx(task)
    assert _submit(node, same[0], ctx) != _submit(node, same[1], ctx)

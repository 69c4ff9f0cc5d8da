"""Long completions reach the learner: 8 groups of 16 completions of 4,096 tokens go from a node
through the coordinator's verification and buffer to the learner's own batch request, over real
libp2p hosts on loopback; a reply's byte budget splits a batch into several replies."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from echo.learner.service import Learner
from echo.learner.trainer import train_groups
from echo.models.prompts import PromptRenderer
from echo.models.tokenizer import NUM_SPECIAL, VOCAB_SIZE
from echo.protocol import ids, limits, signing
from echo.protocol import messages as m
from tests.conftest import learner_publish_v0, run_with_coordinator, submit_job

GROUPS, GROUP_SIZE, TOKENS = 8, 16, 4096


def long_job(coord) -> str:
    return submit_job(
        coord,
        group_size=GROUP_SIZE,
        batch_groups=GROUPS,
        sampling={"max_new_tokens": TOKENS},
        task={"name": "addition", "params": {"max_operand": 5, "max_new_tokens": TOKENS}},
    )


def long_group(lease: m.Lease, rng: np.random.Generator) -> m.Submission:
    """``group_size`` completions that fill ``max_new_tokens`` without EOS (finish 'length')."""
    n = lease.sampling.max_new_tokens
    comps = [
        m.CompletionRecord(
            token_ids=m.pack_tokens(rng.integers(NUM_SPECIAL, VOCAB_SIZE, n)),
            logprobs=m.pack_logprobs(-rng.random(n, dtype=np.float32) * 5),
            finish_reason="length",
        )
        for _ in range(lease.group_size)
    ]
    return m.Submission(
        lease_id=lease.lease_id,
        job_id=lease.job_id,
        version=0,
        engine="torch",
        state_digest="digest-v0",
        completions=comps,
        gen_seconds=1.0,
    )


async def fill_buffer(coord, client) -> tuple[str, Learner, dict[str, m.Submission]]:
    """A running long job with GROUPS accepted groups, and the job's real Learner attached to
    the coordinator over its own libp2p host (the key the job pins)."""
    job_id = long_job(coord)
    ident, _, report = learner_publish_v0(coord, job_id)
    lc = await client(ident)
    hello = m.LearnerHello(
        job_id=job_id,
        peer_id=str(lc.host.peer_id),
        addrs=lc.host.listen_multiaddrs,
        timestamp=time.time(),
    )
    await lc.call(ids.PROTO_LEARNER_HELLO, lc.seal(hello))
    ack = m.decode(m.StepAck, await lc.call(ids.PROTO_LEARNER_REPORT, lc.seal(report)))
    assert ack.ok, ack.message
    node = await client()
    await node.register()
    reply = await node.leases(job_id, have=0, n=GROUPS)
    assert len(reply.leases) == GROUPS, reply.message
    rng = np.random.default_rng(0)
    sent = {}
    for env in reply.leases:
        key = coord.identity.public_key_bytes
        lease = signing.open_record(env, m.Lease, expected_signer=key)[1]
        assert lease.sampling.max_new_tokens == TOKENS
        # The lease carries the prompt's ids, rendered by the coordinator from its task.
        assert m.unpack_tokens(
            lease.prompt_tokens, vocab_size=VOCAB_SIZE, max_len=m.MAX_PROMPT_TOKENS
        ).tolist() == coord.job_control.jobs[job_id].prompt_tokens(lease.prompt_id)
        sub = long_group(lease, rng)
        ok = await node.submit(node.seal(sub))
        assert ok.accepted, (ok.reason, ok.detail)
        sent[lease.lease_id] = sub
    learner = Learner(coord.job_dir(job_id), job_id, coord.multiaddrs[0], torch.get_num_threads())
    learner.link.host, learner.link.peer = lc.host, lc.coord
    return job_id, learner, sent


@contextlib.contextmanager
def nothing_decoded_again(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail any call of the packed-array decoders, or any prompt rendering, while the block
    runs: both happened once, before (verification, the lease)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a fact of a verified group was decoded or rendered again")

    with monkeypatch.context() as patch:
        patch.setattr(m, "unpack_tokens", refuse)
        patch.setattr(m, "unpack_logprobs", refuse)
        patch.setattr(np, "frombuffer", refuse)
        patch.setattr(PromptRenderer, "ids", refuse)
        yield


def check_groups(
    groups: list[m.TrainingGroup], sent: dict[str, m.Submission], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every group arrived whole and bit for bit, and the learner reads the batch as it came."""
    assert {g.rollout_id for g in groups} == set(sent)
    for g in groups:
        assert [c.token_ids for c in g.completions] == [
            np.frombuffer(c.token_ids, "<i4").tolist() for c in sent[g.rollout_id].completions
        ]
        assert [c.logprobs for c in g.completions] == [
            np.frombuffer(c.logprobs, "<f4").tolist() for c in sent[g.rollout_id].completions
        ]
        assert all(len(c.token_ids) == TOKENS for c in g.completions)
    with nothing_decoded_again(monkeypatch):
        decoded, finish = train_groups(groups)
    assert [len(d.completions) for d in decoded] == [GROUP_SIZE] * GROUPS
    assert all(len(c) == TOKENS for d in decoded for c in d.completions)
    assert all(f == ["length"] * GROUP_SIZE for f in finish)


def test_a_batch_of_long_completions_reaches_the_learner_in_one_reply(
    tmp_path, monkeypatch
) -> None:
    async def body(coord, client) -> None:
        _, learner, sent = await fill_buffer(coord, client)
        with nothing_decoded_again(monkeypatch):  # the coordinator's batch path and the learner's
            reply = await learner._take_groups(GROUPS)
        assert not reply.more and len(reply.groups) == GROUPS
        # Over 4 MiB: the old reply limit (a 4 MiB chunk frame plus 64 KiB of headroom) held it
        # only without the duplicate envelope protocol 4 dropped, and not with prompts of 2,000
        # tokens; the batch reply's own budget holds it with room to spare.
        size = len(m.encode(reply))
        assert 4 << 20 < size <= limits.MAX_BATCH_REPLY_BYTES // 4
        check_groups(list(reply.groups), sent, monkeypatch)

    run_with_coordinator(tmp_path, body, buffer_groups=GROUPS, max_open_leases_per_node=GROUPS)


def test_a_smaller_reply_budget_splits_the_batch_and_says_more(tmp_path, monkeypatch) -> None:
    async def body(coord, client) -> None:
        _, learner, sent = await fill_buffer(coord, client)
        per_group = m.training_group_bound(GROUP_SIZE, TOKENS)
        coord.learner_rpc.batch_reply_bytes = 3 * per_group + 1024  # 3 groups a reply
        got, sizes, flags = [], [], []
        while len(got) < GROUPS:
            reply = await learner._take_groups(GROUPS - len(got))
            got.extend(reply.groups)
            sizes.append(len(reply.groups))
            flags.append(reply.more)
        assert sizes == [3, 3, 2] and flags == [True, True, False]
        check_groups(got, sent, monkeypatch)

    run_with_coordinator(tmp_path, body, buffer_groups=GROUPS, max_open_leases_per_node=GROUPS)

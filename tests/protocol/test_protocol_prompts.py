"""Protocol 5: the signed lease carries the prompt's token ids (bounded), and a batch reply
budgets each training group by a bound that real encodings never exceed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from echo.node.worker import lease_prompt
from echo.p2p.identity import Identity
from echo.protocol import codec, ids, limits, signing
from echo.protocol import messages as m
from echo.protocol.errors import SchemaError


def lease(prompt: bytes) -> dict:
    now = time.time()
    return dict(
        lease_id="l1",
        job_id="job",
        node_id="node",
        prompt_id=7,
        prompt_tokens=prompt,
        group_size=4,
        sampling=dict(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=3),
        min_version=0,
        issued_at=now,
        deadline=now + 60,
    )


def test_protocol_version_is_at_least_5() -> None:
    assert ids.PROTOCOL_VERSION >= 5


def test_a_signed_lease_carries_its_prompt_ids() -> None:
    key = Identity.generate()
    rec = m.from_obj(m.Lease, lease(m.pack_tokens([1, 20, 30])))
    env = signing.seal_record(key.private_key, rec)
    back = signing.open_record(env, m.Lease, expected_signer=key.public_key_bytes)[1]
    assert lease_prompt(back, vocab_size=259) == [1, 20, 30]


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        (b"", "at least 4"),
        (m.pack_tokens([1] * (m.MAX_PROMPT_TOKENS + 1)), "at most"),
    ],
)
def test_a_lease_prompt_outside_its_bounds_is_a_schema_error(prompt: bytes, why: str) -> None:
    with pytest.raises(SchemaError, match=f"Lease.prompt_tokens: .*{why}"):
        m.decode(m.Lease, codec.packb(lease(prompt)))


def test_the_node_refuses_prompt_ids_outside_its_vocabulary() -> None:
    rec = m.from_obj(m.Lease, lease(m.pack_tokens([1, 300])))
    with pytest.raises(SchemaError, match="vocabulary"):
        lease_prompt(rec, vocab_size=259)
    odd = m.from_obj(m.Lease, lease(b"\1\0\0\0\2"))
    with pytest.raises(SchemaError, match="multiple of 4"):
        lease_prompt(odd, vocab_size=259)


def test_the_training_group_bound_covers_real_encodings_at_their_longest() -> None:
    rng = np.random.default_rng(0)
    widest = "\U0001f600"  # 4 bytes in UTF-8: the longest a character of a string field takes
    for group_size, tokens in [(1, 1), (3, 64), (16, 4096)]:
        # Ids that take msgpack's longest int form, log-probs its double.
        comps = [
            m.TrainingCompletion(
                token_ids=rng.integers(2**16, 2**31 - 1, tokens).tolist(),
                logprobs=(-rng.random(tokens)).tolist(),
                finish_reason="length",
            )
            for _ in range(group_size)
        ]
        group = m.TrainingGroup(
            rollout_id=widest * 128,
            node_id=widest * 128,
            prompt_id=2**62 - 1,
            prompt_tokens=[2**31 - 1] * m.MAX_PROMPT_TOKENS,
            version=2**40,
            engine=widest * 256,
            rewards=[-1.2345678901234567e300] * group_size,
            completions=comps,
        )
        size = len(m.encode(group))
        bound = m.training_group_bound(group_size, tokens)
        assert size <= bound < size + 8192, (group_size, tokens, size, bound)


def test_one_group_at_the_protocols_extremes_fits_a_batch_reply() -> None:
    worst = m.training_group_bound(m.MAX_GROUP_SIZE, m.MAX_COMPLETION_TOKENS)
    assert worst + 256 <= limits.MAX_BATCH_REPLY_BYTES
    # and the batch (8 groups of 16 completions of 4,096 tokens) fits one reply
    assert 8 * m.training_group_bound(16, 4096) + 256 <= limits.MAX_BATCH_REPLY_BYTES


def test_a_batch_reply_of_stored_groups_is_the_reply_encoded_whole() -> None:
    """The coordinator splices the groups it encoded when it accepted them into a batch reply
    (protocol 9): the bytes are what encoding the whole reply gives, and decode to the groups."""
    groups = [
        m.TrainingGroup(
            rollout_id=f"r{i}",
            node_id="n",
            prompt_id=i,
            prompt_tokens=[1, 2**31 - 1],
            version=3,
            engine="torch",
            rewards=[0.5, -1.0],
            completions=[
                m.TrainingCompletion(token_ids=[7, 300], logprobs=[-0.25, -3.5e-8],
                                     finish_reason="stop"),
                m.TrainingCompletion(token_ids=[70000], logprobs=[0.0], finish_reason="length"),
            ],
        )
        for i in range(3)
    ]
    for kept, more, cancelled in ((groups, True, False), ([], False, True)):
        spliced = m.encode_batch_reply(
            [m.encode(g) for g in kept], 4, more=more, cancelled=cancelled
        )
        whole = m.BatchReply(groups=kept, current_version=4, more=more, cancelled=cancelled)
        assert spliced == m.encode(whole)
        assert m.decode(m.BatchReply, spliced) == whole

"""The attack benchmark's attackers (tools/attackers/, benchmarks/attack.py), without a swarm.

What a benchmark run cannot show by itself when it goes wrong: that the scorer bombs are groups
the coordinator accepts as well-formed and decodes back to exactly the hostile text (else they
would be rejected before any scorer saw them, and the benchmark would measure nothing), that
each payload fits a lease, and that every kind's arguments parse.
"""

from __future__ import annotations

import contextvars
import time
import tomllib
from pathlib import Path

import pytest
import trio

import echo.tools.attackers as a
from echo.coordinator.store.rows import LeaseRow
from echo.coordinator.submissions.verify import JobContext, check_submission
from echo.models.spec import ModelSpec, decode_completion
from echo.models.tokenizer import EOS_ID, VOCAB_SIZE
from echo.p2p.identity import Identity
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.jobspec import parse_job
from echo.tasks.registry import make_task
from echo.tools.attackers import common, content
from echo.tools.attackers.job import GYM_MAX_NEW_TOKENS, GYM_PARAMS, gym_job

ROOT = Path(__file__).resolve().parents[2]

MAX_NEW_TOKENS = 256


def _lease(node_id: str, now: float) -> m.Lease:
    return m.Lease(
        lease_id="lease-1",
        job_id="job-1",
        node_id=node_id,
        prompt_id=7,
        prompt_tokens=m.pack_tokens([1, 40, 41]),
        group_size=8,
        sampling=m.SamplingSpec(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, seed=3),
        min_version=4,
        issued_at=now,
        deadline=now + 30,
    )


def fetch_manifest(now: float) -> m.Manifest:
    return m.Manifest(
        job_id="job-1",
        version=5,
        base_version=4,
        kind="patch",
        total_size=0,
        chunks=[],
        tensor_digests={},
        state_digest="digest-v5",
        anchor_version=0,
        created_at=now,
    )


def test_bomb_texts_fit_the_room_and_cover_the_issue(tmp_path: Path) -> None:
    for room in (31, 63, MAX_NEW_TOKENS - 1, 8191):
        texts = content.bomb_texts(room, tmp_path)
        assert texts and all(len(t) <= room for _, t in texts), room
        assert len({n for n, _ in texts}) == len(texts)
    names = {n for n, _ in content.bomb_texts(MAX_NEW_TOKENS - 1, tmp_path)}
    # Code for eval and for sympy, huge exponents, deep nesting, the longest text that fits.
    assert {"eval_write", "eval_system", "sympy_code", "power_tower", "deep_brackets"} <= names
    assert {"long_line", "long_digits", "latex_tower"} <= names
    code = dict(content.bomb_texts(MAX_NEW_TOKENS - 1, tmp_path))["eval_write"]
    assert str(tmp_path / "eval_write") in code  # the trace it would leave


def test_a_bomb_group_passes_verification_and_decodes_to_its_text(tmp_path: Path) -> None:
    """The coordinator's own checks (steps 1-4) take the group and hand the scorers exactly the
    hostile texts: right lease, version, digest, token ids, log-probs and termination."""
    ident, now = Identity.generate(), time.time()
    lease, manifest = _lease(ident.peer_id_str, now), fetch_manifest(now)
    spec = ModelSpec()
    encoder = content.Encoder(spec.to_dict())
    texts = [t for _, t in content.bomb_texts(MAX_NEW_TOKENS - 1, tmp_path)]
    texts.append("y" * (MAX_NEW_TOKENS + 50))  # longer than a lease: cut, finish "length"
    sub = content.bomb_submission(lease, manifest, encoder, texts[-8:])
    row = LeaseRow(
        lease_id=lease.lease_id,
        job_id=lease.job_id,
        node_id=lease.node_id,
        prompt_id=lease.prompt_id,
        group_size=lease.group_size,
        max_new_tokens=MAX_NEW_TOKENS,
        seed=lease.sampling.seed,
        min_version=lease.min_version,
        issued_at=now,
        deadline=lease.deadline,
        status="open",
    )
    ctx = JobContext(
        job_id="job-1",
        task=make_task("addition", {}),
        decode=lambda ids_: decode_completion(spec, ids_),
        vocab_size=VOCAB_SIZE,
        eos_id=EOS_ID,
        staleness=2,
        current_version=6,
        digests={5: "digest-v5"},
    )
    checked = check_submission(
        signing.seal_record(ident.private_key, sub),
        peer_key=ident.public_key_bytes,
        node_key=ident.public_key_bytes,
        lookup_lease=lambda _: row,
        jobs={"job-1": ctx},
        now=now + 1,
    )
    want = [t[:MAX_NEW_TOKENS] for t in texts[-8:]]
    assert checked.texts == want
    assert [c.finish_reason for c in sub.completions][-1] == "length"


def test_the_gym_job_is_valid_and_leases_room_for_the_bombs() -> None:
    for dataset in GYM_PARAMS:
        spec = parse_job(tomllib.loads(gym_job(f"gym:{dataset}")))
        task = make_task(spec.task.name, dict(spec.task.params))
        assert min(spec.sampling.max_new_tokens, task.max_new_tokens) == GYM_MAX_NEW_TOKENS
        assert {r.kind for r in spec.reward} == {"task", "math"}
        # Room for the code payloads with a marker path of a temporary folder.
        assert len(content.bomb_texts(GYM_MAX_NEW_TOKENS - 1, Path("/tmp/echo-attack-x/b"))) >= 14


@pytest.mark.parametrize("kind", sorted(a.KINDS))
def test_every_kind_parses(kind: str, tmp_path: Path) -> None:
    argv = [kind, "--coordinator", "/ip4/127.0.0.1/tcp/1/p2p/x", "--job", "j"]
    argv += ["--stats", str(tmp_path / "s.json"), "--data-dir", str(tmp_path)]
    args = a.parse_args(argv)
    assert args.kind == kind and args.rate == 5.0 and args.warm_groups == a.STALE_WARM_GROUPS


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    base = ["--coordinator", "c", "--job", "j", "--stats", str(tmp_path / "s.json")]
    for argv in (
        ["liar", *base],  # a real node needs its folder
        ["stale", *base],
        ["churn", *base, "--rate", "0"],
        ["bomb", *base, "--source-ip", "not-an-address"],
        ["nope", *base],
    ):
        with pytest.raises(SystemExit):
            a.parse_args(argv)


def test_a_network_hands_each_new_identity_its_own_address(monkeypatch) -> None:
    monkeypatch.setattr(trio, "open_tcp_stream", trio.open_tcp_stream)  # restored afterwards

    def run() -> list[str]:
        nxt = common.dial_from("127.1.0.0/30")
        return [common.SOURCE.get(), nxt(), nxt(), nxt()]

    assert contextvars.copy_context().run(run) == [
        "127.1.0.1",
        "127.1.0.2",
        "127.1.0.1",
        "127.1.0.2",
    ]

    def one() -> list[str]:
        nxt = common.dial_from("127.0.0.5")
        return [common.SOURCE.get(), nxt()]

    assert contextvars.copy_context().run(one) == ["127.0.0.5", "127.0.0.5"]

"""Verification cost: steps 1-4 per core, and re-scoring (step 5) against the learner's step.

Steps 1-4 (size limits, envelope + Ed25519 signature, strict schema, lease and version window,
group shape, token/log-prob checks, termination, reward recomputed from the lease's prompt) run
through ``echo.coordinator.submissions.verify.check_submission`` on one core, over real signed
submissions; the baseline in the same run is the bare Ed25519 verification of the same bytes, the
floor any design must pay. Re-scoring is timed as a fraction of the learner's own step on the same
batch (``benchmarks/rescore.py``, which also runs alone).

    python benchmarks/verify.py [--quick] [--device cuda]
"""

from __future__ import annotations

import os
import random
import time

import rescore
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from echo.coordinator.store.rows import LeaseRow
from echo.coordinator.submissions.verify import JobContext, check_submission
from echo.models.device import resolve_device
from echo.models.spec import ModelSpec, decode_completion
from echo.models.tokenizer import EOS_ID, VOCAB_SIZE
from echo.p2p.identity import Identity
from echo.protocol import messages as m
from echo.protocol import signing
from echo.tasks.registry import make_task
from echo.tools.bench import emit, parse_args, say

GROUP = rescore.GROUP
MAX_NEW = rescore.MAX_NEW


def make_submissions(n: int, node: Identity, task) -> tuple[list[bytes], dict[str, LeaseRow]]:
    rng = random.Random(0)
    now = time.time()
    leases, subs = {}, []
    for i in range(n):
        lid = f"lease-{i}"
        leases[lid] = LeaseRow(
            lid, "job", node.peer_id_str, i, GROUP, MAX_NEW, i, 0, now, now + 3600, "open"
        )
        comps = []
        for _ in range(GROUP):
            k = rng.randrange(1, MAX_NEW)
            toks = [rng.randrange(3, VOCAB_SIZE) for _ in range(k - 1)] + [EOS_ID]
            comps.append(
                m.CompletionRecord(
                    token_ids=m.pack_tokens(toks),
                    logprobs=m.pack_logprobs([-0.5] * k),
                    finish_reason="stop",
                )
            )
        sub = m.Submission(
            lease_id=lid,
            job_id="job",
            version=3,
            engine="torch",
            state_digest="d",
            completions=comps,
            gen_seconds=0.1,
        )
        subs.append(signing.seal_record(node.private_key, sub))
    return subs, leases


def bench_steps_1_4(n: int) -> dict[str, float]:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    node = Identity.generate()
    task = make_task("addition", {"max_operand": 10})
    spec = ModelSpec()
    ctx = JobContext(
        job_id="job",
        task=task,
        decode=lambda ids: decode_completion(spec, ids),
        vocab_size=VOCAB_SIZE,
        eos_id=EOS_ID,
        staleness=2,
        current_version=3,
        digests={3: "d"},
    )
    subs, leases = make_submissions(n, node, task)
    key = node.public_key_bytes
    t0 = time.perf_counter()
    for data in subs:
        check_submission(
            data,
            peer_key=key,
            node_key=key,
            lookup_lease=leases.get,
            jobs={"job": ctx},
        )
    full = time.perf_counter() - t0
    pub = Ed25519PublicKey.from_public_bytes(key)
    raw = [signing.open_record(d, m.Submission)[0] for d in subs]
    t0 = time.perf_counter()
    for env in raw:
        pub.verify(env.sig, signing._signed_bytes(m.Submission.KIND, env.body))
    sig_only = time.perf_counter() - t0
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return {
        "groups_per_s_per_core": n / full,
        "rollouts_per_s_per_core": n * GROUP / full,
        "signature_only_groups_per_s": n / sig_only,
        "steps_1_4_vs_signature_only": full / sig_only,
    }


def main() -> None:
    args = parse_args(__doc__, setup=rescore.add_device_option)
    device = str(resolve_device(args.device))
    n = 300 if args.quick else 2000
    say(f"steps 1-4 over {n} signed groups of {GROUP} on one core ...")
    v = bench_steps_1_4(n)
    say(
        f"  {v['rollouts_per_s_per_core']:,.0f} rollouts/s per core "
        f"({v['groups_per_s_per_core']:,.0f} groups/s); "
        f"{v['steps_1_4_vs_signature_only']:.2f}x the cost of the bare signature check"
    )
    rs = rescore.run(args.quick, device)
    emit({**v, **rs, "quick": args.quick, "device": device})


if __name__ == "__main__":
    main()

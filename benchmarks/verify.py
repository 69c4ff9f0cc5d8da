"""Verification cost: steps 1-4 per core, and re-scoring (step 5) against the learner's step.

Steps 1-4 (size limits, envelope + Ed25519 signature, strict schema, lease and version window,
group shape, token/log-prob checks, termination, reward recomputed from the lease's prompt) run
through ``echo.coordinator.verify.check_submission`` on one core, over real signed submissions;
the baseline in the same run is the bare Ed25519 verification of the same bytes, the floor any
design must pay. Re-scoring is timed as a fraction of the learner's own step on the same batch.

    python benchmarks/verify.py [--quick]
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import emit, median, parse_args, say  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey  # noqa: E402

from echo.coordinator.rows import LeaseRow  # noqa: E402
from echo.coordinator.verify import JobContext, check_submission  # noqa: E402
from echo.learner.grpo import GRPOConfig, GRPOLearner, TrainGroup  # noqa: E402
from echo.learner.rescore import Rescorer, token_stats  # noqa: E402
from echo.models.spec import ModelSpec, build_model, decode_completion, encode_prompt  # noqa: E402
from echo.models.tokenizer import EOS_ID, VOCAB_SIZE  # noqa: E402
from echo.models.weights import export_state  # noqa: E402
from echo.node.engines.base import GenRequest, SamplingParams  # noqa: E402
from echo.node.engines.torch_engine import TorchEngine  # noqa: E402
from echo.p2p.identity import Identity  # noqa: E402
from echo.protocol import messages as m  # noqa: E402
from echo.protocol import signing  # noqa: E402
from echo.tasks.registry import make_task  # noqa: E402

GROUP = 16
MAX_NEW = 8


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
            node_excluded=False,
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


def bench_rescore(batch_groups: int, reps: int) -> dict[str, float]:
    """Learner step time with and without the fused re-scoring gate (groups sampled from the
    current weights), and the separate prefill that groups from older versions need."""
    torch.set_num_threads(1)
    spec = ModelSpec()
    task = make_task("addition", {"max_operand": 5})
    learner = GRPOLearner(build_model(spec, seed=0), GRPOConfig())
    engine = TorchEngine(spec, threads=1)
    rescorer = Rescorer(spec, keep=3, temperature=1.0)
    plain_s, fused_s, prefill_s = [], [], []
    for r in range(2 * reps):
        state = export_state(learner.model)
        engine.load_state(state)
        rescorer.remember(learner.version, state)
        reqs = [GenRequest(encode_prompt(spec, task.prompt(r * 100 + i)), GROUP,
                           SamplingParams(max_new_tokens=MAX_NEW, seed=r * 100 + i))
                for i in range(batch_groups)]
        groups = []
        for i, comps in enumerate(engine.generate(reqs)):
            groups.append(TrainGroup(
                reqs[i].prompt_ids, [c.token_ids for c in comps], [c.logprobs for c in comps],
                [task.reward(r * 100 + i, decode_completion(spec, c.token_ids[:-1]))
                 for c in comps], version=learner.version))
        finish = [["stop" if c[-1] == EOS_ID else "length" for c in g.completions]
                  for g in groups]
        t0 = time.perf_counter()
        verdicts = rescorer.check(groups, finish)
        prefill_s.append(time.perf_counter() - t0)
        assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok]
        fused = r % 2 == 1
        gated: list = []

        def gate(stats, groups=groups, finish=finish, gated=gated) -> list[bool]:
            out = [rescorer.judge(g, f, "torch", *st).ok
                   for g, f, st in zip(groups, finish, stats, strict=True)]
            gated.extend(out)
            return out

        t0 = time.perf_counter()
        learner.step(groups, gate=gate if fused else None, gate_stats=token_stats)
        (fused_s if fused else plain_s).append(time.perf_counter() - t0)
        assert not fused or (len(gated) == len(groups) and all(gated))
    step = median(plain_s)
    return {"learner_step_s": step, "learner_step_fused_s": median(fused_s),
            "rescore_fraction": max(0.0, median(fused_s) - step) / step,
            "rescore_prefill_s": median(prefill_s),
            "rescore_fraction_stale": median(prefill_s) / step}


def bench_pipeline(batch_groups: int, arrivals: int, reps: int) -> dict[str, float]:
    """Re-scoring as the learner pays it at S = 2, through the real ``Trainer``.

    Every group of a batch is one version old (what the local swarms showed at S = 2: nodes
    sample the newest version while the learner trains on the one before, mean staleness
    0.75-1.0). Groups reach the learner in ``arrivals`` parts (nodes submit the leases they
    generated together); the learner re-scores each part while it waits for the next
    (``Trainer.prescore``), and the last part inside the step. The blended cost is the
    re-scoring on the step's critical path over the step without it; ``..._unpipelined`` is the
    same batch with every group re-scored inside the step, as before pre-scoring.
    """
    from echo.learner.trainer import Trainer
    from echo.protocol.jobspec import JobSpec

    torch.set_num_threads(1)
    spec = ModelSpec()
    job = JobSpec(name="bench", staleness=2, batch_groups=batch_groups, group_size=GROUP)
    task = make_task("addition", {"max_operand": 5})
    engine = TorchEngine(spec, threads=1)
    trainers = {mode: Trainer(job, spec, GRPOLearner(build_model(spec, seed=0), job.grpo), task)
                for mode in ("pipelined", "unpipelined")}
    critical = {mode: [] for mode in trainers}
    steps = {mode: [] for mode in trainers}
    for r in range(reps + 1):
        for mode, tr in trainers.items():
            sampled_from = export_state(tr.learner.model)  # version v: nodes sample from it
            tr.remember(tr.version, sampled_from)
            engine.load_state(sampled_from)
            # ... while the learner steps on to v + 1 with a batch of its own.
            tr.train(make_batch(engine, spec, task, tr.version, batch_groups, seed=r + 1000))
            batch = make_batch(engine, spec, task, tr.version - 1, batch_groups, seed=r)
            part = -(-batch_groups // arrivals)
            if mode == "pipelined":
                for at in range(0, batch_groups - part, part):
                    tr.prescore(batch[at : at + part])
            res = tr.train(batch)
            assert res.metrics["rejected"] == 0, res.metrics
            if r:  # the first round warms up
                critical[mode].append(res.metrics["rescore_s"])
                steps[mode].append(res.metrics["step_s"])
    step = median(steps["pipelined"] + steps["unpipelined"])
    return {"rescore_fraction_blended": median(critical["pipelined"]) / step,
            "rescore_fraction_blended_unpipelined": median(critical["unpipelined"]) / step,
            "pipeline_step_s": step, "arrivals": float(arrivals)}


def make_batch(engine: TorchEngine, spec: ModelSpec, task, version: int, n: int,
               seed: int) -> list[m.TrainingGroup]:
    """``n`` honest groups sampled by ``engine`` as a node would, as the coordinator ships them."""
    reqs = [GenRequest(encode_prompt(spec, task.prompt(seed * 100 + i)), GROUP,
                       SamplingParams(max_new_tokens=MAX_NEW, seed=seed * 100 + i))
            for i in range(n)]
    out = []
    for i, comps in enumerate(engine.generate(reqs)):
        pid = seed * 100 + i
        out.append(m.TrainingGroup(
            rollout_id=f"r{seed}-{version}-{i}", node_id="node", prompt_id=pid,
            prompt_tokens=m.pack_tokens(reqs[i].prompt_ids), version=version, engine="torch",
            rewards=[task.reward(pid, decode_completion(spec, c.token_ids[:-1])) for c in comps],
            completions=[m.CompletionRecord(
                token_ids=m.pack_tokens(c.token_ids), logprobs=m.pack_logprobs(c.logprobs),
                finish_reason=c.finish_reason) for c in comps]))
    return out


def main() -> None:
    args = parse_args(__doc__)
    n = 300 if args.quick else 2000
    say(f"steps 1-4 over {n} signed groups of {GROUP} on one core ...")
    v = bench_steps_1_4(n)
    say(
        f"  {v['rollouts_per_s_per_core']:,.0f} rollouts/s per core "
        f"({v['groups_per_s_per_core']:,.0f} groups/s); "
        f"{v['steps_1_4_vs_signature_only']:.2f}x the cost of the bare signature check"
    )
    reps = 5 if args.quick else 20
    say(f"re-scoring vs learner step, batch of 8 groups x {GROUP}, {reps} reps ...")
    r = bench_rescore(8, reps)
    say(f"  learner step {r['learner_step_s'] * 1e3:.1f} ms; with the fused re-scoring gate "
        f"{r['learner_step_fused_s'] * 1e3:.1f} ms = {r['rescore_fraction']:.1%} extra "
        f"(groups from the current weights)")
    say(f"  groups from older versions need a prefill: {r['rescore_prefill_s'] * 1e3:.1f} ms = "
        f"{r['rescore_fraction_stale']:.1%} of the step")
    say(f"re-scoring at S = 2 as the learner pays it: batch of 16 groups x {GROUP}, all one "
        f"version old, arriving in 4 parts ...")
    p = bench_pipeline(16, 4, reps)
    say(f"  on the step's critical path: {p['rescore_fraction_blended']:.1%} of the step "
        f"(every group re-scored inside the step: "
        f"{p['rescore_fraction_blended_unpipelined']:.1%})")
    emit({**v, **r, **p, "quick": args.quick})


if __name__ == "__main__":
    main()

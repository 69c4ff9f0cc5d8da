"""Adversarial volunteer nodes for the tests: real node processes that each cheat one way.

Run as ``python -m tests.adversaries KIND --coordinator MADDR --data-dir DIR``. Each is the real
:class:`echo.node.worker.Node` (real libp2p identity, registration, weight sync, engine) with one
step of its honest behaviour replaced. They live in tests/, never in the shipped CLI.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import trio

from echo.models.spec import ModelSpec, build_model, encode_prompt
from echo.models.tokenizer import EOS_ID, VOCAB_SIZE
from echo.node.config import NodeConfig
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.engines.torch_engine import TorchEngine
from echo.node.worker import Node, NodeError, lease_request
from echo.p2p.identity import Identity
from echo.p2p.lifecycle import run_until_signalled
from echo.protocol import codec, signing
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.tasks.registry import make_task

# The reason the coordinator or learner must give for each adversary's submissions.
EXPECTED = {
    "random_tokens": R.SAMPLING_SHAPE,
    "other_model": R.RESCORE_MISMATCH,
    "fabricated_logprobs": R.RESCORE_MISMATCH,
    "inflated_reward": R.REWARD_MISMATCH,
    "replay": R.DUPLICATE,
    "replay_new_version": R.DUPLICATE,
    "stale_version": R.STALE_VERSION,
    "half_group": R.INCOMPLETE_GROUP,
    "truncated": R.BAD_TERMINATION,
    "foreign_signature": R.WRONG_SIGNER,
    "swapped_prompt": R.RESCORE_MISMATCH,
    "malformed": R.MALFORMED,
    "oversized": R.MALFORMED,
}


# The stale adversary claims a version this far behind: outside the test job's window (S = 3).
STALE_BY = 4


class Adversary(Node):
    kind = ""

    def __init__(self, cfg: NodeConfig, kind: str) -> None:
        super().__init__(cfg)
        self.kind = kind
        self.rng = random.Random(hash(kind) & 0xFFFF)
        self.first_accepted: bytes | None = None
        self.foreign = Identity.generate()
        self.other: TorchEngine | None = None

    def _true_logprobs(self, prompt: list[int], tokens: list[int], lease: m.Lease) -> list[float]:
        """Log-probs of ``tokens`` under the node's real current weights (honest-looking)."""
        model = self.engine_slot.engine.model
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / lease.sampling.temperature, dim=-1)
        return logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()

    async def _serve_job(self, host, job: m.JobInfo) -> None:
        # Honest nodes need no task code (leases carry prompt ids); the prompt-swapping
        # adversary needs the task to find another prompt.
        self.spec = ModelSpec.from_dict(job.model)
        self.task = make_task(job.task.name, dict(job.task.params))
        await super()._serve_job(host, job)

    async def _work(self, work, sync) -> None:
        spec, tokenizer, task = self.spec, None, self.task
        for lease, prompt in work:
            # Replayers first need one honest accepted submission to replay; a stale claim needs
            # versions old enough to fall outside the window.
            cheat = not (
                (self.kind.startswith("replay") and self.first_accepted is None)
                or (self.kind == "stale_version" and sync.version <= STALE_BY)
            )
            payload = await trio.to_thread.run_sync(
                self._cheat, lease, prompt, spec, tokenizer, task, sync
            )
            with open(self.cfg.data_dir / "adversary.jsonl", "a") as log:
                log.write(json.dumps({"lease_id": lease.lease_id, "cheat": cheat}) + "\n")
            if not cheat:
                # Only cheats count toward --max-groups: a loaded machine's slow first versions
                # once let the stale adversary spend all 30 groups on honest work at v0-v4.
                self.done_groups -= 1
            reply = await self._submit(payload)
            if reply is not None and reply.accepted and self.first_accepted is None:
                self.first_accepted = payload

    def _honest(self, lease: m.Lease, prompt: list[int]):
        return prompt, self.engine_slot.engine.generate([lease_request(lease, prompt)])[0]

    def _submission(self, lease, comps, sync, **over) -> m.Submission:
        fields = dict(
            lease_id=lease.lease_id,
            job_id=lease.job_id,
            version=sync.version,
            engine="torch",
            state_digest=sync.digest,
            completions=comps,
            gen_seconds=0.01,
        )
        fields.update(over)
        return m.Submission(**fields)

    @staticmethod
    def _record(tokens, logprobs, finish) -> m.CompletionRecord:
        return m.CompletionRecord(
            token_ids=m.pack_tokens(tokens),
            logprobs=m.pack_logprobs(logprobs),
            finish_reason=finish,
        )

    def _cheat(self, lease: m.Lease, lease_prompt, spec, tokenizer, task, sync) -> bytes:  # noqa: C901
        k = self.kind
        if k in ("replay", "replay_new_version") and self.first_accepted is not None:
            if k == "replay":
                return self.first_accepted
            _, old = signing.open_record(codec.decompress(self.first_accepted), m.Submission)
            return self.encode_submission(old.model_copy(update={"version": sync.version}))
        if k == "malformed":
            return bytes(self.rng.randrange(256) for _ in range(200))
        if k == "oversized":
            return codec.compress(b"\x00" * (16 << 20))  # 16 MiB once decompressed
        prompt, group = self._honest(lease, lease_prompt)
        comps = [self._record(c.token_ids, c.logprobs, c.finish_reason) for c in group]
        if k == "random_tokens":
            comps = []
            for _ in range(lease.group_size):
                n = self.rng.randrange(1, lease.sampling.max_new_tokens)
                toks = [self.rng.randrange(3, VOCAB_SIZE) for _ in range(n - 1)] + [EOS_ID]
                comps.append(self._record(toks, self._true_logprobs(prompt, toks, lease), "stop"))
        elif k == "other_model":
            if self.other is None:
                self.other = TorchEngine(spec)
                self.other.load_state(
                    {n: t.clone() for n, t in build_model(spec, seed=1234).state_dict().items()}
                )
            req = GenRequest(
                prompt,
                lease.group_size,
                SamplingParams(
                    max_new_tokens=lease.sampling.max_new_tokens, seed=lease.sampling.seed
                ),
            )
            comps = [
                self._record(c.token_ids, c.logprobs, c.finish_reason)
                for c in self.other.generate([req])[0]
            ]
        elif k == "fabricated_logprobs":
            comps = [
                self._record(c.token_ids, [-0.01] * len(c.token_ids), c.finish_reason)
                for c in group
            ]
        elif k == "inflated_reward":
            return self.encode_submission(
                self._submission(lease, comps, sync, claimed_rewards=[1.0] * lease.group_size)
            )
        elif k == "stale_version" and sync.version > STALE_BY:
            return self.encode_submission(
                self._submission(lease, comps, sync, version=sync.version - STALE_BY)
            )
        elif k == "half_group":
            comps = comps[: max(1, len(comps) // 2)]
        elif k == "truncated":
            comps = [
                self._record(
                    c.token_ids[:1] if c.token_ids[0] != EOS_ID else [5], c.logprobs[:1], "length"
                )
                for c in group
            ]
        elif k == "foreign_signature":
            sub = self._submission(lease, comps, sync)
            return codec.compress(signing.seal_record(self.foreign.private_key, sub))
        elif k == "swapped_prompt":
            other_id = lease.prompt_id + 1
            while task.prompt(other_id) == task.prompt(lease.prompt_id):
                other_id += 1  # the same text is no swap at all
            _, other = self._honest(lease, encode_prompt(spec, task.prompt(other_id), tokenizer))
            comps = [self._record(c.token_ids, c.logprobs, c.finish_reason) for c in other]
        return self.encode_submission(self._submission(lease, comps, sync))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=sorted(EXPECTED))
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--max-groups", type=int, default=40)
    args = ap.parse_args()
    cfg = NodeConfig(
        coordinator=args.coordinator,
        data_dir=args.data_dir,
        engine="torch",
        threads=1,
        leases_at_once=2,
    )
    adv = Adversary(cfg, args.kind)
    adv.max_groups = args.max_groups
    try:
        run_until_signalled(adv.run)
    except NodeError as exc:  # excluded: the expected end for most adversaries
        print(f"adversary {args.kind} stopped: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-job runtime context: the parsed spec, its task and tokenizer, and verification state."""

from __future__ import annotations

import json
from dataclasses import dataclass

from echo.coordinator.store import Store
from echo.coordinator.verify import JobContext
from echo.models.spec import (
    ModelSpec,
    decode_completion,
    encode_prompt,
    eos_token_id,
    load_tokenizer,
)
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec
from echo.tasks.registry import make_task


@dataclass
class RunningJob:
    spec: JobSpec
    model: ModelSpec
    ctx: JobContext
    tokenizer: object

    def prompt_tokens(self, prompt_id: int) -> list[int]:
        """The prompt as the model sees it, re-derived here from the task, never from a node."""
        return encode_prompt(self.model, self.ctx.task.prompt(prompt_id), self.tokenizer)

    def info(self, row) -> m.JobInfo:
        spec = self.spec
        return m.JobInfo(
            job_id=row["job_id"],
            model=self.model.to_dict(),
            task=m.TaskRef(name=spec.task.name, params=dict(spec.task.params)),
            publish_dtype=spec.publish_dtype,
            learner_public_key=bytes(row["learner_pubkey"]),
            learner_peer_id=row["learner_peer_id"],
            learner_addrs=json.loads(row["learner_addrs_json"]),
            group_size=spec.group_size,
            max_new_tokens=self.max_new_tokens,
            staleness=spec.staleness,
            current_version=int(row["current_version"]),
        )

    @property
    def max_new_tokens(self) -> int:
        return min(self.spec.sampling.max_new_tokens, self.ctx.task.max_new_tokens)


def load_running_job(store: Store, job_id: str) -> RunningJob:
    """Build the runtime context of a stored job, including versions already published."""
    row = store.job(job_id)
    spec = JobSpec.model_validate(json.loads(row["spec_json"]))
    model = ModelSpec.from_dict(spec.model_spec_dict())
    tokenizer = load_tokenizer(model)
    task = make_task(spec.task.name, dict(spec.task.params))
    vocab = model.vocab if model.kind == "tiny" else len(tokenizer)
    ctx = JobContext(
        job_id=job_id,
        task=task,
        decode=lambda ids: decode_completion(model, ids, tokenizer),
        vocab_size=vocab,
        eos_id=eos_token_id(model),
        staleness=spec.staleness,
        current_version=int(row["current_version"]),
    )
    for v in store.versions(job_id):
        ctx.digests[int(v["version"])] = v["state_digest"]
    return RunningJob(spec=spec, model=model, ctx=ctx, tokenizer=tokenizer)

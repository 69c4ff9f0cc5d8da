"""Per-job runtime context: the parsed spec, its task and tokenizer, and verification state.

:func:`load_running_job` builds a :class:`RunningJob` from the store when a job is submitted or
the coordinator restarts; the learner handlers keep its verification state current as versions
are published.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo.coordinator.rows import JobRow
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
    """A stored job as the handlers use it: spec, model, tokenizer, verification context."""

    spec: JobSpec
    model: ModelSpec
    ctx: JobContext
    tokenizer: object

    def prompt_tokens(self, prompt_id: int) -> list[int]:
        """The prompt as the model sees it, re-derived here from the task, never from a node."""
        return encode_prompt(self.model, self.ctx.task.prompt(prompt_id), self.tokenizer)

    def info(self, row: JobRow) -> m.JobInfo:
        """What a node needs to serve this job, from ``row``, its current stored state."""
        spec = self.spec
        assert row.learner_pubkey is not None  # pinned when the job is submitted
        return m.JobInfo(
            job_id=row.job_id,
            model=self.model.to_dict(),
            task=m.TaskRef(name=spec.task.name, params=dict(spec.task.params)),
            publish_dtype=spec.publish_dtype,
            learner_public_key=row.learner_pubkey,
            learner_peer_id=row.learner_peer_id,
            learner_addrs=row.learner_addrs,
            group_size=spec.group_size,
            max_new_tokens=self.max_new_tokens,
            staleness=spec.staleness,
            current_version=row.current_version,
        )

    @property
    def max_new_tokens(self) -> int:
        """The completion length leases ask for: the spec's, capped by the task's."""
        return min(self.spec.sampling.max_new_tokens, self.ctx.task.max_new_tokens)


def load_running_job(store: Store, job_id: str) -> RunningJob:
    """Build the runtime context of a stored job, including versions already published.

    Raises KeyError for an unknown job; a stored spec that no longer validates (or a model or
    task this build lacks) raises what pydantic, the tokenizer or the task registry raise.
    """
    row = store.job(job_id)
    if row is None:
        raise KeyError(job_id)
    spec = JobSpec.model_validate(row.spec)
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
        current_version=row.current_version,
    )
    for v in store.versions(job_id):
        ctx.digests[v.version] = v.state_digest
    return RunningJob(spec=spec, model=model, ctx=ctx, tokenizer=tokenizer)

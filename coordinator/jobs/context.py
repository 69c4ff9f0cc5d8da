"""Per-job runtime context: the parsed spec, its task and tokenizer, and verification state.

:func:`load_running_job` builds a :class:`RunningJob` from the store when a job is submitted or
the coordinator restarts; the learner handlers keep its verification state current as versions
are published.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from echo.coordinator.store import Store
from echo.coordinator.store.rows import JobRow
from echo.coordinator.submissions.verify import JobContext
from echo.models.prompts import PromptRenderer
from echo.models.spec import (
    ModelSpec,
    decode_completion,
    eos_token_id,
    load_tokenizer,
)
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec, node_task_params
from echo.tasks.base import Task
from echo.tasks.registry import make_task
from echo.tasks.sandbox import Recipe, Sandbox, SandboxError
from echo.tasks.scoring import RewardTerm

log = logging.getLogger(__name__)


@dataclass
class RunningJob:
    """A stored job as the handlers use it: spec, model, tokenizer, verification context, and
    how its prompts become token ids (:attr:`render`) and completions rewards (:attr:`scorer`,
    the job's scoring sandbox, started on first use)."""

    spec: JobSpec
    model: ModelSpec
    ctx: JobContext
    tokenizer: object
    render: PromptRenderer
    scorer: Sandbox

    def prompt_tokens(self, prompt_id: int) -> list[int]:
        """The prompt as the model sees it (chat template or plain text, as the job resolved),
        rendered from the task, never taken from a node: once per lease, which keeps it."""
        return self.render.ids(prompt_id)

    @property
    def prompt_format(self) -> str:
        """``"chat template"`` or ``"plain text"``, for status displays."""
        return self.render.prompt_format

    def info(self, row: JobRow) -> m.JobInfo:
        """What a node needs to serve this job, from ``row``, its current stored state."""
        spec = self.spec
        assert row.learner_pubkey is not None  # pinned when the job is submitted
        return m.JobInfo(
            job_id=row.job_id,
            model=self.model.to_dict(),
            # Without file paths: a node needs the prompt tokens of its lease, not the dataset.
            task=m.TaskRef(name=spec.task.name, params=node_task_params(spec.task.params)),
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

    def close(self) -> None:
        """Stop the job's scoring sandbox; safe to call twice."""
        self.scorer.close()


def scoring_recipe(spec: JobSpec) -> Recipe:
    """What the job's sandbox builds: its task and ``[[job.reward]]`` terms, as plain data."""
    return Recipe(
        task=spec.task.name,
        params=dict(spec.task.params),
        rewards=tuple(
            RewardTerm(
                kind=r.kind,
                weight=r.weight,
                tag=r.tag,
                pattern=r.pattern,
                entry_point=r.entry_point,
                timeout_s=r.timeout_s,
            )
            for r in spec.reward
        ),
    )


def _build(job_id: str, spec: JobSpec) -> tuple[ModelSpec, object, Task, PromptRenderer]:
    model = ModelSpec.from_dict(spec.model_spec_dict())
    tokenizer = load_tokenizer(model)
    task = make_task(spec.task.name, dict(spec.task.params))
    render = PromptRenderer.for_job(model, task, tokenizer, spec.task.chat, job=job_id)
    return model, tokenizer, task, render


def check_job(spec: JobSpec) -> None:
    """Check what a job needs from this coordinator before it is stored: the model's tokenizer,
    the task (its dataset read, both splits non-empty), the chat setting, a first prompt and a
    held-out one rendered, and each ``python`` reward loaded in its process. Blocking (it may
    read a dataset and start a process): run it in a worker thread.

    :raises ValueError: the message names the bad task parameter, dataset file or field, chat
        setting or reward entry point (a reward that does not load in the scoring sandbox is a
        ValueError too here).
    :raises OSError: an unreadable model folder.
    """
    _, _, task, render = _build(spec.name, spec)
    render.ids(0)
    if spec.eval.every:
        held_out = task.eval_prompt_ids(1)
        if not held_out:
            raise ValueError(f"task {task.name!r} has no held-out prompts (set eval.every = 0)")
        render.ids(held_out[0])
    try:  # the sandbox builds the reward: a missing entry point names the registered ones
        with Sandbox(scoring_recipe(spec)) as sandbox:
            sandbox.start()
    except SandboxError as exc:
        raise ValueError(str(exc)) from None


def load_running_job(store: Store, job_id: str) -> RunningJob:
    """Build the runtime context of a stored job, including versions already published.

    Raises KeyError for an unknown job; a stored spec that no longer validates (or a model or
    task this build lacks, or a dataset file that has gone) raises what pydantic, the
    tokenizer or the task registry raise.
    """
    row = store.job(job_id)
    if row is None:
        raise KeyError(job_id)
    spec = JobSpec.model_validate(row.spec)
    model, tokenizer, task, render = _build(job_id, spec)
    vocab = model.vocab if model.kind == "tiny" else len(tokenizer)  # type: ignore[arg-type]
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
    return RunningJob(
        spec=spec,
        model=model,
        ctx=ctx,
        tokenizer=tokenizer,
        render=render,
        scorer=Sandbox(scoring_recipe(spec)),
    )

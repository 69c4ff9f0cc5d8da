"""A LoRA job's version with its adapter merged into the base: a plain Hugging Face folder
(``echo-job export --merged``, issue 28).

:func:`export_merged` owns that folder. The adapter is first exported as the peft folder
:func:`echo.learner.lora.export_adapter` writes (the checkpoint's adapter checked against the
learner's signed digest of base and adapter, read back from the written file); ``peft`` loads it
onto the job's base (``<job dir>/lora_base.safetensors``, whose digest that signed digest binds)
and ``merge_and_unload`` folds ``(alpha / r) B A`` into each wrapped projection, in float32. The
merged weights, cast to the publish dtype, are written as :mod:`echo.learner.exports.export` writes
a full-weight version (safetensors read back tensor by tensor, config, generation config,
tokenizer), under a temporary name renamed into place. The merged weights are not a published state,
so no signed digest names them: what is checked is what they are made of.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from echo.learner.exports.export import (
    ExportError,
    meta_model,
    published_state,
    write_model_folder,
)
from echo.learner.exports.staging import staged_folder
from echo.learner.lora import BASE_FILE, export_adapter
from echo.models.spec import ModelSpec, build_model
from echo.models.weights import load_state
from echo.protocol.jobspec import JobSpec


def merged_state(job_dir: Path, spec: JobSpec, adapter_folder: Path) -> dict[str, torch.Tensor]:
    """The float32 weights of the job's base with the peft adapter of ``adapter_folder``
    merged in (``PeftModel.merge_and_unload``), under the plain model's names."""
    from peft import PeftModel

    model_spec = ModelSpec.from_dict(spec.model_spec_dict())
    model = build_model(model_spec, seed=spec.model.seed).float()
    load_state(model, load_file(str(job_dir / BASE_FILE)))
    peft_model = PeftModel.from_pretrained(model, str(adapter_folder))
    merged = peft_model.merge_and_unload()
    return {n: t.detach() for n, t in merged.state_dict().items()}


def export_merged(job_dir: Path, spec: JobSpec, version: int, digest: str, out: Path) -> list[str]:
    """Write version ``version`` of the LoRA job in ``job_dir`` with its adapter merged into the
    base, as a Hugging Face folder at ``out`` (which must not exist) that
    ``AutoModelForCausalLM.from_pretrained`` loads; returns the names of the files written.

    :raises ExportError: not a LoRA job, or the version's checkpoint is not kept or does not
        reproduce ``digest``.
    :raises FileExistsError: ``out`` exists.
    """
    if spec.lora is None:
        raise ExportError("--merged is for a LoRA job: this job's export holds every weight")
    if out.exists():
        raise FileExistsError(f"{out} exists")
    with staged_folder(out) as tmp:
        try:
            export_adapter(job_dir, spec, version, digest, tmp / "adapter")
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        master = merged_state(job_dir, spec, tmp / "adapter")
        model_spec = ModelSpec.from_dict(spec.model_spec_dict())
        meta = meta_model(model_spec, spec.model.seed)
        state = published_state(master, meta, spec.publish_dtype)
        del master
        shutil.rmtree(tmp / "adapter")
        write_model_folder(state, model_spec, meta, spec.publish_dtype, tmp)
    return sorted(p.name for p in out.iterdir())

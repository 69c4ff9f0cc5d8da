"""A published policy version as a Hugging Face model folder (``echo-job export``).

:func:`export_version` owns turning one version the learner published into a folder that
``AutoModelForCausalLM.from_pretrained`` loads: safetensors weights (sharded like
``save_pretrained`` above :data:`MAX_SHARD_SIZE`), ``config.json`` with the publish dtype,
``generation_config.json``, and the tokenizer with its chat template (the tiny model's byte
tokenizer for kind ``tiny``). The weights are the version's *published* state, the tensors every
node received, bit for bit: rebuilt from the learner's checkpoint of that version by the same
rule as :func:`echo.models.weights.export_state` (cast to the publish dtype, tied tensors once),
checked against the state digest the learner signed for that version, and read back from the
written files before the folder is complete. Only versions whose checkpoint the learner still
keeps can be exported (the newest ``checkpoint.KEEP``).

The folder is written under a temporary name next to ``out`` and renamed
(:func:`echo.learner.exports.staging.staged_folder`, which the adapter and merged exports use too),
so a crash never leaves a half-written export where a complete one is expected.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from echo.learner.checkpoints import checkpoint
from echo.learner.exports.staging import staged_folder
from echo.models.spec import ModelSpec, build_model, load_tokenizer
from echo.models.weights import DTYPES, state_digest, tensor_digest
from echo.protocol.jobspec import JobSpec

# Shards of at most this size, as save_pretrained writes them.
MAX_SHARD_SIZE = "5GB"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

# progress(done_bytes, total_bytes) while the weights are written.
Progress = Callable[[int, int], None]


class ExportError(ValueError):
    """A version that cannot be exported: not kept, or its checkpoint does not reproduce it."""


def meta_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """The job's model architecture without weights (meta tensors): its config and the names
    and ties of its tensors, at no memory cost."""
    with torch.device("meta"):
        if spec.kind == "tiny":
            return build_model(spec, seed=seed)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(spec.path, local_files_only=True)
        return AutoModelForCausalLM.from_config(config)


def published_state(
    master: dict[str, torch.Tensor], model: torch.nn.Module, dtype: str
) -> dict[str, torch.Tensor]:
    """The state nodes received for weights ``master`` (a checkpoint's ``state_dict``) of
    ``model``'s architecture: :func:`~echo.models.weights.export_state`'s rule, applied to the
    checkpoint's tensors (floating ones cast to ``dtype``; of tied names the first only).

    :raises ExportError: the checkpoint lacks a tensor of the architecture.
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    target = DTYPES[dtype]
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if name not in master:
            raise ExportError(f"the checkpoint has no tensor {name!r}")
        src = master[name]
        out[name] = (src.to(dtype=target) if src.is_floating_point() else src).contiguous()
    return dict(sorted(out.items()))


def write_weights(state: dict[str, torch.Tensor], out: Path, progress: Progress | None) -> None:
    """``state`` as safetensors shards under ``out``, with the index Hugging Face expects."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=MAX_SHARD_SIZE
    )
    total = sum(t.numel() * t.element_size() for t in state.values())
    done = 0
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(out / filename), metadata={"format": "pt"})
        done += sum(state[n].numel() * state[n].element_size() for n in names)
        if progress is not None:
            progress(done, total)
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def read_back(state: dict[str, torch.Tensor], out: Path) -> None:
    """Every written tensor against the state, by digest; ExportError on any difference."""
    files = sorted(out.glob("model*.safetensors"))
    found: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name not in state or tensor_digest(fh.get_tensor(name)) != tensor_digest(
                    state[name]
                ):
                    raise ExportError(f"{f.name}: tensor {name!r} was not written as published")
                found.add(name)
    if found != set(state):
        raise ExportError(f"tensors missing from the written files: {sorted(set(state) - found)}")


def write_config_and_tokenizer(
    spec: ModelSpec, model: torch.nn.Module, dtype: str, out: Path
) -> None:
    """The model's ``config.json``, generation config and tokenizer files, under ``out``."""
    from transformers import GenerationConfig

    config = model.config
    config.dtype = dtype  # from_pretrained loads the tensors in the dtype they were published in
    config.save_pretrained(out)
    gen = None
    if spec.kind == "hf":
        try:
            gen = GenerationConfig.from_pretrained(spec.path, local_files_only=True)
        except OSError:  # the model folder has none: derive it from the config
            gen = None
    (gen or GenerationConfig.from_model_config(config)).save_pretrained(out)
    # The tokenizer as the job used it, chat template included (hf); the byte tokenizer (tiny).
    load_tokenizer(spec).save_pretrained(out)


def write_model_folder(
    state: dict[str, torch.Tensor],
    spec: ModelSpec,
    model: torch.nn.Module,
    dtype: str,
    folder: Path,
    progress: Progress | None = None,
) -> None:
    """``state`` (tensors of ``model``'s architecture in ``dtype``) as a Hugging Face model folder
    under ``folder``: the weights, read back against ``state``, then the config, generation config
    and tokenizer.

    :raises ExportError: a written tensor does not read back as ``state`` holds it.
    """
    write_weights(state, folder, progress)
    read_back(state, folder)
    write_config_and_tokenizer(spec, model, dtype, folder)


def export_version(
    job_dir: Path,
    spec: JobSpec,
    version: int,
    digest: str,
    out: Path,
    progress: Progress | None = None,
) -> list[str]:
    """Write version ``version`` of the job in ``job_dir`` as a Hugging Face folder at ``out``
    (which must not exist); returns the names of the files written.

    ``digest`` is the state digest the learner signed for the version (the coordinator's
    record of it): the exported weights must have it.

    :raises ExportError: the version's checkpoint is not kept, or does not reproduce ``digest``.
    :raises FileExistsError: ``out`` exists.
    :raises OSError: a file cannot be read or written.
    """
    if spec.lora is not None:  # the version is an adapter: a peft folder
        from echo.learner.lora import export_adapter

        try:
            return export_adapter(job_dir, spec, version, digest, out)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
    if out.exists():
        raise FileExistsError(f"{out} exists")
    root = job_dir / "checkpoints"
    try:
        master = checkpoint.load_model_state(root, version)
    except FileNotFoundError:
        kept = ", ".join(f"v{v}" for v in checkpoint.versions(root)) or "none"
        raise ExportError(
            f"version {version} is not kept (the learner keeps the newest "
            f"{checkpoint.KEEP} checkpoints; kept: {kept})"
        ) from None
    model_spec = ModelSpec.from_dict(spec.model_spec_dict())
    model = meta_model(model_spec, spec.model.seed)
    state = published_state(master, model, spec.publish_dtype)
    del master
    if state_digest(state) != digest:
        raise ExportError(
            f"the checkpoint of version {version} does not hold the state the "
            "learner published for it"
        )
    with staged_folder(out) as tmp:
        write_model_folder(state, model_spec, model, spec.publish_dtype, tmp, progress)
    return sorted(p.name for p in out.iterdir())


def file_list(folder: Path) -> list[dict[str, Any]]:
    """Name, size and sha256 of every file of an export folder (what a client checks its
    download against), sorted by name."""
    import hashlib

    out = []
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h = hashlib.sha256()
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out.append({"name": p.name, "size": p.stat().st_size, "sha256": h.hexdigest()})
    return out

"""What a job trains: the model (``[job.model]``) and, for a LoRA job, the adapter on it
(``[job.lora]``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["tiny", "hf"] = "tiny"
    path: str | None = Field(default=None, description="local Hugging Face model folder (kind=hf)")
    hidden: int = Field(default=64, ge=8, le=8192)
    layers: int = Field(default=2, ge=1, le=128)
    heads: int = Field(default=4, ge=1, le=128)
    seed: int = 0

    @model_validator(mode="after")
    def _path_for_hf(self) -> ModelSection:
        if self.kind == "hf" and not self.path:
            raise ValueError("model.path is required when model.kind = 'hf'")
        return self


# The projections a LoRA adapter may wrap: every engine maps these names (the GGUF adapter's
# tensor names among them), so a job naming another module could not be served everywhere.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(BaseModel):
    """``[job.lora]``: train a LoRA adapter (``echo.learner.lora``) instead of every weight;
    versions then carry the adapter, on a base model nodes fetch once (``echo.models.lora``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int = Field(ge=1, le=1024, description="the adapter's rank r")
    alpha: float = Field(
        gt=0, le=1_000_000, allow_inf_nan=False, description="scaling: the update is alpha/r B A"
    )
    dropout: float = Field(
        default=0.0,
        description="must be 0: engines sample without dropout, and the learner's log-probs "
        "must be the function they sample from",
    )
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        max_length=len(LORA_TARGETS),
        description=f"projections the adapter wraps, among {', '.join(LORA_TARGETS)}",
    )
    init: str | None = Field(
        default=None,
        max_length=4096,
        description="a peft adapter folder (adapter_config.json and adapter_model.safetensors "
        "of the same rank, alpha and modules) the adapter starts from; unset: B = 0, so "
        "version 0 samples as the base model",
    )

    @model_validator(mode="after")
    def _check(self) -> LoraSection:
        if self.dropout != 0:
            raise ValueError(
                f"dropout must be 0, not {self.dropout}: rollouts are sampled without dropout "
                "and the learner re-scores them with the same function"
            )
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(
                f"target_modules: {', '.join(map(repr, unknown))} is not one of "
                f"{', '.join(LORA_TARGETS)}"
            )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("target_modules names a module twice")
        if self.init is not None and ("\x00" in self.init or not self.init.strip()):
            raise ValueError("init must name a folder")
        return self

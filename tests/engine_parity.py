"""Helpers shared by the engine parity tests (llama.cpp, vLLM): a tiny model with peaked
distributions, a chain of real AdamW versions, and the teacher-forced log-prob reference."""

from __future__ import annotations

import numpy as np
import torch

from echo.models.spec import ModelSpec, build_model
from echo.models.tokenizer import EOS_ID, VOCAB_SIZE
from echo.models.weights import export_state, load_state
from echo.node.engines.base import GenRequest


def peaked_model(spec: ModelSpec, steps: int = 12, seed: int = 0) -> torch.nn.Module:
    """A tiny model trained a little on random byte strings where every 4th token is EOS, so
    its distributions are far from uniform and it stops on its own fairly often."""
    model = build_model(spec, seed=seed).train()
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(3, VOCAB_SIZE, (16, 24), generator=g)
    data[:, 4::4] = EOS_ID
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(steps):
        loss = model(input_ids=data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def adamw_versions(
    model: torch.nn.Module, n: int, dtype: str = "float32", lr: float = 1e-3, seed: int = 1
) -> list[dict[str, torch.Tensor]]:
    """``n`` successive published states, one real AdamW step on random tokens apart."""
    model.train()
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for _ in range(n):
        data = torch.randint(3, VOCAB_SIZE, (8, 16), generator=g)
        loss = model(input_ids=data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(export_state(model, dtype))
    model.eval()
    return out


@torch.inference_mode()
def max_logprob_error(
    spec: ModelSpec, state: dict[str, torch.Tensor], reqs: list[GenRequest], results
) -> float:
    """Largest |reported - transformers| log-prob, where transformers' is the teacher-forced
    ``log_softmax(logits / T)[token]`` of each completion's tokens after its prompt (float32)."""
    model = build_model(spec)
    load_state(model, state)
    worst = 0.0
    for req, group in zip(reqs, results, strict=True):
        for c in group:
            ids = torch.tensor([req.prompt_ids + c.token_ids])
            logits = model(input_ids=ids).logits[0, len(req.prompt_ids) - 1 : -1].float()
            lp = torch.log_softmax(logits / (req.params.temperature or 1.0), dim=-1)
            ref = lp.gather(1, torch.tensor(c.token_ids).unsqueeze(1)).squeeze(1).numpy()
            worst = max(worst, float(np.max(np.abs(ref - np.array(c.logprobs)))))
    return worst

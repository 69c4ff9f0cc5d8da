"""Echo's generation requests as vLLM's, and vLLM's outputs as Echo's completions.

:func:`to_vllm` owns what a :class:`~echo.node.engines.base.GenRequest` may ask of vLLM and how:
prompt ids inside the vocabulary, a prompt and ``max_new_tokens`` inside the model's context, a
temperature vLLM would not change (it clamps temperatures in (0, 0.01) up to 0.01 and treats
them as greedy below 1e-5: the reported log-probs would not be ``log_softmax(logits / T)``), and
``top_p < 1`` only where the workers report log-probs before top-p (see
:mod:`echo.node.engines.vllm_engine`). Sampling is seeded per request (vLLM gives sample j of a
group the seed ``seed + j``), so a group is reproducible; its random stream is vLLM's, not the
torch engine's. vLLM refuses ``n > 1`` for greedy, so a greedy group is one sample, copied.

:func:`group_of` owns termination. Token ids go in and out directly (``skip_tokenizer_init``);
generation stops on the model's single EOS id (``stop_token_ids``), which stays in the output,
and vLLM checks EOS before the length limit, so "stop" ends on exactly one EOS and "length" fills
``max_new_tokens`` without one: every completion is checked for that before it is returned.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from echo.node.engines.base import Completion, GenRequest

# vLLM clamps temperatures in (0, 0.01) up to 0.01 (sampling_params._MAX_TEMP) and treats them
# as greedy below 1e-5: the reported log-probs would not be log_softmax(logits / T).
MIN_TEMPERATURE = 0.01


def to_vllm(
    r: GenRequest,
    *,
    vocab_size: int,
    max_seq_len: int,
    eos_id: int,
    logprobs_before_top_p: bool,
) -> tuple[Any, Any]:
    """``r`` as vLLM's ``(TokensPrompt, SamplingParams)``.

    :raises ValueError: prompt ids outside the vocabulary, a prompt + ``max_new_tokens`` longer
        than ``max_seq_len``, a temperature vLLM would change, or ``top_p < 1`` where the
        workers cannot report log-probs before top-p.
    """
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    p = r.params
    if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token id outside [0, {vocab_size})")
    if len(r.prompt_ids) + p.max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(r.prompt_ids)}) + max_new_tokens ({p.max_new_tokens}) "
            f"exceeds the model's context of {max_seq_len} tokens"
        )
    if 0 < p.temperature < MIN_TEMPERATURE:
        raise ValueError(f"vLLM needs temperature 0 or >= {MIN_TEMPERATURE}")
    if p.top_p < 1 and p.temperature > 0 and not logprobs_before_top_p:
        raise ValueError("this vLLM build cannot report log-probs before top-p: use top_p = 1")
    seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little")
    prompt = TokensPrompt(prompt_token_ids=list(r.prompt_ids))
    params = VSamplingParams(
        # vLLM refuses n > 1 for greedy: one sample, copied (greedy is deterministic).
        n=r.n if p.temperature > 0 else 1,
        temperature=p.temperature,
        top_p=p.top_p if p.temperature > 0 else 1.0,
        max_tokens=p.max_new_tokens,
        # vLLM seeds sample j with seed + j; keep that inside 63 bits.
        seed=seed % (1 << 62),
        logprobs=0,
        stop_token_ids=[eos_id],
        detokenize=False,
    )
    return prompt, params


def group_of(out: Any, r: GenRequest, eos_id: int) -> list[Completion]:
    """The completions of vLLM's output ``out`` for ``r``, in sample order (a greedy sample
    copied ``r.n`` times). :raises RuntimeError: a completion ended in a way the coordinator
    would reject."""
    group = [_completion(c, r, eos_id) for c in sorted(out.outputs, key=lambda c: c.index)]
    if r.params.temperature == 0 and len(group) == 1:
        group = [copy.deepcopy(group[0]) for _ in range(r.n)]
    return group


def _completion(c: Any, req: GenRequest, eos_id: int) -> Completion:
    tokens = list(c.token_ids)
    if c.logprobs is None or len(c.logprobs) != len(tokens):
        raise RuntimeError("vLLM returned no log-prob for some sampled token")
    logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens, strict=True)]
    eos_at = [i for i, t in enumerate(tokens) if t == eos_id]
    if c.finish_reason == "stop" and eos_at == [len(tokens) - 1]:
        reason = "stop"
    elif c.finish_reason == "length" and not eos_at and len(tokens) == req.params.max_new_tokens:
        reason = "length"
    else:
        raise RuntimeError(
            f"vLLM ended a completion with {c.finish_reason!r} after {len(tokens)} tokens "
            f"(EOS at {eos_at}, budget {req.params.max_new_tokens})"
        )
    return Completion(token_ids=tokens, logprobs=logprobs, finish_reason=reason)

"""vLLM's best offline group generation, for ``benchmarks/engine_best.py``.

``LLM.generate`` on the node engine's own ``LLM``, one ``SamplingParams(n=group)`` per prompt,
seeded with the leases' own seeds so that every setting samples the node's very tokens: the same
work and the same lengths (a group whose samples end early decodes fewer rows per step, so other
seeds would change the work, not only the speed). Two settings, both stopping on the model's EOS id
and not detokenizing, as the node's requests do: vLLM's plain call (no log-probs), and what a
node must ask for (the sampled token's log-prob, ``logprobs=0``), so that the cost of that demand
is named beside ``group_vs_engine_vllm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Runner = Callable[[], int]


def vllm_runners(
    llm: Any,
    prompts: list[list[int]],
    group: int,
    max_new: int,
    seeds: list[int],
    eos_id: int,
    temperature: float = 1.0,
) -> dict[str, Runner]:
    """``LLM.generate`` with ``SamplingParams(n=group)`` per prompt on the engine's own ``llm``,
    seeded with the leases' ``seeds``: no log-probs, and the node's demand (see the module
    docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def runner(**demand: Any) -> Runner:
        def run() -> int:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                [
                    SamplingParams(
                        n=group,
                        max_tokens=max_new,
                        temperature=temperature,
                        top_p=1.0,
                        seed=seed,
                        **demand,
                    )
                    for seed in seeds
                ],
                use_tqdm=False,
            )
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        return run

    # The node's LLM has no tokenizer (token ids in and out), so vLLM knows the EOS id only
    # from ``stop_token_ids``: without it every sample runs to ``max_new``, more rows per step
    # than the node decodes once its samples end (a rate of other work).
    eos = {"stop_token_ids": [eos_id], "detokenize": False}
    return {
        "LLM.generate(n=group), EOS stop": runner(**eos),
        "LLM.generate(n=group), EOS stop, logprobs=0 (the node's demand)": runner(
            logprobs=0, **eos
        ),
    }

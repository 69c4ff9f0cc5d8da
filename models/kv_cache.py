"""One forward step that carries a KV cache, under either name transformers gives it.

transformers renamed the cache from ``past_key_values`` to ``cache`` (argument and output field)
during the 5.x series. The main environment pins a release with the new name; vLLM pins one with
the old. The learner's re-scoring and evaluation run in both, so they step through here.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = ["forward_with_cache"]


@functools.cache
def _cache_arg(model_type: type) -> str:
    """The name ``model_type.forward`` takes its cache by (its signature survives transformers'
    deprecation wrappers, which keep ``__wrapped__``)."""
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_with_cache(model: torch.nn.Module, cache: Any = None, **inputs: Any) -> tuple[Any, Any]:
    """Run ``model(**inputs)`` with ``use_cache=True`` over ``cache`` (None starts one) and return
    the model's output and the cache it leaves, whichever name this transformers uses."""
    kwargs = {**inputs, "use_cache": True}
    if cache is not None:
        kwargs[_cache_arg(type(model))] = cache
    out = model(**kwargs)
    cache = getattr(out, "cache", None)
    return out, (cache if cache is not None else out.past_key_values)

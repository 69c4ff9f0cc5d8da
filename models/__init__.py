"""echo.models: what a policy is, independent of who trains or samples it.

- ``tokenizer``: the in-memory byte tokenizer of the tiny model (ids 0-2 special, byte + 3).
- ``spec``: :class:`~echo.models.spec.ModelSpec` and ``build_model`` / ``load_tokenizer``.
- ``weights``: the published state (export, exact load, safetensors bytes, digests, bit views).

Imports nothing else of ours, so learner, nodes and coordinator can all depend on it.
"""

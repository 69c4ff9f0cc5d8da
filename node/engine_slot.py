"""The engine a node holds across the jobs it serves.

:class:`EngineSlot` owns the node's one engine from job to job: which engine it runs (chosen from
the machine's probe; torch for a job whose model that engine cannot run), starting it on a job's
model in a worker thread, the name its submissions and status give it (per engine and device),
keeping it for the next job when that job is a LoRA job of the base it holds (an adapter switch
then, not a model load, see :mod:`echo.node.base_group`), freeing its memory when the node idles
or leaves, and keeping the chunk stores of jobs no longer served within the volunteer's disk
allowance. A node never holds two models in memory: a job of another base gets a fresh engine
only after the last one is closed.

The lease loop (:class:`~echo.node.worker.Node`) generates with :attr:`EngineSlot.engine`; the
slot decides when there is one.
"""

from __future__ import annotations

import contextlib
import importlib

import trio

from echo.models.device import resolve_device
from echo.models.spec import ModelSpec
from echo.node.base_group import keeps_base
from echo.node.config import NodeConfig
from echo.node.display import Display
from echo.node.engines.base import Engine
from echo.node.engines.factory import EngineChoice, make_engine_or_torch
from echo.node.errors import NodeError
from echo.node.probe import Probe, choose_engine
from echo.node.weights import WeightSync
from echo.p2p.chunkstore import prune_job_stores
from echo.p2p.lifecycle import settle_heap
from echo.protocol import messages as m

# Stopping an engine's worker processes (vLLM's shutdown waits up to 2 s per process).
ENGINE_CLOSE_TIMEOUT_S = 10.0
# What each engine is built from (echo.node.engines.factory.make_engine): the engine's module,
# its libraries (torch alone: seconds of CPU), and the model classes its first model build
# imports (transformers' Llama, the architecture of the tiny model and of SmolLM2).
LLAMA = "transformers.models.llama.modeling_llama"
ENGINE_MODULES = {
    "torch": ("echo.node.engines.torch_engine", LLAMA),
    "llamacpp": ("echo.node.engines.llamacpp_engine", LLAMA, "llama_cpp"),
    "vllm": ("echo.node.engines.vllm_engine",),
}


async def preload_engine(name: str) -> None:
    """Import engine ``name``'s libraries in a worker thread. A node does this while it waits
    for its first job, when it has nothing else to do: placed, it then starts generating that
    much sooner (seconds with torch on a small machine, where the imports were the most of a
    tiny job's start). An import that fails is left to :func:`open_engine`, which reports it as
    it always has."""
    modules = ENGINE_MODULES.get(name, ())

    def load() -> None:
        for module in modules:
            # open_engine() imports it again and says what failed.
            with contextlib.suppress(Exception):
                importlib.import_module(module)

    await trio.to_thread.run_sync(load, abandon_on_cancel=True)


async def open_engine(name: str, spec: ModelSpec, device: str, cfg: NodeConfig) -> EngineChoice:
    """Start engine ``name`` on a job's model in a worker thread (torch where ``name`` cannot
    run the model). :raises NodeError: the model does not fit in memory."""
    try:
        return await trio.to_thread.run_sync(
            lambda: make_engine_or_torch(
                name, spec, device=device, threads=cfg.threads,
                gpu_memory_fraction=cfg.gpu_memory_fraction,
            )
        )  # fmt: skip
    except MemoryError:
        raise NodeError("the model does not fit in this machine's memory") from None


class EngineSlot:
    """The node's engine between jobs (see the module docstring). Per job:
    :meth:`make_room`, then :meth:`open`, then :meth:`serving`; :meth:`idle` between jobs and
    :meth:`close` on the way out."""

    def __init__(self, cfg: NodeConfig, probed: Probe, display: Display) -> None:
        self.cfg = cfg
        self.display = display
        # The engine running (or to run): the probe's choice, torch after a fallback.
        self.name, self.reason = choose_engine(probed, cfg.engine)
        # What each job's engine starts as (a job whose model it cannot run gets torch).
        self.chosen = self.name
        # The name submissions carry and the status shows: re-scoring thresholds are per engine
        # and device.
        self.reported = self.name
        self.engine: Engine | None = None
        self._base_group: set[str] = set()  # the engine's last jobs, of one base: it stays

    async def make_room(self, job: m.JobInfo, held: WeightSync | None) -> WeightSync | None:
        """Ready the slot for ``job``, ``held`` being the last job's sync: the engine stays when
        ``job`` is a LoRA job of the base it holds (``held`` is returned: its base need not be
        fetched again), else it is closed (None is returned); the chunk stores of other jobs are
        pruned either way."""
        kept = self.engine is not None and keeps_base(held, job, self._base_group)
        if not kept:
            await self.close()
        await trio.to_thread.run_sync(self._prune_other_jobs, job.job_id)
        return held if kept else None

    async def preload(self) -> None:
        """:func:`preload_engine` of the chosen engine."""
        await preload_engine(self.chosen)

    async def open(self, spec: ModelSpec) -> None:
        """Start the chosen engine on ``spec`` unless the slot kept one, and name it for this
        job's submissions. :raises NodeError: the model does not fit in memory."""
        device = str(resolve_device(self.cfg.device))  # the learner's rule: auto is CUDA if seen
        if self.engine is None:
            choice = await open_engine(self.chosen, spec, device, self.cfg)
            self.engine = choice.engine
            self.name = choice.name
            settle_heap()  # the engine lives as long as the job: no full GC walks it
            if choice.fallback:  # an architecture the chosen engine cannot run: one line
                self.display.say(
                    f"[yellow]{choice.fallback}; running the torch engine instead[/yellow]"
                )
        # GPU kernels differ more from the learner's CPU float32 than a CPU does.
        gpu_torch = self.name == "torch" and device != "cpu"
        self.reported = f"torch-{device}" if gpu_torch else self.name

    def serving(self, job_ids: set[str]) -> None:
        """The jobs the engine now serves: the node's job and those sharing its base."""
        self._base_group = set(job_ids)

    async def idle(self) -> None:
        """Between jobs: free the engine unless it served several jobs of one base (the next
        may be one of them, and keeps it)."""
        if len(self._base_group) < 2:
            await self.close()

    async def close(self) -> None:
        """Free the engine's memory. vLLM runs worker processes: stop them here rather than
        leave them to be force-killed at interpreter exit."""
        engine, self.engine = self.engine, None
        if engine is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(ENGINE_CLOSE_TIMEOUT_S):
                await trio.to_thread.run_sync(engine.close, abandon_on_cancel=True)
            del engine
            settle_heap()  # open() froze it: its cycles (and the weights they hold) go now

    def _prune_other_jobs(self, job_id: str) -> None:
        """Keep the chunks of jobs no longer served within the volunteer's disk allowance."""
        removed = prune_job_stores(
            self.cfg.data_dir / "chunks", {job_id}, int(self.cfg.max_disk_gb * 1e9)
        )
        if removed:
            self.display.say(
                f"freed the weights of {len(removed)} earlier job(s) (max_disk_gb "
                f"{self.cfg.max_disk_gb:g})"
            )

"""Serving several LoRA jobs of one base model with one engine (issue 28).

A node placed on a LoRA job also serves the running jobs the coordinator lists as sharing that
job's base (``RegisterReply.base_jobs``): its lease loop takes turns between them
(:class:`~echo.node.worker.Node`), and before generating for a job the engine is switched to
that job's adapter (:func:`serve`): an adapter switch, the base stays loaded.

:class:`SharedJob` owns one such job's versions. They are pulled from its learner into a chunk
store of their own; the node's own job keeps the relay tree and the gossip (a host answers chunk
requests from one store and holds one subscription per topic), and the scheduler plans the
shared job's trees without this node. Its sync is seeded with the base the node's own job holds,
so the base is neither fetched nor loaded again: the versions checked against their signed
manifests are the adapters alone (and version 0's adapter, if the job is still at its first
anchor: that payload carries the base again).
"""

from __future__ import annotations

import logging

import trio

from echo.node.adapter_sync import load_into_engine
from echo.node.config import NodeConfig
from echo.node.display import Display
from echo.node.engines.base import Engine
from echo.node.weights import WeightError, WeightSync
from echo.p2p.chunkstore import ChunkStore
from echo.p2p.host import EchoHost
from echo.p2p.rpc import RpcError
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError

log = logging.getLogger("echo.node.base_group")


class SharedJob:
    """A LoRA job served beside the node's own on the base it holds (see the module
    docstring). ``coordinator`` is the coordinator's peer id."""

    def __init__(
        self, cfg: NodeConfig, host: EchoHost, coordinator, job: m.JobInfo, display: Display
    ) -> None:
        self.job = job
        self.display = display
        store = ChunkStore(cfg.data_dir / "chunks" / job.job_id, keep_versions=job.staleness + 2)
        self.sync = WeightSync(host, job, coordinator, store)
        self._rebase = False

    async def prepare(self) -> bool:
        """Reach the job's learner; False when none of its addresses answers."""
        await self.sync.add_source_addrs(self.job.learner_addrs)
        return bool(self.sync.sources)

    async def sync_to(self, target: int, own: WeightSync) -> bool:
        """Bring the job's adapter to ``target``, on the base of ``own`` (the node's own job's
        sync) when it is the same; False when that failed (the job's next turn tries again,
        from its newest anchor, as a patch that could not be had may be gone)."""
        sync = self.sync
        if sync.base is None and own.base is not None:
            sync.base, sync.base_digest = own.base, own.base_digest
        try:
            await sync.sync_to(target, rebase=self._rebase)
        except (WeightError, RpcError, ProtocolError) as exc:
            self.display.say(
                f"[yellow]job {self.job.job_id}: weights v{target} not available yet[/yellow] "
                f"({exc})"
            )
            self._rebase = True
            return False
        self._rebase = False
        return True


async def open_shared(
    cfg: NodeConfig, host: EchoHost, coordinator, jobs: list[m.JobInfo], display: Display
) -> list[SharedJob]:
    """:class:`SharedJob` for each of ``jobs`` whose learner can be reached."""
    out = []
    for job in jobs:
        shared = SharedJob(cfg, host, coordinator, job, display)
        if await shared.prepare():
            display.say(f"also serving job [bold]{job.job_id}[/bold] (the same base model)")
            out.append(shared)
        else:
            log.info("job %s: its learner cannot be reached; not served", job.job_id)
    return out


async def serve(engine: Engine, sync: WeightSync) -> bool:
    """Make ``engine`` serve the LoRA version ``sync`` holds, unless it serves it already;
    True when that loaded the base (a model load), False for none or an adapter switch.

    :raises AdapterError: the engine serves something else after loading.
    """
    if sync.adapter is None or engine.lora_served == sync.digest:
        return False
    assert sync.base is not None and sync.state is not None  # a synced LoRA version
    return await trio.to_thread.run_sync(
        load_into_engine, engine, sync.adapter, sync.base, sync.state, sync.digest
    )

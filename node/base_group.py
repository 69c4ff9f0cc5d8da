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


class Turns:
    """Whose leases a node asks for next: its own job's, then each shared job's, in turn; a
    shared job that ended, moved the node or is not a LoRA job leaves the turns."""

    def __init__(
        self, own_job: m.JobInfo, own_sync: WeightSync, shared: list[SharedJob], display: Display
    ) -> None:
        self.own_job, self.own_sync, self.shared = own_job, own_sync, shared
        self.display = display
        self._turn = 0

    def next(self) -> tuple[m.JobInfo, WeightSync, SharedJob | None]:
        """The job whose turn it is, its sync, and its :class:`SharedJob` (None: the own job)."""
        slot = [None, *self.shared][self._turn % (len(self.shared) + 1)]
        self._turn += 1
        if slot is None:
            return self.own_job, self.own_sync, None
        return slot.job, slot.sync, slot

    def left(self, slot: SharedJob, reply: m.LeaseReply) -> bool:
        """Whether ``reply`` to a lease request of ``slot``'s job ends its turns: the job is
        over, or the coordinator no longer counts it as one of the node's base."""
        moved = reply.assigned_job is not None and reply.assigned_job != slot.job.job_id
        over = not reply.leases and reply.message.startswith("job is") and (
            "running" not in reply.message)  # fmt: skip
        if moved or over:
            self._drop(slot, reply.message)
        return moved or over

    async def sync(self, slot: SharedJob, target: int) -> bool:
        """Bring ``slot``'s job to ``target`` (:meth:`SharedJob.sync_to`); False when it cannot
        serve that version now (a failed sync) or at all (not a LoRA job: it leaves)."""
        if not await slot.sync_to(target, self.own_sync):
            return False
        if slot.sync.adapter is None:  # the coordinator listed a full-weight job
            self._drop(slot, "not a LoRA job")
            return False
        return True

    def _drop(self, slot: SharedJob, why: str) -> None:
        self.display.say(f"no longer serving job {slot.job.job_id}: {why}")
        self.shared.remove(slot)


def keeps_base(held: WeightSync | None, job: m.JobInfo, group: set[str]) -> bool:
    """Whether a node whose last job's sync is ``held`` keeps its engine for ``job``: a LoRA job
    among ``group``, the jobs that shared that base."""
    return (
        job.job_id in group
        and held is not None
        and held.adapter is not None
        and held.base is not None
    )


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

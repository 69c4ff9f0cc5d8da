"""Keeping the node's engine on the job's current policy: broadcasts, weight syncs, reports.

:class:`PolicyFollower` owns the node's side of weight distribution for its job: the chunk store
(served to peers), the :class:`~echo.node.weights.WeightSync` that brings the state to a version,
the push relay that gives the node its place in each version's broadcast tree (a gossip listener
joins every plan the coordinator announces), the bad-relay reports the relay raises, and the
status the node reports every few seconds (version held, measured upload rate).

A node learns that a version is out one way: the coordinator's lease reply names the job's
current version, and the worker calls :meth:`PolicyFollower.sync_to` with it. A gossiped plan
decides only how a version's chunks arrive (pushed down its tree), never whether to sync: a node
that missed it learns of the version from its next lease reply and pulls. A sync first lets the
relay bring the version if a plan covers the node, then pulls what is missing, riding out a
learner restart; the engine loads each new state in a worker thread so the host keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import trio

from echo.node.adapter_sync import load_into_engine, say_base_loaded
from echo.node.config import NodeConfig
from echo.node.display import Display
from echo.node.engines.base import Engine
from echo.node.errors import NodeError
from echo.node.push_wait import await_push
from echo.node.session import CoordinatorSession
from echo.node.weights import WeightError, WeightSync
from echo.p2p.budget import NODE_STRANGER_BYTES_PER_S, Audience, stranger_bps
from echo.p2p.chunkstore import ChunkStore, serve_chunks
from echo.p2p.host import EchoHost
from echo.p2p.relay import Relay, RelayConfig
from echo.p2p.rpc import RpcError
from echo.protocol import broadcast as b
from echo.protocol import ids
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError

log = logging.getLogger("echo.node")

STATUS_EVERY_S = 10.0
# A learner restart takes a few seconds; a node waits this long for weights before giving up.
SYNC_GIVE_UP_S = 300.0
# Bad-relay reports queued for the coordinator; beyond this they are dropped (a node under
# attack reports the first ones, the rest add nothing).
BAD_PEER_QUEUE = 32


class PolicyFollower:
    """The node's policy for one job (see the module docstring): :meth:`prepare`, then
    :meth:`start`; :meth:`sync_to` whenever a lease reply names a newer version.

    ``upload_limit_bps`` is the volunteer's cap on pushes to relay children (0: none);
    ``measured_upload_bps`` the push rate a previous job's follower measured (0: none), since a
    node's uplink does not change with the job. A node makes one follower per job it serves.
    """

    def __init__(
        self,
        cfg: NodeConfig,
        session: CoordinatorSession,
        display: Display,
        engine_name: str,
        upload_limit_bps: float,
        measured_upload_bps: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.session = session
        self.display = display
        self.engine_name = engine_name
        self.upload_limit_bps = upload_limit_bps
        # Our push rate to relay children as last measured; until then the volunteer's cap, which
        # the coordinator plans with (0: it assumes its default).
        self.upload_bps = measured_upload_bps or upload_limit_bps
        self.engine: Engine | None = None
        self.sync: WeightSync | None = None
        self.relay: Relay | None = None
        self.audience: Audience | None = None  # whom the node's chunk server serves (prepare)
        self._nursery: trio.Nursery | None = None  # start()'s: the heartbeat joins it
        self._punched_said: set[int] = set()  # versions whose punched-path chunks were told
        self.joined_version = -1  # the job's version when prepare() joined it
        self._bad_peers_in, self._bad_peers_out = trio.open_memory_channel[b.BadPeerReport](
            BAD_PEER_QUEUE
        )

    async def prepare(self, host: EchoHost, job: m.JobInfo) -> WeightSync:
        """Open the job's chunk store, serve it to peers and reach the job's learner.

        A learner that cannot be reached now (restarting after a crash, or on a new address) is
        looked up again by :meth:`sync_to`, which gives up only after :data:`SYNC_GIVE_UP_S`.
        """
        chunks = ChunkStore(
            self.cfg.data_dir / "chunks" / job.job_id, keep_versions=job.staleness + 2
        )
        # Peers outside this node's recent plans (identities are free) share one small bucket:
        # a volunteer's uplink is for the plan (issue 26, finding 7, at the nodes).
        self.audience = Audience(stranger_bps(self.upload_limit_bps, NODE_STRANGER_BYTES_PER_S))
        serve_chunks(host, chunks, audience=self.audience)
        sync = WeightSync(
            host,
            job,
            self.session.peer,
            chunks,
            on_progress=self.display.pull_progress,
            broadcasts=self,
        )
        await sync.add_source_addrs(job.learner_addrs)
        if not sync.sources:
            self.display.say(
                "[yellow]the job's learner cannot be reached yet[/yellow] (restarting?); "
                "asking the coordinator for its address again"
            )
        self.sync = sync
        # Versions published before we served the job were pushed (if at all) before our relay
        # could take them: waiting for those pushes is waiting for nothing (see sync_to).
        self.joined_version = job.current_version
        return sync

    async def start(self, nursery: trio.Nursery, engine: Engine) -> None:
        """Run the relay, the plan listener and the bad-peer reporter in ``nursery``; the
        heartbeat joins them after the first sync (:meth:`sync_to`, when the first lease reply
        names the version ``engine`` must hold)."""
        assert self.sync is not None
        sync, job = self.sync, self.sync.job
        self.engine = engine
        relay = Relay(
            sync.host,
            sync.store,
            learner_keys={job.job_id: job.learner_public_key},
            on_bad_peer=self._queue_bad_peer,
            config=RelayConfig(upload_limit_bps=self.upload_limit_bps or None),
            serve_pulls=False,  # serve_chunks already answers pulls from this store
        )
        self.relay = await nursery.start(relay.run)
        self._nursery = nursery
        nursery.start_soon(self._listen_versions, job)
        nursery.start_soon(self._report_bad_peers)

    def carried_manifest(self, version: int) -> tuple[m.Manifest, bytes] | None:
        """The verified manifest and envelope of ``version`` if the relay carries it
        (:class:`~echo.node.weights.Broadcasts`)."""
        if self.relay is None or self.sync is None or version < 0:
            return None
        t = self.relay.transfer(self.sync.job.job_id, version)
        return None if t is None else (t.manifest, t.envelope)

    def carried_versions(self) -> set[int]:
        """The versions of this job the relay still carries
        (:class:`~echo.node.weights.Broadcasts`)."""
        if self.relay is None or self.sync is None:
            return set()
        job_id = self.sync.job.job_id
        return {t.version for t in self.relay.transfers.values() if t.job_id == job_id}

    def _queue_bad_peer(self, report: b.BadPeerReport) -> None:
        with contextlib.suppress(trio.WouldBlock):
            self._bad_peers_in.send_nowait(report)

    async def _report_bad_peers(self) -> None:
        async for report in self._bad_peers_out:
            self.display.say(
                f"[yellow]relay {report.peer_id[-8:]} {report.reason}[/yellow] at "
                f"v{report.version}; reported"
            )
            try:
                await self.session.call(ids.PROTO_BAD_PEER, self.session.seal(report), timeout=10.0)
            except (RpcError, ProtocolError) as exc:
                log.debug("bad-peer report not delivered: %s", exc)

    async def _listen_versions(self, job: m.JobInfo) -> None:
        """Gossip brings each version's relay tree: we take our place in it (receive from our
        parents, forward to our children), so that the version is here, or on its way, when a
        lease reply names it. It syncs nothing: a plan that never arrives costs a pull."""
        assert self.relay is not None and self.session.host is not None
        sub = await self.session.subscribe_plans()
        try:
            async for _peer, data in sub:
                try:
                    ann = await self.relay.join_plan(data, self.session.key, job.job_id)
                except ProtocolError as exc:
                    log.debug("version announcement ignored: %s", exc)
                    continue
                if ann is not None:
                    self.saw_plan(ann)
        finally:
            # The node's next job subscribes again (one subscription per topic and host).
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                await sub.aclose()

    def saw_plan(self, ann: b.PlanAnnouncement) -> None:
        """A plan of our job arrived: its peers pull from our chunk server on their own
        budgets for the next few versions, and its public peers may offer relays to nodes
        behind NAT."""
        if self.audience is not None:
            self.audience.planned(ann.version, (p.peer_id for p in ann.peers))
        if self.session.volunteers is not None:
            self.session.volunteers.saw_plan(ann)

    async def sync_to(self, target: int) -> None:
        """Bring engine and weights to ``target``, riding out a learner restart or a lost peer.

        The learner may come back on another address after a crash, so on failure the node asks
        the coordinator for the job's current sources and tries again with a growing pause; a
        version that changed is loaded into the engine (and kept on disk with --keep-weights)
        and reported to the coordinator.

        :raises NodeError: no sync succeeded for :data:`SYNC_GIVE_UP_S`.
        :raises JobGone: the job ended meanwhile (the coordinator no longer lists it).
        """
        sync = self.sync
        assert sync is not None
        started = time.monotonic()
        delay, rebase = 0.5, False
        if target > self.joined_version:  # before it, the push was tried before we listened
            await await_push(self.relay, self.display, sync.job.job_id, target)
        while True:
            try:
                changed = await sync.sync_to(target, rebase=rebase)
                break
            except (WeightError, RpcError, ProtocolError) as exc:
                self.display.close_bar()
                if time.monotonic() - started > SYNC_GIVE_UP_S:
                    raise NodeError(f"cannot get policy v{target}: {exc}") from None
                self.display.say(
                    f"[yellow]weights v{target} not available yet[/yellow] ({exc}); retrying"
                )
                await trio.sleep(delay)
                delay = min(delay * 2, 10.0)
                addrs = await self.session.learner_addrs(sync.job.job_id)
                if addrs is not None:
                    sync.sources.clear()
                    await sync.add_source_addrs(addrs)
                # Aim at the newest version from its anchor: a patch we could not get may be
                # gone for good (the learner keeps only the versions since its last anchor).
                rebase = True
                with contextlib.suppress(WeightError, RpcError, ProtocolError):
                    target = max(target, await sync.latest_version())
        self._say_punched(sync.job.job_id, sync.version)
        if self._nursery is not None:  # the first sync: from now on there is a version to report
            self._nursery.start_soon(self._heartbeat)
            self._nursery = None
        if changed:
            assert self.engine is not None and sync.state is not None
            if sync.adapter is not None:  # the base loads once; versions switch the adapter
                assert sync.base is not None
                try:
                    loaded = await trio.to_thread.run_sync(
                        load_into_engine, self.engine, sync.adapter, sync.base, sync.state,
                        sync.digest,
                    )  # fmt: skip
                except NotImplementedError as exc:  # retrying cannot help: say so and stop
                    raise NodeError(f"job {sync.job.job_id} is a LoRA job: {exc}") from None
                if loaded:  # counted by tests: a node loads a base once for all its jobs
                    self.display.say(say_base_loaded(self.engine, sync.adapter.base_digest))
            else:
                await trio.to_thread.run_sync(self.engine.load_state, sync.state)
            if self.cfg.keep_weights:
                await trio.to_thread.run_sync(self._save_weights)
            await self.send_status()

    def _say_punched(self, job_id: str, version: int) -> None:
        """Tell the volunteer (and a test reading the log) how many of ``version``'s chunks came
        pushed over a direct path punched through both routers (or dialled on the LAN)."""
        punches = self.session.punches
        t = self.relay.transfer(job_id, version) if self.relay is not None else None
        if punches is None or t is None or version in self._punched_said:
            return
        self._punched_said.add(version)
        by_peer: dict[str, int] = {}
        for feed in t.feeds:
            if feed.peer in punches.peers and feed.received:
                by_peer[feed.peer] = by_peer.get(feed.peer, 0) + feed.received
        for peer, chunks in sorted(by_peer.items()):
            self.display.say(
                f"v{version}: {chunks} chunks pushed by {peer[-8:]} over a direct path "
                f"({punches.peers[peer]})"
            )

    def _save_weights(self) -> None:
        """--keep-weights: the version's tensors, and beside them the digest the engine computes
        from the weights it actually holds (read back from vLLM's workers, llama.cpp's GGUF),
        so a run can be checked bit for bit after the fact."""
        from echo.models.weights import state_to_bytes

        sync = self.sync
        assert self.engine is not None and sync is not None
        path = self.cfg.data_dir / "policy.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(state_to_bytes(sync.state))
        tmp.replace(path)
        meta = {
            "job_id": sync.job.job_id,
            "version": sync.version,
            "state_digest": sync.digest,
            "engine": self.engine_name,
            "engine_state_digest": self.engine.state_digest(),
        }
        (self.cfg.data_dir / "policy.json").write_text(json.dumps(meta) + "\n")

    def measure_upload(self) -> float:
        """Our push rate in the newest transfer where we pushed (kept from earlier ones)."""
        if self.relay is not None:
            rates = [(t.version, t.stats.push_rate_bps()) for t in self.relay.transfers.values()]
            rates = [r for r in rates if r[1] > 0]
            if rates:
                self.upload_bps = max(rates)[1]
        return self.upload_bps

    async def send_status(self) -> None:
        """Tell the coordinator the version held, its digest, the measured upload rate and the
        generation rate; a report that does not get through is only logged."""
        sync = self.sync
        assert sync is not None
        st = m.NodeStatus(
            upload_bps=self.measure_upload(),
            job_id=sync.job.job_id,
            version=sync.version,
            state_digest=sync.digest,
            tokens_per_s=self.display.stats.tokens_per_s,
            timestamp=time.time(),
        )
        try:
            await self.session.call(ids.PROTO_STATUS, self.session.seal(st), timeout=10.0)
        except (RpcError, ProtocolError) as exc:
            log.debug("status not delivered: %s", exc)

    async def _heartbeat(self) -> None:
        while True:
            await trio.sleep(STATUS_EVERY_S)
            await self.send_status()

    async def finish_forwarding(self, version: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the relay has passed ``version`` on to our children;
        False if some push was still going."""
        if self.relay is None or self.sync is None:
            return True
        return await self.relay.wait_forwarded(self.sync.job.job_id, version, timeout)

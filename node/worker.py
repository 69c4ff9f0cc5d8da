"""The volunteer's rollout worker: register, hold the current policy, lease, generate, submit.

:func:`run_node` owns the node's libp2p host, its engine and its chunk store. It registers
(signed) with the coordinator, syncs weights to the job's current version, then loops: ask for
leases (saying which version it holds), check each lease's coordinator signature, generate the
whole group of every lease in one batch in a worker thread, sign and submit each group, and
show the volunteer what was accepted and why anything was rejected. A gossip listener and the
lease replies both tell it when a newer version is out; it syncs before generating again.

Generation and weight decoding run in trio worker threads so the host keeps serving chunks to
peers meanwhile; every network wait has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import trio
from rich.console import Console

from echo.models.spec import ModelSpec, encode_prompt, load_tokenizer
from echo.node.config import NodeConfig
from echo.node.engines.base import Engine, GenRequest, SamplingParams
from echo.node.engines.factory import make_engine
from echo.node.probe import choose_engine, probe
from echo.node.weights import WeightError, WeightSync
from echo.p2p.broadcast import Relay, RelayConfig
from echo.p2p.chunkstore import ChunkStore, serve_chunks
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.p2p.rpc import RemoteError, RpcError
from echo.p2p.tree import route_from_announcement
from echo.protocol import broadcast as b
from echo.protocol import codec, ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.tasks.registry import make_task

log = logging.getLogger("echo.node")

RPC_TIMEOUT_S = 30.0
STATUS_EVERY_S = 10.0
NO_JOB_RETRY_S = 3.0
# A learner restart takes a few seconds; a node waits this long for weights before giving up.
SYNC_GIVE_UP_S = 300.0
SOFTWARE = "echo-swarm/0.1.0"
# Stopping an engine's worker processes (vLLM's shutdown waits up to 2 s per process).
ENGINE_CLOSE_TIMEOUT_S = 10.0
# A lease reply can announce a version before its plan arrives by gossip: wait this long for the
# push to start before pulling, then this long for the relay (which pulls around stalls itself)
# to complete the version before falling back to pulling it whole.
PLAN_WAIT_S = 1.0
BROADCAST_WAIT_S = 30.0
# When the job ends, a node finishes relaying the last version to its children (for at most
# this long) before it leaves: its subtree may have nobody else to get it from.
FINAL_FORWARD_S = 30.0
# Bad-relay reports queued for the coordinator; beyond this they are dropped (a node under
# attack reports the first ones, the rest add nothing).
BAD_PEER_QUEUE = 32
# Versions at least this large get a progress bar while they arrive (small patches take
# milliseconds; a bar per version would only flicker).
PROGRESS_MIN_BYTES = 16 << 20


def lease_request(lease: m.Lease, prompt_ids: list[int]) -> GenRequest:
    """What an engine is asked to generate for ``lease``: its whole group, its sampling."""
    return GenRequest(
        prompt_ids=prompt_ids,
        n=lease.group_size,
        params=SamplingParams(
            max_new_tokens=lease.sampling.max_new_tokens,
            temperature=lease.sampling.temperature,
            top_p=lease.sampling.top_p,
            seed=lease.sampling.seed,
        ),
    )


class NodeError(RuntimeError):
    """A failure the volunteer can act on; the CLI prints it without a traceback."""


@dataclass
class Stats:
    accepted: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)
    tokens: int = 0
    gen_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.gen_seconds if self.gen_seconds else 0.0


class Node:
    def __init__(
        self, cfg: NodeConfig, console: Console | None = None, max_groups: int | None = None
    ) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.max_groups = max_groups
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(cfg.data_dir / "identity.key")
        self.probe = probe(cfg.data_dir)
        self.engine_name, self.engine_reason = choose_engine(self.probe, cfg.engine)
        self.stats = Stats()
        self.engine: Engine | None = None
        self.host: EchoHost | None = None
        self.coord = None
        self.coord_key = b""
        self.announced = -1
        self.report_engine = self.engine_name
        self.relay: Relay | None = None
        self._bar = None  # rich Progress of a large version being pulled
        self._bar_task = None
        # Our push rate to relay children as last measured; until then the volunteer's cap, which
        # the coordinator plans with (0: it assumes its default).
        self.upload_limit_bps = (cfg.max_upload_mbps or 0.0) * 1e6
        self.upload_bps = self.upload_limit_bps
        self._bad_peers_in, self._bad_peers_out = trio.open_memory_channel[b.BadPeerReport](
            BAD_PEER_QUEUE
        )

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")

    async def _call(self, proto: str, payload: bytes, *, timeout: float = RPC_TIMEOUT_S) -> bytes:
        assert self.host is not None
        return await self.host.request(
            self.coord, proto, payload, timeout=timeout, max_response=16 << 20
        )

    def _seal(self, kind: str, record: m.Record) -> bytes:
        return signing.seal(self.identity.private_key, kind, record.to_obj())

    async def run(self) -> None:
        cfg = self.cfg
        self.say(
            f"node {self.identity.peer_id_str} · engine [bold]{self.engine_name}[/bold] "
            f"({self.engine_reason})"
        )
        async with open_host(self.identity, [cfg.listen]) as host:
            self.host = host
            try:
                self.coord = await host.connect(cfg.coordinator)
            except (RpcError, ValueError, OSError) as exc:
                raise NodeError(
                    f"cannot reach the coordinator at {cfg.coordinator}: {exc}"
                ) from None
            self.coord_key = public_key_from_peer_id(self.coord)
            job = await self._register()
            try:
                await self._serve_job(host, job)
            finally:
                # vLLM runs worker processes: stop them here rather than leave them to be
                # force-killed at interpreter exit.
                engine, self.engine = self.engine, None
                if engine is not None:
                    with trio.CancelScope(shield=True), trio.move_on_after(ENGINE_CLOSE_TIMEOUT_S):
                        await trio.to_thread.run_sync(engine.close, abandon_on_cancel=True)

    def _register_record(self) -> m.Register:
        return m.Register(
            protocol_version=ids.PROTOCOL_VERSION,
            software=SOFTWARE,
            engine=self.engine_name,
            hardware=self.probe.hardware,
            tokens_per_s=self.stats.tokens_per_s,
            upload_bps=self.upload_bps,
            download_bps=0.0,
            timestamp=time.time(),
            addrs=self.host.listen_multiaddrs[:8] if self.host is not None else [],
        )

    async def _register(self) -> m.JobInfo:
        while True:
            try:
                sealed = self._seal("register", self._register_record())
                data = await self._call(ids.PROTO_REGISTER, sealed)
            except RpcError as exc:
                raise NodeError(f"registration refused: {exc}") from None
            reply = m.decode(m.RegisterReply, data)
            if reply.jobs:
                job = reply.jobs[0]
                self.say(
                    f"registered · job [bold]{job.job_id}[/bold] ({job.task.name}) at "
                    f"v{job.current_version}"
                )
                return job
            self.say("registered · no running job yet, waiting")
            await trio.sleep(NO_JOB_RETRY_S)

    async def _serve_job(self, host: EchoHost, job: m.JobInfo) -> None:
        cfg = self.cfg
        spec = ModelSpec.from_dict(job.model)
        device = cfg.device if cfg.device != "auto" else ("cuda" if self.probe.cuda else "cpu")
        # Re-scoring thresholds are per engine and device: GPU kernels differ more from the
        # learner's CPU float32 than a CPU does.
        self.report_engine = (
            f"torch-{device}" if self.engine_name == "torch" and device != "cpu"
            else self.engine_name
        )
        try:
            self.engine = await trio.to_thread.run_sync(
                lambda: make_engine(
                    self.engine_name,
                    spec,
                    device=device,
                    threads=cfg.threads,
                    gpu_memory_fraction=cfg.gpu_memory_fraction,
                )
            )
        except MemoryError:
            raise NodeError("the model does not fit in this machine's memory") from None
        tokenizer = load_tokenizer(spec)
        task = make_task(job.task.name, dict(job.task.params))
        chunks = ChunkStore(cfg.data_dir / "chunks" / job.job_id, keep_versions=job.staleness + 2)
        serve_chunks(host, chunks)
        sync = WeightSync(host, job, self.coord, chunks, on_progress=self._pull_progress)
        await sync.add_source_addrs(job.learner_addrs)
        if not sync.sources:
            raise NodeError("cannot reach the job's learner to fetch weights")
        async with trio.open_nursery() as nursery:
            relay = Relay(
                host,
                chunks,
                learner_keys={job.job_id: job.learner_public_key},
                on_bad_peer=self._queue_bad_peer,
                config=RelayConfig(upload_limit_bps=self.upload_limit_bps or None),
                serve_pulls=False,  # serve_chunks above already answers pulls from this store
            )
            self.relay = await nursery.start(relay.run)
            # Versions the relay is still carrying stay in the store when a sync prunes it.
            sync.keep_also = lambda: {t.version for t in relay.transfers.values()}
            nursery.start_soon(self._listen_versions, job)
            nursery.start_soon(self._report_bad_peers)
            await self._sync(sync, job.current_version)
            nursery.start_soon(self._heartbeat, job, sync)
            await self._lease_loop(job, spec, tokenizer, task, sync)
            nursery.cancel_scope.cancel()

    def _queue_bad_peer(self, report: b.BadPeerReport) -> None:
        with contextlib.suppress(trio.WouldBlock):
            self._bad_peers_in.send_nowait(report)

    async def _report_bad_peers(self) -> None:
        async for report in self._bad_peers_out:
            self.say(f"[yellow]relay {report.peer_id[-8:]} {report.reason}[/yellow] at "
                     f"v{report.version}; reported")
            try:
                await self._call(ids.PROTO_BAD_PEER, self._seal("bad_peer", report), timeout=10.0)
            except (RpcError, ProtocolError) as exc:
                log.debug("bad-peer report not delivered: %s", exc)

    async def _await_broadcast(self, job_id: str, target: int) -> None:
        """Let the relay bring ``target`` into the store if a plan covers us (bounded)."""
        relay = self.relay
        if relay is None:
            return
        t = relay.transfer(job_id, target)
        if t is None:
            with trio.move_on_after(PLAN_WAIT_S):
                while (t := relay.transfer(job_id, target)) is None:
                    await trio.sleep(0.02)
        if t is None:
            return
        with trio.move_on_after(BROADCAST_WAIT_S):
            if t.manifest.total_size < PROGRESS_MIN_BYTES:
                await t.done.wait()
                return
            with self._progress() as bar:
                task = bar.add_task(f"policy v{target} (relay)", total=t.manifest.total_size)
                while not t.done.is_set():
                    have = sum(c.size for c, h in zip(t.manifest.chunks, t.have, strict=True) if h)
                    bar.update(task, completed=have)
                    with trio.move_on_after(0.25):
                        await t.done.wait()

    def _progress(self):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TransferSpeedColumn,
        )

        return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), console=self.console, transient=True)

    def _pull_progress(self, version: int, done: int, total: int) -> None:
        """WeightSync's per-chunk callback: a bar for large versions pulled whole."""
        if total < PROGRESS_MIN_BYTES:
            return
        if self._bar is None:
            self._bar = self._progress()
            self._bar.start()
            self._bar_task = self._bar.add_task(f"policy v{version} (pull)", total=total)
        self._bar.update(self._bar_task, completed=done, total=total,
                         description=f"policy v{version} (pull)")
        if done >= total:
            self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    async def _sync(self, sync: WeightSync, target: int) -> None:
        """Bring engine and weights to ``target``, riding out a learner restart or a lost peer.

        The learner may come back on another address after a crash, so on failure the node asks
        the coordinator for the job's current sources and tries again with a growing pause; a
        node that cannot sync for :data:`SYNC_GIVE_UP_S` stops with a clear message.
        """
        started = time.monotonic()
        delay, rebase = 0.5, False
        await self._await_broadcast(sync.job.job_id, target)
        while True:
            try:
                changed = await sync.sync_to(target, rebase=rebase)
                break
            except (WeightError, RpcError, ProtocolError) as exc:
                self._close_bar()
                if time.monotonic() - started > SYNC_GIVE_UP_S:
                    raise NodeError(f"cannot get policy v{target}: {exc}") from None
                self.say(f"[yellow]weights v{target} not available yet[/yellow] ({exc}); retrying")
                await trio.sleep(delay)
                delay = min(delay * 2, 10.0)
                await self._refresh_sources(sync)
                # Aim at the newest version from its anchor: a patch we could not get may be
                # gone for good (the learner keeps only the versions since its last anchor).
                rebase = True
                with contextlib.suppress(WeightError, RpcError, ProtocolError):
                    target = max(target, await sync.latest_version())
        if changed:
            assert self.engine is not None and sync.state is not None
            await trio.to_thread.run_sync(self.engine.load_state, sync.state)
            if self.cfg.keep_weights:
                await trio.to_thread.run_sync(self._save_weights, sync)
            await self._send_status(sync)

    async def _refresh_sources(self, sync: WeightSync) -> None:
        try:
            reply = m.decode(m.RegisterReply, await self._call(
                ids.PROTO_REGISTER, self._seal("register", self._register_record())))
        except (RpcError, ProtocolError):
            return
        for job in reply.jobs:
            if job.job_id == sync.job.job_id:
                sync.sources.clear()
                await sync.add_source_addrs(job.learner_addrs)

    def _save_weights(self, sync: WeightSync) -> None:
        """--keep-weights: the version's tensors, and beside them the digest the engine computes
        from the weights it actually holds (read back from vLLM's workers, llama.cpp's GGUF),
        so a run can be checked bit for bit after the fact."""
        from echo.models.weights import state_to_bytes

        assert self.engine is not None
        path = self.cfg.data_dir / "policy.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(state_to_bytes(sync.state))
        tmp.replace(path)
        meta = {"job_id": sync.job.job_id, "version": sync.version, "state_digest": sync.digest,
                "engine": self.engine_name, "engine_state_digest": self.engine.state_digest()}
        (self.cfg.data_dir / "policy.json").write_text(json.dumps(meta) + "\n")

    def _measure_upload(self) -> float:
        """Our push rate in the newest transfer where we pushed (kept from earlier ones)."""
        if self.relay is not None:
            rates = [
                (t.version, t.stats.push_rate_bps()) for t in self.relay.transfers.values()
            ]
            rates = [r for r in rates if r[1] > 0]
            if rates:
                self.upload_bps = max(rates)[1]
        return self.upload_bps

    async def _send_status(self, sync: WeightSync) -> None:
        st = m.NodeStatus(
            upload_bps=self._measure_upload(),
            job_id=sync.job.job_id,
            version=sync.version,
            state_digest=sync.digest,
            tokens_per_s=self.stats.tokens_per_s,
            timestamp=time.time(),
        )
        try:
            await self._call(ids.PROTO_STATUS, self._seal("node_status", st), timeout=10.0)
        except RpcError as exc:
            log.debug("status not delivered: %s", exc)

    async def _heartbeat(self, job: m.JobInfo, sync: WeightSync) -> None:
        while True:
            await trio.sleep(STATUS_EVERY_S)
            await self._send_status(sync)

    async def _listen_versions(self, job: m.JobInfo) -> None:
        """Gossip tells us early that a version is out, and the relay tree that carries it: we
        take our place in it (receive from our parents, forward to our children). Leases would
        tell us of the version too, later, and we would pull it."""
        assert self.host is not None and self.relay is not None
        me = str(self.host.peer_id)
        sub = await self.host.subscribe(ids.TOPIC_VERSIONS)
        async for _peer, data in sub:
            try:
                env = signing.open_envelope(
                    data, kind="broadcast_plan", max_bytes=8 << 20, expected_signer=self.coord_key
                )
                ann = b.from_obj(b.PlanAnnouncement, env.decode_body())
                if ann.job_id != job.job_id:
                    continue
                route = route_from_announcement(ann, me)
                if route is not None:
                    await self.relay.start(ann.manifest, route)  # verifies the manifest
            except ProtocolError as exc:
                log.debug("version announcement ignored: %s", exc)
                continue
            self.announced = max(self.announced, ann.version)

    async def _lease_loop(
        self, job: m.JobInfo, spec: ModelSpec, tokenizer, task, sync: WeightSync
    ) -> None:
        done_groups = 0
        while self.max_groups is None or done_groups < self.max_groups:
            if not self.cfg.working_now():
                self.say(f"outside the schedule {self.cfg.schedule}: pausing")
                while not self.cfg.working_now():
                    await trio.sleep(30)
            if self.announced > sync.version:
                await self._sync(sync, self.announced)
            req = m.LeaseRequest(
                job_id=job.job_id,
                max_leases=self.cfg.leases_at_once,
                have_version=sync.version,
                timestamp=time.time(),
            )
            try:
                sealed = self._seal("lease_request", req)
                reply = m.decode(m.LeaseReply, await self._call(ids.PROTO_LEASE, sealed))
            except RemoteError as exc:
                if "excluded" in exc.message:
                    raise NodeError(f"the coordinator excluded this node: {exc.message}") from None
                self.say(f"[yellow]lease request refused:[/yellow] {exc.message}")
                await trio.sleep(2.0)
                continue
            except (RpcError, ProtocolError) as exc:
                self.say(f"[yellow]lease request failed:[/yellow] {exc}")
                await trio.sleep(2.0)
                continue
            if reply.current_version > sync.version:
                await self._sync(sync, reply.current_version)
            if not reply.leases:
                if reply.message.startswith("job is") and "running" not in reply.message:
                    if self.relay is not None and not await self.relay.wait_forwarded(
                        job.job_id, sync.version, FINAL_FORWARD_S
                    ):
                        self.say(f"[yellow]still relaying v{sync.version} after "
                                 f"{FINAL_FORWARD_S:.0f} s; leaving anyway[/yellow]")
                    self.say(f"{reply.message} at v{sync.version}; leaving")
                    return
                await trio.sleep(max(reply.retry_after_s, 0.05))
                continue
            leases = [self._open_lease(b) for b in reply.leases]
            await self._work(leases, spec, tokenizer, task, sync)
            done_groups += len(leases)

    def _open_lease(self, data: bytes) -> m.Lease:
        env = signing.open_envelope(data, kind="lease", expected_signer=self.coord_key)
        return m.from_obj(m.Lease, env.decode_body())

    async def _work(
        self, leases: list[m.Lease], spec: ModelSpec, tokenizer, task, sync: WeightSync
    ) -> None:
        assert self.engine is not None
        version, digest = sync.version, sync.digest
        reqs = [
            lease_request(lease, encode_prompt(spec, task.prompt(lease.prompt_id), tokenizer))
            for lease in leases
        ]
        t0 = time.perf_counter()
        results = await trio.to_thread.run_sync(self.engine.generate, reqs)
        gen_s = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for group in results for c in group)
        self.stats.tokens += tokens
        self.stats.gen_seconds += gen_s
        await self._throttle(tokens, gen_s)
        for lease, group in zip(leases, results, strict=True):
            sub = m.Submission(
                lease_id=lease.lease_id,
                job_id=lease.job_id,
                version=version,
                engine=self.report_engine,
                state_digest=digest,
                completions=[
                    m.CompletionRecord(
                        token_ids=m.pack_tokens(c.token_ids),
                        logprobs=m.pack_logprobs(c.logprobs),
                        finish_reason=c.finish_reason,
                    )
                    for c in group
                ],
                gen_seconds=gen_s / len(leases),
            )
            await self._submit(self.encode_submission(sub))

    def encode_submission(self, sub: m.Submission) -> bytes:
        """Sign and compress a submission (token and log-prob arrays compress ~2-4x; the
        coordinator caps the decompressed size)."""
        return codec.compress(self._seal("submission", sub))

    async def _submit(self, payload: bytes) -> m.SubmitReply | None:
        try:
            reply = m.decode(m.SubmitReply, await self._call(ids.PROTO_SUBMIT, payload))
        except (RpcError, ProtocolError) as exc:
            self.say(f"[yellow]submission failed:[/yellow] {exc}")
            return None
        self._show(reply)
        return reply

    async def _throttle(self, tokens: int, gen_s: float) -> None:
        cap = self.cfg.max_tokens_per_s
        if cap:
            await trio.sleep(max(0.0, tokens / cap - gen_s))

    def _show(self, reply: m.SubmitReply) -> None:
        if reply.accepted:
            self.stats.accepted += 1
        else:
            self.stats.rejected += 1
            self.stats.reasons[reply.reason] += 1
            self.say(f"[red]rejected[/red] ({reply.reason}) {reply.detail}")
        if self.stats.accepted % 10 == 1 or not reply.accepted:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(reply.rejected_by_reason.items()))
            self.say(
                f"accepted {reply.accepted_total} · rejected "
                f"{reply.rejected_total}{' (' + reasons + ')' if reasons else ''} · "
                f"{self.stats.tokens_per_s:,.0f} tok/s"
            )


async def run_node(cfg: NodeConfig, console: Console | None = None) -> None:
    await Node(cfg, console).run()

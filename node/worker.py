"""The volunteer's rollout worker: register, hold the current policy, lease, generate, submit.

:class:`Node` owns the node's libp2p host and its lease loop, and composes the rest: an
:class:`~echo.node.engine_slot.EngineSlot` (the engine it holds across jobs), a
:class:`~echo.node.session.CoordinatorSession` (registration and signed calls), a
:class:`~echo.node.policy.PolicyFollower` per job (broadcasts, weight syncs, status and bad-relay
reports) and a :class:`~echo.node.display.Display` (what the volunteer sees). Beside the jobs,
for as long as it runs, the session keeps a reservation on the coordinator's circuit relay when
the node cannot be dialled (:meth:`~echo.node.session.CoordinatorSession.keep_relay_slot`).

A node serves jobs until it is stopped. It registers, and the coordinator's scheduler places it
on one job (or keeps it idle: on standby, or with nothing running that fits it; it registers
again every few seconds meanwhile). For that job it starts an engine on the job's model, then
loops: ask for leases (saying which version it holds; the first reply names the one to fetch),
check each lease's coordinator signature, generate the whole group of every lease in one batch in
a worker thread from the prompt token ids the signed lease carries (a node needs neither the
dataset nor any task code), sign and submit each group, and show the volunteer what was accepted
and why anything was rejected. Each lease reply names the job's current version, the one way a
node learns of a new one: it syncs to it before generating again (a gossiped plan only brings
the version's chunks, see :mod:`~echo.node.policy`). When the job ends, or a lease reply says the
scheduler moved the node, it passes the version in hand on to its relay children and goes back
to registration for its next job; its engine slot frees the engine's memory meanwhile (unless the
next job may share its base) and prunes the chunk stores of jobs it no longer serves to the
volunteer's ``max_disk_gb``.

Generation and weight decoding run in trio worker threads so the host keeps serving chunks to
peers meanwhile; every network wait has a timeout.
"""

from __future__ import annotations

import time

import trio
from rich.console import Console

from echo.models.spec import ModelSpec, load_tokenizer
from echo.node.adapter_sync import say_base_loaded
from echo.node.base_group import SharedJob, Turns, open_shared, serve
from echo.node.config import NodeConfig
from echo.node.display import Display
from echo.node.engine_slot import EngineSlot
from echo.node.engines.base import GenRequest, SamplingParams
from echo.node.errors import NodeError
from echo.node.policy import PolicyFollower
from echo.node.probe import probe
from echo.node.relay_slots import VolunteerRelays
from echo.node.session import CoordinatorSession
from echo.node.weights import WeightSync
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RemoteError, RpcError
from echo.protocol import codec, ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError

# When the job ends, a node finishes relaying the last version to its children (for at most
# this long) before it leaves: its subtree may have nobody else to get it from.
FINAL_FORWARD_S = 30.0
# A node the scheduler moves passes the version in hand to its children for at most this long.
MOVED_FORWARD_S = 10.0


def lease_prompt(lease: m.Lease, vocab_size: int) -> list[int]:
    """The prompt token ids ``lease`` carries (signed by the coordinator).

    :raises SchemaError: an id outside ``[0, vocab_size)`` or more than MAX_PROMPT_TOKENS ids.
    """
    ids = m.unpack_tokens(lease.prompt_tokens, vocab_size=vocab_size, max_len=m.MAX_PROMPT_TOKENS)
    return ids.tolist()


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


class Node:
    """One volunteer node (see the module docstring): :meth:`run` serves jobs until
    ``max_groups`` groups are done or it is cancelled.

    :meth:`run` raises :class:`NodeError` for failures the volunteer can act on (coordinator or
    learner unreachable, registration refused, excluded, the model does not fit, no weights).
    """

    def __init__(
        self, cfg: NodeConfig, console: Console | None = None, max_groups: int | None = None
    ) -> None:
        self.cfg = cfg
        self.display = Display(console or Console(stderr=True))
        self.stats = self.display.stats
        self.max_groups = max_groups
        self.done_groups = 0
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(cfg.data_dir / "identity.key")
        self.probe = probe(cfg.data_dir)
        self.engine_slot = EngineSlot(cfg, self.probe, self.display)
        self.host: EchoHost | None = None
        self.session = CoordinatorSession(self.identity, self.display, self._register_record)
        self.upload_limit_bps = (cfg.max_upload_mbps or 0.0) * 1e6
        self.policy = self._follower()
        self.jobs_served: list[str] = []  # in the order the node served them

    def say(self, text: str) -> None:
        """Print ``text`` to the volunteer (see :meth:`Display.say`)."""
        self.display.say(text)

    def _follower(self) -> PolicyFollower:
        """A fresh policy follower for the next job; the uplink rate measured so far carries."""
        measured = getattr(self, "policy", None)
        return PolicyFollower(
            self.cfg,
            self.session,
            self.display,
            self.engine_slot.name,
            self.upload_limit_bps,
            measured.upload_bps if measured is not None else 0.0,
        )

    async def run(self) -> None:
        """Serve the jobs the coordinator places this node on, one after another, until
        cancelled (or ``max_groups`` are done); idle in between. The engine is closed after
        each job (unless the next may share its base) and on the way out. Meanwhile
        DATA_DIR/status.json says what the node does (and the local page shows it, with
        ``ui_port``). :raises NodeError: see the class docstring."""
        from echo.node.state import StatusKeeper
        from echo.node.ui import serve_ui

        cfg = self.cfg
        self.say(
            f"node {self.identity.peer_id_str} · engine [bold]{self.engine_slot.name}[/bold] "
            f"({self.engine_slot.reason}) · cost {cfg.cost:g}"
        )
        keeper = StatusKeeper(self)
        with keeper.kept():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keeper.run)
                if cfg.ui_port is not None:
                    binds = await nursery.start(serve_ui, keeper, cfg.ui_port)
                    keeper.ui_url = binds[0].rstrip("/") + "/"
                    self.say(f"status page (this machine only): {keeper.ui_url}")
                try:
                    await self._run_host()
                finally:
                    nursery.cancel_scope.cancel()

    async def _run_host(self) -> None:
        cfg = self.cfg
        async with open_host(self.identity, [cfg.listen]) as host:
            self.host = host
            await self.session.connect(host, cfg.coordinator)
            self.session.volunteers = VolunteerRelays(
                host, self.display, upload_limit_bps=self.upload_limit_bps,
                announce=self.session.announce,
            )
            async with trio.open_nursery() as nursery:
                # Behind NAT: a reservation on the coordinator's relay while the node runs.
                nursery.start_soon(self.session.keep_relay_slot)
                try:
                    await self._serve_jobs(host)
                finally:
                    nursery.cancel_scope.cancel()

    async def _serve_jobs(self, host: EchoHost) -> None:
        job = await self.session.wait_for_job(first=True)
        try:
            while True:
                if self.jobs_served and self.jobs_served[-1] != job.job_id:
                    self.say(
                        f"switching to job [bold]{job.job_id}[/bold] "
                        f"(from {self.jobs_served[-1]})"
                    )
                self.jobs_served.append(job.job_id)
                await self._serve_job(host, job)
                if self.max_groups is not None and self.done_groups >= self.max_groups:
                    return
                await self.engine_slot.idle()
                job = await self.session.wait_for_job()
        finally:
            await self.engine_slot.close()

    def _register_record(self) -> m.Register:
        return m.Register(
            protocol_version=ids.PROTOCOL_VERSION,
            software=ids.SOFTWARE,
            engine=self.engine_slot.name,
            hardware=self.probe.hardware,
            tokens_per_s=self.stats.tokens_per_s,
            upload_bps=self.policy.upload_bps,
            download_bps=0.0,
            timestamp=time.time(),
            # Behind NAT, the circuit addresses of its relay reservations come last.
            addrs=(self.host.listen_multiaddrs[:6] + self.session.circuit_addrs()[:2])
            if self.host is not None
            else [],
            cost=self.cfg.cost,
        )

    async def _serve_job(self, host: EchoHost, job: m.JobInfo) -> None:
        """Work for ``job`` until it ends, the scheduler moves the node, or ``max_groups``."""
        cfg = self.cfg
        # A job of the base the engine holds keeps it (an adapter switch); else the last job's
        # engine goes first: never two models in memory.
        held = await self.engine_slot.make_room(job, self.policy.sync)
        self.policy = self._follower()
        spec = ModelSpec.from_dict(job.model)
        await self.engine_slot.open(spec)
        self.policy.engine_name = self.engine_slot.name
        # The tokenizer only bounds the ids a lease may carry: prompts come tokenized.
        vocab = spec.vocab if spec.kind == "tiny" else len(load_tokenizer(spec))
        sync = await self.policy.prepare(host, job)
        if held is not None:  # the base the engine holds: not fetched again
            sync.base, sync.base_digest = held.base, held.base_digest
        # LoRA jobs on the same base: served too, by adapter switches (echo.node.base_group).
        shared = await open_shared(cfg, host, self.session.peer, self.session.base_jobs,
                                   self.display)  # fmt: skip
        self.engine_slot.serving({job.job_id, *(s.job.job_id for s in shared)})
        async with trio.open_nursery() as nursery:
            assert self.engine_slot.engine is not None
            await self.policy.start(nursery, self.engine_slot.engine)
            await self._lease_loop(job, vocab, sync, shared)
            nursery.cancel_scope.cancel()

    async def _lease_loop(
        self, own_job: m.JobInfo, vocab: int, own_sync: WeightSync, shared: list[SharedJob]
    ) -> None:
        """Leases of the node's job, taking turns with the jobs that share its base."""
        turns = Turns(own_job, own_sync, shared, self.display)
        while self.max_groups is None or self.done_groups < self.max_groups:
            if not self.cfg.working_now():
                self.say(f"outside the schedule {self.cfg.schedule}: pausing")
                while not self.cfg.working_now():
                    await trio.sleep(30)
            job, sync, slot = turns.next()
            req = m.LeaseRequest(
                job_id=job.job_id,
                max_leases=self.cfg.leases_at_once,
                have_version=sync.version,
                timestamp=time.time(),
            )
            try:
                sealed = self.session.seal(req)
                reply = m.decode(m.LeaseReply, await self.session.call(ids.PROTO_LEASE, sealed))
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
            if slot is not None and turns.left(slot, reply):
                continue
            if reply.assigned_job is not None and reply.assigned_job != job.job_id:
                # The scheduler moved us: hand the version in hand on, then go.
                await self.policy.finish_forwarding(sync.version, MOVED_FORWARD_S)
                where = f"job {reply.assigned_job}" if reply.assigned_job else "standby"
                self.say(f"the coordinator moved this node from job {job.job_id} to {where}")
                return
            if reply.current_version > sync.version:
                if slot is None:
                    await self.policy.sync_to(reply.current_version)
                elif not await turns.sync(slot, reply.current_version):
                    continue
            if not reply.leases:
                if reply.message.startswith("job is") and "running" not in reply.message:
                    if not await self.policy.finish_forwarding(sync.version, FINAL_FORWARD_S):
                        self.say(
                            f"[yellow]still relaying v{sync.version} after "
                            f"{FINAL_FORWARD_S:.0f} s; moving on anyway[/yellow]"
                        )
                    self.say(
                        f"job {job.job_id}: {reply.message} at v{sync.version}; "
                        f"looking for the next job"
                    )
                    return
                if slot is None:  # the shared jobs' turns come between, without a pause of theirs
                    pause = max(reply.retry_after_s, 0.05)
                    await trio.sleep(min(pause, 0.2) if turns.shared else pause)
                continue
            leases = [self._open_lease(b) for b in reply.leases]
            work = []
            for lease in leases:
                try:
                    work.append((lease, lease_prompt(lease, vocab)))
                except ProtocolError as exc:  # the coordinator's bug: skip it, the lease expires
                    self.say(f"[yellow]lease {lease.lease_id} skipped:[/yellow] {exc}")
            if work:
                await self._work(work, sync)
            self.done_groups += len(leases)

    def _open_lease(self, data: bytes) -> m.Lease:
        return signing.open_record(data, m.Lease, expected_signer=self.session.key)[1]

    async def _work(self, work: list[tuple[m.Lease, list[int]]], sync: WeightSync) -> None:
        engine = self.engine_slot.engine
        assert engine is not None
        # Several jobs of one base take turns on the engine: switch to this job's adapter.
        if await serve(engine, sync):
            self.say(say_base_loaded(engine, sync.adapter.base_digest))
        version, digest = sync.version, sync.digest
        if sync.adapter is not None:  # what the engine serves, as computed when it loaded
            digest = engine.lora_served
        leases = [lease for lease, _ in work]
        reqs = [lease_request(lease, prompt) for lease, prompt in work]
        t0 = time.perf_counter()
        results = await trio.to_thread.run_sync(engine.generate, reqs)
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
                engine=self.engine_slot.reported,
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
        return codec.compress(self.session.seal(sub))

    async def _submit(self, payload: bytes) -> m.SubmitReply | None:
        try:
            reply = m.decode(m.SubmitReply, await self.session.call(ids.PROTO_SUBMIT, payload))
        except (RpcError, ProtocolError) as exc:
            self.say(f"[yellow]submission failed:[/yellow] {exc}")
            return None
        self.display.show(reply)
        return reply

    async def _throttle(self, tokens: int, gen_s: float) -> None:
        cap = self.cfg.max_tokens_per_s
        if cap:
            pause = max(0.0, tokens / cap - gen_s)
            # The pause counts as generating time: the rate reported is what the node delivers.
            self.stats.gen_seconds += pause
            await trio.sleep(pause)


async def run_node(cfg: NodeConfig, console: Console | None = None) -> None:
    """Run one node with ``cfg`` until it is cancelled. :raises NodeError: see :class:`Node`."""
    await Node(cfg, console).run()

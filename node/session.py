"""The node's signed conversation with its coordinator: connect, register, call, report.

:class:`CoordinatorSession` owns the node's link to the coordinator: the coordinator's peer id and
key (leases and broadcast plans must carry its signature), sealing records with the node's
identity, request/response calls with their timeouts, and registration: the reply names the job
the coordinator's scheduler placed the node on (:meth:`CoordinatorSession.wait_for_job`), and
registering again is how a node with nothing to do polls for work (every :data:`IDLE_POLL_S`,
well inside the coordinator's registration budget) and how it learns a job's current learner
addresses. Once connected it also answers the coordinator's hole-punch go signals
(:class:`~echo.node.punching.Punches`): a node behind NAT opens direct paths to the peers the
coordinator pairs it with, over which the relay can then push. And while it runs,
:meth:`CoordinatorSession.keep_relay_slot` asks the coordinator's dial-back whether the node can
be dialled; one that cannot keeps a circuit relay v2 reservation on the coordinator
(:func:`~echo.p2p.nat.circuit.keep_reservation`), so that peers can reach it for control messages
(bulk chunks never cross a relay). A refused reservation is said once; the node works on
without one (peers then cannot reach it for control messages).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import trio

from echo.node.display import Display
from echo.node.errors import JobGone, NodeError
from echo.node.pacing import Pacer
from echo.node.punching import Punches
from echo.node.relay_slots import VolunteerRelays
from echo.p2p.gossip_validate import signed_by
from echo.p2p.host import EchoHost
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.p2p.nat.circuit import RelayRefused, keep_reservation
from echo.p2p.nat.dcutr import serve_dcutr
from echo.p2p.nat.dialback import ask_dialback
from echo.p2p.pubsub import Subscription
from echo.p2p.rpc import RpcError
from echo.protocol import broadcast as b
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError
from echo.protocol.nat import DialBackReply

RPC_TIMEOUT_S = 30.0
# An idle node registers again this often to learn of work: 10 a minute, inside the
# coordinator's default budget of 12 registrations per peer and minute.
IDLE_POLL_S = 6.0
# Standby nodes woken by a new job's first plan register again within this (uniformly spread):
# a thousand of them at once would be a burst of registrations, each a scheduling pass.
WAKE_JITTER_S = 1.0
# A registration that fails once the node has been registered (the coordinator restarting) is
# retried, with a pause that doubles up to this.
MAX_RETRY_S = 60.0
# Whether the node can be dialled: the coordinator's dial-back, asked once after the first
# registration (as `echo-node doctor` asks it; the coordinator budgets 4 at once per peer). A
# failed ask is retried DIALBACK_TRIES times, DIALBACK_RETRY_S apart.
DIALBACK_TIMEOUT_S = 30.0
DIALBACK_TRIES = 3
DIALBACK_RETRY_S = 5.0
# A reservation the coordinator did not answer (timeout, lost connection) is asked again after
# a pause that doubles from this up to MAX_RETRY_S.
RESERVE_RETRY_S = 2.0


class CoordinatorSession:
    """The node's session with its coordinator (see the module docstring).

    ``describe`` builds the node's current :class:`~echo.protocol.messages.Register` record;
    :meth:`connect` must succeed before any call.
    """

    def __init__(
        self, identity: Identity, display: Display, describe: Callable[[], m.Register]
    ) -> None:
        self.identity = identity
        self.base_jobs: list[m.JobInfo] = []  # the last registration's (RegisterReply.base_jobs)
        self.display = display
        self.describe = describe
        self.host: EchoHost | None = None
        self.peer = None  # the coordinator's peer id
        self.key = b""  # the coordinator's public key: leases and plans must carry its signature
        self.punches: Punches | None = None  # answers the coordinator's punch requests
        self.addr = ""  # the coordinator's multiaddr (.../p2p/<id>): also its relay's
        self.registered: trio.Event | None = None  # set by the first successful registration
        self.reachability: DialBackReply | None = None  # the dial-back's verdict, once asked
        self.relay_slot = None  # the Reservation kept on the coordinator's relay, if any
        # Relays among volunteers (echo.node.relay_slots), set by the worker: offered when
        # reachable, one reservation taken when behind NAT.
        self.volunteers: VolunteerRelays | None = None
        self.pacer = Pacer()  # keeps each RPC under the coordinator's default request budget

    async def connect(self, host: EchoHost, addr: str) -> None:
        """Dial the coordinator at ``addr`` over ``host`` and answer its punch requests there.

        :raises NodeError: unreachable.
        """
        self.host = host
        self.addr = addr
        self.registered = trio.Event()
        try:
            self.peer = await host.connect(addr)
        except (RpcError, ValueError, OSError) as exc:
            raise NodeError(f"cannot reach the coordinator at {addr}: {exc}") from None
        self.key = public_key_from_peer_id(self.peer)
        # Before the first registration: the coordinator pairs a node for a punch as soon as
        # its dial-back says "nat", which can be moments after it registered.
        self.punches = Punches(host, self.peer)
        self.punches.serve()
        # A peer that reaches us through a relay may ask us to dial it (DCUtR).
        serve_dcutr(host)

    def circuit_addrs(self) -> list[str]:
        """Where peers reach this node through relays (registered beside its listen
        addresses; the coordinator announces them in plans when no dial-back reached us)."""
        out = []
        if self.relay_slot is not None and self.relay_slot.active:
            out.append(self.relay_slot.circuit_addr)
        if self.volunteers is not None:
            out += self.volunteers.circuit_addrs
        return out

    async def announce(self) -> None:
        """Register once more (the coordinator learns a new circuit address); a failure is
        left to the next registration."""
        try:
            await self.register()
        except (RpcError, ProtocolError) as exc:
            self.display.say(f"[yellow]registering the relay address failed:[/yellow] {exc}")

    async def call(self, proto: str, payload: bytes, *, timeout: float = RPC_TIMEOUT_S) -> bytes:
        """One request to the coordinator, at the pace its default budget admits (see
        :mod:`echo.node.pacing`; the wait for a token comes before ``timeout``); its reply (at
        most 16 MiB).

        :raises RpcError: the call failed or the coordinator answered with an error.
        """
        assert self.host is not None
        await self.pacer.wait(proto)
        # A coordinator that crashed is back within seconds: callers pace their retries, so
        # libp2p's minute-long "recently failed" block must not hold the node off it.
        self.host.forget_dial_failures(self.peer)
        return await self.host.request(
            self.peer, proto, payload, timeout=timeout, max_response=16 << 20
        )

    def seal(self, record: m.Record) -> bytes:
        """``record`` in an envelope of its own kind signed with the node's identity."""
        return signing.seal_record(self.identity.private_key, record)

    async def register(self) -> m.RegisterReply:
        """Register (signed) once; the coordinator's reply.

        :raises RpcError: the call failed or the coordinator refused it.
        :raises ProtocolError: the reply does not decode.
        """
        data = await self.call(ids.PROTO_REGISTER, self.seal(self.describe()))
        reply = m.decode(m.RegisterReply, data)
        if self.registered is not None:
            self.registered.set()
        return reply

    async def wait_for_job(self, *, first: bool = False) -> m.JobInfo:
        """Register until the coordinator places this node on a job, and return that job.

        Meanwhile the node is idle: the volunteer sees it once per reason (no running job, on
        standby, nothing that fits), and it asks again every :data:`IDLE_POLL_S`, or, placed
        on a job that is starting, as soon as the coordinator gossips the job's first plan. A
        node between jobs rides out a coordinator restart (retries with a growing pause).

        :raises NodeError: ``first`` and the coordinator refused or failed the registration
            (a wrong protocol version, an excluded node, an unreachable coordinator).
        """
        shown, delay = "", IDLE_POLL_S
        plans: Subscription | None = None
        try:
            while True:
                try:
                    reply = await self.register()
                except (RpcError, ProtocolError) as exc:
                    if first or "excluded" in str(exc):
                        raise NodeError(f"registration refused: {exc}") from None
                    self.display.say(f"[yellow]registration failed:[/yellow] {exc}; retrying")
                    await trio.sleep(delay)
                    delay = min(delay * 2, MAX_RETRY_S)
                    continue
                first, delay = False, IDLE_POLL_S
                job = next((j for j in reply.jobs if j.job_id == reply.assigned_job), None)
                # The LoRA jobs on the same base, served beside it (echo.node.base_group).
                self.base_jobs = [j for j in reply.jobs if j.job_id in set(reply.base_jobs)]
                if job is not None:
                    self.display.working(job.job_id)
                    self.display.say(
                        f"registered · job [bold]{job.job_id}[/bold] ({job.task.name}) at "
                        f"v{job.current_version}"
                    )
                    return job
                reason = reply.message if not reply.assigned_job else m.JOB_STARTING
                if reason != shown:
                    self.display.idle(reason or "no job for this node yet")
                    shown = reason
                if reason == m.JOB_STARTING and plans is None and self.host.pubsub is not None:
                    plans = await self.subscribe_plans()
                await self._idle(plans if reason == m.JOB_STARTING else None, reply.assigned_job)
        finally:
            if plans is not None:
                # The job's relay subscribes to the same topic (one subscription per host).
                with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                    await plans.aclose()

    async def subscribe_plans(self) -> Subscription:
        """The coordinator's broadcast plans, gossiped: only envelopes it signed are taken, and
        so forwarded (issue 13). Close the subscription when done: a host holds one per topic.

        :raises RuntimeError: the node's host runs without pubsub.
        """
        assert self.host is not None
        only_plans = signed_by(
            self.peer, b.PlanAnnouncement.KIND, b.MAX_PLAN_ENVELOPE_BYTES, self.key
        )
        return await self.host.subscribe(ids.TOPIC_VERSIONS, only_plans)

    async def _idle(self, plans: Subscription | None, job_id: str) -> None:
        """Wait :data:`IDLE_POLL_S`, or, while a job is starting, until the coordinator's first
        plan of a job (version 0: its learner has published it, and the next registration
        places the node) or any plan of ``job_id`` (the job the node was placed on). Nodes that
        only polled found a new job up to :data:`IDLE_POLL_S` late, while the first nodes'
        groups already moved it on: a short job was over before some of them joined. A random
        pause of up to :data:`WAKE_JITTER_S` spreads the registrations of a swarm's standby
        nodes, which all see that plan at once."""
        with trio.move_on_after(IDLE_POLL_S):
            if plans is None:
                await trio.sleep_forever()
            async for _peer, data in plans:
                try:
                    _, ann = signing.open_record(
                        data, b.PlanAnnouncement, expected_signer=self.key,
                        max_bytes=b.MAX_PLAN_ENVELOPE_BYTES,
                    )
                except ProtocolError:
                    continue
                if ann.version == 0 or (job_id and ann.job_id == job_id):
                    await trio.sleep(random.uniform(0.0, WAKE_JITTER_S))
                    return
            await trio.sleep_forever()  # unsubscribed meanwhile: the poll's pace, as before

    async def learner_addrs(self, job_id: str) -> list[str] | None:
        """The current addresses of ``job_id``'s learner, by registering again (a restarted
        learner may listen elsewhere; the pacer keeps these inside the registration budget);
        None when the call fails.

        :raises JobGone: the coordinator no longer lists ``job_id``.
        """
        try:
            reply = await self.register()
        except (RpcError, ProtocolError):
            return None
        for job in reply.jobs:
            if job.job_id == job_id:
                return job.learner_addrs
        raise JobGone(job_id)

    async def _ask_reachability(self) -> DialBackReply | None:
        """The coordinator's dial-back verdict on this node; None if it never answered."""
        assert self.host is not None
        why = ""
        for attempt in range(DIALBACK_TRIES):
            if attempt:
                await trio.sleep(DIALBACK_RETRY_S)
            try:
                with trio.fail_after(DIALBACK_TIMEOUT_S):
                    return await ask_dialback(self.host, self.peer)
            except (RpcError, ProtocolError, trio.TooSlowError) as exc:
                why = str(exc) or type(exc).__name__
        self.display.say(f"[yellow]reachability unknown[/yellow] (no dial-back: {why})")
        return None

    async def keep_relay_slot(self) -> None:
        """While the node runs: if the coordinator cannot dial it, hold a reservation on the
        coordinator's circuit relay so that peers can reach it for control messages. Waits for
        the first registration (the relay admits registered nodes only). Says once what it
        got; a refused reservation ends it (the node works on without one), an unanswered one is
        asked again. Runs until cancelled (the reservation is refreshed meanwhile, see
        :func:`~echo.p2p.nat.circuit.keep_reservation`); raises nothing else."""
        assert self.host is not None and self.registered is not None
        await self.registered.wait()
        reply = self.reachability = await self._ask_reachability()
        async with trio.open_nursery() as nursery:
            if self.volunteers is not None:
                nursery.start_soon(self.volunteers.run, reply)
            await self._keep_coordinator_slot(reply)

    async def _keep_coordinator_slot(self, reply: DialBackReply | None) -> None:
        assert self.host is not None
        if reply is not None and reply.reachable:
            self.display.say(
                f"reachable directly ({reply.verdict}, dialled at {reply.dialed}): "
                "no relay reservation needed"
            )
            return
        where = "behind NAT" if reply is not None and reply.verdict == "nat" else (
            "not reachable" if reply is not None else "reachability unknown"
        )
        delay, said = RESERVE_RETRY_S, False
        while True:
            try:
                async with keep_reservation(self.host, self.addr) as res:
                    self.relay_slot = res
                    self.display.say(
                        f"{where}: relay reservation held on the coordinator "
                        f"({str(res.relay_id)[-8:]}, in {res.reserved_in_s:.2f} s) · reachable "
                        f"for control messages through its relay at {res.circuit_addr}"
                    )
                    await self.announce()
                    await trio.sleep_forever()
            except RelayRefused as exc:
                self.display.say(
                    f"[yellow]{where}: relay reservation refused by the coordinator: "
                    f"{exc.status.name}[/yellow] · peers cannot reach this node through its "
                    "relay; weights still arrive over connections it opens"
                )
                return
            except ValueError as exc:  # the coordinator's address: it connected, so unlikely
                self.display.say(f"[yellow]no relay reservation:[/yellow] {exc}")
                return
            except RpcError as exc:
                if not said:
                    self.display.say(
                        f"[yellow]{where}: no relay reservation yet:[/yellow] {exc}; retrying"
                    )
                    said = True
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)
            finally:
                self.relay_slot = None

"""The node's signed conversation with its coordinator: connect, register, call, report.

:class:`CoordinatorSession` owns the node's link to the coordinator: the coordinator's peer id and
key (leases and broadcast plans must carry its signature), sealing records with the node's
identity, request/response calls with their timeouts, and registration, repeated while no job is
running and again whenever the node needs the job's current learner addresses.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from echo.node.display import Display
from echo.node.errors import NodeError
from echo.p2p.host import EchoHost
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.p2p.rpc import RpcError
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError

RPC_TIMEOUT_S = 30.0
NO_JOB_RETRY_S = 3.0


class CoordinatorSession:
    """The node's session with its coordinator (see the module docstring).

    ``describe`` builds the node's current :class:`~echo.protocol.messages.Register` record;
    :meth:`connect` must succeed before any call.
    """

    def __init__(
        self, identity: Identity, display: Display, describe: Callable[[], m.Register]
    ) -> None:
        self.identity = identity
        self.display = display
        self.describe = describe
        self.host: EchoHost | None = None
        self.peer = None  # the coordinator's peer id
        self.key = b""  # the coordinator's public key: leases and plans must carry its signature

    async def connect(self, host: EchoHost, addr: str) -> None:
        """Dial the coordinator at ``addr`` over ``host``. :raises NodeError: unreachable."""
        self.host = host
        try:
            self.peer = await host.connect(addr)
        except (RpcError, ValueError, OSError) as exc:
            raise NodeError(f"cannot reach the coordinator at {addr}: {exc}") from None
        self.key = public_key_from_peer_id(self.peer)

    async def call(self, proto: str, payload: bytes, *, timeout: float = RPC_TIMEOUT_S) -> bytes:
        """One request to the coordinator; its reply (at most 16 MiB).

        :raises RpcError: the call failed or the coordinator answered with an error.
        """
        assert self.host is not None
        return await self.host.request(
            self.peer, proto, payload, timeout=timeout, max_response=16 << 20
        )

    def seal(self, record: m.Record) -> bytes:
        """``record`` in an envelope of its own kind signed with the node's identity."""
        return signing.seal_record(self.identity.private_key, record)

    async def register(self) -> m.JobInfo:
        """Register (signed) and return the first running job, waiting while there is none.

        :raises NodeError: the coordinator refused the registration.
        """
        while True:
            try:
                sealed = self.seal(self.describe())
                data = await self.call(ids.PROTO_REGISTER, sealed)
            except RpcError as exc:
                raise NodeError(f"registration refused: {exc}") from None
            reply = m.decode(m.RegisterReply, data)
            if reply.jobs:
                job = reply.jobs[0]
                self.display.say(
                    f"registered · job [bold]{job.job_id}[/bold] ({job.task.name}) at "
                    f"v{job.current_version}"
                )
                return job
            self.display.say("registered · no running job yet, waiting")
            await trio.sleep(NO_JOB_RETRY_S)

    async def learner_addrs(self, job_id: str) -> list[str] | None:
        """The current addresses of ``job_id``'s learner, by registering again (a restarted
        learner may listen elsewhere); None when the call fails or the job is not listed."""
        try:
            reply = m.decode(m.RegisterReply, await self.call(
                ids.PROTO_REGISTER, self.seal(self.describe())))
        except (RpcError, ProtocolError):
            return None
        for job in reply.jobs:
            if job.job_id == job_id:
                return job.learner_addrs
        return None

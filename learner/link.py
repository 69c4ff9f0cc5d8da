"""The learner's signed conversation with its coordinator, under its learner epoch.

:class:`CoordinatorLink` owns what the learner says to the coordinator and how: the
coordinator's peer, sealing every request with the learner's identity and the learner epoch the
coordinator issued this process, the timeouts and reply limits of the calls (hello, a batch of
groups, a step report), and telling a refused epoch (:class:`Superseded`) from a failed call. A
report a previous life of the learner checkpointed under an older epoch is re-signed here with
this process's epoch (:meth:`CoordinatorLink.for_this_epoch`).
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

import trio

from echo.p2p.host import EchoHost
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.p2p.rpc import RemoteError, RpcConnectionError, RpcTimeout
from echo.protocol import ids, limits, signing
from echo.protocol import messages as m

log = logging.getLogger(__name__)

RPC_TIMEOUT = 30.0
# How long the learner keeps dialling a coordinator that refuses or drops its handshake, and its
# pauses between dials (doubling). A coordinator whose loop lags refuses handshakes from capped
# networks for a shedding hold (up to 80 s, echo.p2p.shedding) and then readmits them at one a
# second; an external learner's network is capped, and so was the local one's in
# benchmarks/attack.py (``loopback_is_network``). Dialling once, the learner exited and was
# restarted, each life building the model again: at load 6-12, of three runs in a row one lost
# a life and two never attached (3 lives each, refused each time, in about 2 minutes).
CONNECT_PATIENCE_S = 180.0
CONNECT_PAUSE_S = (0.5, 8.0)

R = TypeVar("R", bound=m.Record)


class Superseded(RuntimeError):
    """The coordinator refused this learner's epoch: a newer learner of the job was started
    or handed the job (or the epoch was never issued). Nothing this learner sends is booked
    any more, so it stops."""


class CoordinatorLink:
    """The learner's calls to its coordinator; :meth:`connect` before the first."""

    def __init__(self, identity: Identity, job_id: str, epoch: int) -> None:
        """``epoch`` is the learner epoch the coordinator issued this process (0 for a job that
        never issued one); it rides on every request."""
        self.identity = identity
        self.job_id = job_id
        self.epoch = epoch
        self.host: EchoHost | None = None
        self.peer = None

    async def connect(
        self, host: EchoHost, coordinator: str, patience_s: float = CONNECT_PATIENCE_S
    ) -> None:
        """Dial the coordinator at multiaddr ``coordinator`` from ``host``, again while it
        refuses or drops the handshake, for up to ``patience_s``.

        :raises RpcConnectionError, RpcTimeout: still refused after ``patience_s``.
        :raises ValueError: ``coordinator`` is not a dialable multiaddr.
        """
        self.host = host
        give_up_at = trio.current_time() + patience_s
        pause, longest = CONNECT_PAUSE_S
        while True:
            try:
                self.peer = await host.connect(coordinator)
                return
            except (RpcConnectionError, RpcTimeout) as exc:
                if trio.current_time() + pause > give_up_at:
                    raise
                log.info(
                    "the coordinator did not take our connection (%s); again in %.1f s", exc, pause
                )
            await trio.sleep(pause)
            # libp2p would refuse to dial it for 60 s after a failed dial: we pace ours.
            host.forget_dial_failures(coordinator.rsplit("/p2p/", 1)[-1])
            pause = min(2 * pause, longest)

    @property
    def coordinator_key(self) -> bytes:
        """The coordinator's public key (its broadcast plans carry its signature)."""
        return public_key_from_peer_id(self.peer)

    async def call(self, proto: str, record: m.Record, reply_cls: type[R]) -> R:
        """``record``, signed, to the coordinator; its reply as a ``reply_cls``, decoded in a worker
        thread (a batch's ids are lists, up to 32 MiB: the loop keeps serving chunks). :raises
        RpcError: the call failed. :raises ProtocolError: the reply does not decode."""
        sealed = signing.seal_record(self.identity.private_key, record)
        cap = limits.MAX_BATCH_REPLY_BYTES
        data = await self._request(proto, sealed, cap)
        return await trio.to_thread.run_sync(lambda: m.decode(reply_cls, data, max_bytes=cap))

    async def _request(self, proto: str, sealed: bytes, max_response: int) -> bytes:
        """One request to the coordinator. :raises Superseded: it refused our learner epoch.
        :raises RpcError: the call failed otherwise."""
        assert self.host is not None
        try:
            return await self.host.request(
                self.peer, proto, sealed, timeout=RPC_TIMEOUT, max_response=max_response
            )
        except RemoteError as exc:
            if exc.message.startswith(f"{m.LEARNER_EPOCH_REFUSED}:"):
                raise Superseded(f"the coordinator refused this learner: {exc.message}") from None
            raise

    async def hello(self) -> m.LearnerHelloReply:
        """Attach to the job: where the learner listens, and where the coordinator's ledger is."""
        assert self.host is not None
        return await self.call(
            ids.PROTO_LEARNER_HELLO,
            m.LearnerHello(
                job_id=self.job_id,
                peer_id=str(self.host.peer_id),
                addrs=self.host.listen_multiaddrs,
                timestamp=time.time(),
                epoch=self.epoch,
            ),
            m.LearnerHelloReply,
        )

    async def take_groups(self, want: int, min_version: int) -> m.BatchReply:
        """Up to ``want`` groups of versions ``min_version`` or newer from the coordinator's
        buffer (one reply: ``more`` says the reply's size budget cut it short)."""
        return await self.call(
            ids.PROTO_LEARNER_BATCH,
            m.BatchRequest(
                job_id=self.job_id,
                max_groups=want,
                min_version=min_version,
                timestamp=time.time(),
                epoch=self.epoch,
            ),
            m.BatchReply,
        )

    async def send_report(self, sealed: bytes, version: int) -> bytes:
        """Send the signed report of ``version``; returns the coordinator's signed broadcast plan
        for it (empty when it made none). :raises RuntimeError: the coordinator refused it."""
        data = await self._request(ids.PROTO_LEARNER_REPORT, sealed, 1 << 16)
        ack = m.decode(m.StepAck, data, max_bytes=8 << 20)
        if not ack.ok:
            raise RuntimeError(f"coordinator refused version {version}: {ack.message}")
        return ack.plan

    def for_this_epoch(self, sealed: bytes) -> bytes:
        """``sealed`` (a StepReport this learner signed, perhaps in an earlier life under an
        older epoch: a report checkpointed but never booked) re-signed with this process's
        epoch; unchanged when it carries it already. :raises ProtocolError: not such a report."""
        _, report = signing.open_record(
            sealed, m.StepReport, expected_signer=self.identity.public_key_bytes
        )
        if report.epoch == self.epoch:
            return sealed
        return signing.seal_record(
            self.identity.private_key, report.model_copy(update={"epoch": self.epoch})
        )

"""The learner as the source of its versions in the swarm.

:class:`VersionSource` owns the learner's side of dissemination: its libp2p host's listen
address (the previous run's port when it is still free, so nodes fetching from a learner that
crashed find it again), serving chunks from its chunk store on the budgets of its
:class:`~echo.p2p.budget.Audience` (nodes in a recent plan and nodes whose groups it trained on;
everyone else shares a small bucket), pushing each new version down the coordinator's broadcast
plan through its relay, counting the bytes it sent, and serving the final version until nodes
stop asking. What it serves is written by the :class:`~echo.learner.publish.Publisher`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from echo.p2p.budget import STRANGER_BYTES_PER_S, Audience, stranger_bps
from echo.p2p.chunkstore import ChunkStore, serve_chunks
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.relay import Relay, RelayConfig, open_relay
from echo.protocol.errors import ProtocolError

log = logging.getLogger("echo.learner")

# After the last step the learner is the only holder some nodes can fetch the final version from:
# it keeps serving until no chunk has been asked for in FINAL_IDLE_S (a node mid-generation asks
# after its current groups), and never longer than FINAL_SERVE_MAX_S.
FINAL_IDLE_S = 10.0
FINAL_SERVE_MAX_S = 90.0


class VersionSource:
    """Serves one job's versions from ``chunks``: :meth:`open_host`, then :meth:`open_relay`."""

    def __init__(
        self,
        job_dir: Path,
        job_id: str,
        chunks: ChunkStore,
        learner_key: bytes,
        upload_limit_bps: float | None,
    ) -> None:
        """``learner_key`` is the public key that signs the job's manifests (the relay checks
        plans and chunks against it); ``upload_limit_bps`` caps the pushes to relay children."""
        self.job_dir = job_dir
        self.job_id = job_id
        self.chunks = chunks
        self.learner_key = learner_key
        self.upload_limit_bps = upload_limit_bps
        # Whom we serve chunks to on their own budgets: planned nodes and those whose groups we
        # trained on; everyone else shares a small bucket (issue 26, finding 7).
        self.audience = Audience(stranger_bps(upload_limit_bps, STRANGER_BYTES_PER_S))
        self.relay: Relay | None = None
        self.served_bytes = 0  # chunk bytes nodes pulled from us

    @asynccontextmanager
    async def open_host(self, identity: Identity, coordinator: str) -> AsyncIterator[EchoHost]:
        """The learner's host, listening on the interface ``coordinator`` (a multiaddr) is
        reached on and serving chunks; its port is remembered for the next run."""
        async with open_host(identity, [self._listen_addr(coordinator)]) as host:
            self._remember_port(host)
            serve_chunks(host, self.chunks, on_served=self._count_served, audience=self.audience)
            yield host

    @asynccontextmanager
    async def open_relay(self, host: EchoHost) -> AsyncIterator[Relay]:
        """The relay that pushes versions to the learner's children in a plan (nodes pull from
        :meth:`open_host`'s chunk service, not from it)."""
        async with open_relay(
            host,
            self.chunks,
            learner_keys={self.job_id: self.learner_key},
            config=RelayConfig(upload_limit_bps=self.upload_limit_bps),
            serve_pulls=False,
        ) as relay:
            self.relay = relay
            yield relay

    def _listen_addr(self, coordinator: str) -> str:
        """The port of the previous run if there was one: nodes fetching chunks from us when we
        crashed find us again at the same address (they also re-ask the coordinator)."""
        ip = coordinator.split("/")[2]  # the interface the coordinator is reached on
        try:
            port = int((self.job_dir / "learner.port").read_text())
            with socket.socket() as probe:  # still free? (another process may have taken it)
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((ip, port))
        except (OSError, ValueError):
            port = 0
        return f"/ip4/{ip}/tcp/{port}"

    def _remember_port(self, host: EchoHost) -> None:
        port = host.listen_multiaddrs[0].split("/tcp/")[1].split("/")[0]
        (self.job_dir / "learner.port").write_text(port)

    def _count_served(self, n: int) -> None:
        self.served_bytes += n

    def bytes_sent(self) -> int:
        """Chunk bytes this learner has sent, pushed and pulled, since it started."""
        return self.served_bytes + (self.relay.pushed_out_total if self.relay else 0)

    def proven(self, node_ids: Iterable[str]) -> None:
        """Nodes whose groups the learner accepted: they pull from us on their own budgets."""
        for node_id in node_ids:
            self.audience.proven(node_id)

    async def broadcast(self, sealed_plan: bytes, coordinator_key: bytes, version: int) -> None:
        """Push ``version`` to our children in the coordinator's plan; nodes the push does not
        reach pull from us instead, so a bad plan only costs time."""
        assert self.relay is not None
        try:
            ann = await self.relay.join_plan(sealed_plan, coordinator_key, self.job_id)
        except ProtocolError as exc:
            log.warning("cannot push v%d down the plan: %s", version, exc)
            return
        if ann is not None:  # the plan's nodes may pull from us on their own budgets
            self.audience.planned(ann.version, (p.peer_id for p in ann.peers))

    async def serve_final(self, version: int) -> None:
        """Serve the final ``version`` until no chunk has been asked for in :data:`FINAL_IDLE_S`
        (at most :data:`FINAL_SERVE_MAX_S`)."""
        start = time.monotonic()
        log.info("serving the final version v%d until nodes stop asking", version)
        if self.relay is not None:  # first let the push down the tree finish
            await self.relay.wait_forwarded(self.job_id, version, FINAL_SERVE_MAX_S / 3)
        self.chunks.last_read = max(self.chunks.last_read, time.monotonic())
        while time.monotonic() - self.chunks.last_read < FINAL_IDLE_S:
            if time.monotonic() - start > FINAL_SERVE_MAX_S:
                log.info("served the final version for %.0f s; exiting", FINAL_SERVE_MAX_S)
                return
            await trio.sleep(1.0)
        log.info("no chunk requests for %.0f s; exiting", FINAL_IDLE_S)

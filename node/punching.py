"""The node's side of a coordinated hole punch: answer the coordinator's go signal.

The coordinator (connected to both) sends each of two nodes that no dial-back reached a
:class:`~echo.protocol.nat.PunchRequest` at the same moment; :class:`Punches` answers it
by opening the direct connection -- :func:`echo.p2p.nat.holepunch.punch` across two routers, a plain
dial of the peer's LAN addresses behind one -- and replies with a
:class:`~echo.protocol.nat.PunchReply` once the connection is up or the attempt is over.
The coordinator plans the pair's edge only after both sides said ok; the connection is what the
relay then pushes over (its parents and children behind NAT are announced without addresses).

Owns: the handler of :data:`~echo.protocol.nat.PROTO_PUNCH` on the node's host and the
set of peers it has a punched connection to (:attr:`Punches.peers`). The connection itself
belongs to the host (closed with it). A request from anyone but the coordinator is refused (a
go signal makes the node dial: a stranger must not be able to aim it); failures of the punch
are answered ``ok=False``, never raised into the host.
"""

from __future__ import annotations

import logging
import time

import trio
from libp2p.peer.id import ID

from echo.p2p.host import EchoHost
from echo.p2p.nat.circuit import dial_direct, has_direct_connection
from echo.p2p.nat.holepunch import HolePunchFailed, is_initiator, punch
from echo.p2p.rpc import RpcError
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.errors import ProtocolError
from echo.protocol.nat import (
    MAX_PUNCH_DELAY_S,
    MAX_PUNCH_TIMEOUT_S,
    PROTO_PUNCH,
    PunchReply,
    PunchRequest,
)

log = logging.getLogger("echo.node.punching")

_REQUEST_MAX = 4096
_REPLY_MAX = 1024
# How often the "lan" responder looks for the initiator's connection: a fraction of a LAN dial.
_LAN_POLL_S = 0.05


class Punches:
    """Answers punch requests from ``coordinator`` on ``host`` (see the module docstring)."""

    def __init__(self, host: EchoHost, coordinator: ID) -> None:
        self.host = host
        self.coordinator = coordinator
        # Peers a punch (or a LAN dial) connected us to, with how: the relay's pushes to and
        # from them go over that connection.
        self.peers: dict[str, str] = {}

    def serve(self) -> None:
        """Register the handler on the host (replaces an earlier one: one coordinator)."""
        self.host.set_handler(
            PROTO_PUNCH,
            self._handle,
            max_request=_REQUEST_MAX,
            max_response=_REPLY_MAX,
            # The request is answered when the punch is over: its delay plus its timeout.
            handler_timeout=MAX_PUNCH_DELAY_S + MAX_PUNCH_TIMEOUT_S + 5.0,
        )

    async def _handle(self, peer_id: ID, data: bytes) -> bytes:
        if peer_id != self.coordinator:
            raise ProtocolError(
                "only this node's coordinator may ask it to punch", code=R.WRONG_SIGNER
            )
        req = m.decode(PunchRequest, data)
        return m.encode(await self.run(req))

    async def run(self, req: PunchRequest) -> PunchReply:
        """Open the connection ``req`` asks for and say how it went; never raises (but
        cancellation). On success the peer is remembered in :attr:`peers`."""
        t0 = time.time()
        start_at = t0 + req.start_in_s
        try:
            if req.method == "punch":
                got = await punch(
                    self.host, req.peer_id, req.peer_addrs[0], start_at=start_at,
                    timeout=req.timeout_s,
                )
                via, elapsed = got.via, got.elapsed_s
            else:
                await self._lan(req, start_at)
                via, elapsed = "lan", time.time() - start_at
        except (HolePunchFailed, RpcError, ValueError) as exc:
            log.info("punch to %s (%s) failed: %s", req.peer_id[-8:], req.method, exc)
            return PunchReply(ok=False, detail=str(exc)[:250])
        self.peers[req.peer_id] = via
        log.info("direct path to %s (%s via %s) in %.2f s", req.peer_id[-8:], req.method, via,
                 elapsed)
        return PunchReply(ok=True, via=via, elapsed_s=max(0.0, elapsed))

    async def _lan(self, req: PunchRequest, start_at: float) -> None:
        """Behind one router: the initiator dials the peer's LAN addresses; the other waits
        for that connection. :raises HolePunchFailed: nothing connected within the timeout."""
        with trio.move_on_after(max(0.0, start_at - time.time()) + req.timeout_s):
            await trio.sleep(max(0.0, start_at - time.time()))
            if is_initiator(self.host.peer_id, req.peer_id):
                errors = []
                for addr in req.peer_addrs:
                    try:
                        # A relayed connection to the peer may be up: not the LAN path.
                        if str(await dial_direct(self.host, addr, timeout=req.timeout_s)) != (
                            req.peer_id
                        ):
                            raise ValueError(f"{addr} is not {req.peer_id}")
                        return
                    except (RpcError, ValueError) as exc:
                        errors.append(str(exc)[:80])
                raise HolePunchFailed(f"no LAN address of {req.peer_id[-8:]} answered: {errors}")
            while not has_direct_connection(self.host, req.peer_id):
                await trio.sleep(_LAN_POLL_S)
            return
        raise HolePunchFailed(f"no LAN connection with {req.peer_id[-8:]} in {req.timeout_s:g} s")


__all__ = ["Punches"]

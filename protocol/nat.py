"""Dial-back messages (the AutoNAT idea): "can you dial me?" and the answer; and the
coordinator's go signal for a hole punch between two nodes behind NAT.

A node (or ``echo-node doctor``) sends :class:`DialBackRequest` with the addresses it listens on
to a dialable peer (the coordinator); that peer dials them back from a host of its own, on a
fresh connection, and answers :class:`DialBackReply`. Neither record is signed: the request
changes nothing but the asker's own knowledge, and the answer is only as good as the peer asked
(the coordinator's verdict for the planner is the one it measured itself).

:class:`PunchRequest` goes the other way: the coordinator (connected to both) asks each of two
nodes that no dial-back reached to open a direct connection to the other at the same moment
(:mod:`echo.p2p.nat.holepunch`, or a plain dial on their shared LAN), and each answers with a
:class:`PunchReply` once it has a connection or gave up. A node takes it only from its own
coordinator (the Noise-authenticated peer): a go signal makes it dial, so a stranger must not be
able to send one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from echo.protocol.messages import Record, ShortStr

PROTO_DIALBACK = "/echo/dialback/1.0.0"  # anyone -> a dialable peer: dial me back
MAX_DIALBACK_ADDRS = 8
PROTO_PUNCH = "/echo/punch/1.0.0"  # coordinator -> a node behind NAT: connect to this peer now
MAX_PUNCH_ADDRS = 8
# A punch waits at most this long after its start (holepunch.PUNCH_TIMEOUT_S is 10 s); longer
# asks would pin a node's listen port and the coordinator's task for nothing.
MAX_PUNCH_TIMEOUT_S = 30.0
MAX_PUNCH_DELAY_S = 10.0

# What the dialling peer concluded:
# - "public": an advertised address was dialled and answered with the asker's key;
# - "forwarded": the asker's observed address with an advertised port answered (a port forward);
# - "nat": no advertised address is on the address the asker was seen from (behind NAT);
# - "unreachable": addresses on the observed IP, but no dial answered (a firewall);
# - "unknown": the peer could not tell (no observed address).
Verdict = Literal["public", "forwarded", "nat", "unreachable", "unknown"]


class DialBackRequest(Record):
    addrs: list[ShortStr] = Field(default_factory=list, max_length=MAX_DIALBACK_ADDRS)


class DialBackReply(Record):
    verdict: Verdict
    reachable: bool
    observed_ip: ShortStr = ""  # where the asker's request came from
    dialed: ShortStr = ""  # the address that answered, when reachable
    detail: ShortStr = ""


# How the two nodes get their direct connection:
# - "punch": TCP simultaneous open to the peer's public address (its router's WAN ip and the
#   port it listens on), both ``start_in_s`` after the request arrives (echo.p2p.nat.holepunch);
# - "lan": both are behind one router (the coordinator saw them on the same public ip), so the
#   one holepunch.is_initiator picks dials the other's advertised (LAN) addresses and the other
#   waits for that connection.
PunchMethod = Literal["punch", "lan"]


class PunchRequest(Record):
    peer_id: Annotated[str, Field(min_length=1, max_length=128)]
    method: PunchMethod
    peer_addrs: list[ShortStr] = Field(min_length=1, max_length=MAX_PUNCH_ADDRS)
    # Seconds from receipt until the node starts. Relative, not a wall-clock time: volunteers'
    # clocks may be off by more than the punch tolerates, while both requests leave the
    # coordinator together and arrive within a few round trips of each other.
    start_in_s: float = Field(ge=0, le=MAX_PUNCH_DELAY_S, allow_inf_nan=False)
    timeout_s: float = Field(gt=0, le=MAX_PUNCH_TIMEOUT_S, allow_inf_nan=False)


class PunchReply(Record):
    ok: bool  # a direct connection to the peer is up (and the node keeps it)
    via: ShortStr = ""  # holepunch.Punched.via, or "lan"
    elapsed_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    detail: ShortStr = ""

"""Dial-back messages (the AutoNAT idea): "can you dial me?" and the answer.

A node (or ``echo-node doctor``) sends :class:`DialBackRequest` with the addresses it listens on
to a dialable peer (the coordinator); that peer dials them back from a host of its own, on a
fresh connection, and answers :class:`DialBackReply`. Neither record is signed: the request
changes nothing but the asker's own knowledge, and the answer is only as good as the peer asked
(the coordinator's verdict for the planner is the one it measured itself).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from echo.protocol.messages import Record, ShortStr

PROTO_DIALBACK = "/echo/dialback/1.0.0"  # anyone -> a dialable peer: dial me back
MAX_DIALBACK_ADDRS = 8

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

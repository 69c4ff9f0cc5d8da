"""WideRate: a /16 (IPv6 /32) without a protected peer gets a handshake rate of its own.

A churn of identities that moves on to the next /24 of its /16 got each /24's full allowance
(``benchmarks/attack.py``'s churner, over 127.1.0.0/16). Live tests bind loopback sources:
127.0.0.0/16 and 127.1.0.0/16 are two wide networks, each loopback address its own /32 prefix.
"""

from __future__ import annotations

import pytest
from libp2p.network.exceptions import SwarmException

from echo.p2p.conn_guard import ConnectionGuard, GuardPolicy
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.prefixes import wide_of
from echo.p2p.wide_rate import WIDE_BURST, WIDE_REFILL_S, WideRate
from tests.conftest import Clock
from tests.p2p.test_conn_guard import dial_from, inbound_from, run


def test_wide_of() -> None:
    assert wide_of("5.6.7.8") == "5.6.0.0/16"
    assert wide_of("::ffff:5.6.7.8") == "5.6.0.0/16"
    assert wide_of("2001:db8:1:2::1") == "2001:db8::/32"
    assert wide_of("not an ip") is None
    with pytest.raises(ValueError):
        WideRate(burst=0)


def test_fresh_24s_of_one_16_share_its_rate() -> None:
    """Each /24 of 5.6.0.0/16 has its own allowance under the per-/24 rate; the /16 has
    WIDE_BURST at once and one more per WIDE_REFILL_S / WIDE_BURST; another /16 is not
    affected."""
    clock = Clock()
    guard = ConnectionGuard(GuardPolicy(), connection_cap=1000, clock=clock)

    def handshake(ip: str) -> bool:
        ok = guard._reserve((ip, 1))
        guard._pending.pop((ip, 1), None)  # the churned identity is gone at once
        return ok

    got = [handshake(f"5.6.{n}.1") for n in range(WIDE_BURST + 4)]
    assert got == [True] * WIDE_BURST + [False] * 4
    assert guard.wide.refused == 4
    assert handshake("9.9.0.1")  # another /16
    assert all(handshake(f"10.1.{n}.1") for n in range(WIDE_BURST + 4))  # private: a lab
    clock.t += WIDE_REFILL_S / WIDE_BURST
    assert handshake("5.6.200.1") and not handshake("5.6.201.1")


def test_a_16_with_a_protected_peer_is_not_slowed() -> None:
    """A protected peer connected from 127.0.0.1 vouches for 127.0.0.0/16: strangers from
    there connect past the wide burst; strangers from 127.1.0.0/16 get the burst, then are
    refused before their handshake."""

    async def body() -> None:
        policy = GuardPolicy(loopback_cap=4)  # each loopback address its own capped prefix
        async with open_host(Identity.generate(), pubsub=False, guard_policy=policy) as server:
            server.guard.wide = WideRate(burst=2, refill_s=1000.0)
            async with open_host(Identity.generate(), pubsub=False) as worker:
                await dial_from("127.0.0.1", worker, server)
                server.guard.protect(worker.peer_id)
                for i in range(4):  # past the burst of 2, all from the vouched /16
                    async with open_host(Identity.generate(), pubsub=False) as s:
                        await dial_from(f"127.0.0.{10 + i}", s, server)
                        assert inbound_from(server, s.peer_id)
                for i in range(3):
                    async with open_host(Identity.generate(), pubsub=False) as s:
                        if i < 2:
                            await dial_from(f"127.1.0.{10 + i}", s, server)
                            assert inbound_from(server, s.peer_id)
                        else:
                            with pytest.raises(SwarmException):  # its handshake failed
                                await dial_from(f"127.1.0.{10 + i}", s, server)
                            assert not inbound_from(server, s.peer_id)
                assert server.guard.wide.refused == 1

    run(body)

"""Gossipsub through EchoHost: delivery of a quick burst, size limits, validators."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
from libp2p.peer.id import ID

from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.pubsub import INVALID_BEFORE_BLACKLIST, MAX_PUBSUB_MESSAGE_BYTES

TOPIC = "echo/test/announce"
TEST_DEADLINE = 30.0


def run_pair(body: Callable[[EchoHost, EchoHost], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b:
                await a.connect(b.listen_multiaddrs[0], timeout=5)
                await body(a, b)

    trio.run(main)


async def collect(sub, n: int, timeout: float) -> list[tuple[ID, bytes]]:
    got: list[tuple[ID, bytes]] = []
    with trio.move_on_after(timeout):
        async for item in sub:
            got.append(item)
            if len(got) == n:
                break
    return got


def test_burst_of_20_all_arrive() -> None:
    async def body(a: EchoHost, b: EchoHost) -> None:
        sub = await b.subscribe(TOPIC)
        # Mesh / fanout formation: wait (bounded) until A knows B subscribes.
        await a.wait_for_subscribers(TOPIC, 1, timeout=10)
        sent = [b"msg-%d" % i for i in range(20)]
        for m in sent:
            await a.publish(TOPIC, m)
        got = await collect(sub, 20, timeout=10)
        assert [d for _, d in got] == sent
        assert {p for p, _ in got} == {a.peer_id}
        assert sub.dropped == 0
        await sub.aclose()

    run_pair(body)


def test_size_limit_and_validator() -> None:
    async def body(a: EchoHost, b: EchoHost) -> None:
        with pytest.raises(ValueError):
            await a.publish(TOPIC, bytes(MAX_PUBSUB_MESSAGE_BYTES + 1))
        sub = await b.subscribe(TOPIC, validator=lambda peer, data: not data.startswith(b"bad"))
        await a.wait_for_subscribers(TOPIC, 1, timeout=10)
        for m in (b"bad-1", b"good-1", b"bad-2", b"good-2"):
            await a.publish(TOPIC, m)
        got = await collect(sub, 2, timeout=10)
        assert [d for _, d in got] == [b"good-1", b"good-2"]

    run_pair(body)


def test_pubsub_disabled_and_misuse() -> None:
    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            async with open_host(Identity.generate(), pubsub=False) as a:
                with pytest.raises(RuntimeError):
                    await a.publish(TOPIC, b"x")
            async with open_host(Identity.generate()) as b:
                sub = await b.subscribe(TOPIC)
                with pytest.raises(ValueError):
                    await b.subscribe(TOPIC)
                await sub.aclose()
                await (await b.subscribe(TOPIC)).aclose()  # free again after aclose
                late = await b.subscribe("echo/test/other")
            # After the host closed: the subscription ends, the host refuses new work.
            with pytest.raises(trio.EndOfChannel):
                await late.receive()
            await late.aclose()
            with pytest.raises(RuntimeError):
                await b.publish(TOPIC, b"x")

    trio.run(main)


def test_junk_forwarder_is_shut_out() -> None:
    """A peer whose messages the validator keeps refusing is blacklisted: its streams are reset
    and what it publishes later is never validated again; the honest publisher still gets
    through."""

    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            async with (
                open_host(Identity.generate()) as good,
                open_host(Identity.generate()) as spam,
                open_host(Identity.generate()) as b,
            ):
                await good.connect(b.listen_multiaddrs[0], timeout=5)
                await spam.connect(b.listen_multiaddrs[0], timeout=5)
                service = b.pubsub
                assert service is not None
                sub = await b.subscribe(TOPIC, validator=lambda origin, _: origin == good.peer_id)
                await good.wait_for_subscribers(TOPIC, 1, timeout=10)
                await spam.wait_for_subscribers(TOPIC, 1, timeout=10)
                for i in range(INVALID_BEFORE_BLACKLIST + 5):
                    await spam.publish(TOPIC, b"junk-%d" % i)
                with trio.fail_after(10):
                    while not service.pubsub.is_peer_blacklisted(spam.peer_id):
                        await trio.sleep(0.05)
                assert service.blacklisted == 1
                refused_before = service._refused.get(spam.peer_id)
                for i in range(10):
                    await spam.publish(TOPIC, b"more-junk-%d" % i)
                await good.publish(TOPIC, b"news")
                got = await collect(sub, 1, timeout=10)
                assert [d for _, d in got] == [b"news"]
                await trio.sleep(0.5)
                # Nothing the spammer sent after the blacklist reached the validator.
                assert service._refused.get(spam.peer_id) == refused_before
                assert not service.pubsub.is_peer_blacklisted(good.peer_id)
                await sub.aclose()

    trio.run(main)

#!/usr/bin/env python3
"""py-libp2p 0.8.1's QUIC transport against TCP + Noise + yamux, on loopback: throughput and
whether long transfers arrive whole (DESIGN.md: an older py-libp2p's QUIC lost trailing bytes).

Two hosts per transport in one process; one stream per transfer: the sender writes ``--mb`` MB
of a seeded pattern in 64 KiB writes and closes its side, the receiver reads to EOF and answers
with the byte count and SHA-256 of what it got, which the sender compares with what it sent.
Transports: ``quic`` (``new_host(enable_quic=True)`` on ``/udp/0/quic-v1``), ``tcp`` (py-libp2p's
own TCP + Noise + yamux: the baseline, same code path) and ``echo-tcp`` (our host:
``echo.p2p.host.open_host``, TCP + Noise + our yamux variant, what the swarm runs).

Prints one line per transfer, then one JSON object: per transport MB/s (median of ``--repeat``)
and whether every transfer arrived whole, and ``quic_vs_tcp`` (QUIC's MB/s over the baseline's).

Run: ``.venv/bin/python benchmarks/quic.py [--quick] [--mb 64] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio
from libp2p import new_host
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

PROTO = TProtocol("/echo-bench/quic/1")
WRITE = 64 * 1024
# Per transfer: generous (QUIC moved well under 1 MB/s here), scaled with the size.
TIMEOUT_S_PER_MB = 10.0


def pattern(n: int, seed: int = 7) -> bytes:
    """``n`` bytes that differ along the stream (a lost or reordered block changes the hash)."""
    block = hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(block[:32] + i.to_bytes(8, "big")).digest() + block[32:]
        i += 1
    return bytes(out[:n])


@asynccontextmanager
async def plain_pair(listen: str, quic: bool) -> AsyncIterator[tuple]:
    a = new_host(key_pair=create_new_key_pair(), enable_quic=quic)
    b = new_host(key_pair=create_new_key_pair(), enable_quic=quic)
    async with a.run(listen_addrs=[Multiaddr(listen)]), b.run(listen_addrs=[Multiaddr(listen)]):
        yield a, b


@asynccontextmanager
async def echo_pair() -> AsyncIterator[tuple]:
    from echo.p2p.host import open_host
    from echo.p2p.identity import Identity

    async with (
        open_host(Identity.generate(), pubsub=False) as a,
        open_host(Identity.generate(), pubsub=False) as b,
    ):
        yield a.libp2p, b.libp2p


async def transfer(pair: Callable, data: bytes) -> tuple[float, bool, str]:
    """(seconds, whole, detail) of one transfer of ``data`` from a to b."""
    want = (len(data), hashlib.sha256(data).hexdigest())
    async with pair() as (a, b):

        async def handle(stream) -> None:  # type: ignore[no-untyped-def]
            h, n = hashlib.sha256(), 0
            while True:
                try:
                    chunk = await stream.read(WRITE)
                except Exception as exc:  # noqa: BLE001 (EOF is an exception on some muxers)
                    if type(exc).__name__ != "StreamEOF":
                        print(f"receiver: read ended with {exc!r}", file=sys.stderr)
                    break
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
            await stream.write(f"{n} {h.hexdigest()}".encode())
            await stream.close()

        b.set_stream_handler(PROTO, handle)
        addr = [x for x in b.get_addrs()][0]
        with trio.fail_after(60 + TIMEOUT_S_PER_MB * len(data) / 1e6):
            await a.connect(info_from_p2p_addr(addr))
            s = await a.new_stream(b.get_id(), [PROTO])
            t0 = time.perf_counter()
            for i in range(0, len(data), WRITE):
                await s.write(data[i : i + WRITE])
            # A half-close: QUIC's close() ends both directions (we still read the answer).
            await s.close_write()
            reply = b""
            while True:
                try:
                    chunk = await s.read(1024)
                except Exception:  # noqa: BLE001 (EOF as an error on some muxers)
                    break
                if not chunk:
                    break
                reply += chunk
            dt = time.perf_counter() - t0
    got = reply.decode(errors="replace").split()
    whole = len(got) == 2 and (int(got[0]), got[1]) == want
    return dt, whole, f"received {got[0] if got else '?'} of {len(data)} bytes"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 MB, 2 repeats")
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    mb, repeat = (16.0, 2) if args.quick else (args.mb, args.repeat)
    data = pattern(int(mb * 1e6))
    pairs = {
        "tcp": lambda: plain_pair("/ip4/127.0.0.1/tcp/0", quic=False),
        "quic": lambda: plain_pair("/ip4/127.0.0.1/udp/0/quic-v1", quic=True),
        "echo-tcp": echo_pair,
    }
    result: dict = {"mb": mb, "repeat": repeat}
    for name, pair in pairs.items():
        rates, whole, errors = [], True, []
        for i in range(repeat):
            try:
                dt, ok, detail = trio.run(transfer, pair, data)
            except Exception as exc:  # noqa: BLE001 (reported: a transport that fails)
                while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                    exc = exc.exceptions[0]
                ok, dt, detail = False, float("nan"), f"{type(exc).__name__}: {exc}"[:200]
            rates.append(mb / dt if ok else 0.0)
            whole &= ok
            if not ok:
                errors.append(detail)
            print(f"{name} #{i}: {mb:g} MB in {dt:.2f} s, {'whole' if ok else detail}",
                  file=sys.stderr)
        result[name] = {"mb_per_s": round(statistics.median(rates), 1), "whole": whole,
                        "errors": errors[:2]}
    base = result["tcp"]["mb_per_s"]
    result["quic_vs_tcp"] = round(result["quic"]["mb_per_s"] / base, 2) if base else None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Does py-libp2p 0.8.1's DCUtR hold up against the emulated home routers? (issue 32)

Builds an internet with :mod:`netem_nat`: a public relay ``r``, a public peer ``a``, ``e1`` and
``e2`` behind two endpoint-independent routers, ``s`` behind a symmetric one. Every host runs
an agent (``--agent``) that listens on port 4001, answers DCUtR
(:func:`echo.p2p.nat.dcutr.serve_dcutr`) and, behind NAT, keeps a reservation on ``r``. Then for
each pair the dialler reaches the target through its circuit address and runs one DCUtR exchange
(:func:`echo.p2p.nat.dcutr.upgrade`), ``--trials`` times (the connections are closed between
trials):

- ``a -> e1``: a public peer asks a NAT'd one to dial back (connection reversal);
- ``e1 -> e2``: both behind eim routers: the crossing dials are a TCP hole punch;
- ``e1 -> s``, ``s -> e1``: a symmetric router on one side (expected to fail).

Prints one line per trial and a JSON object: per pair, successes out of trials and the median
seconds of the successful exchanges. Needs root, iproute2 and iptables.

Run: ``sudo .venv/bin/python -m echo.tools.dcutr_netns [--trials 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import echo.tools.netem_nat as netem_nat

PORT = 4001
PREFIX = "ecd"
PAIRS = [("a", "e1"), ("e1", "e2"), ("e1", "s"), ("s", "e1")]


def agent(listen: str) -> None:
    """One host driven by JSON lines on stdin, one ``@@ {json}`` reply per line."""
    import os
    import time

    import trio

    from echo.p2p.host import open_host
    from echo.p2p.identity import Identity
    from echo.p2p.nat import dcutr
    from echo.p2p.nat.circuit import dial_circuit, has_direct_connection, keep_reservation
    from echo.p2p.nat.circuit_relay import CONTROL_RELAY_LIMITS, offer_relay

    def say(obj: dict) -> None:
        print("@@", json.dumps(obj), flush=True)

    async def main() -> None:
        async with open_host(Identity.generate(), [listen], pubsub=False) as h:
            dcutr.serve_dcutr(h)
            say({"peer": str(h.peer_id), "addr": h.listen_multiaddrs[0]})
            stdin = trio.lowlevel.FdStream(os.dup(0))

            async def relay(task_status) -> None:  # type: ignore[no-untyped-def]
                async with offer_relay(h, CONTROL_RELAY_LIMITS):
                    task_status.started()
                    await trio.sleep_forever()

            async def reserve(addr: str, task_status) -> None:  # type: ignore[no-untyped-def]
                async with keep_reservation(h, addr) as res:
                    task_status.started(res.circuit_addr)
                    await trio.sleep_forever()

            async with trio.open_nursery() as n:
                async for cmd in json_lines(stdin):
                    try:
                        if cmd["op"] == "quit":
                            n.cancel_scope.cancel()
                            return
                        if cmd["op"] == "relay":
                            await n.start(relay)
                            say({"ok": True})
                        elif cmd["op"] == "reserve":
                            say({"ok": True, "circuit": await n.start(reserve, cmd["addr"])})
                        elif cmd["op"] == "upgrade":
                            pid = await dial_circuit(h, cmd["circuit"], timeout=10, new=True)
                            t0 = time.monotonic()
                            ok = await dcutr.upgrade(h, pid, timeout=30)
                            dt = time.monotonic() - t0
                            direct = has_direct_connection(h, pid)
                            with trio.move_on_after(5):
                                await h.disconnect(pid)
                            say({"ok": ok and direct, "s": round(dt, 2)})
                    except Exception as exc:  # noqa: BLE001 (reported to the driver)
                        say({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
                n.cancel_scope.cancel()  # the driver closed our stdin

    trio.run(main)


async def json_lines(stream: Any) -> AsyncIterator[dict]:
    """An agent's commands: one JSON object per line of ``stream`` (a trio receive stream),
    until it closes."""
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        yield json.loads(line)


class Agent:
    def __init__(self, name: str, ip: str) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--agent", f"/ip4/{ip}/tcp/{PORT}"]
        self.name = name
        self.proc = subprocess.Popen(
            netem_nat.exec_argv(name, argv, PREFIX),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        hello = self.line()
        self.peer, self.addr = hello["peer"], hello["addr"]

    def line(self) -> dict:
        while True:
            got = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not got:
                raise RuntimeError(f"agent {self.name} died")
            if got.startswith("@@ "):
                return json.loads(got[3:])

    def __call__(self, op: str, **kw: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.line()

    def stop(self) -> None:
        try:
            self.proc.stdin.write('{"op": "quit"}\n')  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def run(trials: int) -> dict:
    inet = netem_nat.up(
        [netem_nat.RouterSpec("h1", "eim"), netem_nat.RouterSpec("h2", "eim"),
         netem_nat.RouterSpec("h3", "sym")],
        [netem_nat.NatHostSpec("r"), netem_nat.NatHostSpec("a"),
         netem_nat.NatHostSpec("e1", "h1"), netem_nat.NatHostSpec("e2", "h2"),
         netem_nat.NatHostSpec("s", "h3")],
        prefix=PREFIX, public_subnet="10.69.0.0/24", quiet=True,
    )
    agents: dict[str, Agent] = {}
    try:
        for name, h in inet.hosts.items():
            agents[name] = Agent(name, h.ip)
        assert agents["r"]("relay")["ok"]
        circuit = {n: agents[n]("reserve", addr=agents["r"].addr)["circuit"]
                   for n in ("e1", "e2", "s")}
        out: dict = {}
        for src, dst in PAIRS:
            oks, secs, errors = 0, [], []
            for i in range(trials):
                got = agents[src]("upgrade", circuit=circuit[dst])
                print(f"{src} -> {dst} #{i}: {got}", file=sys.stderr)
                if got.get("ok"):
                    oks += 1
                    secs.append(got["s"])
                elif "error" in got:
                    errors.append(got["error"])
            out[f"{src}->{dst}"] = {
                "direct": f"{oks}/{trials}",
                "median_s": statistics.median(secs) if secs else None,
                "errors": errors[:2],
            }
        return out
    finally:
        for ag in agents.values():
            ag.stop()
        netem_nat.down(PREFIX, quiet=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--agent", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent:
        agent(args.agent)
        return 0
    print(json.dumps(run(args.trials)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Does js-libp2p's DCUtR punch through the emulated home routers with one of our nodes? (issue 32)

Builds an internet with :mod:`netem_nat`: a public relay ``r`` (our circuit relay v2,
:func:`echo.p2p.nat.circuit_relay.offer_relay`, driven by :mod:`echo.tools.dcutr_netns`'s
agent), a js-libp2p peer ``j`` behind an endpoint-independent router ``h1``
(``tests/interop/js/peer.mjs``: TCP, Noise, yamux, identify, circuit relay v2 transport and
``@libp2p/dcutr``, pinned by its package-lock.json) holding a reservation on ``r``, and our node
``n`` behind another eim router ``h2``, answering DCUtR (:func:`echo.p2p.nat.dcutr.serve_dcutr`).
``n`` dials ``j`` through its circuit address; by the spec the inbound side (``j``) starts the
upgrade, so ``n`` only answers and waits for a direct (non-relayed) connection.

The public /24 is a global range (``100.200.0.0/24``, nothing routes off the machine):
js-libp2p's DCUtR drops every address in a private range, the default emulated internet's
included. Prints one line per trial and, last, a JSON object: ``dcutr_interop`` (true when a
trial ended with a direct connection), ``direct`` (successes out of trials), and what each side
saw. Needs root, iproute2, iptables, node and ``npm ci`` in tests/interop/js.

Run: ``sudo .venv/bin/python -m echo.tools.dcutr_js [--trials 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import echo.tools.netem_nat as netem_nat
from echo.tools import dcutr_netns

PREFIX = "ecj"
PORT = 4001
PUBLIC_SUBNET = "100.200.0.0/24"
JS_DIR = Path(__file__).resolve().parent.parent / "tests" / "interop" / "js"
WAIT_DIRECT_S = 30.0


def js_ready() -> tuple[bool, str]:
    """Whether the js-libp2p peer can run here, and if not, why."""
    import shutil

    if shutil.which("node") is None:
        return False, "no node"
    if not (JS_DIR / "node_modules" / "@libp2p" / "dcutr").is_dir():
        return False, f"no node_modules in {JS_DIR} (run npm ci there)"
    return True, ""


def agent(listen: str) -> None:
    """Our node: answers DCUtR; ``dial`` reaches a peer through a circuit and waits (JSON lines
    on stdin, one ``@@ {json}`` reply per line)."""
    import logging
    import os

    import trio

    # The library's account of the exchange (what it dialled, why it stopped) goes to stderr,
    # which the driver keeps for the report.
    logging.basicConfig(stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    for name in ("libp2p.relay.circuit_v2.dcutr", "echo.p2p.nat"):
        logging.getLogger(name).setLevel(logging.DEBUG)

    from echo.p2p.host import open_host
    from echo.p2p.identity import Identity
    from echo.p2p.nat import dcutr
    from echo.p2p.nat.circuit import dial_circuit, has_direct_connection

    def say(obj: dict) -> None:
        print("@@", json.dumps(obj), flush=True)

    async def main() -> None:
        async with open_host(Identity.generate(), [listen], pubsub=False) as h:
            dcutr.serve_dcutr(h)
            say({"peer": str(h.peer_id), "addr": h.listen_multiaddrs[0]})
            async for cmd in dcutr_netns.json_lines(trio.lowlevel.FdStream(os.dup(0))):
                if cmd["op"] == "quit":
                    return
                try:
                    t0 = time.monotonic()
                    pid = await dial_circuit(h, cmd["circuit"], timeout=10, new=True)
                    with trio.move_on_after(float(cmd.get("wait_s", WAIT_DIRECT_S))):
                        while not has_direct_connection(h, pid):
                            await trio.sleep(0.1)
                    conns = h.libp2p.get_network().connections.get(pid, [])
                    if not isinstance(conns, list):
                        conns = [conns]
                    addrs = []
                    for c in conns:
                        try:
                            addrs.append([str(a) for a in c.get_transport_addresses()])
                        except Exception as exc:  # noqa: BLE001 (a report, not a decision)
                            addrs.append([f"? {type(exc).__name__}"])
                    say({"ok": has_direct_connection(h, pid), "s": round(time.monotonic() - t0, 2),
                         "upgrades": dcutr.upgrades(h), "conns": addrs})
                    with trio.move_on_after(5):
                        await h.disconnect(pid)
                except Exception as exc:  # noqa: BLE001 (reported to the driver)
                    say({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})

    trio.run(main)


class NodeAgent(dcutr_netns.Agent):
    """Our node behind ``h2`` (:func:`agent`), in the same line protocol as dcutr_netns's;
    its log (the library's DCUtR lines) in a temporary file, :meth:`log_tail`."""

    def __init__(self, name: str, ip: str) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--agent", f"/ip4/{ip}/tcp/{PORT}"]
        self.name = name
        # Closed in stop(): the agent writes to it for as long as it runs.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            netem_nat.exec_argv(name, argv, PREFIX),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        hello = self.line()
        self.peer, self.addr = hello["peer"], hello["addr"]

    def log_tail(self, lines: int = 40) -> list[str]:
        self.log.seek(0)
        return [ln.rstrip()[:400] for ln in self.log.read().splitlines()[-lines:]]

    def stop(self) -> None:
        super().stop()
        self.log.close()


class RelayAgent(dcutr_netns.Agent):
    """dcutr_netns's agent in this module's internet (its prefix)."""

    def __init__(self, name: str, ip: str) -> None:
        argv = [sys.executable, dcutr_netns.__file__, "--agent", f"/ip4/{ip}/tcp/{PORT}"]
        self.name = name
        self.proc = subprocess.Popen(
            netem_nat.exec_argv(name, argv, PREFIX),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        hello = self.line()
        self.peer, self.addr = hello["peer"], hello["addr"]


class JsPeer:
    """``peer.mjs`` in namespace ``name``; its event lines are read on a thread into a queue."""

    def __init__(self, name: str, ip: str, relay: str, announce: str) -> None:
        argv = ["node", str(JS_DIR / "peer.mjs"), f"/ip4/{ip}/tcp/{PORT}", relay, announce]
        env = {**os.environ, "DEBUG": "libp2p:dcutr*"}  # its log lines carry the failure
        self.proc = subprocess.Popen(
            netem_nat.exec_argv(name, argv, PREFIX), cwd=JS_DIR, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.events: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for got in self.proc.stdout:  # type: ignore[union-attr]
            if got.startswith("@@ "):
                self.events.put(json.loads(got[3:]))

    def _read_err(self) -> None:
        for got in self.proc.stderr:  # type: ignore[union-attr]
            if "dcutr" in got:
                self.stderr.append(got.rstrip()[:600])

    def wait_for(self, event: str, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                ev = self.events.get(timeout=max(0.05, end - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(ev)
            if ev.get("event") == event:
                return ev
        tail = " | ".join(self.stderr[-5:])
        raise RuntimeError(f"js peer: no {event!r} in {timeout:.0f} s (stderr: {tail})")

    def drain(self) -> list[dict]:
        got = []
        while True:
            try:
                got.append(self.events.get_nowait())
            except queue.Empty:
                self.seen.extend(got)
                return got

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _unreplied(router: str) -> list[str]:
    """The router's conntrack entries for TCP connections that never got a reply: the SYNs of
    a punch that its peer's router dropped (source and destination ports say why)."""
    got = subprocess.run(netem_nat.exec_argv(router, ["cat", "/proc/net/nf_conntrack"], PREFIX),
                         capture_output=True, text=True, check=False)
    return [" ".join(w for w in line.split() if w.split("=")[0] in ("src", "dst", "sport", "dport")
                     or w.startswith("[UNREPLIED"))
            for line in got.stdout.splitlines() if "UNREPLIED" in line and " tcp " in f" {line}"]


def run(trials: int, announce: bool = True, js_public: bool = False,
        wait_s: float = WAIT_DIRECT_S) -> dict:
    """One internet, ``trials`` circuit dials from ``n`` to ``j``; the summary (module doc).
    ``js_public`` puts ``j`` on the public side (the exchange still runs: our node's identify
    addresses are its LAN ones, so js-libp2p's unilateral dial is skipped)."""
    inet = netem_nat.up(
        [netem_nat.RouterSpec("h1", "eim"), netem_nat.RouterSpec("h2", "eim")],
        [netem_nat.NatHostSpec("r"), netem_nat.NatHostSpec("j", "" if js_public else "h1"),
         netem_nat.NatHostSpec("n", "h2")],
        prefix=PREFIX, public_subnet=PUBLIC_SUBNET, quiet=True, global_subnet=True,
    )
    relay = node = js = None
    try:
        relay = RelayAgent("r", inet.hosts["r"].ip)
        assert relay("relay")["ok"]
        relay_addr = f"{relay.addr}/p2p/{relay.peer}" if "/p2p/" not in relay.addr else relay.addr
        # js-libp2p leaves a public address out of its DCUtR CONNECT until AutoNAT confirms it,
        # and learns a NAT mapping only that way; we name it instead (eim keeps the source
        # port, so the router's WAN address and the listen port), as a confirmation would.
        j = inet.hosts["j"]
        wan = f"/ip4/{j.ip if js_public else j.public_ip}/tcp/{PORT}" if announce else ""
        js = JsPeer("j", inet.hosts["j"].ip, relay_addr, wan)
        started = js.wait_for("started", 60)
        circuit = js.wait_for("reserved", 30)["circuits"][0]
        node = NodeAgent("n", inet.hosts["n"].ip)
        results = []
        for i in range(trials):
            got = node("dial", circuit=circuit, wait_s=wait_s)
            time.sleep(0.5)
            got["js_events"] = js.drain()
            got["conntrack"] = {r: _unreplied(r) for r in ("h1", "h2")}
            print(f"n -> j #{i}: {json.dumps(got)}", file=sys.stderr)
            results.append(got)
        oks = sum(1 for r in results if r.get("ok"))
        return {"dcutr_interop": oks > 0, "direct": f"{oks}/{trials}", "js_peer": started["peer"],
                "circuit": circuit, "trials": results, "js_stderr": js.stderr[-40:],
                "node_log": node.log_tail()}
    finally:
        for proc in (node, relay, js):
            if proc is not None:
                proc.stop()
        netem_nat.down(PREFIX, quiet=True)


def figures(trials: int = 1) -> dict:
    """The benchmark's figures (benchmarks/nat.py): ``dcutr_interop``, whether js-libp2p's DCUtR
    punched through two eim routers with our node; ``dcutr_interop_one_router``, whether it
    gave a direct connection with our node behind one (js-libp2p public); each ``None`` with
    ``dcutr_interop_skipped`` where the js peer cannot run."""
    ok, why = js_ready()
    if not ok:
        return {"dcutr_interop": None, "dcutr_interop_one_router": None,
                "dcutr_interop_skipped": why}
    # js-libp2p gives up after its third attempt (3 x 5 s): waiting longer shows nothing more.
    both = run(trials, wait_s=20.0)
    one = run(trials, js_public=True, wait_s=20.0)
    return {"dcutr_interop": both["dcutr_interop"], "dcutr_interop_direct": both["direct"],
            "dcutr_interop_one_router": one["dcutr_interop"],
            "dcutr_interop_one_router_direct": one["direct"],
            "dcutr_interop_one_router_s": [t.get("s") for t in one["trials"]]}


def summary(fig: dict) -> str:
    """One line on :func:`figures`' result."""
    if fig.get("dcutr_interop_skipped"):
        return f"skipped: {fig['dcutr_interop_skipped']}"
    return (f"punched through two eim routers {fig['dcutr_interop_direct']}; direct with our node"
            f" behind one {fig['dcutr_interop_one_router_direct']}"
            f" ({fig['dcutr_interop_one_router_s']} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--no-announce", action="store_true",
                    help="do not tell the js peer its router's mapping of its listen port")
    ap.add_argument("--js-public", action="store_true",
                    help="the js peer on the public side (our node alone behind a router)")
    ap.add_argument("--agent", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent:
        agent(args.agent)
        return 0
    ok, why = js_ready()
    if not ok:
        print(json.dumps({"dcutr_interop": None, "skipped": why}))
        return 0
    print(json.dumps(run(args.trials, announce=not args.no_announce, js_public=args.js_public)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A push to a node behind NAT that has not dialled its parent (issue 32), in the emulated
internet (tools/netem_nat.py): the parent reaches it through its volunteer's circuit relay and
asks it over that circuit to dial back (DCUtR), and the version then arrives by push over the
direct connection the child opened through its router.

Three real hosts, each a process in its own namespace: ``vol``, a public volunteer offering a
relay with the limits volunteers use (``CONTROL_RELAY_LIMITS``); ``par``, a public parent whose
relay holds a version; ``kid``, behind an endpoint-independent router, whose relay holds a
reservation on ``vol`` and answers DCUtR, as a node behind NAT does. The parent is given a route
whose only child is ``kid`` known by its circuit address, as plans announce nodes behind NAT;
``kid`` never learns the parent's address, so its own dial (``Peers.reach_out``) cannot come
first. The push therefore goes through :meth:`echo.p2p.relay.peers.Peers.connect`'s fallback,
the product path: wait ``_REVERSAL_GRACE_S``, dial the circuit, DCUtR, push on the direct
connection. Without that fallback the version never arrives (the parent cannot dial ``kid``).

Why here and not in the NAT swarm: there, whether a public parent's first push finds its child
unconnected is a race between the plan reaching the two and the child's dial, and the swarm's
circuit count comes from relay figures logged every 10 s, which a 15 s job on an idle machine
mostly misses (docs/results/2026-12-07-circuits.md, "Amended: circuits in the swarm are a race
and a sampling").

Needs root, iproute2 and iptables (nat table); skipped where they are missing.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import echo.tools.netem_nat as netem_nat
from echo.p2p.relay import peers as relay_peers

PREFIX = "ecnp"
_OK, _WHY = netem_nat.available(prefix="ecnq")
pytestmark = pytest.mark.skipif(not _OK, reason=f"NAT emulation unavailable: {_WHY}")
PORT = 4001
# Three processes start python + libp2p (about 2 s each on a busy 2-core machine); the push
# itself takes the 2 s grace and one DCUtR exchange (0.6 s in netem_nat).
REPLY_TIMEOUT_S = 60

# One host per namespace, driven by JSON lines on stdin, one "@@ {json}" reply per line:
#   vol: offers a circuit relay; "stats" -> circuits opened.
#   par: holds version 1 of JOB (1 MB) in its relay; "push" starts the version with a route
#        whose one child is the named peer at its circuit address, and waits for the push.
#   kid: "join" opens its relay (the learner key given), answers DCUtR and reserves on the
#        named relay; "wait" waits for version 1 and reports how it came and from where.
AGENT = """
import hashlib, json, os, sys, tempfile, time
from pathlib import Path
import trio
from echo.p2p.chunkstore import ChunkStore, split_chunks
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.nat import dcutr
from echo.p2p.nat.circuit import has_direct_connection, is_relayed, keep_reservation
from echo.p2p.nat.circuit_relay import CONTROL_RELAY_LIMITS, offer_relay
from echo.p2p.relay import RelayConfig, open_relay
from echo.protocol import broadcast as b
from echo.protocol import messages as m
from echo.protocol import signing
from echo.tools.dcutr_netns import json_lines

JOB = "job-natpush"
role, listen = sys.argv[1], sys.argv[2]

def say(obj):
    print("@@", json.dumps(obj), flush=True)

def conns(host, peer):
    got = [c for p, cs in host.libp2p.get_network().connections.items() if str(p) == peer
           for c in cs]
    return [{"relayed": is_relayed(c), "direction": c.direction.name} for c in got]

async def main():
    tmp = Path(tempfile.mkdtemp(prefix=f"natpush-{role}-"))
    cfg = RelayConfig()
    async with open_host(Identity.generate(), [listen], pubsub=False) as h, \\
            trio.open_nursery() as n:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        hello = {"peer": str(h.peer_id), "addr": h.listen_multiaddrs[0]}
        if role == "vol":
            relay = await n.start(serve_relay, h)
        if role == "par":
            learner = Identity.generate()
            payload = os.urandom(1_000_000)
            store = ChunkStore(tmp / "store")
            refs = [m.ChunkRef(sha256=store.put(1, c), size=len(c))
                    for c in split_chunks(payload, 64 * 1024)]
            man = m.Manifest(job_id=JOB, version=1, base_version=-1, kind="anchor",
                             total_size=len(payload), chunks=refs, tensor_digests={},
                             state_digest="d", anchor_version=1, created_at=0.0)
            env = signing.seal_record(learner.private_key, man)
            keys = {JOB: learner.public_key_bytes}
            prelay = await n.start(run_relay, h, store, keys, cfg)
            hello.update(learner_key=learner.public_key_bytes.hex(),
                         sha=hashlib.sha256(payload).hexdigest())
        say(hello)
        async for cmd in json_lines(stdin):
            try:
                if cmd["op"] == "quit":
                    break
                if cmd["op"] == "stats":
                    say({"circuits": relay.circuits_opened})
                elif cmd["op"] == "join":
                    keys = {JOB: bytes.fromhex(cmd["learner_key"])}
                    krelay = await n.start(run_relay, h, ChunkStore(tmp / "store"), keys, cfg)
                    dcutr.serve_dcutr(h)
                    say({"circuit": await n.start(reserve, h, cmd["relay"])})
                elif cmd["op"] == "push":
                    kid = cmd["child"]
                    before = conns(h, kid)
                    route = b.Route(job_id=JOB, version=1, stripes=1, weights=[],
                                    children=[[b.PeerAddr(peer_id=kid, addrs=[cmd["circuit"]])]])
                    t0 = time.monotonic()
                    t = await prelay.start(env, route)
                    with trio.fail_after(5):  # the push task is started, not yet run
                        while not t.child_state:
                            await trio.sleep(0.01)
                    forwarded = await prelay.wait_forwarded(JOB, 1, timeout=40)
                    say({"before": before, "forwarded": forwarded, "s": time.monotonic() - t0,
                         "state": sorted(set(t.child_state.values())),
                         "upgrades": dcutr.upgrades(h), "direct": has_direct_connection(h, kid)})
                elif cmd["op"] == "wait":
                    t = await krelay.wait(JOB, 1, timeout=cmd["timeout"])
                    say({"sha": hashlib.sha256(t.payload(krelay.store)).hexdigest(),
                         "pulled": t.stats.chunks_pulled, "conns": conns(h, cmd["parent"])})
            except Exception as exc:
                say({"error": f"{type(exc).__name__}: {exc}"[:300]})
        n.cancel_scope.cancel()

async def serve_relay(h, task_status):
    async with offer_relay(h, CONTROL_RELAY_LIMITS) as relay:
        task_status.started(relay)
        await trio.sleep_forever()

async def run_relay(h, store, keys, cfg, task_status):
    async with open_relay(h, store, learner_keys=keys, config=cfg) as relay:
        task_status.started(relay)
        await trio.sleep_forever()

async def reserve(h, addr, task_status):
    async with keep_reservation(h, addr) as res:
        task_status.started(res.circuit_addr)
        await trio.sleep_forever()

trio.run(main)
"""


class _Agent:
    """One :data:`AGENT` process in host ``name``'s namespace; its replies are read by a
    thread, so that every wait for one has a timeout."""

    def __init__(self, role: str, name: str, ip: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            netem_nat.exec_argv(
                name, [sys.executable, "-c", AGENT, role, f"/ip4/{ip}/tcp/{PORT}"], PREFIX
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        self.replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.reply()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("@@ "):
                self.replies.put(json.loads(line[3:]))
        self.replies.put(None)  # exited

    def reply(self) -> dict:
        try:
            got = self.replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"no reply from {self.name} in {REPLY_TIMEOUT_S} s") from None
        assert got is not None, f"agent {self.name} exited ({self.proc.poll()})"
        assert "error" not in got, (self.name, got)
        return got

    def __call__(self, op: str, **kw: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write('{"op": "quit"}\n')  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def test_a_push_to_a_child_that_never_dialled_goes_through_its_relay_and_dcutr() -> None:
    inet = netem_nat.up(
        [netem_nat.RouterSpec("home", "eim")],
        [netem_nat.NatHostSpec("vol"), netem_nat.NatHostSpec("par"),
         netem_nat.NatHostSpec("kid", "home")],
        prefix=PREFIX,
        public_subnet="10.68.0.0/24",
        quiet=True,
    )  # fmt: skip
    agents: list[_Agent] = []
    try:
        for role in ("vol", "par", "kid"):
            agents.append(_Agent(role, role, inet.hosts[role].ip))
        vol, par, kid = agents
        circuit = kid("join", learner_key=par.hello["learner_key"], relay=vol.hello["addr"])[
            "circuit"
        ]
        assert circuit.startswith(vol.hello["addr"]) and "/p2p-circuit/" in circuit, circuit
        assert vol("stats")["circuits"] == 0

        pushed = par("push", child=kid.hello["peer"], circuit=circuit)
        # Nothing joined the two before the push: the kid never dialled the parent.
        assert pushed["before"] == [], pushed
        # The push waited out the grace for the kid's own dial, then went through the
        # volunteer's relay (one circuit) and one DCUtR exchange to a direct connection ...
        assert pushed["forwarded"] and pushed["state"] == ["done"], pushed
        assert pushed["s"] >= relay_peers._REVERSAL_GRACE_S, pushed
        assert pushed["upgrades"] == 1 and pushed["direct"], pushed
        assert vol("stats")["circuits"] == 1

        got = kid("wait", parent=par.hello["peer"], timeout=30)
        # ... and the whole version came by push (nothing pulled) over a direct connection
        # that the kid opened through its router (the only direction its NAT lets through).
        assert got["sha"] == par.hello["sha"] and got["pulled"] == 0, got
        direct = [c for c in got["conns"] if not c["relayed"]]
        assert direct and {c["direction"] for c in direct} == {"OUTBOUND"}, got
    finally:
        for a in agents:
            a.stop()
        netem_nat.down(PREFIX, quiet=True)

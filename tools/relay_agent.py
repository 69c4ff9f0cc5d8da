"""One relay host of a broadcast benchmark as its own process, and the orchestrator's handle on it.

The agent (:func:`agent_entry`; ``benchmarks/broadcast.py --agent`` or ``python -m
echo.tools.relay_agent``) runs one real EchoHost and one :class:`~echo.p2p.relay.Relay` over a
:class:`~echo.p2p.chunkstore.ChunkStore`, and obeys JSON-line commands on stdin: ``config``
(restart the relay with a :class:`~echo.p2p.relay.RelayConfig`), ``publish`` (the source seals a
fresh random version), ``connect``, ``route`` (start relaying a version along a
:class:`~echo.protocol.broadcast.Route`), ``timeline``, ``verify`` (the payload's sha256) and
``quit``. It answers with event lines that start with :data:`EVENT`; anything else on its stdout
is library noise. :class:`AgentProc` is the other end of that protocol: both sides of it live
here so that they change together.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import trio

from echo.p2p.chunkstore import ChunkStore, split_chunks
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.p2p.relay import Relay, RelayConfig
from echo.protocol import broadcast as b
from echo.protocol import messages as m
from echo.protocol import signing
from echo.tools.bench import say

JOB = "bench"
EVENT = "@@ "  # agent -> orchestrator lines start with this; anything else is library noise
COMMAND_TIMEOUT_S = 120.0


def _say_event(**obj: Any) -> None:
    sys.stdout.write(EVENT + json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    buf = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


class _Agent:
    """One host: an EchoHost, a relay (restarted per run with that run's config), a store."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.learner_pub = bytes.fromhex(args.learner_pub)
        self.ident = (Identity.from_seed(bytes.fromhex(args.seed)) if args.seed
                      else Identity.generate())
        self.store = ChunkStore(Path(args.store), keep_versions=2)
        self.relay: Relay | None = None
        self.relay_scope: trio.CancelScope | None = None
        self.relay_stopped = trio.Event()
        self.envelopes: dict[int, bytes] = {}

    async def _run_relay(self, host, config: RelayConfig, stopped: trio.Event, *,
                         task_status) -> None:
        try:
            with trio.CancelScope() as scope:
                relay = Relay(host, self.store, learner_keys={JOB: self.learner_pub},
                              config=config,
                              on_bad_peer=lambda r: _say_event(event="bad_peer", peer=r.peer_id,
                                                               reason=r.reason))
                self.relay_scope = scope
                await relay.run(task_status=task_status)
        finally:
            stopped.set()

    async def _restart_relay(self, nursery, host, config: RelayConfig) -> None:
        """Stop the running relay (and wait until its handlers are gone), start a new one."""
        if self.relay_scope is not None:
            self.relay_scope.cancel()
            with trio.fail_after(COMMAND_TIMEOUT_S):
                await self.relay_stopped.wait()
        self.relay_stopped = trio.Event()
        self.relay = await nursery.start(self._run_relay, host, config, self.relay_stopped)

    def _publish(self, version: int, size: int, chunk: int) -> None:
        import numpy as np

        payload = np.random.default_rng(version).bytes(size)
        refs = [m.ChunkRef(sha256=self.store.put(version, c), size=len(c))
                for c in split_chunks(payload, chunk)]
        man = m.Manifest(job_id=JOB, version=version, base_version=-1, kind="anchor",
                         total_size=size, chunks=refs, tensor_digests={}, state_digest="bench",
                         anchor_version=version, created_at=time.time())
        env = signing.seal_record(self.ident.private_key, man)
        self.envelopes[version] = env
        _say_event(event="published", version=version, envelope=env.hex(),
                   sha=hashlib.sha256(payload).hexdigest(), chunks=len(refs))

    async def _watch(self, version: int, timeout: float) -> None:
        assert self.relay is not None
        try:
            t = await self.relay.wait(JOB, version, timeout)
        except TimeoutError as exc:
            t = self.relay.transfer(JOB, version)
            state = {} if t is None else {
                "have": t.n_have, "chunks": t.n, "want": len(t.want),
                "feeds": [(f.peer[-8:], f.stripe, f.state) for f in t.feeds],
                "peer_have": len(t.peer_have), "stats": vars(t.stats)}
            _say_event(event="timeout", version=version, detail=str(exc), state=state)
            return
        st = t.stats
        _say_event(event="complete", version=version, done_at=t.done_at, **_timeline(t),
                   pulled=st.chunks_pulled, bad=st.bad_chunks,
                   pushed_out=st.pushed_out_bytes, push_rate=st.push_rate_bps(),
                   lagging=sum(1 for s in t.child_state.values() if s == "lagging"))

    async def main(self) -> None:
        async with open_host(self.ident, [self.args.listen], pubsub=False) as host:
            _say_event(event="ready", peer_id=self.ident.peer_id_str, addrs=host.listen_multiaddrs)
            stdin = trio.lowlevel.FdStream(os.dup(0))
            async with trio.open_nursery() as nursery:
                await self._restart_relay(nursery, host, RelayConfig())
                async for line in _lines(stdin):
                    cmd = json.loads(line)
                    op = cmd["cmd"]
                    if op == "quit":
                        break
                    if op == "publish":
                        self._publish(cmd["version"], cmd["size"], cmd["chunk"])
                    elif op == "config":
                        await self._restart_relay(nursery, host, RelayConfig(**cmd["config"]))
                        _say_event(event="configured")
                    elif op == "connect":
                        async with trio.open_nursery() as dials:
                            for addr in cmd["addrs"]:
                                dials.start_soon(host.connect, addr)
                        _say_event(event="connected")
                    elif op == "route":
                        route = b.decode(b.Route, bytes.fromhex(cmd["route"]))
                        env = bytes.fromhex(cmd["envelope"]) if cmd.get("envelope") else (
                            self.envelopes[route.version])
                        t0 = time.monotonic()
                        assert self.relay is not None
                        await self.relay.start(env, route)
                        _say_event(event="routed", version=route.version, t0=t0)
                        if cmd.get("watch", True):
                            nursery.start_soon(self._watch, route.version, cmd["timeout"])
                    elif op == "timeline":
                        assert self.relay is not None
                        t = self.relay.transfer(JOB, cmd["version"])
                        _say_event(event="timeline", **({} if t is None else _timeline(t)))
                    elif op == "verify":
                        assert self.relay is not None
                        t = self.relay.transfer(JOB, cmd["version"])
                        sha = (hashlib.sha256(t.payload(self.store)).hexdigest()
                               if t is not None and t.complete else "")
                        self.store.prune()
                        _say_event(event="verified", version=cmd["version"], sha=sha)
                nursery.cancel_scope.cancel()


def _timeline(t) -> dict[str, Any]:
    """When each stripe's first and last chunk arrived here, and when each child last
    acknowledged (time.monotonic(), for --per-node)."""
    stripes: dict[int, list[float]] = {}
    for i, at in zip(t.order, t.arrived_at, strict=True):
        first_last = stripes.setdefault(t.stripe_of(i), [at, at])
        first_last[1] = at
    return {"stripe_times": {str(s): v for s, v in sorted(stripes.items())},
            "acked_at": [[s, c, at] for (s, c), at in t.acked_at.items()]}


def agent_entry(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent", action="store_true")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--learner-pub", required=True)
    parser.add_argument("--seed", default="")
    parser.add_argument("--store", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{os.path.basename(args.store)}] %(name)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    if os.environ.get("ECHO_BENCH_AGENT_LOG"):
        logging.getLogger("echo").setLevel(os.environ["ECHO_BENCH_AGENT_LOG"])
    profile_to = os.environ.get("ECHO_BENCH_PROFILE_DIR")
    if profile_to:  # developer aid: a cProfile dump per agent
        import cProfile

        cProfile.runctx("trio.run(_Agent(args).main)", globals(), {"args": args, "trio": trio},
                        filename=os.path.join(profile_to, os.path.basename(args.store) + ".prof"))
    else:
        trio.run(_Agent(args).main)


class AgentProc:
    """The orchestrator's handle on one agent process (JSON lines over its stdin/stdout)."""

    def __init__(self, name: str, proc: trio.Process) -> None:
        self.name = name
        self.proc = proc
        self.send_ch, self.recv_ch = trio.open_memory_channel[dict](1000)
        self.peer_id = ""
        self.addrs: list[str] = []
        self.log_path: Path | None = None

    async def pump(self) -> None:
        assert self.proc.stdout is not None
        async for line in _lines(self.proc.stdout):
            if line.startswith(EVENT):
                await self.send_ch.send(json.loads(line[len(EVENT):]))
        await self.send_ch.aclose()

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all((json.dumps(cmd) + "\n").encode())

    async def expect(self, event: str, timeout: float) -> dict:
        with trio.fail_after(timeout):
            async for msg in self.recv_ch:
                if msg.get("event") == event:
                    return msg
                if msg.get("event") == "bad_peer":
                    say(f"    {self.name}: reported {msg['peer'][-8:]} ({msg['reason']})")
                if msg.get("event") == "timeout":
                    raise RuntimeError(f"agent {self.name} gave up: {msg}")
        tail = ""
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"agent {self.name} exited while waiting for {event}:\n{tail}")


if __name__ == "__main__":
    agent_entry(sys.argv[1:])

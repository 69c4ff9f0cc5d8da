"""Broadcast planning on the learner's report path, against the full plan, as the swarm grows.

For N registered nodes (every one with an address and a measured uplink) the coordinator's
:class:`~echo.coordinator.dissemination.planning.Dissemination` plans version after version while 2%
of the nodes leave and as many join between versions. Per N it prints:

- the report path: what :meth:`Dissemination.plan` costs a version (a patch of the last plan);
- the baseline measured in the same run: the full search
(:func:`echo.coordinator.dissemination.planner.best.best_plan`),
  which the report used to wait for and which now runs in a background task;
- the signed announcement's size against the gossip message cap (nodes drop larger ones).

    python benchmarks/planner.py [--quick]
"""

from __future__ import annotations

import random
import time

from echo.coordinator.dissemination.planning import Dissemination
from echo.p2p.identity import Identity
from echo.p2p.pubsub import MAX_PUBSUB_MESSAGE_BYTES
from echo.protocol import signing
from echo.tools.bench import emit, median, parse_args, say

MB = 1_000_000
TOTAL_BYTES = 64 << 20
CHUNK_BYTES = 4 << 20
CHURN = 0.02


def node_id(i: int) -> str:
    # Peer ids as long as real ones (base58 of an Ed25519 identity multihash: 52 characters).
    return f"12D3KooW{i:044d}"


def bench(n: int, versions: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    diss = Dissemination(learner_upload_bps=12.5 * MB, default_node_upload_bps=2.5 * MB)
    ident = Identity.generate()
    nodes = [node_id(i) for i in range(n)]
    next_id = n
    for i, nid in enumerate(nodes):
        diss.relays.registered(nid, [f"/ip4/10.{i // 65536}.{i // 256 % 256}.{i % 256}/tcp/4001"],
                        rng.choice([1, 2.5, 5, 10, 25]) * MB)
        diss.relays.measured(nid, rng.choice([1, 2.5, 5, 10, 25]) * MB)

    def plan(v: int) -> bytes:
        ann = diss.plan("job", v, b"m" * 2048, TOTAL_BYTES, chunk_bytes=CHUNK_BYTES,
                        source="learner", source_addrs=["/ip4/10.255.0.1/tcp/4001"], nodes=nodes)
        assert ann is not None
        return signing.seal_record(ident.private_key, ann)

    plan(0)  # the job's first plan: one equal-rate tree
    t0 = time.perf_counter()
    diss.refresh("job")
    full_s = time.perf_counter() - t0
    report_s, sizes = [], []
    for v in range(1, versions + 1):
        for _ in range(max(1, int(CHURN * n))):
            nodes.pop(rng.randrange(len(nodes)))
            nid = node_id(next_id)
            next_id += 1
            diss.relays.registered(nid, ["/ip4/10.254.0.1/tcp/4001"], 5 * MB)
            nodes.append(nid)
        t0 = time.perf_counter()
        sealed = plan(v)
        report_s.append(time.perf_counter() - t0)
        sizes.append(len(sealed))
        diss.refresh("job")  # what the background task does between versions
    report = median(report_s)
    return {"report_path_ms": report * 1e3, "full_plan_s": full_s,
            "full_vs_report_path": full_s / report, "announcement_bytes": float(max(sizes))}


def main() -> None:
    args = parse_args(__doc__)
    sizes = (16, 128, 500) if args.quick else (16, 128, 1000)
    out: dict[str, float | bool] = {"quick": args.quick}
    for n in sizes:
        r = bench(n, versions=3 if args.quick else 5)
        fits = r["announcement_bytes"] <= MAX_PUBSUB_MESSAGE_BYTES
        say(f"N = {n:4d}: report path {r['report_path_ms']:8.1f} ms per version; full plan "
            f"{r['full_plan_s']:6.2f} s ({r['full_vs_report_path']:,.0f}x, off the report path); "
            f"announcement {r['announcement_bytes'] / 1024:,.0f} KiB "
            f"({'fits' if fits else 'over'} the {MAX_PUBSUB_MESSAGE_BYTES // 1024} KiB gossip cap)")
        out.update({f"{k}_{n}": v for k, v in r.items()})
    emit(out)


if __name__ == "__main__":
    main()

"""Reading a local swarm's run: the live console table, the version a node's engine holds, and
``summary.json`` from the coordinator's job and node reports (:mod:`echo.tools.local_swarm`)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table


def kept_version(node_dir: Path) -> int:
    """The version a node's engine last loaded, from the policy.json that --keep-weights writes
    after the load (-1 before the first, or while the file is being replaced)."""
    try:
        return int(json.loads((node_dir / "policy.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def render(st: dict, nodes: list[dict], elapsed: float) -> Table:
    t = Table(
        title=f"Echo swarm · job {st['job_id']} · {st['status']} · "
        f"v{st['current_version']}/{st['steps']} · {elapsed:.0f} s"
    )
    t.add_column("version")
    t.add_column("mean reward", justify="right")
    t.add_column("groups", justify="right")
    for p in st["reward_by_version"][-8:]:
        t.add_row(f"v{p['version']}", f"{p['mean_reward']:.3f}", str(p["groups"]))
    r = st["rollouts"]
    t.add_section()
    t.add_row("trained", str(r.get("trained", 0)), "")
    t.add_row("buffered", str(r.get("accepted", 0) + r.get("in_batch", 0)), "")
    t.add_row("rejected", str(r.get("rejected_total", 0)), "")
    if r.get("uniform"):
        t.add_row("set aside (no advantage)", str(r["uniform"]), "")
    ln = st.get("learning") or {}
    if ln.get("eval_last") is not None:
        last = ln["eval_by_version"][-1]["version"]
        t.add_row("held-out accuracy", f"{ln['eval_last']:.3f}",
                  f"v{last} (v0: {ln['eval_first']:.3f})")
    if ln.get("staleness_mean") is not None:
        is_w = "-" if ln.get("is_w_mean") is None else f"{ln['is_w_mean']:.3f}"
        t.add_row("groups' staleness", f"{ln['staleness_mean']:.2f}", f"π/μ {is_w}")
    for n in nodes:
        t.add_row(
            f"node …{n['node_id'][-6:]}",
            f"{n['tokens_per_s']:,.0f} tok/s",
            f"v{n['version']} ✓{n['accepted']} ✗{n['rejected']}",
        )
    return t


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def source_bytes(versions: list[dict]) -> list[dict]:
    """Bytes the learner sent (pushes and pulls) while version v was the newest, next to v's
    payload: the learner reports its running total with every version. A learner restart resets
    the total; that interval is left out."""
    out = []
    for a, b in zip(versions, versions[1:], strict=False):
        ta, tb = a["metrics"].get("source_bytes_total"), b["metrics"].get("source_bytes_total")
        if ta is None or tb is None or tb < ta:
            continue
        out.append({"version": a["version"], "kind": a["kind"], "payload_bytes": a["bytes"],
                    "source_bytes": int(tb - ta)})
    return out


def summarize(st: dict, nodes: list[dict], wall: float) -> dict:
    curve = st["reward_by_version"]
    versions = st["versions"]
    tta = [v["time_to_all_s"] for v in versions if v["time_to_all_s"] is not None]
    evals = [(p["version"], p["accuracy"]) for p in st["learning"]["eval_by_version"]]
    return {
        "job_id": st["job_id"],
        "status": st["status"],
        "eval_first": evals[0][1] if evals else None,
        "eval_last": evals[-1][1] if evals else None,
        "eval_by_version": [{"version": v, "accuracy": a} for v, a in evals],
        # published_at: when each version came out (the real-learning benchmark's throughput).
        "learner_by_version": [{"version": v["version"], "published_at": v["published_at"],
                                **v["metrics"]} for v in versions],
        "versions": st["current_version"],
        "reward_first": curve[0]["mean_reward"] if curve else None,
        "reward_last": curve[-1]["mean_reward"] if curve else None,
        "reward_by_version": curve,
        "rollouts_accepted": sum(n["accepted"] for n in nodes),
        "rollouts_rejected": st["rollouts"].get("rejected_total", 0),
        "rejected_by_reason": st["rejected_by_reason"],
        "rollouts_trained": st["rollouts"].get("trained", 0),
        "rollouts_uniform": st["rollouts"].get("uniform", 0),
        "nodes": len(nodes),
        "node_ids": [n["node_id"] for n in nodes],
        "engines": sorted(n["engine"] for n in nodes),
        "accepted_by_engine": {e: sum(n["accepted"] for n in nodes if n["engine"] == e)
                               for e in sorted({n["engine"] for n in nodes})},
        "time_to_all_s": [{"version": v["version"], "s": v["time_to_all_s"]} for v in versions],
        "time_to_all_s_median": sorted(tta)[len(tta) // 2] if tta else None,
        "source_bytes_per_version": (src := source_bytes(versions)),
        # Copies of a version the learner's uplink carried (star: one per node).
        "source_copies_median": _median([x["source_bytes"] / x["payload_bytes"] for x in src
                                         if x["payload_bytes"]]),
        "wall_s": wall,
    }

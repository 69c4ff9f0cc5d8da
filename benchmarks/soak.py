"""Soak (issue 13): a live swarm under churning identities; does the coordinator level off?

A local swarm (coordinator, learner, one honest node: real processes on loopback) trains a
small job while ``python -m echo.tools.attackers churn`` brings ``--rate`` new identities a second,
each registering, taking a lease it lets expire and sending one junk submission, never to return.
Every ``--every-s`` the coordinator's resident memory (psutil), its database's size on disk
(with the WAL) and its row counts are sampled.

Retention is scaled to the run, so that "after warm-up" comes within it: closed leases, idle
identities, rejections and trained envelopes are kept ``--retain-s`` (default: a tenth of the
run; the shipped defaults are an hour to a day), and the expired-lease penalty window is the
same. Warm-up is the first third. The verdict per series: it levels off when its last third's
peak is within 10% (memory: and 16 MiB) of the middle third's. Versions and the completions of
trained groups are the training record and grow with training by design: the database's bytes
per version are printed beside it.

``--quick``: 2 minutes. Default: 30 minutes (outside CI).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from echo.tools.bench import emit, parse_args, say
from echo.tools.processes import new_run_dir, stop
from echo.tools.swarm import DEMO_COORDINATOR_TOML, Swarm, job_toml

ROOT = Path(__file__).resolve().parent.parent

TABLES = ("nodes", "leases", "rollouts", "rejections", "versions")


def _config(retain_s: float) -> str:
    return DEMO_COORDINATOR_TOML + (
        f"\n[retention]\nclosed_leases_s = {retain_s}\ntrained_envelopes_s = {retain_s}\n"
        f"rejections_s = {retain_s}\nidle_nodes_s = {retain_s}\n"
        f"\n[verification]\nexpired_lease_window_s = {retain_s}\n"
    )


def _sample(coord: psutil.Process, db_path: Path) -> dict:
    size = sum(p.stat().st_size for p in db_path.parent.glob(db_path.name + "*"))
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    try:
        rows = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in TABLES}
    finally:
        db.close()
    return {"t": time.time(), "rss": coord.memory_info().rss, "db_bytes": size, **rows}


def levels_off(xs: list[float], slack: float = 0.0) -> bool | None:
    """Whether the last third's peak is within 10% (plus ``slack``) of the middle third's."""
    n = len(xs)
    if n < 6:
        return None
    mid, last = xs[n // 3 : 2 * n // 3], xs[2 * n // 3 :]
    return max(last) <= 1.1 * max(mid) + slack


def main() -> int:
    args = parse_args(
        __doc__.splitlines()[0],
        setup=lambda p: (
            p.add_argument("--minutes", type=float, default=None),
            p.add_argument("--rate", type=float, default=5.0, help="new identities a second"),
            p.add_argument("--every-s", type=float, default=None),
            p.add_argument("--retain-s", type=float, default=None),
            p.add_argument("--out", type=Path, default=None),
        ),
    )
    minutes = args.minutes or (2.0 if args.quick else 30.0)
    every = args.every_s or max(2.0, minutes * 60 / 90)
    retain = args.retain_s or max(20.0, minutes * 6)
    out = new_run_dir(args.out) if args.out else Path(tempfile.mkdtemp(prefix="echo-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    say(
        f"soak: {minutes:g} min, {args.rate:g} new identities/s, retention {retain:.0f} s, "
        f"sampled every {every:.0f} s; logs in {out}"
    )
    swarm = Swarm(out)
    churn = None
    samples: list[dict] = []
    try:
        coord_proc = _start_configured(swarm, retain)
        coord = psutil.Process(coord_proc.pid)
        job_id = swarm.submit(
            job_toml("soak", steps=1000000, group_size=8, batch_groups=4, warmup=5, eval_every=0)
        )
        swarm.start_node("node-0", ["--threads", "1", "--leases-at-once", "2", "--engine", "torch"])
        with open(out / "churn.log", "wb") as log:
            churn = subprocess.Popen(
                [
                    "nice",
                    "-n",
                    "19",
                    sys.executable,
                    "-m", "echo.tools.attackers",
                    "churn",
                    "--coordinator",
                    swarm.maddr,
                    "--job",
                    job_id,
                    "--rate",
                    str(args.rate),
                    "--stats",
                    str(out / "churn.json"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        db_path = out / "coordinator" / "coordinator.sqlite"
        end = time.time() + minutes * 60
        while time.time() < end:
            time.sleep(every)
            if churn.poll() is not None:  # without its churn the run measures nothing
                raise SystemExit(f"the churn attacker exited early: the soak is void; see {out}")
            s = _sample(coord, db_path)
            s["version"] = int(swarm.status(job_id)[0]["current_version"])
            samples.append(s)
            say(
                f"{(s['t'] - samples[0]['t']) / 60:5.1f} min: RSS {s['rss'] / 2**20:6.1f} MiB, "
                f"db {s['db_bytes'] / 2**20:6.2f} MiB, v{s['version']}, "
                + ", ".join(f"{t} {s[t]}" for t in TABLES)
            )
    finally:
        if churn is not None:
            stop([churn])
        swarm.stop()
    verdict = {
        "rss": levels_off([s["rss"] for s in samples], slack=16 * 2**20),
        "nodes": levels_off([s["nodes"] for s in samples]),
        "leases": levels_off([s["leases"] for s in samples]),
        "rejections": levels_off([s["rejections"] for s in samples]),
        "db_bytes": levels_off([s["db_bytes"] for s in samples]),
    }
    first, last = samples[0], samples[-1]
    per_version = (last["db_bytes"] - first["db_bytes"]) / max(
        1, last["version"] - first["version"]
    )
    say("levels off after warm-up: " + ", ".join(f"{k} {v}" for k, v in verdict.items()))
    say(
        f"database growth per trained version: {per_version / 1024:.1f} KiB "
        "(the training record: versions and trained completions)"
    )
    emit(
        {
            "benchmark": "soak",
            "quick": args.quick,
            "minutes": minutes,
            "rate": args.rate,
            "retain_s": retain,
            "levels_off": verdict,
            "db_bytes_per_version": per_version,
            "rss_first": first["rss"],
            "rss_last": last["rss"],
            "db_first": first["db_bytes"],
            "db_last": last["db_bytes"],
            "samples": samples,
        }
    )
    return 0


def _start_configured(swarm: Swarm, retain: float) -> subprocess.Popen:
    """The coordinator under the soak's configuration (Swarm writes the demo's own)."""
    from echo.tools.processes import start, wait_for

    out = swarm.out
    (out / "coordinator.json").unlink(missing_ok=True)
    (out / "soak.toml").write_text(_config(retain))
    proc = start(
        [
            sys.executable,
            "-m",
            "echo.coordinator.cli",
            "serve",
            "--config",
            str(out / "soak.toml"),
            "--data-dir",
            str(out / "coordinator"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--http-port",
            "0",
            "--info-file",
            str(out / "coordinator.json"),
        ],
        out / "coordinator.log",
        swarm.env,
    )
    swarm.procs.append(proc)
    import httpx

    info = wait_for(out / "coordinator.json", proc, 60)
    swarm.maddr = info["multiaddrs"][0]
    swarm.api = httpx.Client(
        base_url=info["http"][0], timeout=10, headers={"Authorization": f"Bearer {info['token']}"}
    )
    return proc


if __name__ == "__main__":
    sys.exit(main())

"""What the operator dashboard costs the coordinator while 200 nodes report (issue 31).

A real coordinator (libp2p, SQLite, hypercorn) runs in this process with a store of 200
registered nodes and a job with a history (versions, trained groups, rejections: what a snapshot
reads). A second process is the load: reporter hosts (real libp2p peers, each a registered node)
send signed status RPCs at the rate of 200 nodes reporting every 2 s, and in the "open" phase
SSE viewers hold the operator's stream (``/v1/events``). Phases alternate closed / open / closed
/ open; per phase the coordinator's process CPU (psutil) and the status RPCs' p99 latency are
measured. Baseline: the closed phases, in the same run.

Printed: the coordinator's CPU per wall second in each phase, the extra with the dashboard open
(``dashboard_cpu_share``: a share of one core; goal <= 0.05; beside it how much the two closed
phases differ, its noise), the CPU the feed spent building snapshots (``snapshot_cpu_share``,
measured inside the feed), the status RPCs' p99 as the reporters see it, and the p99 lateness
of the coordinator's event loop (a 10 ms sleep probe: what any RPC waits extra), open against
closed. The reporters are fewer hosts than nodes (each sends for 200 / hosts nodes' worth of
statuses): 200 libp2p hosts do not fit beside the coordinator on 2 cores, and on 2 cores the
reporters' own process bounds the RPC rate and latency (the loop lag is the coordinator's).

``--quick``: 4 phases of 10 s (about a minute). Default: 4 phases of 60 s.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

from echo.tools.bench import emit, parse_args, say

ROOT = Path(__file__).resolve().parent.parent

NODES = 200
STATUS_EVERY_S = 2.0  # each of the 200 nodes reports this often


def _args(argv=None):
    def setup(p):
        p.add_argument("--child", nargs=5, metavar=("ADDR", "HTTP", "SECONDS", "VIEWERS", "OUT"),
                       help=argparse_hidden)
        p.add_argument("--hosts", type=int, default=10, help="reporter hosts (default 10)")
        p.add_argument("--viewers", type=int, default=5, help="SSE viewers when open")
        p.add_argument("--job", default="", help=argparse_hidden)

    return parse_args(__doc__.splitlines()[0], argv, setup=setup)


argparse_hidden = "internal: run as the load process"


# ---------------------------------------------------------------- the load (child process)


async def _load(
    addr: str, http: str, seconds: float, viewers: int, hosts: int, job_id: str
) -> dict:
    import httpx

    from echo.p2p.host import open_host
    from echo.p2p.identity import Identity
    from echo.protocol import ids, signing
    from echo.protocol import messages as m

    lat: list[float] = []
    events = [0]
    rate = NODES / STATUS_EVERY_S / max(1, hosts)  # statuses per second per host

    async def reporter(i: int, ready: trio.Event) -> None:
        ident = Identity.from_seed(i.to_bytes(32, "big"))
        async with open_host(ident, pubsub=False) as host:
            peer = await host.connect(addr)
            reg = m.Register(
                protocol_version=ids.PROTOCOL_VERSION, software="bench", engine="torch",
                hardware=m.Hardware(cpu_count=2, ram_bytes=1 << 30), tokens_per_s=100.0,
                upload_bps=0.0, download_bps=0.0, timestamp=time.time(), addrs=[],
            )
            sealed = signing.seal_record(ident.private_key, reg)
            await host.request(peer, ids.PROTO_REGISTER, sealed, timeout=10, max_response=1 << 20)
            ready.set()
            end = trio.current_time() + seconds
            while trio.current_time() < end:
                st = m.NodeStatus(job_id=job_id, version=-1, state_digest="", tokens_per_s=100.0,
                                  timestamp=time.time())
                t0 = time.perf_counter()
                await host.request(peer, ids.PROTO_STATUS,
                                   signing.seal_record(ident.private_key, st), timeout=10,
                                   max_response=1 << 16)
                lat.append(time.perf_counter() - t0)
                await trio.sleep(1.0 / rate)

    async def viewer() -> None:
        async with httpx.AsyncClient(base_url=http, timeout=30) as c, c.stream(
            "GET", "/v1/events", headers={"Authorization": "Bearer bench-token"}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: snapshot"):
                    events[0] += 1

    with trio.fail_after(seconds + 60):
        async with trio.open_nursery() as n:
            if hosts == 0:  # the viewers' process: SSE readers only
                for _ in range(viewers):
                    n.start_soon(viewer)
                await trio.sleep(seconds + 1)
                n.cancel_scope.cancel()
            readies = []
            for i in range(hosts):
                ev = trio.Event()
                readies.append(ev)
                n.start_soon(reporter, i, ev)
    lat.sort()
    return {"rpcs": len(lat), "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
            "p50_ms": 1000 * statistics.median(lat) if lat else None, "events": events[0]}


# ---------------------------------------------------------------- the coordinator (this process)


def _fill(store, job_id: str, group_size: int, versions: int) -> None:
    """200 nodes and a job history, inserted in one transaction (a fixture: the product path
    writes them one acknowledged group at a time)."""
    now = time.time()
    with store._tx() as db:
        for i in range(NODES):
            db.execute(
                "INSERT INTO nodes (node_id, public_key, engine, hardware_json, tokens_per_s,"
                " first_seen, last_seen, accepted, version) VALUES (?,?,?,?,?,?,?,?,?)",
                (f"node-{i:04d}", bytes(32), "torch", "{}", 100.0 + i, now - 3600, now, 10, 3),
            )
        for v in range(versions):
            at = now - (versions - v) * 10
            for g in range(16):
                rid = f"r-{v}-{g}"
                db.execute(
                    "INSERT INTO rollouts (rollout_id, job_id, node_id, version, prompt_id, status,"
                    " rewards_json, mean_reward, tokens, content_hash, envelope, created_at,"
                    " trained_version) VALUES (?,?,?,?,?,'trained','[]',?,?,?,x'',?,?)",
                    (rid, job_id, f"node-{(v * 16 + g) % NODES:04d}", max(0, v - 1), g, 0.5,
                     64 * group_size, rid.encode(), at, v),
                )
            db.execute(
                "INSERT INTO rejections (job_id, node_id, lease_id, reason, detail, at)"
                " VALUES (?,?,?,?,'',?)",
                (job_id, f"node-{v % NODES:04d}", f"x{v}", "bad_tokens", at),
            )
            db.execute(
                "INSERT INTO versions VALUES (?,?,'patch',x'','d',0,16,?,?,NULL)",
                (job_id, v, json.dumps({"eval_accuracy": v / versions, "staleness_mean": 1.0,
                                        "staleness_max": 2.0}), at),
            )
        db.execute("UPDATE jobs SET current_version=?, status='running' WHERE job_id=?",
                   (versions - 1, job_id))


async def _main(args) -> dict:
    from echo.coordinator.config import CoordinatorConfig
    from echo.coordinator.service import Coordinator
    from echo.coordinator.store import Store
    from echo.p2p.identity import Identity
    from echo.protocol.jobspec import parse_job

    seconds = 10.0 if args.quick else 60.0
    tmp = Path(tempfile.mkdtemp(prefix="echo-dash-bench-"))
    cfg = CoordinatorConfig(data_dir=tmp, listen=["/ip4/127.0.0.1/tcp/0"], http_port=0,
                            api_token="bench-token", learner={"local": False})
    coord = Coordinator(cfg, Store.open(tmp / "db.sqlite"), Identity.generate())
    spec = parse_job({"name": "bench", "task": {"name": "addition", "params": {}}})
    proc = psutil.Process()
    phases = []
    lags: list[float] = []

    async def lag_probe() -> None:
        # How late the coordinator's event loop wakes a 10 ms sleep: what any RPC waits extra.
        while True:
            t0 = time.perf_counter()
            await trio.sleep(0.01)
            lags.append(time.perf_counter() - t0 - 0.01)

    async with trio.open_nursery() as n:
        await n.start(coord.run)
        n.start_soon(lag_probe)
        job_id = coord.submit_job(spec)
        _fill(coord.store, job_id, spec.group_size, 60 if args.quick else 300)
        for phase in ("closed", "open", "closed", "open"):
            viewers = args.viewers if phase == "open" else 0
            out = tmp / f"{len(phases)}.json"
            def cmd(hosts: int, viewers: int, out: Path) -> list[str]:
                return [sys.executable, __file__, "--hosts", str(hosts), "--child",
                        coord.multiaddrs[0], coord.http_addrs[0], str(seconds), str(viewers),
                        str(out), "--job", job_id]

            # Reporters and viewers in processes of their own: neither slows the other's clock.
            child = await trio.lowlevel.open_process(cmd(args.hosts, 0, out))
            watcher = None
            if viewers:
                watcher = await trio.lowlevel.open_process(cmd(0, viewers, out.with_suffix(".v")))
            # The window: the child's steady state (after its hosts registered, before they stop).
            await trio.sleep(4.0)
            cpu0, t0, b0 = proc.cpu_times(), time.monotonic(), coord.live.build_cpu_s
            lags.clear()
            await trio.sleep(seconds - 2.0)
            cpu1, t1, b1 = proc.cpu_times(), time.monotonic(), coord.live.build_cpu_s
            lag = sorted(lags)
            lag_p99 = 1000 * lag[int(0.99 * (len(lag) - 1))]
            with trio.fail_after(seconds + 90):
                await child.wait()
                if watcher is not None:
                    await watcher.wait()
            load = json.loads(out.read_text())
            if watcher is not None:
                load["events"] = json.loads(out.with_suffix(".v").read_text())["events"]
            cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / (t1 - t0)
            phases.append({"phase": phase, "cpu_per_s": cpu, "loop_lag_p99_ms": lag_p99,
                           "snapshot_cpu_per_s": (b1 - b0) / (t1 - t0), **load})
            say(f"{phase:6s}: coordinator CPU {cpu:.3f} s/s, snapshots {(b1 - b0) / (t1 - t0):.4f}"
                f" s/s, status RPC p50 {load['p50_ms']:.1f} ms p99 {load['p99_ms']:.1f} ms"
                f" ({load['rpcs']} RPCs, {load['events']} SSE events), loop lag p99"
                f" {lag_p99:.1f} ms")
        n.cancel_scope.cancel()
    per_build = coord.live.build_cpu_s / max(1, coord.live.builds)
    say(f"one snapshot (200 nodes, the job's history) takes {1000 * per_build:.1f} ms of CPU;"
        f" at one per {coord.live.tick_s:.0f} s tick: {per_build / coord.live.tick_s:.4f} of a core"
        f" whatever the number of viewers")
    coord.store.close()
    closed = [p for p in phases if p["phase"] == "closed"]
    opened = [p for p in phases if p["phase"] == "open"]

    def mean(ps, k):
        return sum(p[k] for p in ps) / len(ps)

    share = mean(opened, "cpu_per_s") - mean(closed, "cpu_per_s")
    noise = abs(closed[0]["cpu_per_s"] - closed[1]["cpu_per_s"])
    snap_share = mean(opened, "snapshot_cpu_per_s")
    p99_ratio = mean(opened, "p99_ms") / mean(closed, "p99_ms")
    lag_ratio = mean(opened, "loop_lag_p99_ms") / mean(closed, "loop_lag_p99_ms")
    say(f"dashboard open vs closed: {share:+.3f} CPU s/s (closed phases differ by {noise:.3f};"
        f" snapshots alone {snap_share:.4f}), status RPC p99 x{p99_ratio:.2f}, coordinator loop"
        f" lag p99 x{lag_ratio:.2f}")
    return {
        "benchmark": "dashboard",
        "nodes": NODES,
        "reporter_hosts": args.hosts,
        "viewers": args.viewers,
        "phase_s": seconds,
        "dashboard_cpu_share": round(share, 4),
        "cpu_noise_between_closed_phases": round(noise, 4),
        "snapshot_cpu_share": round(snap_share, 5),
        "snapshot_cpu_ms": round(1000 * per_build, 2),
        "snapshot_share_per_tick": round(per_build / coord.live.tick_s, 5),
        "rpc_p99_ms_closed": round(mean(closed, "p99_ms"), 2),
        "rpc_p99_ms_open": round(mean(opened, "p99_ms"), 2),
        "rpc_p99_open_vs_closed": round(p99_ratio, 3),
        "loop_lag_p99_ms_closed": round(mean(closed, "loop_lag_p99_ms"), 2),
        "loop_lag_p99_ms_open": round(mean(opened, "loop_lag_p99_ms"), 2),
        "goal_cpu_share": 0.05,
        "phases": phases,
    }


def main() -> None:
    args = _args()
    if args.child:
        addr, http, seconds, viewers, out = args.child
        res = trio.run(_load, addr, http, float(seconds), int(viewers), args.hosts, args.job)
        Path(out).write_text(json.dumps(res))
        return
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    emit(trio.run(_main, args))


if __name__ == "__main__":
    main()

"""What one churned identity costs the coordinator, against one honest request (issue 26).

An identity churner (``benchmarks/attack.py``'s ``churn``) costs the coordinator per identity a
connection (TCP, Noise, yamux, multiselect, identify), a registration, a lease request, a junk
submission and, while the identity stays connected, whatever the coordinator does on its own
for a new node (its dial-back reachability probe). This runs a real coordinator (its own
process, real libp2p host, real SQLite, a job) and, from this process, measures the
coordinator's CPU seconds (``/proc``, its whole process) in four phases of the same run:

1. idle: nobody asks anything (housekeeping's own rate, subtracted from the phases below);
2. honest: one registered node, already connected, asks for leases back to back: the
   baseline, CPU per honest request;
3. connections: fresh identities that connect, stay ``--linger`` seconds and ask nothing
   (the share of the connection itself);
4. churn: fresh identities, each dialling from a listening host of its own, registering,
   asking for a lease, sending one junk submission and staying connected ``--linger`` seconds
   (an attacker stays as long as staying costs the coordinator more).

Prints the CPU per churned identity in ms and as a ratio to one honest request, and how many
dial-backs the coordinator made (its log). ``--quick``: fewer requests and identities.

JSON: ``cpu_ms_per_identity``, ``cpu_ms_per_honest_request``, ``cpu_ms_per_connection``,
``identity_vs_honest_request``, ``dialbacks``, ``identities``, ``load_avg_1m``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from echo.p2p.host import open_host
from echo.p2p.identity import Identity
from echo.protocol import ids
from echo.tools.bench import emit, parse_args, say
from echo.tools.peer_kit import lease_request, loopback_config, registration

JOB = "churn"
IDLE_S = 2.0


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _py_spy(pid: int, out: str) -> subprocess.Popen:
    """py-spy sampling ``pid`` into ``out`` (collapsed stacks, idle samples left out) until
    interrupted."""
    exe = Path(sys.executable).with_name("py-spy")
    cmd = [str(exe) if exe.exists() else "py-spy", "record", "-p", str(pid), "-f", "raw"]
    cmd += ["-o", out, "-r", "200"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def serve(data_dir: Path) -> None:
    """The coordinator's process: a job, its address written to ``data_dir/addr``."""
    from echo.coordinator.service import Coordinator
    from echo.coordinator.store import Store
    from echo.protocol.jobspec import parse_job

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    # Budgets are not what this measures: the honest node asks back to back.
    cfg = loopback_config(data_dir, {"requests_per_s": 1000.0, "burst_requests": 1000.0})
    coord = Coordinator(cfg, Store.open(data_dir / "db.sqlite"), Identity.generate())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(coord.run)
            spec = {"name": JOB, "group_size": 4, "batch_groups": 2, "steps": 5}
            spec["task"] = {"name": "addition", "params": {"max_operand": 5}}
            job_id = coord.submit_job(parse_job(spec))
            tmp = data_dir / "addr.tmp"
            tmp.write_text(f"{coord.multiaddrs[0]}\n{job_id}\n")
            tmp.rename(data_dir / "addr")

    trio.run(main)


def _registration(ident: Identity, host) -> bytes:
    return registration(ident, host.listen_multiaddrs, software="bench")


async def _call(host, peer, proto: str, payload: bytes) -> bytes:
    return await host.request(peer, proto, payload, timeout=10, max_response=1 << 20)


async def _visit(
    addr: str, job_id: str, linger_s: float, errors: list[str], bare: bool = False
) -> None:
    ident = Identity.generate()
    try:
        async with open_host(ident, ["/ip4/127.0.0.1/tcp/0"], pubsub=False) as host:
            peer = await host.connect(addr)
            if bare:  # the connection alone: no request
                await trio.sleep(linger_s)
                return
            await _call(host, peer, ids.PROTO_REGISTER, _registration(ident, host))
            try:
                await _call(host, peer, ids.PROTO_LEASE, lease_request(ident, job_id, n=2))
                await _call(host, peer, ids.PROTO_SUBMIT, os.urandom(4096))
            except Exception as exc:  # noqa: BLE001 (refusals are expected: junk)
                errors.append(type(exc).__name__)
            await trio.sleep(linger_s)
    except Exception as exc:  # noqa: BLE001 (counted, the run goes on)
        errors.append(type(exc).__name__)


async def _churn(
    addr: str, job_id: str, n: int, rate: float, linger_s: float, bare: bool = False
) -> list[str]:
    errors: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(_visit, addr, job_id, linger_s, errors, bare)
            await trio.sleep(1.0 / rate)
    return errors


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]))
        return

    def setup(p) -> None:
        p.add_argument("--rate", type=float, default=5.0, help="churned identities a second")
        p.add_argument("--linger", type=float, default=1.0, help="seconds each one stays")
        p.add_argument(
            "--profile",
            metavar="FILE",
            help="py-spy (if installed) samples the coordinator during the churn, raw stacks",
        )

    args = parse_args(__doc__.splitlines()[0], setup=setup)
    honest_n, churn_n = (200, 40) if args.quick else (1000, 150)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        log_path = data / "coordinator.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, __file__, "--serve", str(data)], stderr=log)
        try:
            deadline = time.monotonic() + 120
            while not (data / "addr").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"coordinator did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.2)
            addr, job_id = (data / "addr").read_text().split()
            time.sleep(2.0)  # its job's start-up work settles

            c0 = _cpu_s(proc.pid)
            time.sleep(IDLE_S)
            idle_rate = (_cpu_s(proc.pid) - c0) / IDLE_S
            say(f"idle: {idle_rate * 100:.1f}% of a core")

            cpu, honest_s = trio.run(_honest_phase, addr, job_id, honest_n, proc.pid)
            honest_ms = (cpu - idle_rate * honest_s) / honest_n * 1e3
            say(f"honest: {honest_n} lease requests, {honest_ms:.2f} ms CPU each")

            t0, c0 = time.monotonic(), _cpu_s(proc.pid)
            trio.run(_churn, addr, job_id, churn_n, args.rate, args.linger, True)
            time.sleep(1.0)
            bare_s = time.monotonic() - t0
            conn_ms = ((_cpu_s(proc.pid) - c0) - idle_rate * bare_s) / churn_n * 1e3
            say(f"connections alone: {churn_n} at {args.rate}/s, {conn_ms:.1f} ms CPU each")

            spy = _py_spy(proc.pid, args.profile) if args.profile else None
            t0, c0 = time.monotonic(), _cpu_s(proc.pid)
            errors = trio.run(_churn, addr, job_id, churn_n, args.rate, args.linger)
            time.sleep(1.0)  # dial-backs of the last ones
            churn_s = time.monotonic() - t0
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its samples on an interrupt
                spy.wait(30)
            ident_ms = ((_cpu_s(proc.pid) - c0) - idle_rate * churn_s) / churn_n * 1e3
            dialbacks = log_path.read_text().count("dialled")
            say(
                f"churn: {churn_n} identities at {args.rate}/s, {ident_ms:.1f} ms CPU each "
                f"({ident_ms / honest_ms:.0f}x an honest request), {dialbacks} dial-backs, "
                f"{len(errors)} refused calls"
            )
        finally:
            proc.terminate()
            proc.wait(10)
    emit(
        {
            "cpu_ms_per_identity": round(ident_ms, 2),
            "cpu_ms_per_honest_request": round(honest_ms, 3),
            "cpu_ms_per_connection": round(conn_ms, 2),
            "identity_vs_honest_request": round(ident_ms / honest_ms, 1),
            "dialbacks": dialbacks,
            "identities": churn_n,
            "load_avg_1m": os.getloadavg()[0],
        }
    )


async def _honest_phase(addr: str, job_id: str, n: int, pid: int) -> tuple[float, float]:
    """(coordinator CPU seconds, wall seconds) of ``n`` lease requests of one registered,
    connected node (its connection, registration and dial-back are not counted)."""
    ident = Identity.generate()
    async with open_host(ident, ["/ip4/127.0.0.1/tcp/0"], pubsub=False) as host:
        peer = await host.connect(addr)
        await _call(host, peer, ids.PROTO_REGISTER, _registration(ident, host))
        await trio.sleep(1.0)  # its dial-back and scheduling pass are done before the count
        t0, c0 = time.monotonic(), _cpu_s(pid)
        for _ in range(n):
            await _call(host, peer, ids.PROTO_LEASE, lease_request(ident, job_id, n=2))
        return _cpu_s(pid) - c0, time.monotonic() - t0


if __name__ == "__main__":
    main()

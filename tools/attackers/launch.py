"""Where and how the attacker processes run beside a local swarm (benchmarks/attack.py): their
addresses, their cores and scheduling, their start, their counters and their stop.

Where the attackers stand: they dial from 127.0.0.x addresses other than the honest nodes'
127.0.0.1, which the coordinator counts as networks of their own (``[admission]
loopback_is_network``: budgets, a connection cap and a handshake rate per address, as for a
stranger's public /24). Each kind has an address of its own (:data:`KIND_NETWORKS`): behind
one, the kinds refused each other (the leecher was refused at the handshake for whole phases
behind the junk streams' address, and the hoarders' registrations alone spend a network's
96 a minute), which measures the budgets, not the attacks. The churner's identities come
from a new address each (127.1.0.0/16), a botnet's: from one network it could not register 5
a second (the budget admits 1.6). An ``ip`` of None puts every attacker on 127.0.0.1 with
the honest nodes, uncapped, as if each identity had a network of its own. On the internet the
attackers use their own machines; here they get cores of their own (``cpus``: the swarm is
pinned to the others), and run under SCHED_IDLE (:data:`ATTACKER_SCHED`) besides (which
ranks them only inside their sessions' autogroups: see :data:`AUTOGROUP_NICE`). Sharing
the cores instead, five processes that only spin slowed a 2-core swarm by ~30%: CPU taken,
not damage done through the protocol.

Each attacker writes its counters to ``<out>/attack-<kind>.json`` and logs to
``attack-<kind>.log`` (:mod:`echo.tools.attackers` run as a process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from echo.node.priority import lower_session_group
from echo.tools.bench import say
from echo.tools.processes import ROOT, stop

# Where the attackers dial from: one address, another network than the honest nodes' (an
# attacker with many identities but one machine, the case budgets per network prefix are for).
ATTACKER_IP = "127.0.0.2"
# Kinds with a network of their own (see the module doc); the rest share ATTACKER_IP.
KIND_NETWORKS = {
    "leech": "127.0.0.3",
    "leech24": "127.0.0.4",
    "bomb": "127.0.0.5",
    "stale": "127.0.0.6",
    "demote": "127.0.0.7",
    "churn": "127.1.0.0/16",
}
CHURN_RATE = 5.0
# How the attacker processes share this machine's cores with the swarm. On the internet they run
# on their own machines, so what they should cost here is the work they make the coordinator and
# the nodes do, not CPU time taken from them. "idle" (SCHED_IDLE) runs an attacker only when no
# swarm process wants a core. Measured with all five (--quick, 2 cores): nice 19, ratio 0.35 and
# lease p50 14 -> 108 ms; SCHED_IDLE, 0.52 and 12 -> 59 ms. Neither removes the cost of sharing
# the cores: spinning SCHED_IDLE processes alone slow this swarm by ~30% (see the README).
ATTACKER_SCHED = {"idle": ["chrt", "--idle", "0"], "nice": ["nice", "-n", "19"], "none": []}
# Each attacker starts a session of its own (stop() ends its process group), and with autogroup
# scheduling (/proc/sys/kernel/sched_autogroup_enabled, on here) each session is one group
# that the kernel weighs as a nice-0 task, whatever its tasks' policy: SCHED_IDLE only ranks
# tasks inside their group. Measured (10 SCHED_IDLE spinners pinned to core 1, each in its own
# session, 12 s windows): the machine's other work kept 0.3-8.5 % of core 1 against 13-99 %
# without them; what it lost waited or moved to the other core, the swarm's. So by default the
# attackers compete with the machine's other work on their own core as nice-0 processes would
# (never on the swarm's). "idle-autogroup19" puts their autogroups at the lowest weight too,
# which yields as SCHED_IDLE meant, but at load 19 they got 3 % of a core and none of the ten
# began its attack within 60 s: no attack measured.
ATTACKER_SCHED["idle-autogroup19"] = ATTACKER_SCHED["idle"]
AUTOGROUP_NICE = 19


def _lowest_autogroup() -> None:
    """In the attacker's process, after its setsid: its session's autogroup at nice 19 (a
    kernel without autogroups: the policy alone ranks the attacker)."""
    lower_session_group(AUTOGROUP_NICE)


class Fleet:
    """The attacker processes of one run against the coordinator at ``maddr``, job ``job_id``;
    ``peers``: the honest nodes' addresses (what leechers, gossip spammers and demoters aim at);
    ``marker_dir``: where the bombs' code payloads would leave their traces."""

    def __init__(
        self,
        out: Path,
        maddr: str,
        job_id: str,
        peers: list[str],
        marker_dir: Path,
        sched: str = "idle",
        ip: str | None = ATTACKER_IP,
        cpus: set[int] | None = None,
    ) -> None:
        self.out, self.maddr, self.job_id, self.peers = out, maddr, job_id, peers
        self.marker_dir, self.ip, self.cpus = marker_dir, ip, cpus
        self.prefix = ATTACKER_SCHED[sched]
        self.lowest = sched == "idle-autogroup19"
        self.procs: list[subprocess.Popen] = []
        self.kinds: list[str] = []

    def start(self, kinds: list[str]) -> None:
        pin = ["taskset", "-c", ",".join(map(str, sorted(self.cpus)))] if self.cpus else []
        for kind in kinds:
            cmd = [
                *pin,
                *self.prefix,
                sys.executable,
                "-m",
                "echo.tools.attackers",
                kind,
                "--coordinator",
                self.maddr,
                "--job",
                self.job_id,
                "--stats",
                str(self.out / f"attack-{kind}.json"),
            ]
            if self.ip:
                own = self.ip == ATTACKER_IP and KIND_NETWORKS.get(kind)
                cmd += ["--source-ip", own or self.ip]
            if kind in ("liar", "stale"):
                cmd += ["--data-dir", str(self.out / kind)]
            if kind in ("leech", "leech24", "gossip", "demote"):
                for addr in self.peers:
                    cmd += ["--peer", addr]
            if kind == "churn":
                cmd += ["--rate", str(CHURN_RATE)]
            if kind == "bomb":
                cmd += ["--marker-dir", str(self.marker_dir)]
            with open(self.out / f"attack-{kind}.log", "wb") as log:  # the child keeps it
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                        start_new_session=True,
                        preexec_fn=_lowest_autogroup if self.lowest else None,
                    )
                )
            self.kinds.append(kind)

    def stats(self) -> dict:
        """Each attacker's counters as it last wrote them, by kind."""
        out = {}
        for path in sorted(self.out.glob("attack-*.json")):
            try:
                out[path.stem.removeprefix("attack-")] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def wait_for_stale(self, cap_s: float) -> None:
        """Until every stale hoarder has earned its quota and turned, at most ``cap_s``."""
        deadline = time.time() + cap_s
        while time.time() < deadline:
            st = self.stats().get("stale", {})
            if st.get("identities") and st.get("turned", 0) >= st["identities"]:
                say(f"the {st['turned']} stale hoarders have turned")
                return
            if self.procs[self.kinds.index("stale")].poll() is not None:
                break
            time.sleep(1.0)
        st = self.stats().get("stale", {})
        say(
            f"stale hoarders: {st.get('turned', 0)} of {st.get('identities', '?')} turned "
            f"({st.get('warm_accepted', 0)} groups accepted meanwhile); attacking anyway"
        )

    def wait_for_start(self, cap_s: float) -> None:
        """Until every attacker started has begun (written its counters), at most ``cap_s``."""
        deadline = time.time() + cap_s
        waiting = list(self.kinds)
        while waiting and time.time() < deadline:
            waiting = [
                k
                for k, p in zip(self.kinds, self.procs, strict=True)
                if not (self.out / f"attack-{k}.json").exists() and p.poll() is None
            ]
            time.sleep(0.5)
        if waiting:
            say(f"attackers not started after {cap_s:.0f} s (measured anyway): {waiting}")

    def dead(self) -> list[str]:
        """The kinds whose process has exited."""
        return [k for k, p in zip(self.kinds, self.procs, strict=True) if p.poll() is not None]

    def stop(self) -> None:
        stop(self.procs)

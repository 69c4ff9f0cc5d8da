#!/usr/bin/env python3
"""Emulated hosts on one machine: network namespaces on a private bridge, shaped by tc.

Each host is a network namespace ``<prefix>-<name>`` holding one end of a veth pair whose other
end is attached to the bridge ``<prefix>br`` in the root namespace. Hosts get addresses from a
private /24 (default ``10.77.0.0/24``, host ``i`` is ``.i+2``); the bridge itself has no address,
there is no default route in any namespace, no NAT and no forwarding, so traffic can only go from
one emulated host to another -- never off the machine.

Shaping, per host and direction (rates in bytes per second), on the veth end where packets
leave: the host's own end for upload, the bridge-side end for download.

- ``htb``: one HTB class at the link rate with two children: TCP packets under 128
  bytes (ACKs, window updates) in a priority class, everything else in a bulk class whose FIFO
  holds about 100 ms (at least 256 KiB). Like a home router with upstream ACK priority: without
  it a saturated upload delays the ACKs of everything the host downloads by the whole queue,
  and TCP recovers from a loss at a crawl (bufferbloat), which is not what we mean to measure.
- ``htb-fq`` (default): as ``htb``, but the bulk class is split into
  one class per other host (by destination IP on upload, source IP on download), each with its
  own FIFO, sharing the link round-robin -- like a router with per-flow fair queueing
  (fq_codel, cake), which this kernel lacks as qdiscs. With one FIFO shared by a dozen flows,
  drop-tail losses land on a few flows at a time and their retransmission timeouts back off
  for seconds while the others take the link, so a parent's children start seconds apart.
- ``tbf``: a plain token bucket (10 ms bucket, at least 128 KiB; 100 ms queue, at least
  256 KiB) -- simpler, and bufferbloat included.
- All: the veths' GSO packets are capped at 16 KiB so a queue of 100 ms still holds several of
  them at the slowest rates.
- Latency: netem as the leaf of the (upload) classes, *when the kernel has sch_netem*. If it
  does not, ``up`` says so on stderr and records ``delay_ms: "unsupported"``; nothing else
  fails.

Commands (root and iproute2 needed)::

    netem.py up --hosts src:10e6:40e6 n1:2e6:20e6[:DELAY_MS] ...   # name:up_Bps:down_Bps[:ms]
    netem.py down                                                  # remove everything we made
    netem.py exec NAME -- CMD ...                                  # run CMD inside host NAME
    netem.py status                                                # hosts, addresses, qdiscs

Python use (the broadcast benchmark): :func:`available`, :func:`up` (returns :class:`HostInfo`
list and cleans up after itself if any step fails), :func:`down`, :func:`exec_argv`.

Owns: the namespaces, bridge and veths named with its prefix, and the state file
``/tmp/echo-netem-<prefix>.json``; ``down`` removes exactly those. Raises :class:`NetemError`
(with the failing command and its stderr) for anything the kernel or iproute2 refuses.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_PREFIX = "ech"
DEFAULT_SUBNET = "10.77.0.0/24"
# tbf: a bucket of 10 ms at the rate but at least 128 KiB, so GSO packets pass whole (a smaller
# bucket makes tbf cut each into MTU-sized packets, which costs CPU on every hop); a queue of
# 100 ms, at least 256 KiB.
_BURST_S = 0.01
_QUEUE_S = 0.1
_MIN_BURST = 128 * 1024
_MIN_QUEUE = 256 * 1024
# htb: the bulk FIFO holds 100 ms at the rate, at least 256 KiB (a smaller queue shared by a
# dozen TCP flows drops so much that retransmission timeouts stall flows for seconds).
_HTB_MIN_QUEUE = 256 * 1024
_GSO_MAX = 16 * 1024
# u32 match: IPv4 protocol TCP and total length < 128 bytes (pure ACKs, small control frames).
_SMALL_TCP = ["match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2"]
SHAPERS = ("htb", "htb-fq", "tbf")
# htb-fq: every per-peer class gets the same quantum, so backlogged peers share the link equally;
# above a veth GSO packet (16 KiB plus headers) so each turn sends at least one whole packet.
_FQ_QUANTUM = 18000
_CMD_TIMEOUT_S = 20.0
_NAME_MAX = 15  # Linux interface names


class NetemError(RuntimeError):
    """iproute2 / tc refused a step (message holds the command and its stderr)."""


@dataclass(frozen=True)
class HostSpec:
    name: str
    up_bps: float
    down_bps: float
    delay_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> HostSpec:
        parts = text.split(":")
        if len(parts) not in (3, 4) or not parts[0]:
            raise ValueError(f"host spec {text!r} is not NAME:UP_BPS:DOWN_BPS[:DELAY_MS]")
        return cls(parts[0], float(parts[1]), float(parts[2]),
                   float(parts[3]) if len(parts) == 4 else 0.0)


@dataclass(frozen=True)
class HostInfo:
    name: str
    netns: str
    ip: str
    up_bps: float
    down_bps: float
    delay_ms: float | str
    dev: str = ""  # the host's veth end (inside its namespace)
    bridge_dev: str = ""  # the bridge-side end


def _state_path(prefix: str) -> Path:
    return Path(f"/tmp/echo-netem-{prefix}.json")


def run_command(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (an ``ip``/``tc``/``iptables`` call), bounded by a timeout; output captured.

    :raises NetemError: if it cannot start, times out, or (with ``check``) exits non-zero.
    """
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetemError(f"{' '.join(argv)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise NetemError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ns(prefix: str, name: str) -> str:
    return f"{prefix}-{name}"


def _ifnames(prefix: str, index: int) -> tuple[str, str]:
    """(bridge-side veth, host-side veth) names for host ``index``."""
    outer, inner = f"{prefix}v{index}", f"{prefix}h{index}"
    if len(outer) > _NAME_MAX or len(inner) > _NAME_MAX:
        raise ValueError(f"prefix {prefix!r} too long for interface names")
    return outer, inner


def _tbf(rate_bps: float) -> list[str]:
    burst = max(_MIN_BURST, int(rate_bps * _BURST_S))
    limit = max(_MIN_QUEUE, int(rate_bps * _QUEUE_S))
    return ["tbf", "rate", f"{int(rate_bps * 8)}bit", "burst", str(burst), "limit", str(limit)]


def shape(tc: list[str], dev: str, rate_bps: float, shaper: str, delay_ms: float,
           queue_s: float = _QUEUE_S, peers: Sequence[tuple[str, str]] = ()) -> None:
    """Shape egress of ``dev`` (``tc`` is the tc prefix, with ``-n NS`` for a namespace).

    ``peers`` (``htb-fq`` only): ``("dst" | "src", ip)`` per other host, one bulk class each."""
    rate = f"{int(rate_bps * 8)}bit"
    if shaper == "tbf":
        if delay_ms > 0:
            run_command([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                         f"{delay_ms}ms"])
            run_command([*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                         *_tbf(rate_bps)])
        else:
            run_command([*tc, "qdisc", "add", "dev", dev, "root", *_tbf(rate_bps)])
        return
    queue = max(_HTB_MIN_QUEUE, int(rate_bps * queue_s))
    small, bulk = f"{max(8, int(rate_bps * 0.1 * 8))}bit", f"{int(rate_bps * 0.9 * 8)}bit"
    run_command([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"])
    run_command([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                 "rate", rate, "ceil", rate])
    run_command([*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb",
                 "rate", small, "ceil", rate, "prio", "0"])
    leaves = [("1:10", "10:", None), ("1:20", "20:", None)]
    run_command([*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb",
                 "rate", bulk, "ceil", rate, "prio", "1"])
    if shaper == "htb-fq":
        share = f"{max(8, int(rate_bps * 0.9 * 8 / max(1, len(peers))))}bit"
        for j, (field_, ip) in enumerate(peers):
            cls = f"1:{0x100 + j:x}"
            run_command([*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb",
                         "rate", share, "ceil", rate, "prio", "1", "quantum", str(_FQ_QUANTUM)])
            leaves.append((cls, f"{0x100 + j:x}:", (field_, ip)))
    for cls, handle, _ in leaves:
        limit = "1000" if handle == "10:" else str(max(64, queue // 1500))
        if delay_ms > 0:
            run_command([*tc, "qdisc", "add", "dev", dev, "parent", cls, "handle", handle,
                         "netem", "delay", f"{delay_ms}ms", "limit", limit])
        elif handle == "10:":
            run_command([*tc, "qdisc", "add", "dev", dev, "parent", cls, "handle", handle, "pfifo",
                         "limit", "1000"])
        else:
            run_command([*tc, "qdisc", "add", "dev", dev, "parent", cls, "handle", handle, "bfifo",
                         "limit", str(queue)])
    run_command([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                 "u32", *_SMALL_TCP, "flowid", "1:10"])
    for cls, _, match in leaves:
        if match is not None:
            run_command([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                         "2", "u32", "match", "ip", match[0], f"{match[1]}/32", "flowid", cls])


def available(prefix: str = "echk") -> tuple[bool, str]:
    """Can we build namespaces and shape them here? (ok, reason). Leaves nothing behind."""
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) not installed"
    probe = [HostSpec("a", 1e6, 1e6), HostSpec("b", 1e6, 1e6)]
    try:
        up(probe, prefix=prefix, subnet="10.76.255.0/29", quiet=True)
    except (NetemError, OSError) as exc:
        return False, str(exc)
    finally:
        down(prefix, quiet=True)
    return True, "ok"


def netem_supported() -> bool:
    """Whether the kernel offers the netem qdisc (delay emulation)."""
    cfg = Path("/proc/config.gz")
    if cfg.exists():
        import gzip

        with gzip.open(cfg, "rt") as f:
            text = f.read()
        if "CONFIG_NET_SCH_NETEM=y" in text or "CONFIG_NET_SCH_NETEM=m" in text:
            return True
        if "# CONFIG_NET_SCH_NETEM is not set" in text:
            return False
    return Path("/sys/module/sch_netem").exists()


def up(
    hosts: Sequence[HostSpec],
    *,
    prefix: str = DEFAULT_PREFIX,
    subnet: str = DEFAULT_SUBNET,
    quiet: bool = False,
    sysctls: Sequence[str] = (),
    shaper: str = "htb-fq",
    queue_s: float = _QUEUE_S,
    gso_max: int = _GSO_MAX,
) -> list[HostInfo]:
    """Build the hosts (after removing any previous set with this prefix). On any failure
    everything built so far is removed and :class:`NetemError` raised. ``sysctls``
    (``key=value``) are set inside every namespace (e.g. ``net.ipv4.tcp_notsent_lowat=131072``)."""
    net = ipaddress.ip_network(subnet)
    if not net.is_private:
        raise ValueError(f"{subnet} is not a private range")
    if len(hosts) > net.num_addresses - 3:
        raise ValueError(f"{len(hosts)} hosts do not fit in {subnet}")
    if shaper not in SHAPERS:
        raise ValueError(f"shaper must be one of {SHAPERS}")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError("host names must be unique")
    down(prefix, quiet=True)
    bridge = f"{prefix}br"
    delay_ok = netem_supported()
    infos: list[HostInfo] = []
    try:
        run_command(["ip", "link", "add", bridge, "type", "bridge"])
        _sysctl_quiet(f"/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6", "1")
        run_command(["ip", "link", "set", bridge, "up"])
        for i, h in enumerate(hosts):
            ns = _ns(prefix, h.name)
            outer, inner = _ifnames(prefix, i)
            ip = str(net.network_address + i + 2)
            run_command(["ip", "netns", "add", ns])
            no_v6 = "net.ipv6.conf.all.disable_ipv6=1"
            run_command(["ip", "netns", "exec", ns, "sysctl", "-qw", no_v6], check=False)
            run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
            for kv in sysctls:
                run_command(["ip", "netns", "exec", ns, "sysctl", "-qw", kv])
            run_command(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
            run_command(["ip", "link", "set", inner, "netns", ns])
            run_command(["ip", "link", "set", outer, "master", bridge])
            run_command(["ip", "link", "set", outer, "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{ip}/{net.prefixlen}", "dev", inner])
            run_command(["ip", "-n", ns, "link", "set", inner, "up"])
            for ipn, dev in ((["ip", "-n", ns], inner), (["ip"], outer)):
                run_command(
                    [*ipn, "link", "set", "dev", dev, "gso_max_size", str(gso_max)], check=False
                )
            delay: float | str = h.delay_ms
            if h.delay_ms > 0 and not delay_ok:
                delay = "unsupported"
                if not quiet:
                    print(f"netem: this kernel has no sch_netem; {h.name} gets no added delay "
                          f"({h.delay_ms} ms asked), bandwidth shaping only", file=sys.stderr)
            applied = h.delay_ms if delay_ok else 0.0
            # Upload where it leaves the host, download where the bridge hands it over.
            others = [str(net.network_address + j + 2) for j in range(len(hosts)) if j != i]
            shape(["tc", "-n", ns], inner, h.up_bps, shaper, applied, queue_s,
                   [("dst", o) for o in others])
            shape(["tc"], outer, h.down_bps, shaper, 0.0, queue_s, [("src", o) for o in others])
            infos.append(HostInfo(h.name, ns, ip, h.up_bps, h.down_bps, delay, inner, outer))
        _state_path(prefix).write_text(json.dumps([asdict(i) for i in infos], indent=1))
    except BaseException:
        down(prefix, quiet=True)
        raise
    if not quiet:
        for info in infos:
            print(f"netem: {info.name:>8} {info.ip:<12} up {info.up_bps / 1e6:.2f} MB/s  "
                  f"down {info.down_bps / 1e6:.2f} MB/s  delay {info.delay_ms}", file=sys.stderr)
    return infos


def _sysctl_quiet(path: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path(path).write_text(value)


def remove_namespaces_and_links(prefix: str, ours: Callable[[str], bool]) -> None:
    """Delete every namespace ``<prefix>-*`` (with the links inside it), then every link of the
    root namespace whose name ``ours`` accepts; what is already gone is passed over."""
    listing = run_command(["ip", "netns", "list"], check=False).stdout
    for line in listing.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(f"{prefix}-"):
            run_command(["ip", "netns", "del", ns], check=False)
    links = run_command(["ip", "-o", "link", "show"], check=False).stdout
    for line in links.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if ours(name):
            run_command(["ip", "link", "del", name], check=False)


def down(prefix: str = DEFAULT_PREFIX, *, quiet: bool = False) -> None:
    """Remove every namespace, veth and bridge this prefix made (idempotent)."""
    remove_namespaces_and_links(
        prefix,
        lambda name: name == f"{prefix}br"
        or (name.startswith(f"{prefix}v") and name[len(prefix) + 1 :].isdigit()),
    )
    _state_path(prefix).unlink(missing_ok=True)
    if not quiet:
        print(f"netem: removed hosts with prefix {prefix!r}", file=sys.stderr)


def load(prefix: str = DEFAULT_PREFIX) -> list[HostInfo]:
    path = _state_path(prefix)
    if not path.exists():
        return []
    return [HostInfo(**d) for d in json.loads(path.read_text())]


def exec_argv(name: str, argv: Sequence[str], prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The command line that runs ``argv`` inside host ``name``."""
    return ["ip", "netns", "exec", _ns(prefix, name), *argv]


def status(prefix: str = DEFAULT_PREFIX) -> str:
    lines = []
    for info in load(prefix):
        lines.append(f"{info.name} ({info.netns}) {info.ip} up {info.up_bps / 1e6:.2f} MB/s "
                     f"down {info.down_bps / 1e6:.2f} MB/s delay {info.delay_ms}")
        for label, tc, dev in (("up", ["tc", "-n", info.netns], info.dev),
                               ("down", ["tc"], info.bridge_dev)):
            out = run_command([*tc, "-s", "qdisc", "show", "dev", dev], check=False).stdout.strip()
            lines += [f"  {label}: " + ln.strip() for ln in out.splitlines() if ln.strip()]
    return "\n".join(lines) or f"no hosts with prefix {prefix!r}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="create hosts")
    p_up.add_argument("--hosts", nargs="+", required=True, help="NAME:UP_BPS:DOWN_BPS[:DELAY_MS]")
    p_up.add_argument("--subnet", default=DEFAULT_SUBNET)
    p_up.add_argument("--shaper", choices=SHAPERS, default="htb-fq")
    p_up.add_argument("--sysctl", nargs="*", default=[], help="key=value set in every host")
    sub.add_parser("down", help="remove hosts")
    sub.add_parser("status", help="show hosts and qdisc counters")
    p_exec = sub.add_parser("exec", help="run a command inside a host")
    p_exec.add_argument("name")
    p_exec.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            up([HostSpec.parse(h) for h in args.hosts], prefix=args.prefix, subnet=args.subnet,
               shaper=args.shaper, sysctls=args.sysctl)
        elif args.cmd == "down":
            down(args.prefix)
        elif args.cmd == "status":
            print(status(args.prefix))
        elif args.cmd == "exec":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not cmd:
                parser.error("exec needs a command after --")
            os.execvp("ip", exec_argv(args.name, cmd, args.prefix))
    except (NetemError, ValueError) as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `status | head`
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

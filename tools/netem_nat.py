#!/usr/bin/env python3
"""An emulated internet on one machine: public hosts, home routers doing NAT, nodes behind them.

Layout (every name carries the prefix, default ``ecn``):

- the *public internet* is a bridge ``<prefix>pub`` in the root namespace with no address, and a
  private /24 (default ``10.78.0.0/24``) standing in for public addresses;
- a *public host* is a namespace ``<prefix>-<name>`` with one veth on that bridge;
- a *home router* is a namespace ``<prefix>-<name>`` with a WAN veth on the public bridge and a
  LAN bridge of its own (``192.168.<k>.0/24``, the router is ``.1``). It forwards LAN -> WAN,
  masquerades (iptables ``MASQUERADE``) and lets back in only what conntrack ties to a
  connection opened from inside -- like a home router with no port forwarded. Two kinds:

  - ``eim`` (endpoint-independent mapping): plain ``MASQUERADE``, which keeps the source port
    whenever it is free, so one inside port maps to the same outside port for every remote;
  - ``sym`` (symmetric, port-randomising): ``MASQUERADE --random-fully``, a fresh random outside
    port per connection (what breaks hole punching);

- a *node behind a router* is a namespace with a veth on the router's LAN bridge and a default
  route via the router. Two nodes behind one router reach each other on their LAN addresses.

No namespace has a route off the machine: public hosts have no default route at all, and a
router's only default is none (it forwards between its LAN and the public bridge only), so
traffic stays between the namespaces. ``--forward PORT`` on a router adds a DNAT port forward
(WAN port -> the first node behind it), for the "forward a port" advice.

Links are shaped like :mod:`netem`'s (HTB with ACK priority, upload on the host's end, download
on the far end), when rates are given.

Commands (root, iproute2 and iptables with the nat table needed)::

    netem_nat.py up --router home1:eim --router home2:sym \\
        --host coord:20e6:20e6 --host n1@home1:2e6:20e6 --host n2@home1:2e6:20e6 \\
        --host n3@home2:2e6:20e6                      # NAME[@ROUTER]:UP_BPS:DOWN_BPS[:MS]
    netem_nat.py down
    netem_nat.py exec NAME -- CMD ...
    netem_nat.py status

Python use: :func:`available`, :func:`up` (returns :class:`Internet`, cleans up after any
failed step), :func:`down`, :func:`exec_argv`. Owns the namespaces, bridges and veths named with
its prefix and the state file ``/tmp/echo-netnat-<prefix>.json``; ``down`` removes exactly those.
Raises :class:`netem.NetemError` (the failing command and its stderr) for anything the kernel,
iproute2 or iptables refuses, ``ValueError`` for a bad spec (naming it).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import echo.tools.netem as netem
from echo.tools.netem import NetemError, run_command

DEFAULT_PREFIX = "ecn"
DEFAULT_PUBLIC = "10.78.0.0/24"
NAT_KINDS = ("eim", "sym")
_MAX_ROUTERS = 200
_NAME_MAX = 15  # Linux interface names


@dataclass(frozen=True)
class RouterSpec:
    name: str
    kind: str  # "eim" | "sym"
    forward_port: int = 0  # WAN TCP port forwarded to the first node behind it (0: none)

    @classmethod
    def parse(cls, text: str) -> RouterSpec:
        """``NAME:KIND[:FORWARD_PORT]``; ValueError naming the bad part."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError(f"router spec {text!r} is not NAME:KIND[:FORWARD_PORT]")
        if parts[1] not in NAT_KINDS:
            raise ValueError(f"router {parts[0]!r}: kind {parts[1]!r} is not one of {NAT_KINDS}")
        port = int(parts[2]) if len(parts) == 3 else 0
        if not 0 <= port < 65536:
            raise ValueError(f"router {parts[0]!r}: forward port {port} out of range")
        return cls(parts[0], parts[1], port)


@dataclass(frozen=True)
class NatHostSpec:
    name: str
    router: str = ""  # "" = public host
    up_bps: float = 0.0  # 0 = not shaped
    down_bps: float = 0.0
    delay_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> NatHostSpec:
        """``NAME[@ROUTER][:UP_BPS:DOWN_BPS[:DELAY_MS]]``; ValueError naming the bad part."""
        head, _, rest = text.partition(":")
        name, _, router = head.partition("@")
        if not name:
            raise ValueError(f"host spec {text!r} has no name")
        nums = rest.split(":") if rest else []
        if len(nums) not in (0, 2, 3):
            raise ValueError(f"host spec {text!r} is not NAME[@ROUTER][:UP:DOWN[:DELAY_MS]]")
        try:
            vals = [float(x) for x in nums]
        except ValueError:
            raise ValueError(f"host spec {text!r}: rates must be numbers") from None
        return cls(name, router, *vals)


@dataclass
class NatHost:
    name: str
    netns: str
    ip: str  # the address it listens on (LAN address behind a router)
    router: str = ""  # "" for a public host
    nat: str = "public"  # "public" | "eim" | "sym"
    public_ip: str = ""  # what the public internet sees it as (its router's WAN address)


@dataclass
class Internet:
    prefix: str
    hosts: dict[str, NatHost] = field(default_factory=dict)
    routers: dict[str, NatHost] = field(default_factory=dict)

    def behind_nat(self) -> list[str]:
        return [h.name for h in self.hosts.values() if h.router]

    def public(self) -> list[str]:
        return [h.name for h in self.hosts.values() if not h.router]


def _state_path(prefix: str) -> Path:
    return Path(f"/tmp/echo-netnat-{prefix}.json")


def _ifname(prefix: str, tag: str, i: int) -> str:
    name = f"{prefix}{tag}{i}"
    if len(name) + 1 > _NAME_MAX:  # +1: the temporary name of the pair's other end
        raise ValueError(f"prefix {prefix!r} too long for interface names")
    return name


def available(prefix: str = "ecnk") -> tuple[bool, str]:
    """Can we build NAT routers here? (ok, reason). Builds one router, one node, one public host,
    checks a connection through the NAT, and removes them."""
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return False, f"{tool} not installed"
    try:
        net = up(
            [RouterSpec("r", "sym")],
            [NatHostSpec("p"), NatHostSpec("n", "r")],
            prefix=prefix,
            public_subnet="10.76.254.0/29",
            lan_base=250,
            quiet=True,
        )
        target = net.hosts["p"].ip
        probe = f"import socket; s = socket.create_connection(('{target}', 9), timeout=2)"
        proc = run_command(exec_argv("n", [sys.executable, "-c", probe], prefix), check=False)
        if "ConnectionRefused" not in proc.stderr:  # refused = the SYN crossed the NAT
            return False, f"no TCP through the emulated NAT: {proc.stderr.strip()[-200:]}"
    except (NetemError, OSError, ValueError) as exc:
        return False, str(exc)
    finally:
        down(prefix, quiet=True)
    return True, "ok"


def _shape(ns: str | None, dev: str, rate: float, delay_ms: float = 0.0) -> None:
    if rate > 0:
        tc = ["tc", "-n", ns] if ns else ["tc"]
        netem.shape(tc, dev, rate, "htb", delay_ms if netem.netem_supported() else 0.0)


def _veth_pair(outer: str, inner: str, ns_inner: str, ns_outer: str | None) -> None:
    """A veth pair made in the root namespace under temporary names (the root may have an
    ``eth0`` of its own), the inner end moved into ``ns_inner`` and renamed ``inner``."""
    tmp = outer + "x"
    run_command(["ip", "link", "add", outer, "type", "veth", "peer", "name", tmp])
    run_command(["ip", "link", "set", tmp, "netns", ns_inner])
    run_command(["ip", "-n", ns_inner, "link", "set", tmp, "name", inner])
    if ns_outer:
        run_command(["ip", "link", "set", outer, "netns", ns_outer])


def _new_ns(ns: str) -> None:
    run_command(["ip", "netns", "add", ns])
    run_command(
        ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
        check=False,
    )
    run_command(["ip", "-n", ns, "link", "set", "lo", "up"])


def _router(
    prefix: str, k: int, spec: RouterSpec, wan_ip: str, plen: int, lan_base: int, bridge: str
) -> NatHost:
    """One router namespace: WAN veth on the public bridge, LAN bridge, NAT and a stateful
    firewall (inbound only for connections opened from inside, plus the optional forward)."""
    ns = f"{prefix}-{spec.name}"
    _new_ns(ns)
    outer, wan = _ifname(prefix, "w", k), "wan"
    _veth_pair(outer, wan, ns, None)
    run_command(["ip", "link", "set", outer, "master", bridge])
    run_command(["ip", "link", "set", outer, "up"])
    run_command(["ip", "-n", ns, "addr", "add", f"{wan_ip}/{plen}", "dev", wan])
    run_command(["ip", "-n", ns, "link", "set", wan, "up"])
    run_command(["ip", "-n", ns, "link", "add", "lan", "type", "bridge"])
    run_command(["ip", "-n", ns, "addr", "add", f"192.168.{lan_base + k}.1/24", "dev", "lan"])
    run_command(["ip", "-n", ns, "link", "set", "lan", "up"])
    ipt = ["ip", "netns", "exec", ns, "iptables"]
    run_command(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    masq = ["-j", "MASQUERADE"] + (["--random-fully"] if spec.kind == "sym" else [])
    run_command([*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", wan, *masq])
    run_command([*ipt, "-P", "FORWARD", "DROP"])
    run_command([*ipt, "-A", "FORWARD", "-i", "lan", "-o", wan, "-j", "ACCEPT"])
    # Between two nodes on the LAN (bridged frames pass FORWARD when br_netfilter is loaded).
    run_command([*ipt, "-A", "FORWARD", "-i", "lan", "-o", "lan", "-j", "ACCEPT"])
    run_command(
        [
            *ipt,
            "-A",
            "FORWARD",
            "-i",
            wan,
            "-o",
            "lan",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED,DNAT",
            "-j",
            "ACCEPT",
        ]
    )
    # Nothing from the public side may reach the router itself except replies (no open ports).
    run_command(
        [
            *ipt,
            "-A",
            "INPUT",
            "-i",
            wan,
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "ACCEPT",
        ]
    )
    run_command([*ipt, "-A", "INPUT", "-i", wan, "-j", "DROP"])
    return NatHost(spec.name, ns, f"192.168.{lan_base + k}.1", "", spec.kind, wan_ip)


def up(
    routers: Sequence[RouterSpec],
    hosts: Sequence[NatHostSpec],
    *,
    prefix: str = DEFAULT_PREFIX,
    public_subnet: str = DEFAULT_PUBLIC,
    lan_base: int = 10,
    quiet: bool = False,
    global_subnet: bool = False,
) -> Internet:
    """Build the internet (after removing any previous one with this prefix). On any failure
    everything built so far is removed and :class:`NetemError` raised.

    :raises ValueError: duplicate names, an unknown router, too many hosts for the subnet.
    """
    net = ipaddress.ip_network(public_subnet)
    # A global range is refused unless asked for: no namespace routes off the machine, but a
    # private one cannot be mistaken for the real internet. js-libp2p's DCUtR dials only
    # addresses outside private ranges, so its interop test (tools/dcutr_js.py) needs one.
    if not net.is_private and not global_subnet:
        raise ValueError(f"public_subnet {public_subnet} is not a private range")
    public = [h for h in hosts if not h.router]
    if len(public) + len(routers) > net.num_addresses - 3:
        raise ValueError(
            f"{len(public)} hosts and {len(routers)} routers do not fit in {public_subnet}"
        )
    if len(routers) > _MAX_ROUTERS or lan_base + len(routers) > 254:
        raise ValueError(f"too many routers ({len(routers)}) for LANs from 192.168.{lan_base}.0")
    names = [r.name for r in routers] + [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError("router and host names must be unique")
    by_router = {r.name: r for r in routers}
    for h in hosts:
        if h.router and h.router not in by_router:
            raise ValueError(f"host {h.name!r}: unknown router {h.router!r}")
    down(prefix, quiet=True)
    inet = Internet(prefix)
    bridge = f"{prefix}pub"
    try:
        run_command(["ip", "link", "add", bridge, "type", "bridge"])
        run_command(["ip", "link", "set", bridge, "up"])
        addr = iter(net.network_address + 2 + i for i in range(net.num_addresses - 3))
        for k, r in enumerate(routers):
            inet.routers[r.name] = _router(
                prefix, k, r, str(next(addr)), net.prefixlen, lan_base, bridge
            )
        lan_next = {r.name: 2 for r in routers}
        for i, h in enumerate(hosts):
            ns = f"{prefix}-{h.name}"
            _new_ns(ns)
            if not h.router:
                outer = _ifname(prefix, "p", i)
                _veth_pair(outer, "eth0", ns, None)
                run_command(["ip", "link", "set", outer, "master", bridge])
                run_command(["ip", "link", "set", outer, "up"])
                ip, plen, far_ns = str(next(addr)), net.prefixlen, None
                inet.hosts[h.name] = NatHost(h.name, ns, ip, "", "public", ip)
            else:
                rt = inet.routers[h.router]
                outer = _ifname(prefix, "l", i)
                _veth_pair(outer, "eth0", ns, rt.netns)
                run_command(["ip", "-n", rt.netns, "link", "set", outer, "master", "lan"])
                run_command(["ip", "-n", rt.netns, "link", "set", outer, "up"])
                lan = rt.ip.rsplit(".", 1)[0]
                ip, plen, far_ns = f"{lan}.{lan_next[h.router]}", 24, rt.netns
                lan_next[h.router] += 1
                inet.hosts[h.name] = NatHost(h.name, ns, ip, h.router, rt.nat, rt.public_ip)
            run_command(["ip", "-n", ns, "addr", "add", f"{ip}/{plen}", "dev", "eth0"])
            run_command(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if h.router:
                run_command(["ip", "-n", ns, "route", "add", "default", "via", rt.ip])
            _shape(ns, "eth0", h.up_bps, h.delay_ms)
            _shape(far_ns, outer, h.down_bps)
        for r in routers:
            if r.forward_port:
                _forward(inet, r)
        _state_path(prefix).write_text(
            json.dumps(
                {
                    "hosts": [asdict(h) for h in inet.hosts.values()],
                    "routers": [asdict(h) for h in inet.routers.values()],
                },
                indent=1,
            )
        )
    except BaseException:
        down(prefix, quiet=True)
        raise
    if not quiet:
        print(status(prefix), file=sys.stderr)
    return inet


def _forward(inet: Internet, r: RouterSpec) -> None:
    """DNAT ``r.forward_port`` on the router's WAN address to the first node behind it."""
    inside = [h for h in inet.hosts.values() if h.router == r.name]
    if not inside:
        raise ValueError(f"router {r.name!r} forwards port {r.forward_port} but has no host")
    ipt = ["ip", "netns", "exec", inet.routers[r.name].netns, "iptables"]
    run_command(
        [
            *ipt,
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-i",
            "wan",
            "-p",
            "tcp",
            "--dport",
            str(r.forward_port),
            "-j",
            "DNAT",
            "--to-destination",
            f"{inside[0].ip}:{r.forward_port}",
        ]
    )


def down(prefix: str = DEFAULT_PREFIX, *, quiet: bool = False) -> None:
    """Remove every namespace, veth and bridge this prefix made (idempotent). Deleting a
    namespace deletes the veths and LAN bridge inside it; the public bridge and the root-side
    veth ends go by name."""
    netem.remove_namespaces_and_links(
        prefix,
        lambda name: name == f"{prefix}pub"
        or (
            name.startswith(prefix)
            and name[len(prefix) :][:1] in ("w", "p", "l")
            and name[len(prefix) + 1 :].isdigit()
        ),
    )
    _state_path(prefix).unlink(missing_ok=True)
    if not quiet:
        print(f"netem_nat: removed the internet with prefix {prefix!r}", file=sys.stderr)


def load(prefix: str = DEFAULT_PREFIX) -> Internet | None:
    path = _state_path(prefix)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    inet = Internet(prefix)
    inet.hosts = {d["name"]: NatHost(**d) for d in raw["hosts"]}
    inet.routers = {d["name"]: NatHost(**d) for d in raw["routers"]}
    return inet


def exec_argv(name: str, argv: Sequence[str], prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The command line that runs ``argv`` inside host (or router) ``name``."""
    return ["ip", "netns", "exec", f"{prefix}-{name}", *argv]


def status(prefix: str = DEFAULT_PREFIX) -> str:
    inet = load(prefix)
    if inet is None:
        return f"no internet with prefix {prefix!r}"
    lines = [
        f"router {r.name:<10} {r.nat:<4} WAN {r.public_ip:<14} LAN {r.ip}/24"
        for r in inet.routers.values()
    ]
    lines += [
        f"host   {h.name:<10} {h.nat:<6} {h.ip:<14}"
        + (f" behind {h.router} (seen as {h.public_ip})" if h.router else "")
        for h in inet.hosts.values()
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="create routers and hosts")
    p_up.add_argument("--router", action="append", default=[], help="NAME:eim|sym[:FWD_PORT]")
    p_up.add_argument(
        "--host",
        action="append",
        default=[],
        required=True,
        help="NAME[@ROUTER][:UP_BPS:DOWN_BPS[:DELAY_MS]]",
    )
    p_up.add_argument("--public-subnet", default=DEFAULT_PUBLIC)
    sub.add_parser("down", help="remove everything")
    sub.add_parser("status", help="routers and hosts")
    p_exec = sub.add_parser("exec", help="run a command inside a host or router")
    p_exec.add_argument("name")
    p_exec.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            up(
                [RouterSpec.parse(r) for r in args.router],
                [NatHostSpec.parse(h) for h in args.host],
                prefix=args.prefix,
                public_subnet=args.public_subnet,
            )
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
        print(f"netem_nat: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``echo-node doctor``: every check a join needs, one line each, with a fix for failures."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata

import trio
from rich.console import Console

from echo.node.config import NodeConfig
from echo.node.probe import choose_engine, probe
from echo.protocol.nat import DialBackReply

MIN_FREE_DISK = 2 << 30
MIN_RAM = 2 << 30


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def static_checks(cfg: NodeConfig) -> list[Check]:
    out = []
    py = sys.version_info
    out.append(
        Check(
            "python",
            py >= (3, 11),
            f"{py.major}.{py.minor}.{py.micro}",
            "install Python 3.11 or newer",
        )
    )
    for pkg in ("torch", "transformers", "libp2p", "trio", "cryptography"):
        v = _version(pkg)
        out.append(
            Check(
                f"package {pkg}",
                v is not None,
                v or "missing",
                f"pip install 'echo-swarm' (brings {pkg})",
            )
        )
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    p = probe(cfg.data_dir)
    try:
        name, why = choose_engine(p, cfg.engine)
        out.append(Check("engine", True, f"{name}: {why}"))
    except ValueError as exc:
        out.append(
            Check("engine", False, str(exc), "install the engine's extra or use --engine auto")
        )
    if p.cuda:
        out.append(Check("gpu", True, f"{p.hardware.gpu}, {p.hardware.vram_bytes / 2**30:.1f} GiB"))
    else:
        out.append(
            Check("gpu", True, "none (CPU engines only)" + (" · Apple MPS" if p.mps else ""))
        )
    out.append(
        Check(
            "memory",
            p.hardware.ram_bytes >= MIN_RAM,
            f"{p.hardware.ram_bytes / 2**30:.1f} GiB RAM",
            "close other programs or pick a smaller job; 2 GiB is the minimum",
        )
    )
    out.append(
        Check(
            "disk",
            p.free_disk_bytes >= MIN_FREE_DISK,
            f"{p.free_disk_bytes / 2**30:.1f} GiB free in {cfg.data_dir}",
            "free some disk or point --data-dir elsewhere (models keep a few versions)",
        )
    )
    return out


def _port(addr: str) -> str:
    parts = addr.split("/")
    return parts[4] if len(parts) > 4 and parts[3] == "tcp" else "PORT"


def _relay_note(relay: str | None) -> str:
    """What the node gets from the coordinator's relay, by :func:`relay_offered`'s answer."""
    if relay == "offered":
        return (
            "while it runs, the node keeps a reservation on the coordinator's relay (circuit "
            "relay v2), so peers can reach you there for control messages; weights never "
            "cross a relay"
        )
    if relay == "none":
        return (
            "this coordinator offers no relay (an older build), so peers cannot reach you at "
            "all"
        )
    return (
        "the node asks the coordinator's relay for a reservation while it runs (control "
        "messages only; weights never cross a relay)"
    )


def reachability_check(
    reply: DialBackReply | None, listen: list[str], error: str = "", relay: str | None = None
) -> Check:
    """What a dial-back verdict means for this volunteer: whom it relays to, what the coordinator's
    circuit relay gives a node that cannot be dialled (``relay``: "offered", "none", or None
    when not asked), and what to change. Never a failure: a node behind NAT still receives
    weights and generates rollouts."""
    port = _port(listen[0]) if listen else "PORT"
    shown = port if port not in ("0", "PORT") else "N"
    if reply is None:
        return Check(
            "reachability",
            True,
            f"unknown (the coordinator did not dial back: {error or 'no answer'}); you receive "
            f"weights either way; {_relay_note(relay)}",
        )
    seen = f" (the coordinator sees you as {reply.observed_ip})" if reply.observed_ip else ""
    if reply.verdict == "public":
        return Check(
            "reachability",
            True,
            f"public: peers can dial you at {reply.dialed}; you can relay weights to others "
            "(no relay reservation needed)",
        )
    if reply.verdict == "forwarded":
        return Check(
            "reachability",
            True,
            f"reachable through a port forwarded on your router ({reply.dialed}); you can "
            "relay weights to others (no relay reservation needed)",
        )
    if reply.verdict == "unreachable":
        return Check(
            "reachability",
            True,
            f"a firewall blocks dials to your address{seen}: you receive weights over "
            "connections you open and relay them only to peers you can dial (nodes behind NAT "
            f"never get them from you); {_relay_note(relay)}. To relay weights to everyone: "
            f"allow inbound TCP port {port}",
        )
    return Check(
        "reachability",
        True,
        f"behind NAT{seen}: peers cannot dial you, so you receive weights over connections "
        "you open, and relay them only to peers you can dial, and to other nodes behind NAT "
        "where the coordinator punches a direct path between you (possible behind an "
        "endpoint-independent NAT, never behind a symmetric one); "
        f"{_relay_note(relay)}. To relay weights to everyone: forward TCP port {shown} on your "
        f"router to this machine and listen on it (--listen /ip4/0.0.0.0/tcp/{shown})",
    )


async def relay_offered(host, coordinator) -> str | None:
    """Whether the coordinator offers circuit relay v2: "offered", "none" (it does not speak
    the hop protocol), or None (no answer). Doctor's throwaway identity is no registered node,
    so a relay that admits only its nodes answers PERMISSION_DENIED -- which says it is
    offered."""
    from echo.p2p.nat.circuit import RelayRefused, reserve
    from echo.p2p.rpc import RpcError, RpcTimeout

    try:
        await reserve(host, coordinator, timeout=10)
    except RelayRefused:  # it speaks the hop protocol: refused us, not our node
        return "offered"
    except RpcTimeout:
        return None
    except RpcError:  # no hop stream: the protocol is not served
        return "none"
    return "offered"


async def network_checks(cfg: NodeConfig) -> list[Check]:
    from echo.p2p.host import open_host
    from echo.p2p.identity import Identity
    from echo.p2p.nat.dialback import ask_dialback
    from echo.p2p.rpc import RpcError
    from echo.protocol.errors import SchemaError

    out = []
    if not cfg.coordinator:
        return [
            Check(
                "coordinator",
                False,
                "no address given",
                "pass --coordinator with the multiaddr the coordinator prints",
            )
        ]
    async with open_host(Identity.generate(), [cfg.listen], pubsub=False) as host:
        try:
            with trio.fail_after(15):
                coordinator = await host.connect(cfg.coordinator)
            out.append(Check("coordinator", True, f"reachable at {cfg.coordinator}"))
        except (RpcError, ValueError, OSError, trio.TooSlowError) as exc:
            out.append(
                Check(
                    "coordinator",
                    False,
                    str(exc),
                    "check the address, that the coordinator runs, and your firewall",
                )
            )
        reply, why, relay = None, "", None
        if out[-1].ok:
            try:
                with trio.fail_after(30):
                    reply = await ask_dialback(host, coordinator)
            except (RpcError, SchemaError, trio.TooSlowError) as exc:
                why = str(exc) or type(exc).__name__
            if reply is None or not reply.reachable:
                relay = await relay_offered(host, coordinator)
        out.append(reachability_check(reply, host.listen_multiaddrs, why, relay))
    return out


async def run_doctor(cfg: NodeConfig, console: Console) -> bool:
    checks = static_checks(cfg) + await network_checks(cfg)
    for c in checks:
        mark = "[green]ok  [/green]" if c.ok else "[red]FAIL[/red]"
        console.print(f"{mark} {c.name:<22} {c.detail}")
        if not c.ok and c.fix:
            console.print(f"       fix: {c.fix}")
    return all(c.ok for c in checks)

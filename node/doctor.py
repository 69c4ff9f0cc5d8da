"""``echo-node doctor``: every check a join needs, one line each, with a fix for failures."""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass
from importlib import metadata

import trio
from rich.console import Console

from echo.node.config import NodeConfig
from echo.node.probe import choose_engine, probe

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


def _public(addr: str) -> bool:
    parts = addr.split("/")
    try:
        ip = ipaddress.ip_address(parts[2])
    except (IndexError, ValueError):
        return False
    return ip.is_global


async def network_checks(cfg: NodeConfig) -> list[Check]:
    from echo.p2p.host import open_host
    from echo.p2p.identity import Identity
    from echo.p2p.rpc import RpcError

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
                await host.connect(cfg.coordinator)
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
        public = any(_public(a) for a in host.listen_multiaddrs)
        out.append(
            Check(
                "reachability",
                True,
                "listening on a public address: peers can reach you"
                if public
                else "behind NAT or on a private address: peers cannot dial you, so you "
                "will receive weights but not relay them (a relay is not set up yet)",
            )
        )
    return out


async def run_doctor(cfg: NodeConfig, console: Console) -> bool:
    checks = static_checks(cfg) + await network_checks(cfg)
    for c in checks:
        mark = "[green]ok  [/green]" if c.ok else "[red]FAIL[/red]"
        console.print(f"{mark} {c.name:<22} {c.detail}")
        if not c.ok and c.fix:
            console.print(f"       fix: {c.fix}")
    return all(c.ok for c in checks)

"""``down`` of both emulators (echo.tools.netem, echo.tools.netem_nat) removes every namespace
and root-namespace link its prefix made, through the teardown they share, and nothing of another
prefix. Needs root, iproute2 and iptables; skipped where the emulators cannot run. The prefixes
and subnets here are used by no other test, so parallel runs of the NAT tests are left alone."""

from __future__ import annotations

import subprocess

import pytest

import echo.tools.netem as netem
import echo.tools.netem_nat as netem_nat

_OK, _WHY = netem.available(prefix="edtk")
_NAT_OK, _NAT_WHY = netem_nat.available(prefix="edtq") if _OK else (False, _WHY)


def _made(prefix: str) -> tuple[list[str], list[str]]:
    """Namespaces ``<prefix>-*`` and root-namespace links whose names start with ``prefix``."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    spaces = sorted(
        line.split()[0] for line in listing.stdout.splitlines() if line.startswith(f"{prefix}-")
    )
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    names = [line.split(":")[1].strip().split("@")[0] for line in links.stdout.splitlines()]
    return spaces, sorted(n for n in names if n.startswith(prefix))


@pytest.mark.skipif(not _OK, reason=f"netns emulation unavailable: {_WHY}")
def test_netem_down_removes_its_hosts_bridge_and_veths_only() -> None:
    hosts = [netem.HostSpec("a", 1e6, 1e6), netem.HostSpec("b", 2e6, 2e6)]
    try:
        netem.up(hosts, prefix="edta", subnet="10.76.250.0/29", quiet=True)
        netem.up(hosts[:1], prefix="edtb", subnet="10.76.250.8/29", quiet=True)
        assert _made("edta") == (["edta-a", "edta-b"], ["edtabr", "edtav0", "edtav1"])
        netem.down("edta", quiet=True)
        assert _made("edta") == ([], [])
        assert netem.load("edta") == []
        assert _made("edtb") == (["edtb-a"], ["edtbbr", "edtbv0"])
    finally:
        netem.down("edta", quiet=True)
        netem.down("edtb", quiet=True)
    assert _made("edtb") == ([], [])


@pytest.mark.skipif(not _NAT_OK, reason=f"NAT emulation unavailable: {_NAT_WHY}")
def test_netem_nat_down_removes_its_routers_hosts_and_public_bridge() -> None:
    try:
        netem_nat.up(
            [netem_nat.RouterSpec("r0", "eim")],
            [netem_nat.NatHostSpec("s"), netem_nat.NatHostSpec("n0", "r0")],
            prefix="edtn",
            public_subnet="10.79.250.0/24",
            quiet=True,
        )
        spaces, links = _made("edtn")
        assert spaces == ["edtn-n0", "edtn-r0", "edtn-s"]
        assert "edtnpub" in links
        netem_nat.down("edtn", quiet=True)
        assert _made("edtn") == ([], [])
        assert netem_nat.load("edtn") is None
    finally:
        netem_nat.down("edtn", quiet=True)

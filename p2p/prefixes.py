"""Which network an address counts in: the prefixes that admission, budgets and plans group by.

Identities are free, addresses are not: what a stranger can hold is bounded per network, not per
peer. :func:`prefix_of` gives an address's /24 (IPv6: /48) with its kind (public, private,
loopback), which the connection guard caps and the planner uses to tell peers apart;
:func:`wide_of` its /16 (IPv6: /32), the wider net whose handshake rate
:mod:`echo.p2p.wide_rate` bounds. Both are pure and cached: they run for every connection held,
at every admission.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from typing import Literal

PrefixKind = Literal["public", "private", "loopback"]


@dataclass(frozen=True)
class Prefix:
    """The network an address is counted in: its kind and the network (``"1.2.3.0/24"``)."""

    kind: PrefixKind
    network: str


# prefix_of runs for every inbound connection held, at every admission
# (ConnectionGuard.inbound_count): parsing them was a tenth of the coordinator's loop under a
# churn of identities (benchmarks/attack.py). Pure, so its answers are kept, a bounded number.
@functools.lru_cache(maxsize=1 << 16)
def prefix_of(address: str) -> Prefix | None:
    """The prefix ``address`` is counted in, or None for something that is not an IP address.

    IPv4: its /24; IPv6: its /48 (one site's allocation); an IPv4-mapped IPv6 address counts as
    its IPv4 address. Loopback addresses are each their own prefix (/32 or /128), so a policy
    that caps loopback caps each address. Private covers ``ipaddress``'s ``is_private`` (RFC
    1918, unique-local, documentation ranges) and link-local.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return Prefix("loopback", str(ipaddress.ip_network(ip)))
    bits = 24 if ip.version == 4 else 48
    kind: PrefixKind = "private" if ip.is_private or ip.is_link_local else "public"
    return Prefix(kind, str(ipaddress.ip_network(f"{ip}/{bits}", strict=False)))


@functools.lru_cache(maxsize=1 << 16)
def wide_of(address: str) -> str | None:
    """The wide network of ``address`` (``"1.2.0.0/16"``, an IPv6 /32; an IPv4-mapped IPv6
    address counts as its IPv4 address), or None for something that is not an IP address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = 16 if ip.version == 4 else 32
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))

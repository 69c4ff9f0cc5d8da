"""Circuit addresses in plans: how peers reach a node that no dial-back reached.

A node behind NAT holds reservations on circuit relays (the coordinator's, and a public
volunteer's: :mod:`echo.node.relay_slots`) and registers the circuit addresses they give it,
``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<node>``, beside its listen addresses. Plans then
announce such a node with those circuit addresses instead of none, so that peers can reach it
for control messages (have-maps, the DCUtR exchange that asks it to dial back); bulk data still
travels only on direct connections (pushes and chunk pulls refuse relayed ones).

What a node registers steers other volunteers' dials, so a circuit address is announced only
when its relay part is a relay the coordinator vouches for: the coordinator itself, or a node
whose dial-back reached it at exactly that address (:func:`trusted_circuits`). A node cannot make
peers dial a stranger by registering a circuit "through" it. The target part must be the node
itself. Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from echo.p2p.nat.circuit import parse_circuit_addr

CIRCUIT = "/p2p-circuit"
# Circuit addresses a node is announced with at most (one per relay it reserved on).
MAX_CIRCUITS = 2


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def split_addrs(node_id: str, addrs: Sequence[str]) -> tuple[list[str], list[str]]:
    """(direct addresses, well-formed circuit addresses that target ``node_id``). Circuit
    addresses naming another target, or malformed, are dropped: they are no dial-back
    candidate either."""
    direct, circuits = [], []
    for addr in addrs:
        if not is_circuit(addr):
            direct.append(addr)
            continue
        try:
            _, _, target = parse_circuit_addr(addr)
        except ValueError:
            continue
        if str(target) == node_id and addr not in circuits:
            circuits.append(addr)
    return direct, circuits[:MAX_CIRCUITS]


def trusted_circuits(
    circuits: Sequence[str], relays: Mapping[str, Collection[str]]
) -> list[str]:
    """Those of ``circuits`` whose relay part (``<addr>/p2p/<relay id>``) is one of the
    addresses ``relays`` vouches for that relay id (the coordinator's own listen addresses, a
    reachable node's verified ones)."""
    out = []
    for addr in circuits:
        try:
            relay_part, relay_id, _ = parse_circuit_addr(addr)
        except ValueError:
            continue
        if relay_part in relays.get(str(relay_id), ()):
            out.append(addr)
    return out


__all__ = ["CIRCUIT", "MAX_CIRCUITS", "is_circuit", "split_addrs", "trusted_circuits"]

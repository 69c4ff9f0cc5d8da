"""Issue 26, findings 3 and 6: nobody steers relay placement with their own word, and plans hand
volunteers only addresses a dial-back verified.

Finding 3: bad-chunk reports demote a relay only from reporters with accepted work on distinct
networks, and the demotion ages out; a node's uplink counts as its receivers measured it, never
as it declared. Finding 6: plans carry dial-back-verified addresses only; a node not yet probed
is not dialable; local addresses reach other nodes only in a local swarm (or when allowed).

Every test drives the real :class:`~echo.coordinator.dissemination.planning.Dissemination` (and the
pure punch planner); the only stand-in is a hand-moved clock.
"""

from __future__ import annotations

from echo.coordinator.dissemination import relays
from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.dissemination.punch_pairs import NatInfo, punch_pairs
from echo.protocol import broadcast as b
from tests.conftest import Clock

MB = 1_000_000
TOTAL = 64 * MB


def _swarm(n: int, clock: Clock | None = None, **kw: object) -> Dissemination:
    """``n`` nodes ``n0..`` registered on public addresses, each on a /24 of its own, and
    verified by a dial-back."""
    d = Dissemination(
        learner_upload_bps=2 * MB,
        default_node_upload_bps=1 * MB,
        **({"clock": clock} if clock is not None else {}),
        **kw,  # type: ignore[arg-type]
    )
    for i in range(n):
        _join(d, f"n{i}", f"203.0.{i}.7", 1 * MB)
    return d


def _join(d: Dissemination, name: str, ip: str, declared: float) -> None:
    d.relays.registered(name, [f"/ip4/{ip}/tcp/4001/p2p/{name}"], declared)
    d.relays.set_reachable(name, True, verdict="public", observed_ip=ip)


def _plan(d: Dissemination, nodes: list[str], leaves: list[str] = (), version: int = 1):
    ann = d.plan("job", version, b"m", TOTAL, source="L", source_addrs=[], nodes=nodes,
                 leaves=leaves)
    assert ann is not None
    return ann


def _bad(peer: str) -> b.BadPeerReport:
    return b.BadPeerReport(job_id="job", version=1, peer_id=peer, reason="bad_chunk")


def _roots(ann: b.PlanAnnouncement) -> set[str]:
    """The source's children in any stripe."""
    return {c for s in ann.plan.stripes for e in s if e.parent == "L" for c in e.children}


# -- finding 3: demotion ---------------------------------------------------------------------------


def test_three_merely_registered_identities_cannot_demote_a_relay() -> None:
    """The issue's reproduction: three registered identities (no accepted group: the
    coordinator plans them as leaves), each on a network of its own, report a relay for bad
    chunks; the relay keeps its uplink and its place."""
    d = _swarm(6)
    fresh = ["n3", "n4", "n5"]
    _plan(d, [f"n{i}" for i in range(6)], leaves=fresh)
    for reporter in fresh:
        d.reported(reporter, _bad("n0"))
    assert d.relays.upload_of("n0") == 1 * MB and not d.relays.is_demoted("n0")
    # The same when the handler says how many groups each reporter had accepted: none.
    for reporter in ("n1", "n2", "n3"):
        d.reported(reporter, _bad("n0"), accepted=0)
    assert not d.relays.is_demoted("n0")


def test_credible_reporters_count_once_per_network() -> None:
    """Reporters with accepted work count once per /24: three of them behind one network do
    not demote; a third network does."""
    d = _swarm(3)
    for name, ip in (("r1", "85.51.100.1"), ("r2", "85.51.100.2"), ("r3", "85.51.100.3")):
        _join(d, name, ip, 1 * MB)  # one /24
    _join(d, "r4", "93.0.2.9", 1 * MB)
    _plan(d, ["n0", "n1", "n2", "r1", "r2", "r3", "r4"])  # nobody a leaf: all have accepted work
    for r in ("r1", "r2", "r3", "n1"):
        d.reported(r, _bad("n0"))
    assert d.relays.upload_of("n0") == 1 * MB  # two networks so far
    d.reported("r4", _bad("n0"))
    assert d.relays.upload_of("n0") == 0.0 and d.relays.is_demoted("n0")
    ann = _plan(d, ["n0", "n1", "n2", "r1", "r2", "r3", "r4"], version=2)
    assert all(not {e.parent for e in s if e.children} & {"n0"} for s in ann.plan.stripes)


def test_a_demotion_ages_out() -> None:
    clock = Clock(1000.0)
    d = _swarm(4, clock)
    _plan(d, ["n0", "n1", "n2", "n3"])
    for r in ("n1", "n2", "n3"):
        d.reported(r, _bad("n0"), accepted=5)
    assert d.relays.is_demoted("n0")
    clock.t += relays.DEMOTE_WINDOW_S - 1
    assert d.relays.is_demoted("n0")
    clock.t += 2
    assert not d.relays.is_demoted("n0") and d.relays.upload_of("n0") == 1 * MB


# -- finding 3: uplinks ----------------------------------------------------------------------------


def test_an_uplink_liar_is_not_planned_at_the_root() -> None:
    """The issue's reproduction: one status message saying 1e15 B/s (and a registration saying
    as much) made the liar the fastest node of the swarm. Its own word now counts up to the
    default; relays whose receivers measured them stay ahead of it."""
    d = _swarm(8)
    for n in ("n0", "n1"):
        d.relays.confirm(n, ("job", 0), 4 * MB)  # their receivers measured 4 MB/s
        d.relays.measured(n, 4 * MB)
    _join(d, "liar", "93.0.2.66", 1e15)
    d.relays.measured("liar", 1e15)
    assert d.relays.upload_of("liar") == 1 * MB
    assert d.relays.upload_of("n0") == 4 * MB
    members = [f"n{i}" for i in range(8)] + ["liar"]
    ann = _plan(d, members)
    assert "liar" not in _roots(ann)
    assert d.refresh("job")
    ann = _plan(d, members, version=2)
    assert "liar" not in _roots(ann)


def test_receivers_confirm_a_relays_uplink() -> None:
    """A relay is credited with the stripe bytes it owed each child that proved it holds the
    version, over the longest time they took -- not less than the learner's own time to send
    the version -- once per network, never for an unproven child, a child on its own network,
    or one that reported it stalled."""
    clock = Clock(50.0)
    d = _swarm(0, clock)
    _join(d, "relay", "203.0.1.7", 1 * MB)
    kids = {"k1": "85.51.1.7", "k2": "85.51.2.7", "k3": "85.51.2.8", "k4": "203.0.1.9",
            "k5": "85.51.5.7", "k6": "85.51.6.7"}
    for k, ip in kids.items():
        _join(d, k, ip, 1 * MB)
    d.relays.measured("relay", 50 * MB)  # what it says: counts up to what its receivers confirm
    d.relays.confirm("relay", ("job", 0), 40 * MB)  # e.g. an earlier version's receipts
    assert d.relays.upload_of("relay") == 40 * MB
    ann = _plan(d, ["relay", *kids], leaves=["k6"])
    children = {c for s in ann.plan.stripes for e in s if e.parent == "relay" for c in e.children}
    assert children, ann.plan
    owed = TOTAL / len(ann.plan.stripes)  # equal-rate plan: equal stripes
    d.reported("k5", b.BadPeerReport(job_id="job", version=1, peer_id="relay", reason="stalled"))
    clock.t += 40.0  # longer than the learner's floor, 64 MB / 2 MB/s
    for k in kids:
        d.receipts.delivered(k, "job", 1)
    got = d.relays.links["relay"].confirmed[("job", 1)]
    # k1 and k2 count; k3 shares k2's /24, k4 the relay's, k5 reported a stall, k6 is a leaf.
    credited = len(children & {"k1", "k2"})
    assert credited and got == credited * owed / 40.0
    # Children that "hold" the version at once (its digest is no secret) are timed at the
    # learner's floor: 2 children x 64 MB over 64 MB / 2 MB/s, however fast they say they were.
    d2 = _swarm(0, Clock(0.0))
    for name, ip in (("relay", "203.0.1.7"), ("k1", "85.51.1.7"), ("k2", "85.51.2.7")):
        _join(d2, name, ip, 1 * MB)
    d2.relays.confirm("relay", ("job", 0), 40 * MB)
    d2.relays.measured("relay", 40 * MB)
    ann = _plan(d2, ["relay", "k1", "k2"])
    assert {c for s in ann.plan.stripes for e in s if e.parent == "relay" for c in e.children} \
        == {"k1", "k2"}
    for k in ("k1", "k2"):
        d2.receipts.delivered(k, "job", 1)
    assert d2.relays.links["relay"].confirmed[("job", 1)] == 2 * TOTAL / (TOTAL / (2 * MB))


# -- finding 6: addresses --------------------------------------------------------------------------


def test_plans_carry_only_addresses_a_dial_back_verified() -> None:
    """A node declares its own address plus a stranger's host and its LAN router; the plan
    hands out only the address on the ip the coordinator saw it on (or exactly the one the
    dial-back reached)."""
    d = _swarm(2)
    declared = ["/ip4/81.2.113.5/tcp/4001/p2p/x", "/ip4/8.8.8.8/tcp/53/p2p/x",
                "/ip4/192.168.1.1/tcp/80/p2p/x"]
    d.relays.registered("x", declared, 1 * MB)
    d.relays.set_reachable("x", True, verdict="public", observed_ip="81.2.113.5")
    ann = _plan(d, ["n0", "n1", "x"])
    assert {p.peer_id: p.addrs for p in ann.peers}["x"] == ["/ip4/81.2.113.5/tcp/4001/p2p/x"]
    d.relays.set_reachable("x", True, verdict="forwarded", observed_ip="81.2.113.5",
                    dialed="/ip4/81.2.113.5/tcp/80")
    ann = _plan(d, ["n0", "n1", "x"], version=2)
    assert {p.peer_id: p.addrs for p in ann.peers}["x"] == ["/ip4/81.2.113.5/tcp/80/p2p/x"]


def test_a_node_not_yet_probed_is_not_dialable() -> None:
    """Before its dial-back a node is announced without addresses, and two such nodes are never
    planned as parent and child (neither could dial the other)."""
    d = Dissemination(learner_upload_bps=2 * MB, default_node_upload_bps=1 * MB)
    for i in range(6):
        d.relays.registered(f"u{i}", [f"/ip4/203.0.{i}.7/tcp/4001/p2p/u{i}"], 1 * MB)
    ann = _plan(d, [f"u{i}" for i in range(6)])
    assert all(p.addrs == [] for p in ann.peers)
    edges = {(e.parent, c) for s in ann.plan.stripes for e in s for c in e.children}
    assert {p for p, _ in edges} == {"L"}  # only the source feeds them


def test_local_addresses_reach_other_nodes_only_in_a_local_swarm() -> None:
    """A node seen on a private address in a swarm with public nodes is announced without
    addresses (nobody is told to dial into their own LAN), unless the operator allows local
    addresses; in a swarm where every address is local (the demo) they are announced."""
    for allow, want in ((None, []), (True, ["/ip4/192.168.1.20/tcp/4001/p2p/lan"])):
        d = _swarm(3, local_addrs=allow)
        _join(d, "lan", "192.168.1.20", 1 * MB)
        ann = _plan(d, ["n0", "n1", "n2", "lan"])
        by_peer = {p.peer_id: p.addrs for p in ann.peers}
        assert by_peer["lan"] == want and by_peer["n0"]
    d = Dissemination(learner_upload_bps=2 * MB, default_node_upload_bps=1 * MB)
    for i in range(3):
        _join(d, f"l{i}", "127.0.0.1", 1 * MB)
    ann = _plan(d, ["l0", "l1", "l2"])
    assert all(p.addrs for p in ann.peers if p.peer_id != "L")
    d = _swarm(0, local_addrs=False)
    _join(d, "l0", "127.0.0.1", 1 * MB)
    assert all(p.addrs == [] for p in _plan(d, ["l0"]).peers)


def test_lan_punches_hand_out_only_lan_addresses() -> None:
    """Two nodes behind one router dial each other's LAN addresses: a declared "LAN" address
    on a public ip (a stranger's host) is never handed out; with nothing in a LAN range left,
    the pair is not asked to connect at all."""
    nat = {
        "a": NatInfo("85.51.100.1", ("/ip4/192.168.0.2/tcp/4001/p2p/a",
                                      "/ip4/8.8.8.8/tcp/53/p2p/a")),
        "b": NatInfo("85.51.100.1", ("/ip4/192.168.0.3/tcp/4001/p2p/b",)),
        "c": NatInfo("85.51.100.9", ("/ip4/1.1.1.1/tcp/443/p2p/c",)),
        "d": NatInfo("85.51.100.9", ("/ip4/192.168.7.2/tcp/4001/p2p/d",)),
    }
    pairs = {frozenset((p.a, p.b)): p for p in punch_pairs(nat, {})}
    ab = pairs[frozenset(("a", "b"))]
    assert ab.method == "lan"
    assert ab.addrs_for_b == ("/ip4/192.168.0.2/tcp/4001/p2p/a",)
    assert ab.addrs_for_a == ("/ip4/192.168.0.3/tcp/4001/p2p/b",)
    assert frozenset(("c", "d")) not in pairs


def test_the_operator_sets_the_local_address_policy_in_coordinator_toml(tmp_path) -> None:
    """``[broadcast] local_addrs`` reaches the planner of the running coordinator: 'never' keeps
    even an all-loopback swarm's addresses out of plans; a bad value names the key."""
    import pytest

    from echo.coordinator.config import load_config
    from echo.coordinator.service import Coordinator
    from echo.coordinator.store import Store
    from echo.p2p.identity import Identity
    from echo.protocol.jobspec import SpecError

    policies = {}
    for value in ("auto", "always", "never"):
        toml = tmp_path / f"{value}.toml"
        toml.write_text(f'data_dir = "{tmp_path / value}"\n[broadcast]\nlocal_addrs = "{value}"\n')
        cfg = load_config(toml)
        store = Store.open(tmp_path / f"{value}.sqlite")
        try:
            policies[value] = Coordinator(cfg, store, Identity.generate()).dissemination.local_addrs
        finally:
            store.close()
    assert policies == {"auto": None, "always": True, "never": False}
    bad = tmp_path / "bad.toml"
    bad.write_text('[broadcast]\nlocal_addrs = "sometimes"\n')
    with pytest.raises(SpecError, match="broadcast.local_addrs"):
        load_config(bad)

"""Dial-backs for strangers from a small budget, for nodes with accepted work at once (issue
26: identity churn).

Each dial-back is a second connection the coordinator opens (TCP, Noise, yamux, identify both
ways) to a node that asked nothing for it, and identities are free: a churner's every fresh
identity was probed. A node that has delivered nothing is planned as not dialable anyway (it
receives over the connections it opens), so beyond the strangers' budget its probe waits for its
first accepted group. Checked against the real coordinator (libp2p hosts, the prober, SQLite).
"""

from __future__ import annotations

import trio

from echo.coordinator.dissemination.dialbacks import ProbeQueue
from echo.coordinator.dissemination.planning import Dissemination
from tests.conftest import Clock, run_with_coordinator
from tests.coordinator.test_coordinator import group_for, open_lease, start_job

# The prober polls every 0.2 s: a probe that was due has happened well within this.
SETTLE_S = 2.0


def test_past_the_strangers_budget_a_node_is_dialled_back_once_it_has_accepted_work(
    tmp_path, monkeypatch
) -> None:
    from echo.coordinator.dissemination import dialbacks

    monkeypatch.setattr(dialbacks, "STRANGER_BURST", 0)  # the budget spent by earlier strangers

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        nid = str(node.host.peer_id)
        await trio.sleep(SETTLE_S)
        link = coord.dissemination.relays.links[nid]
        assert link.addrs, "registered with addresses"
        assert link.reachable is None, "a node without accepted work was dialled back"
        lease = open_lease(coord, (await node.leases(job_id, have=0)).leases[0])
        assert (await node.submit(node.seal(group_for(lease)))).accepted
        with trio.fail_after(10):
            while link.reachable is None:
                await trio.sleep(0.1)
        assert link.reachable is True and link.verdict  # loopback answers the dial-back

    run_with_coordinator(tmp_path, body)


def test_a_node_that_registers_with_accepted_work_is_probed_at_once() -> None:
    """After a coordinator restart a node's record says it has worked: no new group needed."""
    d = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e6)
    worked = {"old"}
    q = ProbeQueue(Clock(), worked=worked.__contains__, stranger_burst=0)
    d.relays.on_new_addrs = q.wanted
    d.relays.registered("old", ["/ip4/81.2.113.5/tcp/4001"], 0.0)
    d.relays.registered("new", ["/ip4/81.2.113.6/tcp/4001"], 0.0)
    assert [n for n, _ in q.due(d, lambda n: True)] == ["old"]
    q.earned("new")
    assert [n for n, _ in q.due(d, lambda n: True)] == ["new"]
    # Judged meanwhile: its first group asks for nothing more.
    d.relays.set_reachable("old", True, verdict="public", observed_ip="81.2.113.5")
    q.earned("old")
    assert q.due(d, lambda n: True) == []


def test_strangers_are_probed_from_a_burst_then_one_every_few_seconds() -> None:
    """An operator's swarm that starts at once is judged at once; a churn of identities gets one
    probe per STRANGER_EVERY_S, and a node with accepted work is never held back by it."""
    from echo.coordinator.dissemination.dialbacks import STRANGER_BURST, STRANGER_EVERY_S

    clock = Clock()
    d = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e6)
    q = ProbeQueue(clock, worked={"worker"}.__contains__)
    d.relays.on_new_addrs = q.wanted
    names = [f"s{i}" for i in range(STRANGER_BURST + 5)]
    for i, name in enumerate(names):
        d.relays.registered(name, [f"/ip4/81.2.{i}.5/tcp/4001"], 0.0)
    assert [n for n, _ in q.due(d, lambda n: True)] == names[:STRANGER_BURST]
    d.relays.registered("worker", ["/ip4/81.3.0.5/tcp/4001"], 0.0)
    d.relays.registered("late", ["/ip4/81.3.0.6/tcp/4001"], 0.0)
    assert [n for n, _ in q.due(d, lambda n: True)] == ["worker"]
    clock.t += STRANGER_EVERY_S
    d.relays.registered("later", ["/ip4/81.3.0.7/tcp/4001"], 0.0)
    d.relays.registered("latest", ["/ip4/81.3.0.8/tcp/4001"], 0.0)
    assert [n for n, _ in q.due(d, lambda n: True)] == ["later"]


def test_no_stranger_is_probed_while_its_network_is_shed_and_the_budget_waits_too() -> None:
    """While the coordinator sheds a stranger's network (its loop lags, or a hold's readmission
    lets strangers back one a second), the stranger is not dialled back and the budget does not
    refill: it had refilled during each hold, so every churned identity the readmission let in
    was probed on a loop that had just saturated (benchmarks/attack.py)."""
    from echo.coordinator.dissemination.dialbacks import STRANGER_EVERY_S

    clock = Clock()
    d = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e6)
    q = ProbeQueue(clock, worked={"worker"}.__contains__, stranger_burst=1)
    shed = {"held"}
    q.held_back = lambda node: bool(shed) and node != "private"
    d.relays.on_new_addrs = q.wanted
    d.relays.registered("held", ["/ip4/81.2.0.5/tcp/4001"], 0.0)
    d.relays.registered("worker", ["/ip4/81.2.0.6/tcp/4001"], 0.0)
    d.relays.registered("private", ["/ip4/10.0.0.6/tcp/4001"], 0.0)
    # A node with accepted work, and one on a network that is never shed, are not held back.
    assert [n for n, _ in q.due(d, lambda n: True)] == ["worker", "private"]
    clock.t += 10 * STRANGER_EVERY_S  # a long hold: the budget must not refill meanwhile
    d.relays.registered("held2", ["/ip4/81.2.0.7/tcp/4001"], 0.0)
    assert q.due(d, lambda n: True) == []
    shed.clear()  # the readmission is over
    for i in range(3):
        d.relays.registered(f"calm{i}", [f"/ip4/81.2.1.{i}/tcp/4001"], 0.0)
    # The burst spent on "private" was not refilled by the held time: nothing is left.
    assert q.due(d, lambda n: True) == []
    clock.t += STRANGER_EVERY_S
    d.relays.registered("next", ["/ip4/81.2.2.1/tcp/4001"], 0.0)
    assert [n for n, _ in q.due(d, lambda n: True)] == ["next"]


def test_the_coordinator_dials_back_no_stranger_its_readmission_lets_in(
    tmp_path, monkeypatch
) -> None:
    """The real coordinator (loopback capped, as benchmarks/attack.py runs it) with a lag set by
    the test: a stranger registering while calm is dialled back; one the readmission after a
    hold lets in is not, until the readmission is over and it registers again."""
    from echo.coordinator import service
    from tests.p2p.test_shedding import HandLag

    clock = Clock()
    hold_s = 5.0
    lag = HandLag(0.2, hold_s, clock=clock)
    real_install = service.install_shedder
    monkeypatch.setattr(service, "install_shedder", lambda host: real_install(host, lag))

    async def body(coord, client) -> None:
        calm = await client()
        await calm.register()
        links = coord.dissemination.relays.links
        with trio.fail_after(10):
            while links[str(calm.host.peer_id)].reachable is None:
                await trio.sleep(0.1)
        lag.observe(1.0)  # the loop saturated: a hold
        clock.t += hold_s + 0.1  # over: strangers come back at the readmission's rate
        assert lag.readmitting and not lag.lagging
        readmitted = await client()
        await readmitted.register()
        await trio.sleep(SETTLE_S)
        link = links[str(readmitted.host.peer_id)]
        assert link.addrs and link.reachable is None, "dialled back during the readmission"
        clock.t += 100.0  # calm again
        assert not lag.readmitting
        await readmitted.register()  # a node re-registers every few seconds
        with trio.fail_after(10):
            while link.reachable is None:
                await trio.sleep(0.1)

    run_with_coordinator(tmp_path, body, admission={"loopback_is_network": True})

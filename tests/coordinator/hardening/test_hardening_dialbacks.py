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

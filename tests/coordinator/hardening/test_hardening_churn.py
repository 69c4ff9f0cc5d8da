"""Identity churn (issue 26, finding 4): per-tick work follows the active nodes, not every
identity that ever registered.

A churn of free identities used to cost the coordinator a scheduling pass per registration, a
look at every unprobed link every 0.2 s, a full read of the nodes table (excluded rows kept
forever) every second, and per-node entries keyed by whatever job id a status named. Each is
checked here against the real classes and a real SQLite file.
"""

from __future__ import annotations

import sqlite3
import time

import trio

from echo.coordinator.config import RetentionSection
from echo.coordinator.dissemination.dialbacks import PENDING_S, ProbeQueue
from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.scheduling.placement import FORGET_S, PASS_COALESCE_S
from echo.coordinator.store import Store
from echo.coordinator.store.db import SCHEMA_VERSION
from echo.tools.peer_kit import register_record
from tests.conftest import Clock, run_with_coordinator
from tests.coordinator.test_coordinator import start_job

EXCLUDED_ROWS = 100_000
DAY_S = 86400.0


def _fill(store: Store, now: float) -> None:
    """EXCLUDED_ROWS excluded identities (recently heard from: not prunable yet), 20 silent
    ones, and 10 active nodes, registered in that order."""
    rows = [
        (f"x{i:06d}", b"k" * 32, "torch", "{}", now - 50, now - 5, 1, now - 30)
        for i in range(EXCLUDED_ROWS)
    ]
    rows += [(f"s{i:02d}", b"k" * 32, "torch", "{}", now - 40, now - 3600, 0, 0) for i in range(20)]
    rows += [
        (f"a{i:02d}", b"k" * 32, "torch", "{}", now - 20 + i, now - 1, 0, 0) for i in range(10)
    ]
    with store._tx() as db:
        db.executemany(
            "INSERT INTO nodes (node_id, public_key, engine, hardware_json, first_seen,"
            " last_seen, excluded, excluded_at) VALUES (?,?,?,?,?,?,?,?)",
            rows,
        )


def test_active_nodes_reads_only_the_active_rows(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    now = time.time()
    _fill(store, now)
    t0 = time.perf_counter()
    active = store.active_nodes(now - 60)
    took = time.perf_counter() - t0
    assert [n.node_id for n in active] == [f"a{i:02d}" for i in range(10)]
    # One range of the index, whatever the number of excluded or silent rows.
    plan = " ".join(
        r[3]
        for r in store._db.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM nodes WHERE excluded=0 AND last_seen>?"
            " ORDER BY first_seen",
            (now - 60,),
        )
    )
    assert "USING INDEX nodes_active" in plan, plan
    assert took < 0.1, took  # the full read it replaces took 0.4-1.3 s here
    store.close()


def test_a_registration_commits_without_an_fsync_of_its_own(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    sql: list[str] = []
    store._db.set_trace_callback(sql.append)
    store.upsert_node("n", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    store._db.set_trace_callback(None)
    insert = next(i for i, q in enumerate(sql) if q.startswith("INSERT INTO nodes"))
    assert "PRAGMA synchronous=NORMAL" in sql[:insert]  # restored to FULL after the commit
    assert sql[-1] == "PRAGMA synchronous=FULL"
    store.close()


def test_excluded_identities_are_forgotten_after_a_while(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    for n in ("old", "recent", "talking"):
        store.upsert_node(n, b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
        store.set_excluded(n, True)
        store.record_node_version("j", n, 0)
    long_ago = time.time() - 2 * DAY_S
    store._db.execute(
        "UPDATE nodes SET excluded_at=?, last_seen=? WHERE node_id='old'", (long_ago,) * 2
    )
    # Excluded long ago but still calling: kept.
    store._db.execute("UPDATE nodes SET excluded_at=? WHERE node_id='talking'", (long_ago,))
    # Silent for long, but excluded only now: kept a full window.
    store._db.execute("UPDATE nodes SET last_seen=? WHERE node_id='recent'", (long_ago,))
    pruned = store.prune(time.time(), RetentionSection(idle_nodes_s=DAY_S), lease_window_s=600)
    assert pruned["excluded_nodes"] == 1
    assert sorted(n.node_id for n in store.nodes()) == ["recent", "talking"]
    left = store._db.execute("SELECT node_id FROM node_versions ORDER BY node_id").fetchall()
    assert [r[0] for r in left] == ["recent", "talking"]
    store.close()


def test_a_file_from_before_excluded_at_keeps_its_excluded_a_full_window(tmp_path) -> None:
    path = tmp_path / "db.sqlite"
    store = Store.open(path)
    store.upsert_node("x", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    store.set_excluded("x", True)
    store.close()
    db = sqlite3.connect(path)
    db.execute("DROP INDEX nodes_active")
    db.execute("ALTER TABLE nodes DROP COLUMN excluded_at")  # the file as the last build left it
    db.commit()
    db.close()
    t0 = time.time()
    store = Store.open(path)
    row = store._db.execute("SELECT excluded, excluded_at FROM nodes").fetchone()
    assert row[0] == 1 and row[1] >= t0
    # An additive column: the schema is the build's, unchanged.
    assert store._db.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
    store.close()


def test_a_burst_of_registrations_shares_a_few_passes(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        placement, burst = coord.placement, 200
        placed: dict[str, str] = {}

        async def one(i: int) -> None:  # what the register handler does, for a new identity
            node = f"churn{i:03d}"
            coord.store.upsert_node(node, b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
            placed[node], _ = await placement.place(node, register_record([]))

        before, t0 = placement.passes, time.monotonic()
        async with trio.open_nursery() as nursery:
            for i in range(burst):
                nursery.start_soon(one, i)
        took = time.monotonic() - t0
        # One pass per registration before (200); now registrations waiting at once share one,
        # at most one per PASS_COALESCE_S, beside the periodic passes of every_s.
        most = 2 + took / PASS_COALESCE_S + took / placement.every_s
        assert placement.passes - before <= most, (placement.passes - before, took)
        assert set(placed.values()) == {job_id}  # each still learns its job from its reply

    run_with_coordinator(tmp_path, body)


def test_placement_state_is_bounded_to_live_jobs_and_present_nodes(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        placement = coord.placement
        node = await client()
        await node.register()
        nid = str(node.host.peer_id)
        # 2,000 statuses, each naming another job: only the live job gets entries.
        for i in range(2000):
            placement.observed(nid, f"nojob{i}", 5.0, 1)
            placement.observed(f"stranger{i}", f"nojob{i}", 5.0, 1)
        placement.observed(nid, job_id, 7.0, 0)
        assert set(placement.nodes) == {nid}
        assert placement.nodes[nid].measured == {job_id: 7.0}
        assert placement.nodes[nid].held == {job_id: 0}
        # Nodes that left are forgotten once FORGET_S passed; one heard from since is kept.
        placement.observed(nid, job_id, 7.0, 0)
        later = time.time() + FORGET_S + 1
        placement.nodes["gone"] = type(placement.nodes[nid])(seen=time.time())
        placement.nodes[nid].seen = later - 1
        placement.refresh(now=later)
        assert set(placement.nodes) == {nid}

    run_with_coordinator(tmp_path, body)


def test_the_prober_looks_only_at_nodes_that_asked(tmp_path) -> None:
    diss = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e6)
    for i in range(5000):  # a churn that registered and left: never probed
        diss.relays.registered(f"gone{i}", [f"/ip4/10.0.{i // 250}.{i % 250}/tcp/4001"], 0.0)
    clock = Clock(100.0)
    probes = ProbeQueue(clock=clock)
    for n in ("new", "away", "busy"):
        diss.relays.registered(n, [f"/ip4/192.0.2.1/tcp/{len(n)}"], 0.0)
        probes.wanted(n)
    looked: list[str] = []

    def ready(node: str) -> bool:
        looked.append(node)
        return node == "new"

    assert [n for n, _ in probes.due(diss, ready)] == ["new"]
    assert sorted(looked) == ["away", "busy"] + ["new"]  # not the 5,000 others
    # "busy" re-registered during its probe: it stays queued until that probe is done.
    looked.clear()
    assert probes.due(diss, lambda n: n == "busy") == [("busy", ["/ip4/192.0.2.1/tcp/4"])]
    # "away" is not connected: dropped PENDING_S after it asked (its next registration asks
    # again).
    clock.t += PENDING_S + 1
    assert probes.due(diss, lambda n: False) == [] and len(probes) == 0


def test_pruned_identities_leave_the_dissemination_links_too(tmp_path, monkeypatch) -> None:
    """The store forgets a churned identity; so does the relay planner (its links were kept for
    good: a churn of 5 identities a second grew them by 18,000 an hour)."""
    import trio

    import echo.coordinator.service as service
    from tests.conftest import run_with_coordinator

    monkeypatch.setattr(service, "PRUNE_EVERY_S", 0.5)

    async def body(coord, client) -> None:
        gone, staying = await client(), await client()
        await gone.register()
        await staying.register()
        gone_id, staying_id = str(gone.host.peer_id), str(staying.host.peer_id)
        assert {gone_id, staying_id} <= set(coord.dissemination.relays.links)
        coord.store._db.execute(
            "UPDATE nodes SET last_seen=? WHERE node_id=?", (time.time() - 2 * DAY_S, gone_id)
        )
        with trio.fail_after(10):
            while coord.store.node(gone_id) is not None:
                await trio.sleep(0.2)
        assert gone_id not in coord.dissemination.relays.links
        assert staying_id in coord.dissemination.relays.links

    run_with_coordinator(tmp_path, body)

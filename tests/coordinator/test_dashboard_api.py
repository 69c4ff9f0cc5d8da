"""The dashboard's HTTP side over a real coordinator (libp2p, SQLite, hypercorn): the SSE
streams, the credit and public-node endpoints, what is public and what needs the token."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
import trio

from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol.credit import verify_entries
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import group_for, open_lease, start_job

AUTH = {"Authorization": "Bearer test-token"}


async def publish(learner, job_id: str, version: int, trained, verdicts=()) -> None:
    man = m.Manifest(
        job_id=job_id, version=version, base_version=version - 1, kind="patch", total_size=0,
        chunks=[], tensor_digests={}, state_digest=f"digest-v{version}", anchor_version=0,
        created_at=time.time(),
    )
    rep = m.StepReport(
        job_id=job_id, version=version,
        manifest=signing.seal_record(learner.identity.private_key, man),
        trained=list(trained), verdicts=list(verdicts),
        metrics={"eval_accuracy": 0.25, "staleness_mean": 0.0, "staleness_max": 0.0},
    )
    ack = m.decode(m.StepAck, await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(rep)))
    assert ack.ok, ack.message


async def take_batch(learner, job_id: str) -> list[str]:
    req = m.BatchRequest(job_id=job_id, max_groups=16, min_version=0, timestamp=time.time())
    reply = await learner.call(ids.PROTO_LEARNER_BATCH, learner.seal(req), max_response=64 << 20)
    return [g.rollout_id for g in m.decode(m.BatchReply, reply).groups]


async def run_swarm(coord, client):
    """A job, two nodes with accepted groups, version 1 trained: node A's two groups trained
    (one of them wrong: reward 0, still valid work), node B's group rejected by re-scoring."""
    job_id, learner = await start_job(coord, client)
    a, b = await client(), await client()
    for n in (a, b):
        await n.register()
    la = await a.leases(job_id, have=0, n=2)
    lb = await b.leases(job_id, have=0, n=1)
    leases_a = [open_lease(coord, x) for x in la.leases]
    lease_b = open_lease(coord, lb.leases[0])
    assert (await a.submit(a.seal(group_for(leases_a[0])))).accepted
    assert (await a.submit(a.seal(group_for(leases_a[1], answer="99")))).accepted
    assert (await b.submit(b.seal(group_for(lease_b)))).accepted
    assert len(await take_batch(learner, job_id)) == 3
    bad = m.RescoreVerdict(rollout_id=lease_b.lease_id, ok=False, reason=R.RESCORE_MISMATCH)
    await publish(learner, job_id, 1, [x.lease_id for x in leases_a], [bad])
    return job_id, learner, a, b, leases_a, lease_b


async def next_snapshot(lines) -> dict:
    """The next ``snapshot`` event of an SSE stream's lines."""
    event = None
    async for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:") and event == "snapshot":
            return json.loads(line[5:])
    raise AssertionError("the stream ended")


def test_credit_endpoint_pays_trained_groups_and_entries_verify(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _, a, b, leases_a, lease_b = await run_swarm(coord, client)
        node_a, node_b = str(a.host.peer_id), str(b.host.peer_id)
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:
            with trio.fail_after(10):  # the book pays within a second of the version
                while (await http.get(f"/v1/credit/{node_a}")).json()["entries_total"] == 0:
                    await trio.sleep(0.1)
            got = (await http.get(f"/v1/credit/{node_a}")).json()  # public: no token
            # What a volunteer checks, with nothing but the coordinator's peer id.
            key = public_key_from_peer_id(got["coordinator_peer_id"])
            envs = [base64.b64decode(e["envelope"]) for e in got["entries"]]
            ledger = verify_entries(envs, key, node_a)
            [entry] = ledger.entries
            assert sorted(entry.refs) == sorted(x.lease_id for x in leases_a)
            tokens = sum(
                r[0]
                for r in coord.store._db.execute(
                    "SELECT tokens FROM rollouts WHERE node_id=? AND status='trained'", (node_a,)
                )
            )
            assert entry.tokens == tokens > 0
            assert got["total_ucredits"] == ledger.total == tokens * entry.params // 1000
            assert got["by_kind"] == {"rollouts": ledger.total}
            # Node B's only group was rejected: no credit, and the reason is beside it.
            got_b = (await http.get(f"/v1/credit/{node_b}")).json()
            assert got_b["total_ucredits"] == 0 and got_b["entries"] == []
            assert [r["reason"] for r in got_b["recent_rejections"]] == [R.RESCORE_MISMATCH]
            assert got_b["recent_rejections"][0]["lease_id"] == lease_b.lease_id
            # Paging, and bad input: clear 400s.
            page = (await http.get(f"/v1/credit/{node_a}?after=0")).json()
            assert page["entries"] == [] and page["next_after"] is None
            for q, why in (("?limit=abc", "integers"), ("?limit=0", "limit must be"),
                           ("?limit=1001", "limit must be")):
                r = await http.get(f"/v1/credit/{node_a}{q}")
                assert r.status_code == 400 and why in r.json()["error"]
            r = await http.get("/v1/credit/" + "x" * 129)
            assert r.status_code == 400
            # The leaderboard and a node's own row are public too.
            board = (await http.get("/v1/leaderboard")).json()
            assert board[0]["node_id"] == node_a and board[0]["credits"] == ledger.total / 1e6
            row = (await http.get(f"/v1/public/nodes/{node_b}")).json()
            assert row["rejected_by_reason"] == {R.RESCORE_MISMATCH: 1} and row["engine"] == "torch"
            assert (await http.get("/v1/public/nodes/nobody")).status_code == 404

    run_with_coordinator(tmp_path, body)


def test_sse_streams_snapshots_live_behind_the_token_with_a_cap(tmp_path) -> None:
    async def body(coord, client) -> None:
        coord.live.tick_s = 0.2
        job_id, learner, a, _, _, _ = await run_swarm(coord, client)
        node_a = str(a.host.peer_id)
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:
            assert (await http.get("/v1/events")).status_code == 401
            assert (await http.get("/v1/dashboard")).status_code == 401
            page = await http.get("/")
            assert page.status_code == 200 and "Echo swarm coordinator" in page.text
            assert (await http.get("/dashboard/uPlot.iife.min.js")).status_code == 200
            assert "MIT License" in (await http.get("/dashboard/LICENSE.uPlot")).text
            assert (await http.get("/dashboard/../db.sqlite")).status_code == 404
            with trio.fail_after(40):
                async with http.stream("GET", "/v1/events", headers=AUTH) as resp:
                    assert resp.headers["content-type"].startswith("text/event-stream")
                    lines = resp.aiter_lines()
                    snap = await next_snapshot(lines)
                    [job] = snap["jobs"]
                    assert job["job_id"] == job_id and job["current_version"] == 1
                    s = job["series"]
                    assert [v for v, _ in s["reward"]] == [0]  # groups were sampled at v0
                    assert s["eval"] == [[1, 0.25]]
                    assert s["staleness"] == [[1, 0.0, 0]]  # sampled at v0, trained by v0
                    # 3 groups of 4 (approx: they may fall into different bins)
                    assert sum(s["rollouts_per_s"]) * snap["bin_s"] == pytest.approx(3 * 4)
                    assert sum(sum(c) for c in s["rejections"].values()) == 1
                    nodes = {n["node_id"]: n for n in snap["nodes"]}
                    assert nodes[node_a]["accepted"] == 2
                    # Live: a new version shows in a later event, without a new request.
                    ln = await a.leases(job_id, have=1, n=1)
                    lease = open_lease(coord, ln.leases[0])
                    sub = group_for(lease, version=1, digest="digest-v1")
                    assert (await a.submit(a.seal(sub))).accepted
                    await take_batch(learner, job_id)
                    await publish(learner, job_id, 2, [lease.lease_id])
                    while True:  # the version, then its payment (the book runs each second)
                        snap = await next_snapshot(lines)
                        paid = {r["node_id"] for r in snap["leaderboard"]}
                        if snap["jobs"][0]["current_version"] == 2 and node_a in paid:
                            break
                    assert {n["node_id"]: n for n in snap["nodes"]}[node_a]["credits"] > 0
                    # The caps, counted apart: one operator watches, a second is refused while
                    # the operator cap is 1; public viewers have slots of their own.
                    coord.live.max_operator = 1
                    r = await http.get("/v1/events", headers=AUTH)
                    assert r.status_code == 503 and "too many" in r.json()["error"]
                    async with http.stream("GET", "/v1/public/events") as pub:
                        assert pub.status_code == 200
                    coord.live.max_public = 0
                    r = await http.get("/v1/public/events")
                    assert r.status_code == 503
            # The viewer left: its slot is freed at the next tick (the response closes its end).
            with trio.fail_after(5):
                while coord.live.viewers:
                    await trio.sleep(0.1)
            coord.live.max_public = 4
            with trio.fail_after(10):
                async with http.stream("GET", "/v1/public/events") as resp:
                    snap = await next_snapshot(resp.aiter_lines())
            # The public stream carries the leaderboard and the swarm's size, no job data.
            assert set(snap) == {"at", "leaderboard", "nodes_active", "jobs_running"}
            assert snap["jobs_running"] == 1 and snap["leaderboard"][0]["node_id"] == node_a
            full = (await http.get("/v1/dashboard", headers=AUTH)).json()
            assert full["jobs"][0]["job_id"] == job_id

    run_with_coordinator(tmp_path, body)


def test_echo_node_credit_shows_the_verified_ledger_of_a_stopped_node(tmp_path) -> None:
    from typer.testing import CliRunner

    from echo.node.cli import app

    data_dir = tmp_path / "node"
    data_dir.mkdir()
    ident = Identity.load_or_create(data_dir / "identity.key")

    async def body(coord, client) -> None:
        job_id, learner = await start_job(coord, client)
        node = await client(ident)  # the node, under the identity its data dir holds
        await node.register()
        lease = open_lease(coord, (await node.leases(job_id, have=0, n=1)).leases[0])
        assert (await node.submit(node.seal(group_for(lease)))).accepted
        await take_batch(learner, job_id)
        await publish(learner, job_id, 1, [lease.lease_id])
        with trio.fail_after(10):
            while coord.store.credit_total(ident.peer_id_str)[1] == 0:
                await trio.sleep(0.1)
        api, joined = coord.http_addrs[0], coord.multiaddrs[0]
        runner = CliRunner()

        def cli(*args: str):
            return runner.invoke(app, ["credit", "--api", api, "--data-dir", str(data_dir), *args])

        ok = await trio.to_thread.run_sync(cli, "--coordinator", joined)
        assert ok.exit_code == 0, ok.output
        total = coord.store.credit_total(ident.peer_id_str)[0]
        assert f"credit: {total / 1e6:.6f} in 1 entries" in ok.output
        assert "key from the coordinator you joined" in ok.output
        assert "1 groups" in ok.output
        # Checked against another coordinator's key, the same ledger is refused.
        other = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id_str}"
        bad = await trio.to_thread.run_sync(cli, "--coordinator", other)
        assert bad.exit_code == 1 and "does not verify" in bad.output
        gone = await trio.to_thread.run_sync(
            lambda: runner.invoke(app, ["credit", "--api", "http://127.0.0.1:9", "--node", "x"])
        )
        assert gone.exit_code == 1 and "cannot reach the coordinator" in gone.output

    run_with_coordinator(tmp_path, body)


def test_a_viewer_that_stops_reading_is_cut_off_and_a_closed_feed_builds_nothing() -> None:
    from echo.coordinator.dashboard.live import MAX_MISSED, QUEUE, LiveFeed

    builds = [0]

    def build() -> dict:
        builds[0] += 1
        return {"n": builds[0]}

    async def main() -> None:
        feed = LiveFeed(build, lambda: {"public": True}, tick_s=0.0)
        feed.publish()
        assert builds[0] == 0  # nobody watches: nothing is built
        slow = feed.subscribe(public=False)
        fast = feed.subscribe(public=True)
        assert slow is not None and fast is not None
        got = []
        for _ in range(QUEUE + MAX_MISSED):
            feed.publish()
            got.append(json.loads(fast.receive_nowait()))
        # The fast viewer got every tick; the slow one kept its queue, then was cut off.
        assert got[-1] == {"public": True} and len(got) == QUEUE + MAX_MISSED
        assert [v.public for v in feed.viewers] == [True]
        held = []
        with pytest.raises(trio.EndOfChannel):
            while True:
                held.append(json.loads(await slow.receive()))
        assert len(held) == QUEUE  # the primed snapshot and the first ticks, then the end
        fast.close()
        before = builds[0]
        feed.publish()  # the last viewer left: no more builds
        assert builds[0] == before and feed.viewers == []

    trio.run(main)

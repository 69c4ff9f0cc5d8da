"""Cost before trust (issue 13, item 1): a stranger's submission costs the coordinator a frame read.

A peer that is not a registered node, an excluded one, or one with no open lease gets its answer
before anything is decompressed, signature-checked, parsed twice or written to the database.
The spies below count calls through to the real functions; the database's ``total_changes``
counts every row written.
"""

from __future__ import annotations

import pytest
import trio
from libp2p.custom_types import TProtocol

from echo.coordinator.api import job_cli
from echo.coordinator.api.app import job_status
from echo.p2p.rpc import RpcTimeout
from echo.protocol import codec, ids, signing
from echo.protocol import reasons as R
from tests.conftest import run_with_coordinator, submit_job
from tests.coordinator.test_coordinator import group_for, open_lease, start_job


class Spy:
    """Counts calls of a module function, calling through to it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> None:
        self.calls = 0
        real = getattr(module, name)

        def spy(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)


def test_unregistered_peer_costs_a_frame_read_and_nothing_more(tmp_path, monkeypatch) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        honest = await client()
        await honest.register()
        lease = open_lease(coord, (await honest.leases(job_id, 0, 1)).leases[0])
        stranger = await client()  # never registers
        decompress = Spy(monkeypatch, codec, "decompress")
        opened = Spy(monkeypatch, signing, "open_envelope")
        bomb = codec.compress(bytes(6 << 20))  # inflates to 6 MiB
        writes = coord.store._db.total_changes
        reply = await stranger.submit(bomb)
        assert not reply.accepted and reply.reason == R.UNKNOWN_NODE
        # The stranger now serves a backoff: its connection is left unread meanwhile, so its
        # next submissions are not even opened as streams here.
        assert coord.host.gate.in_backoff(str(stranger.host.peer_id))
        for payload in (stranger.seal(group_for(lease)), honest.seal(group_for(lease))):
            with pytest.raises(RpcTimeout):
                await stranger.host.request(
                    stranger.coord, ids.PROTO_SUBMIT, payload, timeout=1.0, max_response=1 << 20
                )
        assert decompress.calls == 0 and opened.calls == 0
        assert coord.store._db.total_changes == writes
        # The honest node's lease was not touched by the stranger's copy of its group.
        assert coord.store.lease(lease.lease_id).status == "open"

    run_with_coordinator(tmp_path, body, exclude_after_failures=100)


def test_registered_node_without_an_open_lease_costs_nothing(tmp_path, monkeypatch) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        holder, idle = await client(), await client()
        await holder.register()
        await idle.register()
        lease = open_lease(coord, (await holder.leases(job_id, 0, 1)).leases[0])
        decompress = Spy(monkeypatch, codec, "decompress")
        opened = Spy(monkeypatch, signing, "open_envelope")
        writes = coord.store._db.total_changes
        for payload in (codec.compress(bytes(6 << 20)), idle.seal(group_for(lease))):
            reply = await idle.submit(payload)
            assert not reply.accepted and reply.reason == R.UNKNOWN_LEASE
        assert decompress.calls == 0 and opened.calls == 0
        assert coord.store._db.total_changes == writes

    run_with_coordinator(tmp_path, body, exclude_after_failures=100)


def test_rejected_submission_is_parsed_once(tmp_path, monkeypatch) -> None:
    """A registered node's bad group: one envelope opening, its lease closed, one rejection row."""

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
        opened = Spy(monkeypatch, signing, "open_envelope")
        reply = await node.submit(node.seal(group_for(lease, n=1)))
        assert reply.reason == R.INCOMPLETE_GROUP
        assert opened.calls == 1
        assert coord.store.lease(lease.lease_id).status == "submitted"
        assert coord.store.rejection_counts(str(node.host.peer_id)) == {R.INCOMPLETE_GROUP: 1}
        # The job's status names the reason too, and another job's status does not.
        st = job_status(coord, job_id)
        assert st["rejected_by_reason"] == {R.INCOMPLETE_GROUP: 1}
        with job_cli.console.capture() as shown:
            job_cli._print_status(st)
        assert f"rejected 1 ({R.INCOMPLETE_GROUP} 1)" in shown.get()
        assert job_status(coord, submit_job(coord))["rejected_by_reason"] == {}

    run_with_coordinator(tmp_path, body, exclude_after_failures=100)


def test_junk_from_an_excluded_identity_writes_no_rows(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        leases = [open_lease(coord, b) for b in (await node.leases(job_id, 0, 3)).leases]
        for lease in leases[:2]:
            await node.submit(node.seal(group_for(lease, n=1)))
        assert coord.store.node(str(node.host.peer_id)).excluded
        writes = coord.store._db.total_changes
        for _ in range(5):
            reply = await node.submit(codec.compress(bytes(6 << 20)))
            assert reply.reason == R.NODE_EXCLUDED
        # Framing violations (a truncated frame) from it are not booked row by row either.
        for _ in range(3):
            try:
                stream = await node.host.libp2p.new_stream(
                    node.coord, [TProtocol(ids.PROTO_SUBMIT)]
                )
                await stream.write((1000).to_bytes(4, "big") + b"x")
                await stream.close()
                await stream.read(10)
            except Exception:  # reset before or after negotiation: either is fine
                pass
        await trio.sleep(0.5)  # the coordinator books a violation after the stream ends
        assert coord.store._db.total_changes == writes

    run_with_coordinator(tmp_path, body, exclude_after_failures=2)


def test_new_nodes_refused_unread_while_their_shared_scoring_budget_is_spent(
    tmp_path, monkeypatch
) -> None:
    """Issue 26: fresh identities share one scoring budget. While bombs have spent it, a new
    node's group is refused before it is read, as ``rate_limited`` (not held against it); once
    the budget refills, the same node's next group is scored and accepted."""

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        first, second = (open_lease(coord, x) for x in (await node.leases(job_id, 0, 2)).leases)
        payload = codec.compress(node.seal(group_for(first)))
        scoring = coord.node_rpc.submissions.scoring
        scoring._new_nodes.level = -5.0  # what a run of bombs leaves
        decompress = Spy(monkeypatch, codec, "decompress")
        opened = Spy(monkeypatch, signing, "open_envelope")
        reply = await node.submit(payload)
        assert not reply.accepted and reply.reason == R.RATE_LIMITED
        assert "new nodes" in reply.detail
        assert decompress.calls == 0 and opened.calls == 0
        row = coord.store.node(str(node.host.peer_id))
        assert row.failures == 0  # not held against it
        scoring._new_nodes.level = 5.0
        ok = await node.submit(node.seal(group_for(second)))
        assert ok.accepted

    run_with_coordinator(tmp_path, body, exclude_after_failures=100)

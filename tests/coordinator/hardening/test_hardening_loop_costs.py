"""What the coordinator's loop pays per request does not grow with a churn of identities.

Under benchmarks/attack.py's attackers the loop never idled (py-spy: 14 of 999 samples), and
two per-request costs grew with the identities a churn leaves active or connected:

- **Status reports.** Each heartbeat that names a version the node verifiably holds asks "does
  every active node serving this job hold it now?" (the version's time to all nodes). That built
  a row for every active identity, per report: under a churn of 5 identities a second (each
  active for a minute) it was a tenth of the loop. Now only the nodes still behind are read, one
  id at a time, until the first that serves the job. Against the real coordinator.
- **Admission by prefix** (p2p/conn_guard.py): see the last test.
"""

from __future__ import annotations

import time

import echo.coordinator.store.nodes as store_nodes
from echo.protocol import messages as m
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import start_job

CHURNED = 2000


def _status(client, job_id: str, version: int) -> bytes:
    return client.seal(
        m.NodeStatus(
            job_id=job_id,
            version=version,
            state_digest=f"digest-v{version}",
            tokens_per_s=100.0,
            timestamp=time.time(),
        )
    )


def test_time_to_all_nodes_waits_for_every_node_serving_the_job(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        a, b = await client(), await client()
        await a.register()
        await b.register()
        rpc = coord.node_rpc
        await rpc.handle_status(a.host.peer_id, _status(a, job_id, 0))
        assert coord.store.version(job_id, 0).all_nodes_at is None  # b still holds nothing
        await rpc.handle_status(b.host.peer_id, _status(b, job_id, 0))
        assert coord.store.version(job_id, 0).all_nodes_at is not None

    run_with_coordinator(tmp_path, body)


def test_a_status_report_builds_no_row_per_active_identity(tmp_path, monkeypatch) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        for i in range(CHURNED):  # a minute of churn: registered, heard from, nothing held
            coord.store.upsert_node(f"churned-{i}", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
        built = []
        real = store_nodes.node_row

        def counted(r):
            built.append(1)
            return real(r)

        monkeypatch.setattr(store_nodes, "node_row", counted)
        # No checkpoint inside the handler: what it reads is all that is counted here.
        await coord.node_rpc.handle_status(node.host.peer_id, _status(node, job_id, 0))
        assert len(built) <= 2, f"one status report built {len(built)} node rows"
        assert coord.store.version(job_id, 0).all_nodes_at is not None  # none of them serves it

    run_with_coordinator(tmp_path, body)


def test_admission_parses_each_address_once() -> None:
    """Every admission counts the prefix's inbound connections, parsing each held connection's
    address (a tenth of the loop under churn); the parse is kept per address."""
    from echo.p2p.prefixes import prefix_of

    first = prefix_of("203.0.113.9")
    assert first is not None and first.network == "203.0.113.0/24"
    assert prefix_of("203.0.113.9") is first
    assert prefix_of("not an address") is None


def test_a_scheduling_pass_takes_the_typical_rate_once_per_job(tmp_path, monkeypatch) -> None:
    """A node nothing is known of is counted at the job's typical rate, a median over every known
    node: taken per such node, a churn's fresh identities made each pass quadratic (and a pass
    runs up to 4 times a second while identities register)."""
    from echo.coordinator.scheduling.inputs import PassInputs

    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        for i in range(CHURNED // 4):  # active, never measured
            coord.store.upsert_node(f"churned-{i}", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
        asked = []
        real = PassInputs.typical_rate

        def counted(self, job, tpr):
            asked.append(job)
            return real(self, job, tpr)

        monkeypatch.setattr(PassInputs, "typical_rate", counted)
        coord.placement.refresh()
        assert asked == [job_id], f"{len(asked)} medians in one pass"

    run_with_coordinator(tmp_path, body)

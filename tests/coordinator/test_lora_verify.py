"""The coordinator over real libp2p refuses a LoRA job's rollouts sampled from the base alone or
from a stale adapter (``wrong_weights``), and accepts those from the published adapter: the
digest a node reports is computed by its engine from the base and adapter it holds."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from echo.learner.lora import AdapterPublisher, LoraTrainer, adapter_ref
from echo.models.lora import lora_digest
from echo.node.engines.torch_engine import TorchEngine
from echo.p2p.chunkstore import ChunkStore
from echo.p2p.identity import Identity
from echo.protocol import ids
from echo.protocol import messages as m
from echo.protocol import reasons as R
from tests.conftest import run_with_coordinator, submit_job
from tests.coordinator.test_coordinator import group_for, open_lease
from tests.learner.test_lora import LORA, SPEC, groups_from, lora_job


def test_base_only_and_stale_adapters_are_refused_with_wrong_weights(tmp_path: Path) -> None:
    trainer, _ = LoraTrainer.build(lora_job(), SPEC, tmp_path / "learner")
    assert isinstance(trainer, LoraTrainer)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    v0_adapter = trainer.published_state()
    stale = TorchEngine(SPEC)  # a node that stayed on v0's adapter
    stale.load_adapter(trainer.base, v0_adapter, ref)
    trainer.learner.step(groups_from(stale, 3, seed=1, version=0))
    v1_adapter = trainer.published_state()
    current = TorchEngine(SPEC)
    current.load_adapter(trainer.base, v1_adapter, ref)
    base_only = TorchEngine(SPEC)  # the verl bug: the adapter never reached the engine
    base_only.load_state(trainer.base)

    async def body(coord, client) -> None:
        job_id = submit_job(coord, lora=LORA, warmup={"steps": 2})
        ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
        pub = AdapterPublisher(ident.private_key, job_id, ChunkStore(tmp_path / "chunks"), 4,
                               trainer.base, trainer.shape)  # fmt: skip
        learner = await client(ident)
        hello = m.LearnerHello(job_id=job_id, peer_id=str(learner.host.peer_id),
                               addrs=learner.host.listen_multiaddrs, timestamp=time.time())
        await learner.call(ids.PROTO_LEARNER_HELLO, learner.seal(hello))  # fmt: skip
        for version, adapter in ((0, v0_adapter), (1, v1_adapter)):
            env = pub.publish(adapter, version).envelope
            report = m.StepReport(job_id=job_id, version=version, manifest=env, trained=[])
            ack = m.decode(
                m.StepAck, await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(report))
            )
            assert ack.ok, ack.message

        node = await client()
        await node.register()
        leases = [open_lease(coord, b) for b in (await node.leases(job_id, 1, 4)).leases]
        assert len(leases) == 4

        async def outcome(lease: m.Lease, digest: str) -> str:
            reply = await node.submit(node.seal(group_for(lease, version=1, digest=digest)))
            return "accepted" if reply.accepted else reply.reason

        assert base_only.lora_served == ""
        assert await outcome(leases[0], base_only.lora_served) == R.WRONG_WEIGHTS
        # A base-only engine that names its state honestly: still not the version.
        assert await outcome(leases[1], lora_digest(trainer.base_digest, None)) == R.WRONG_WEIGHTS
        assert await outcome(leases[2], stale.lora_served) == R.WRONG_WEIGHTS
        assert await outcome(leases[3], current.lora_served) == "accepted"

    run_with_coordinator(tmp_path / "coord", body)


def test_a_late_joiner_fetches_the_base_once_then_adapters(tmp_path: Path) -> None:
    """A node joining at v5 (anchors every 4) fetches the base with v0, then the v4 adapter
    anchor and the v5 patch, all from the learner's chunks over libp2p, each hash-checked; the
    next version is a patch of the adapter alone, and the engine serves the signed digest."""
    from echo.node.adapter_sync import load_into_engine
    from echo.node.weights import WeightSync
    from echo.p2p.chunkstore import serve_chunks

    trainer, _ = LoraTrainer.build(lora_job(), SPEC, tmp_path / "learner")
    assert isinstance(trainer, LoraTrainer)
    ref = adapter_ref(trainer.shape, trainer.base_digest, False)
    sampler = TorchEngine(SPEC)
    adapters = []
    for v in range(7):
        if v:
            sampler.load_adapter(trainer.base, adapters[-1], ref)
            trainer.learner.step(groups_from(sampler, 2, seed=v, version=v - 1))
        adapters.append(trainer.published_state())

    async def body(coord, client) -> None:
        job_id = submit_job(coord, lora=LORA, warmup={"steps": 2}, anchor_every=4, steps=20)
        ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
        store = ChunkStore(tmp_path / "chunks", keep_versions=2)
        pub = AdapterPublisher(ident.private_key, job_id, store, 4, trainer.base, trainer.shape)
        learner = await client(ident)
        serve_chunks(learner.host, store)
        hello = m.LearnerHello(job_id=job_id, peer_id=str(learner.host.peer_id),
                               addrs=learner.host.listen_multiaddrs, timestamp=time.time())
        await learner.call(ids.PROTO_LEARNER_HELLO, learner.seal(hello))  # fmt: skip
        published = {}
        for version in range(7):
            published[version] = pub.publish(adapters[version], version)
            report = m.StepReport(job_id=job_id, version=version,
                                  manifest=published[version].envelope, trained=[])
            ack = m.decode(
                m.StepAck, await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(report))
            )  # fmt: skip
            assert ack.ok, ack.message
            if version == 5:
                break
        assert sorted(store.versions()) == [0, 4, 5]  # v1-v3 pruned, the base kept

        node = await client()
        (job,) = (await node.register()).jobs
        sync = WeightSync(node.host, job, node.coord, ChunkStore(tmp_path / "node"))
        await sync.add_source_addrs(job.learner_addrs)
        assert await sync.sync_to(5)
        assert sync.base_digest == trainer.base_digest and sync.base is not None
        assert all(torch.equal(sync.state[n], adapters[5][n]) for n in adapters[5])
        assert sync.digest == published[5].manifest.state_digest
        fetched = sum(published[v].payload_bytes for v in (0, 4, 5))
        assert sync.bytes_received == fetched
        engine = TorchEngine(SPEC)
        load_into_engine(engine, sync.adapter, sync.base, sync.state, sync.digest)
        assert engine.lora_served == published[5].manifest.state_digest

        published[6] = pub.publish(adapters[6], 6)
        report = m.StepReport(job_id=job_id, version=6, manifest=published[6].envelope,
                              trained=[])  # fmt: skip
        await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(report))
        assert await sync.sync_to(6)
        # The base is not fetched again: v6 is a patch of the adapter alone.
        assert sync.bytes_received == fetched + published[6].payload_bytes
        assert published[6].manifest.kind == "patch"
        assert all(torch.equal(sync.state[n], adapters[6][n]) for n in adapters[6])
        assert not engine.holds_base("0" * 64) and engine.holds_base(trainer.base_digest)
        load_into_engine(engine, sync.adapter, sync.base, sync.state, sync.digest)
        assert engine.lora_served == published[6].manifest.state_digest

    run_with_coordinator(tmp_path / "coord", body)


def test_an_init_adapter_is_read_only_under_the_operators_roots(tmp_path: Path) -> None:
    from tests.coordinator.hardening.test_hardening_jobapi import post_job, run_coordinator

    roots = tmp_path / "datasets"
    (roots / "adapter").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()

    def job(init: str) -> dict:
        return {"name": "l", "steps": 2, "lora": {**LORA, "init": init}}

    async def body(coord, http) -> None:
        for outside in (str(tmp_path / "elsewhere"), str(roots / ".." / "elsewhere"), "/etc"):
            r = await post_job(http, job(outside))
            assert r.status_code == 400, r.text
            assert "lora.init" in r.json()["error"] and "dataset_roots" in r.json()["error"]
        assert coord.store.jobs() == []
        r = await post_job(http, job(str(roots / "adapter")))
        assert r.status_code == 201, r.text

    run_coordinator(tmp_path, body, jobs={"dataset_roots": [str(roots)]})

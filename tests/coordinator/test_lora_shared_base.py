"""The coordinator over real libp2p with two LoRA jobs of one base (issue 28): a node's
registration lists the other job of its job's base, its lease requests for that job are granted
(not redirected), and a full-weight job's are still redirected to the node's job."""

from __future__ import annotations

import time
from pathlib import Path

from echo.learner.lora import AdapterPublisher, LoraTrainer
from echo.p2p.chunkstore import ChunkStore
from echo.p2p.identity import Identity
from echo.protocol import ids
from echo.protocol import messages as m
from tests.conftest import learner_publish_v0, run_with_coordinator, submit_job
from tests.learner.test_lora import LORA, SPEC, lora_job


def test_a_node_serves_every_lora_job_of_its_base(tmp_path: Path) -> None:
    trainer, _ = LoraTrainer.build(lora_job(), SPEC, tmp_path / "learner")
    assert isinstance(trainer, LoraTrainer)

    async def body(coord, client) -> None:
        async def publish(job_id: str, ident: Identity, report: m.StepReport) -> None:
            learner = await client(ident)
            hello = m.LearnerHello(job_id=job_id, peer_id=str(learner.host.peer_id),
                                   addrs=learner.host.listen_multiaddrs, timestamp=time.time())
            await learner.call(ids.PROTO_LEARNER_HELLO, learner.seal(hello))  # fmt: skip
            ack = m.decode(
                m.StepAck, await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(report))
            )
            assert ack.ok, ack.message

        jobs = [submit_job(coord, lora=LORA, warmup={"steps": 2}) for _ in range(2)]
        for job_id in jobs:  # both publish v0: adapters of the same base
            ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
            pub = AdapterPublisher(ident.private_key, job_id, ChunkStore(tmp_path / job_id), 4,
                                   trainer.base, trainer.shape)  # fmt: skip
            env = pub.publish(trainer.published_state(), 0).envelope
            await publish(job_id, ident, m.StepReport(job_id=job_id, version=0, manifest=env,
                                                      trained=[]))  # fmt: skip
        full = submit_job(coord)  # a full-weight job beside them
        ident, _, report = learner_publish_v0(coord, full)
        await publish(full, ident, report)

        node = await client()
        reg = await node.register()
        placed = reg.assigned_job
        assert placed in jobs or placed == full, reg
        if placed == full:  # the placement spreads nodes; a second node lands on a LoRA job
            node = await client()
            reg = await node.register()
            placed = reg.assigned_job
        assert placed in jobs, reg
        other = next(j for j in jobs if j != placed)
        assert reg.base_jobs == [other]
        # Leases of the other job of its base: granted, not a move.
        reply = await node.leases(other, 0, 2)
        assert reply.assigned_job is None and reply.leases, reply
        # Leases of a job of another model: the node is told where it is placed.
        reply = await node.leases(full, 0, 2)
        assert reply.assigned_job == placed and not reply.leases, reply
        assert coord.placement.bases.siblings(full, [*jobs, full]) == []

    run_with_coordinator(tmp_path / "coord", body)

"""The coordinator over real libp2p: registration, leases, verification outcomes, the learner
protocol, and bad input that must leave it running."""

from __future__ import annotations

import sqlite3
import time

import numpy as np
import pytest
import trio
import zstandard
from libp2p.custom_types import TProtocol

from echo.coordinator.rpc.common import admission
from echo.coordinator.store import Store
from echo.coordinator.store.db import SCHEMA_VERSION
from echo.models.tokenizer import EOS_ID, encode
from echo.p2p.identity import Identity
from echo.p2p.rpc import RemoteError
from echo.protocol import codec, ids, signing
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.tasks.registry import make_task
from tests.conftest import learner_publish_v0, run_with_coordinator, submit_job

TASK = make_task("addition", {"max_operand": 5})


def group_for(
    lease: m.Lease,
    *,
    answer: str | None = None,
    version: int = 0,
    digest: str = "digest-v0",
    n: int | None = None,
    **over,
) -> m.Submission:
    text = answer if answer is not None else TASK.answer(lease.prompt_id)
    toks = encode(text) + [EOS_ID]
    comps = [
        m.CompletionRecord(
            token_ids=m.pack_tokens(toks),
            logprobs=m.pack_logprobs([-0.1] * len(toks)),
            finish_reason="stop",
        )
        for _ in range(lease.group_size if n is None else n)
    ]
    fields = dict(
        lease_id=lease.lease_id,
        job_id=lease.job_id,
        version=version,
        engine="torch",
        state_digest=digest,
        completions=comps,
        gen_seconds=0.01,
    )
    fields.update(over)
    return m.Submission(**fields)


async def start_job(coord, client, **spec) -> tuple[str, object]:
    """A job (``spec`` over the test defaults) with its learner attached and version 0
    published; returns the job id and the learner's client."""
    job_id = submit_job(coord, **spec)
    learner, _ = await attach_learner(coord, client, job_id)
    return job_id, learner


async def attach_learner(coord, client, job_id: str) -> tuple[object, m.StepAck]:
    """The submitted job's learner says hello and publishes version 0; returns its client and
    the coordinator's acknowledgement (fails the test unless it is ok)."""
    ident, _, report = learner_publish_v0(coord, job_id)
    learner = await client(ident)
    hello = m.LearnerHello(
        job_id=job_id,
        peer_id=str(learner.host.peer_id),
        addrs=learner.host.listen_multiaddrs,
        timestamp=time.time(),
    )
    reply = m.decode(
        m.LearnerHelloReply,
        await learner.call(ids.PROTO_LEARNER_HELLO, learner.seal(hello)),
    )
    assert reply.current_version == -1
    ack = m.decode(
        m.StepAck, await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(report))
    )
    assert ack.ok, ack.message
    return learner, ack


async def publish_version(
    learner, job_id: str, version: int, trained: list[str] | None = None
) -> None:
    """The learner's real step report of ``version`` (a patch on ``version - 1``, no chunks),
    naming ``trained`` as the rollouts it trained on; fails the test unless it is acked."""
    man = m.Manifest(
        job_id=job_id,
        version=version,
        base_version=version - 1,
        kind="patch",
        total_size=0,
        chunks=[],
        tensor_digests={},
        state_digest=f"digest-v{version}",
        anchor_version=0,
        created_at=time.time(),
    )
    rep = m.StepReport(
        job_id=job_id,
        version=version,
        manifest=signing.seal_record(learner.identity.private_key, man),
        trained=trained or [],
    )
    ack = m.decode(m.StepAck, await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(rep)))
    assert ack.ok, ack.message


def open_lease(coord, data: bytes) -> m.Lease:
    return signing.open_record(data, m.Lease, expected_signer=coord.identity.public_key_bytes)[1]


def test_register_lease_submit_and_batch(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, learner = await start_job(coord, client)
        node = await client()
        reply = await node.register()
        assert [j.job_id for j in reply.jobs] == [job_id]
        assert reply.jobs[0].learner_public_key == learner.identity.public_key_bytes
        # Idle reaping spares the learner and nodes with accepted work, not a mere registrant.
        guard = coord.host.guard
        assert guard.is_protected(learner.host.peer_id)
        assert not guard.is_protected(node.host.peer_id)
        lr = await node.leases(job_id, have=0, n=2)
        assert len(lr.leases) == 2
        lease = open_lease(coord, lr.leases[0])
        assert lease.node_id == str(node.host.peer_id)
        ok = await node.submit(node.seal(group_for(lease)))
        assert ok.accepted and ok.accepted_total == 1
        assert guard.is_protected(node.host.peer_id)
        # A wrong answer is still accepted (reward 0, recomputed here), compressed on the wire.
        lease2 = open_lease(coord, lr.leases[1])
        ok2 = await node.submit(
            codec.compress(node.seal(group_for(lease2, answer="99")))
        )
        assert ok2.accepted
        rows = {r["rollout_id"]: r for r in coord.store._db.execute("SELECT * FROM rollouts")}
        assert rows[lease.lease_id]["mean_reward"] == 1.0
        assert rows[lease2.lease_id]["mean_reward"] == 0.0
        # The learner takes both groups, each with its lease's prompt and its verified ids.
        req = m.BatchRequest(job_id=job_id, max_groups=8, min_version=0, timestamp=time.time())
        batch = m.decode(
            m.BatchReply,
            await learner.call(
                ids.PROTO_LEARNER_BATCH, learner.seal(req), max_response=64 << 20
            ),
        )
        assert {g.rollout_id for g in batch.groups} == {lease.lease_id, lease2.lease_id}
        g = next(g for g in batch.groups if g.rollout_id == lease.lease_id)
        assert g.prompt_tokens == np.frombuffer(lease.prompt_tokens, "<i4").tolist()
        assert g.prompt_tokens[1:] == encode(TASK.prompt(lease.prompt_id))
        sent = group_for(lease).completions
        assert [c.token_ids for c in g.completions] == [
            np.frombuffer(c.token_ids, "<i4").tolist() for c in sent
        ]
        assert [c.logprobs for c in g.completions] == [
            np.frombuffer(c.logprobs, "<f4").tolist() for c in sent
        ]
        # Version 1 trains exactly these; the ledger records it, and nothing is trained twice.
        ident = learner.identity
        man = m.Manifest(
            job_id=job_id,
            version=1,
            base_version=0,
            kind="patch",
            total_size=0,
            chunks=[],
            tensor_digests={},
            state_digest="digest-v1",
            anchor_version=0,
            created_at=time.time(),
        )
        rep = m.StepReport(
            job_id=job_id,
            version=1,
            manifest=signing.seal_record(ident.private_key, man),
            trained=[lease.lease_id, lease2.lease_id],
        )
        ack = m.decode(
            m.StepAck,
            await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(rep)),
        )
        assert ack.ok
        trained = coord.store.trained_rollouts(job_id)
        assert {r.rollout_id for r in trained} == {lease.lease_id, lease2.lease_id}
        assert all(r.trained_version == 1 for r in trained)
        again = m.decode(
            m.StepAck,
            await learner.call(ids.PROTO_LEARNER_REPORT, learner.seal(rep)),
        )
        assert again.ok  # idempotent re-send after a learner restart
        batch2 = m.decode(
            m.BatchReply,
            await learner.call(
                ids.PROTO_LEARNER_BATCH, learner.seal(req), max_response=64 << 20
            ),
        )
        assert batch2.groups == []

    run_with_coordinator(tmp_path, body)


def test_verification_reasons(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node, other = await client(), await client()
        await node.register()
        await other.register()
        leases = [open_lease(coord, b) for b in (await node.leases(job_id, 0, 4)).leases]
        a, b, c, d = leases

        async def expect(payload: bytes, reason: str, who=node) -> None:
            reply = await who.submit(payload)
            assert not reply.accepted and reply.reason == reason, (reply.reason, reply.detail)

        await expect(node.seal(group_for(a, n=3)), R.INCOMPLETE_GROUP)
        # The lease is consumed by the failed attempt: a retry is a duplicate.
        await expect(node.seal(group_for(a)), R.DUPLICATE)
        await other.leases(job_id, 0, 1)  # a peer without an open lease is not even read
        await expect(other.seal(group_for(b)), R.LEASE_NOT_YOURS, who=other)
        await expect(node.seal(group_for(b, version=1)), R.FUTURE_VERSION)
        await expect(node.seal(group_for(c, digest="forged")), R.WRONG_WEIGHTS)
        bad_tokens = group_for(d).model_copy(
            update={
                "completions": [
                    m.CompletionRecord(
                        token_ids=m.pack_tokens([400, EOS_ID]),
                        logprobs=m.pack_logprobs([-1, -1]),
                        finish_reason="stop",
                    )
                ]
                * d.group_size
            }
        )
        await expect(node.seal(bad_tokens), R.BAD_TOKENS)
        await node.leases(job_id, 0, 1)  # an open lease, so what follows is read at all
        # Signed by another key than the peer's own.
        await expect(other.seal(group_for(d)), R.WRONG_SIGNER)
        await expect(b"\xdd\xff\xff\xff\xff", R.MALFORMED)
        unknown = group_for(d).model_copy(update={"lease_id": "nope"})
        await expect(node.seal(unknown), R.UNKNOWN_LEASE)
        counts = coord.store.rejection_counts(str(node.host.peer_id))
        assert counts[R.DUPLICATE] == 1 and counts[R.MALFORMED] == 1

    run_with_coordinator(tmp_path, body, exclude_after_failures=100)


def test_bad_input_penalizes_and_coordinator_keeps_running(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        peer = node.coord
        me = str(node.host.peer_id)

        async def raw(data: bytes, close: bool) -> None:
            stream = await node.host.libp2p.new_stream(peer, [TProtocol(ids.PROTO_SUBMIT)])
            await stream.write(data)
            if close:
                await stream.close()
            with trio.move_on_after(3):
                try:
                    while await stream.read(1024):
                        pass
                except Exception:
                    pass
            await stream.reset()

        # 1. oversized length prefix; 2. truncated frame: both are transport violations.
        await raw((1 << 30).to_bytes(4, "big") + b"x" * 100, close=False)
        await raw((1000).to_bytes(4, "big") + b"x" * 10, close=True)
        with trio.fail_after(5):
            while coord.host.violations.get(node.host.peer_id, 0) < 2:
                await trio.sleep(0.02)
        # 3. wrong signature (valid envelope, one body bit flipped).
        lease = open_lease(coord, (await node.leases(job_id, 0, 1)).leases[0])
        sealed = node.seal(group_for(lease))
        raw_env = codec.unpackb(sealed)
        raw_env["body"] = raw_env["body"][:-1] + bytes([raw_env["body"][-1] ^ 1])
        reply = await node.submit(codec.packb(raw_env))
        assert (reply.accepted, reply.reason) == (False, R.SIGNATURE)
        # 4. msgpack bomb; 5. zstd bomb (64 MiB of zeros declared in a few KB).
        assert (await node.submit(b"\xdf\xff\xff\xff\xff")).reason == R.MALFORMED
        bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
        reply = await node.submit(bomb)
        assert reply.reason == R.MALFORMED and "declares" in reply.detail
        # A bad register is a clean error reply, not a crash.
        with pytest.raises(RemoteError, match="decode|frame|signature|schema"):
            await node.call(ids.PROTO_REGISTER, b"\x91" * 50 + b"\x00")
        # The node was penalized; the coordinator still serves it and others.
        row = coord.store.node(me)
        assert row.failures >= 4 and row.streak == 0
        fresh = await client()
        assert (await fresh.register()).jobs

    run_with_coordinator(tmp_path, body, exclude_after_failures=100)


def test_repeated_failures_exclude_node_and_drop_its_buffer(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        leases = [open_lease(coord, b) for b in (await node.leases(job_id, 0, 4)).leases]
        assert (await node.submit(node.seal(group_for(leases[0])))).accepted
        assert coord.host.guard.is_protected(node.host.peer_id)
        for lease in leases[1:3]:
            r = await node.submit(node.seal(group_for(lease, n=1)))
            assert r.reason == R.INCOMPLETE_GROUP
        row = coord.store.node(str(node.host.peer_id))
        assert row.excluded == 1
        assert not coord.host.guard.is_protected(node.host.peer_id)  # reaped like a stranger
        status = coord.store._db.execute(
            "SELECT status, reason FROM rollouts WHERE rollout_id=?", (leases[0].lease_id,)
        ).fetchone()
        assert tuple(status) == ("dropped", R.NODE_EXCLUDED)
        r = await node.submit(node.seal(group_for(leases[3])))
        assert r.reason == R.NODE_EXCLUDED
        # One admission check words the refusal alike on every route a node takes.
        refused = admission(coord.store.node(str(node.host.peer_id)))
        assert refused is not None and refused[0] == R.NODE_EXCLUDED
        assert (r.reason, r.detail) == refused
        for ask in (lambda: node.leases(job_id, 0, 1), node.register):
            with pytest.raises(RemoteError, match="excluded") as err:
                await ask()
            assert err.value.message == f"{refused[0]}: {refused[1]}"

    run_with_coordinator(tmp_path, body, exclude_after_failures=2)


def test_lease_quota_grows_with_a_run_of_valid_results(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, _ = await start_job(coord, client)
        node = await client()
        await node.register()
        first = (await node.leases(job_id, 0, 8)).leases
        assert len(first) == 1  # a fresh identity ties up one lease at a time
        assert (await node.leases(job_id, 0, 8)).leases == []
        for expected in (1, 1, 2):  # quota 1 + streak // 3
            lease = open_lease(coord, first[0])
            assert (await node.submit(node.seal(group_for(lease)))).accepted
            first = (await node.leases(job_id, 0, 8)).leases
            assert len(first) == expected

    run_with_coordinator(tmp_path, body, lease_quota_ramp=3, exclude_after_failures=100,
                         buffer_groups=100)


def test_a_schema_1_database_opens_at_the_current_schema_without_its_buffer(tmp_path) -> None:
    """Schema 3 stores each group with its lease's prompt, which older files never kept and
    only the task can render again: their buffered groups are dropped (not held against their
    nodes), their open leases forgotten, and their trained record kept."""
    ident = Identity.generate()
    lease = m.Lease(
        lease_id="r1",
        job_id="job",
        node_id=ident.peer_id_str,
        prompt_id=3,
        prompt_tokens=m.pack_tokens(encode(TASK.prompt(3))),
        group_size=2,
        sampling=m.SamplingSpec(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=1),
        min_version=0,
        issued_at=0.0,
        deadline=1.0,
    )
    sub = group_for(lease)
    envelope = signing.seal_record(ident.private_key, sub)
    path = tmp_path / "v1.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE rollouts (
            rollout_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, node_id TEXT NOT NULL,
            version INTEGER NOT NULL, prompt_id INTEGER NOT NULL, status TEXT NOT NULL,
            reason TEXT NOT NULL DEFAULT '', rewards_json TEXT NOT NULL, mean_reward REAL NOT NULL,
            tokens INTEGER NOT NULL, content_hash BLOB NOT NULL, envelope BLOB NOT NULL,
            created_at REAL NOT NULL, batch_at REAL, trained_version INTEGER
        );
        CREATE TABLE leases (
            lease_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, node_id TEXT NOT NULL,
            prompt_id INTEGER NOT NULL, group_size INTEGER NOT NULL,
            max_new_tokens INTEGER NOT NULL, seed INTEGER NOT NULL, min_version INTEGER NOT NULL,
            issued_at REAL NOT NULL, deadline REAL NOT NULL, status TEXT NOT NULL
        );
        INSERT INTO leases VALUES ('open1', 'job', 'n', 4, 2, 8, 1, 0, 0, 1e12, 'open');
        INSERT INTO leases VALUES ('r0', 'job', 'n', 3, 2, 8, 1, 0, 0, 1, 'submitted');
        """
    )
    for rid, status in (("r1", "accepted"), ("r0", "trained")):
        db.execute(
            "INSERT INTO rollouts VALUES (?, 'job', ?, 0, 3, ?, '', '[1.0, 1.0]', 1.0, 4, ?, ?,"
            " 0, NULL, NULL)",
            (rid, ident.peer_id_str, status, rid.encode(), envelope),
        )
    db.commit()
    db.close()
    store = Store.open(path)
    try:
        assert store.take_batch("job", 8, 0) == []
        # Migrated through every step to the current schema (3: prompts stored with leases;
        # 4: the credit ledger, whose cursor starts empty so past groups get paid).
        assert store._db.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
        status = dict(store._db.execute("SELECT rollout_id, status || '/' || reason FROM rollouts"))
        assert status == {"r1": "dropped/upgraded", "r0": "trained/"}
        assert store.lease("open1") is None and store.lease("r0").prompt_ids == ()
        assert store.rejection_counts(ident.peer_id_str) == {}  # nothing held against a node
        assert store.credit_cursors() == {}
    finally:
        store.close()

"""The credit ledger against a real SQLite store, the real credit book and the real relay
planner: what is paid equals what trained groups and confirmed relays earned, each entry
verifies, and nothing can rewrite or forge it."""

from __future__ import annotations

import sqlite3
import time

import pytest

from echo.coordinator.credit import CreditBook
from echo.coordinator.dissemination.planning import Dissemination
from echo.coordinator.scheduling.fit import param_count
from echo.coordinator.store import Store
from echo.coordinator.store.rows import LeaseRow
from echo.p2p.identity import Identity, public_key_from_peer_id
from echo.protocol import messages as m
from echo.protocol import reasons as R
from echo.protocol import signing
from echo.protocol.credit import CreditEntry, CreditError, price, verify_entries
from echo.protocol.jobspec import parse_job

SPEC = parse_job(
    {
        "name": "credit",
        "group_size": 2,
        "batch_groups": 2,
        "steps": 5,
        "task": {"name": "addition", "params": {"max_operand": 5}},
    }
)


def _accept(store: Store, job_id: str, node: str, n: int, tokens: int, *, buffered=True) -> str:
    """One accepted group of ``node`` (lease ``n``) holding ``tokens`` tokens."""
    lease_id = f"lease-{node}-{n}"
    now = time.time()
    store.add_leases(
        [LeaseRow(lease_id, job_id, node, n, 2, 16, n, 0, now, now + 60, "open")]
    )
    # Stored as the submit path encodes it: the learner's form of the group.
    comp = m.TrainingCompletion(
        token_ids=[1] * (tokens // 2), logprobs=[-0.1] * (tokens // 2), finish_reason="length"
    )
    group = m.encode(
        m.TrainingGroup(
            rollout_id=lease_id,
            node_id=node,
            prompt_id=n,
            prompt_tokens=[1],
            version=0,
            engine="torch",
            rewards=[1.0, 0.0] if buffered else [1.0, 1.0],
            completions=[comp, comp],
        )
    )
    store.accept_rollout(
        lease_id=lease_id,
        job_id=job_id,
        node_id=node,
        version=0,
        prompt_id=n,
        engine="torch",
        group=group,
        rewards=[1.0, 0.0] if buffered else [1.0, 1.0],
        tokens=tokens,
        content_hash=lease_id.encode().ljust(32, b"\0")[:32],
        envelope=b"env",
        buffered=buffered,
    )
    return lease_id


def _store_with_history(tmp_path) -> tuple[Store, str, dict[str, list[tuple[str, int]]]]:
    """Two nodes' groups: trained into v1 and v2, one rejected by re-scoring, one uniform (never
    trained), one still buffered. Returns the store, the job and each node's trained groups."""
    store = Store.open(tmp_path / "db.sqlite")
    job_id = "job-credit"
    store.create_job(job_id, "credit", SPEC.model_dump(mode="json"))
    for node in ("node-a", "node-b"):
        store.upsert_node(node, bytes(32), "torch", {}, 10.0, 0.0, 0.0)
    a1 = _accept(store, job_id, "node-a", 1, 40)
    a2 = _accept(store, job_id, "node-a", 2, 60)
    b1 = _accept(store, job_id, "node-b", 3, 30)
    bad = _accept(store, job_id, "node-b", 4, 50)
    _accept(store, job_id, "node-b", 5, 70, buffered=False)  # uniform: dropped, unscored
    store.take_batch(job_id, 10, 0)
    for v, trained, rejected in ((0, [], []), (1, [a1, b1], [(bad, R.RESCORE_MISMATCH, "{}")])):
        store.publish_version(
            job_id, v, kind="anchor", manifest=b"m", state_digest=f"d{v}", total_size=0,
            trained=trained, rejected=rejected, metrics={},
        )
    store.take_batch(job_id, 10, 0)
    store.publish_version(
        job_id, 2, kind="patch", manifest=b"m", state_digest="d2", total_size=0,
        trained=[a2], rejected=[], metrics={},
    )
    _accept(store, job_id, "node-a", 6, 80)  # buffered, not trained yet: not paid yet
    trained = {"node-a": [(a1, 40), (a2, 60)], "node-b": [(b1, 30)]}
    return store, job_id, trained


def _envelopes(store: Store, node: str) -> list[bytes]:
    return [r.envelope for r in store.credit_entries(node)]


def test_credit_equals_what_trained_groups_earned_and_every_entry_verifies(tmp_path) -> None:
    store, job_id, trained = _store_with_history(tmp_path)
    coord = Identity.generate()
    book = CreditBook(store, coord)
    params = param_count(SPEC.model_spec_dict())
    assert params > 0
    assert book.book_trained() == 3  # node-a in v1 and v2, node-b in v1
    key = public_key_from_peer_id(coord.peer_id_str)  # what a volunteer knows of its coordinator
    for node, groups in trained.items():
        ledger = verify_entries(_envelopes(store, node), key, node)
        # Each entry pays one version's groups of the node; together, exactly its trained ones.
        paid = sorted(r for e in ledger.entries for r in e.refs)
        assert paid == sorted(rid for rid, _ in groups)
        rows = {
            r[0]: (r[1], r[2])
            for r in store._db.execute(
                "SELECT rollout_id, tokens, trained_version FROM rollouts WHERE node_id=?",
                (node,),
            )
        }
        expected = 0
        for e in ledger.entries:
            assert e.kind == "rollouts" and e.params == params
            assert e.tokens == sum(rows[r][0] for r in e.refs)
            assert {rows[r][1] for r in e.refs} == {e.version}
            expected += e.tokens * params // 1000
        assert ledger.total == expected == store.credit_total(node)[0]
        assert expected == sum(price("rollouts", tokens=t, params=params) for _, t in groups)
    # The rejected and the uniform groups of node-b earn nothing; booking again pays nothing.
    assert book.book_trained() == 0
    assert store.credit_total("node-b")[1] == 1
    # A 7B token is worth more than a 135M one.
    assert price("rollouts", tokens=1, params=7_000_000_000) > price(
        "rollouts", tokens=1, params=135_000_000
    )
    # Once the buffered group trains into v3, it is paid in an entry of its own, chained on.
    store.take_batch(job_id, 10, 0)
    store.publish_version(
        job_id, 3, kind="patch", manifest=b"m", state_digest="d3", total_size=0,
        trained=["lease-node-a-6"], rejected=[], metrics={},
    )
    assert book.book_trained() == 1
    ledger = verify_entries(_envelopes(store, "node-a"), key, "node-a")
    assert [e.seq for e in ledger.entries] == [0, 1, 2]
    assert ledger.entries[-1].refs == ["lease-node-a-6"] and ledger.entries[-1].tokens == 80
    store.close()


def test_the_ledger_is_append_only_and_tampering_is_caught(tmp_path) -> None:
    store, _, _ = _store_with_history(tmp_path)
    coord = Identity.generate()
    CreditBook(store, coord).book_trained()
    key = coord.public_key_bytes
    envs = _envelopes(store, "node-a")
    assert len(envs) == 2
    # The database refuses to rewrite or delete an entry.
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        store._db.execute("UPDATE credit SET amount=amount*2")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        store._db.execute("DELETE FROM credit WHERE node_id='node-a'")
    assert verify_entries(_envelopes(store, "node-a"), key, "node-a").total > 0
    # A volunteer catches: a flipped byte, a dropped or reordered entry, another node's entry,
    # another signer, and an amount that is not the price of what the entry names.
    flipped = bytearray(envs[0])
    flipped[-70] ^= 1
    for bad, why in (
        ([bytes(flipped), envs[1]], "entry 0"),
        ([envs[1]], "chain is broken"),
        ([envs[1], envs[0]], "chain is broken"),
        (_envelopes(store, "node-b"), "pays node-b"),
    ):
        with pytest.raises(CreditError, match=why):
            verify_entries(bad, key, "node-a")
    with pytest.raises(CreditError, match="unexpected key"):
        verify_entries(envs, Identity.generate().public_key_bytes, "node-a")
    _, first = signing.open_record(envs[0], CreditEntry)
    inflated = signing.seal_record(
        coord.private_key, first.model_copy(update={"amount": first.amount + 1})
    )
    with pytest.raises(CreditError, match="price list says"):
        verify_entries([inflated], key, "node-a")
    with pytest.raises(CreditError, match="bytes, over"):
        verify_entries([b"\x00" * (300 * 1024)], key, "node-a")
    store.close()


def test_confirmed_relaying_is_paid_once_and_only_across_networks(tmp_path) -> None:
    store = Store.open(tmp_path / "db.sqlite")
    coord = Identity.generate()
    book = CreditBook(store, coord)
    d = Dissemination(learner_upload_bps=1e6, default_node_upload_bps=1e7, max_fanout=1)
    d.receipts.on_relay_credit = book.relayed
    # A chain learner -> a -> b -> c: b and c share a /24, so b relaying to c is not paid (a
    # node's own sybils next door could confirm anything).
    nets = {"node-a": "203.0.113.5", "node-b": "198.51.100.7", "node-c": "198.51.100.9"}
    for n, ip in nets.items():
        d.relays.registered(n, [f"/ip4/{ip}/tcp/4001"], 1e7)
        d.relays.set_reachable(
            n, True, verdict="public", observed_ip=ip, dialed=f"/ip4/{ip}/tcp/4001"
        )
    total = 10_000_000
    d.plan("job", 1, b"m", total, source="learner", source_addrs=[], nodes=list(nets))
    plan = d.current_plan("job")
    assert plan is not None and dict(plan.stripes[0].children) == {
        "learner": ("node-a",), "node-a": ("node-b",), "node-b": ("node-c",)
    }
    d.receipts.delivered("node-b", "job", 1, accepted=0)  # no accepted work: its word pays nobody
    assert store.credit_total("node-a") == (0, 0)
    d.plan("job", 2, b"m", total, source="learner", source_addrs=[], nodes=list(nets))
    for n in nets:
        d.receipts.delivered(n, "job", 2, accepted=1)
        d.receipts.delivered(n, "job", 2, accepted=1)  # a repeated receipt pays nothing more
    ledger = verify_entries(_envelopes(store, "node-a"), coord.public_key_bytes, "node-a")
    [entry] = ledger.entries
    assert (entry.kind, entry.refs, entry.version, entry.nbytes) == ("relay", ["node-b"], 2, total)
    assert ledger.total == price("relay", nbytes=total) == total
    assert store.credit_total("node-b") == (0, 0)
    # The same transfer reported again (a restarted planner) is not paid twice.
    assert book.relayed("job", 2, "node-a", "node-b", total) is None
    store.close()


def test_a_schema_3_database_gains_the_ledger_and_pays_its_history(tmp_path) -> None:
    store, _, trained = _store_with_history(tmp_path)
    # Back to schema 3 (the one before the ledger): no credit tables (DROP TABLE fires no DELETE
    # trigger).
    for t in ("credit", "credit_totals", "credit_cursor"):
        store._db.execute(f"DROP TABLE {t}")
    store._db.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    store.close()
    store = Store.open(tmp_path / "db.sqlite")
    schema = store._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    assert schema[0] == "4"
    coord = Identity.generate()
    assert CreditBook(store, coord).book_trained() == 3  # what trained before the ledger
    ledger = verify_entries(_envelopes(store, "node-a"), coord.public_key_bytes, "node-a")
    assert sorted(r for e in ledger.entries for r in e.refs) == [r for r, _ in trained["node-a"]]
    store._db.execute("UPDATE meta SET value='5' WHERE key='schema_version'")
    store.close()
    from echo.coordinator.store.db import StoreError

    with pytest.raises(StoreError, match="schema 5"):
        Store.open(tmp_path / "db.sqlite")

"""Dynamic sampling (the job's ``skip_uniform_groups``): a group whose samples all scored the
same is credited to its node but kept out of the batch buffer, so the lease budget sends another
prompt in its place; past UNIFORM_BATCHES batches of them per version they train as usual."""

from __future__ import annotations

import hashlib

import pytest

from echo.coordinator.store import Store
from echo.coordinator.store.rows import LeaseRow
from echo.coordinator.submissions.submit import UNIFORM_BATCHES, buffers
from echo.protocol import reasons as R
from echo.protocol.jobspec import SpecError, load_job_toml
from tests.conftest import STORED_GROUP


def _accept(store: Store, lid: str, rewards: list[float], buffered: bool) -> None:
    store.add_leases([LeaseRow(lid, "j", "node", 0, 4, 8, 0, 0, 0.0, 1e12, "open")])
    store.accept_rollout(
        lease_id=lid,
        job_id="j",
        node_id="node",
        version=0,
        prompt_id=0,
        engine="torch",
        group=STORED_GROUP,
        rewards=rewards,
        tokens=3 * len(rewards),
        content_hash=hashlib.sha256(lid.encode()).digest(),
        envelope=b"E",
        buffered=buffered,
    )


def test_the_job_option_is_validated() -> None:
    assert not load_job_toml("[job]\nname='x'\n").skip_uniform_groups  # off unless asked
    assert load_job_toml("[job]\nname='x'\nskip_uniform_groups=true\n").skip_uniform_groups
    with pytest.raises(SpecError, match="skip_uniform_groups"):
        load_job_toml("[job]\nname='x'\nskip_uniform_groups='sometimes'\n")


def test_which_groups_are_buffered() -> None:
    on = load_job_toml("[job]\nname='x'\nbatch_groups=2\nskip_uniform_groups=true\n")
    off = load_job_toml("[job]\nname='x'\nbatch_groups=2\n")

    def never() -> int:
        raise AssertionError("counted without need")

    assert buffers(off, [0.0, 0.0], never)  # the option is off
    assert buffers(on, [0.0, 1.0], never)  # an advantage to train on
    assert not buffers(on, [0.0, 0.0], lambda: 0)
    assert not buffers(on, [1.0, 1.0], lambda: UNIFORM_BATCHES * 2 - 1)
    assert buffers(on, [1.0, 1.0], lambda: UNIFORM_BATCHES * 2)  # the version's cap is reached


def test_a_set_aside_group_is_credited_counted_and_never_batched(tmp_path) -> None:
    store = Store.open(tmp_path / "c.db")
    store.create_job("j", "j", {})
    store.upsert_node("node", b"k" * 32, "torch", {}, 0.0, 0.0, 0.0)
    _accept(store, "u", [0.0, 0.0, 0.0, 0.0], buffered=False)
    _accept(store, "s", [1.0, 0.0, 0.0, 0.0], buffered=True)

    assert store.buffered_count("j") == 1  # the lease budget sees room for another group
    assert store.uniform_count("j", 0) == 1 and store.uniform_count("j", 1) == 0
    assert store.node("node").accepted == 2  # valid work either way
    counts = store.rollout_counts("j")
    assert counts["dropped"] == 1 and counts["uniform"] == 1
    # The sampled reward curve counts every group sampled, set aside or not.
    assert store.reward_by_version("j") == [(0, 0.125, 2)]
    batch = store.take_batch("j", 8, 0)
    assert [b.rollout.rollout_id for b in batch] == ["s"]
    assert store.take_batch("j", 8, 0) == []


def test_the_reason_is_not_held_against_a_node() -> None:
    assert R.UNIFORM not in R.COUNTS_AGAINST

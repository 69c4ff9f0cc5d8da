"""End to end: the real programs as separate processes on loopback (coordinator, its learner,
three nodes), driven by tools/local_swarm.py exactly as the demo runs them."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from echo.models.spec import ModelSpec, build_model
from echo.models.weights import export_state, state_digest, state_from_bytes, to_bits
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.jobspec import JobSpec
from echo.tools.local_swarm import node_engines
from tests.e2e.swarm_tool import SwarmTool, run_swarm_tool

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def swarm_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("swarm")
    run_swarm_tool(
        "echo.tools.local_swarm",
        out,
        ["--quiet", "--nodes", "3", "--steps", "150", "--timeout", "220",
         "--kill-learner-at", "40"],
        timeout=360,
        what="local swarm",
    )  # fmt: skip
    return out


# The short runs: 12 versions of 4 groups on 2 torch nodes, one per mode below.
SHORT = ["--quiet", "--nodes", "2", "--engines", "torch", "--steps", "12", "--timeout", "150"]
SHORT_BATCH = 4
SHORT_MODES = {
    "sync": ["--staleness", "0"],
    "ds": ["--skip-uniform"],
    "noplan": ["--no-broadcast"],
}


# The tests that read a short run, and which run each reads.
SHORT_TESTS = {
    "test_synchronous_mode_trains_only_on_the_current_version": "sync",
    "test_skip_uniform_groups_trains_only_on_groups_with_an_advantage": "ds",
    "test_nodes_that_hear_no_plan_follow_every_version_through_their_lease_replies": "noplan",
}


@pytest.fixture(scope="module")
def short_runs(request, tmp_path_factory) -> Iterator[dict[str, SwarmTool]]:
    """The three short swarms, started at once; each test waits for its own. Each is its own
    swarm (coordinator, learner, nodes) in its own folder, as when run one after the other: a
    short run's wall time is mostly waits (processes starting, the nodes' idle poll, the final
    sync, the stop), about 35 CPU seconds of 110 wall on a loaded 2-core machine, so three at
    once end much sooner than three in a row."""
    # Only the runs this session's selected tests read (`-k` one of them starts one swarm).
    selected = {SHORT_TESTS[i.name] for i in request.session.items if i.name in SHORT_TESTS}
    base = tmp_path_factory.mktemp("short")
    runs = {
        mode: SwarmTool(
            "echo.tools.local_swarm",
            base / mode,
            [*SHORT, "--batch-groups", str(SHORT_BATCH), *extra],
            timeout=240,
            what=f"local swarm ({mode})",
        )
        for mode, extra in SHORT_MODES.items()
        if mode in selected
    }
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


def _job_dir(out: Path) -> Path:
    (job_dir,) = (out / "coordinator" / "jobs").iterdir()
    return job_dir


def test_summary_and_reward_rose(swarm_run: Path) -> None:
    s = json.loads((swarm_run / "summary.json").read_text())
    for key in (
        "versions",
        "reward_first",
        "reward_last",
        "rollouts_accepted",
        "rollouts_rejected",
        "nodes",
        "wall_s",
    ):
        assert key in s
    assert s["status"] == "done" and s["versions"] == 150 and s["nodes"] == 3
    # Learning is judged where the run ends: the last 10 versions' sampled reward against the
    # first 5, and held-out greedy accuracy at the last version against the first.
    curve = [p["mean_reward"] for p in s["reward_by_version"]]
    first, last = sum(curve[:5]) / 5, sum(curve[-10:]) / 10
    assert last > first + 0.1, (first, last, curve)
    assert s["eval_last"] > s["eval_first"] + 0.2, s["eval_by_version"]
    assert s["rollouts_rejected"] <= 0.005 * max(1, s["rollouts_accepted"]) + 1
    # A mixed swarm: one node per engine this machine has (CI installs llama.cpp, and vLLM in
    # .venv-vllm), each of which served the job.
    expected = set(node_engines("mixed"))
    assert set(s["engines"]) == expected, s["engines"]
    assert all(s["accepted_by_engine"][e] > 0 for e in expected), s["accepted_by_engine"]
    # Versions went down the relay tree: the learner's uplink carried about one copy of each
    # version (the demo's plan: learner -> one node -> the other two), where a star needs three.
    assert s["source_copies_median"] is not None and s["source_copies_median"] < 2.0, s[
        "source_bytes_per_version"
    ]
    # The learner was SIGKILLed mid-run; the coordinator restarted it from its checkpoint.
    assert s["learner_killed_at"] is not None
    log = (_job_dir(swarm_run) / "learner.log").read_text()
    assert "resumed from checkpoint" in log


def test_every_trained_rollout_was_signed_by_a_registered_node_and_accepted(swarm_run) -> None:
    db = sqlite3.connect(swarm_run / "coordinator" / "coordinator.sqlite")
    db.row_factory = sqlite3.Row
    nodes = {r["node_id"]: bytes(r["public_key"]) for r in db.execute("SELECT * FROM nodes")}
    trained = db.execute("SELECT * FROM rollouts WHERE status='trained'").fetchall()
    assert len(trained) > 100
    for r in trained:
        assert r["node_id"] in nodes
        _, sub = signing.open_record(
            bytes(r["envelope"]), m.Submission, expected_signer=nodes[r["node_id"]]
        )
        lease = db.execute("SELECT * FROM leases WHERE lease_id=?", (sub.lease_id,)).fetchone()
        assert lease["node_id"] == r["node_id"] and lease["status"] == "submitted"
        assert r["trained_version"] is not None and r["trained_version"] > r["version"]
    # Nothing trained twice, and nothing rejected was trained.
    assert len({r["rollout_id"] for r in trained}) == len(trained)
    n_versions = db.execute("SELECT COUNT(*) FROM versions").fetchone()[0]
    assert n_versions == 151
    assert sum(r["trained_count"] for r in db.execute("SELECT trained_count FROM versions")) == len(
        trained
    )


def test_node_weights_are_bit_identical_to_the_learner(swarm_run: Path) -> None:
    job_dir = _job_dir(swarm_run)
    spec = JobSpec.model_validate_json((job_dir / "job.json").read_text())
    db = sqlite3.connect(swarm_run / "coordinator" / "coordinator.sqlite")
    published = dict(db.execute("SELECT version, state_digest FROM versions").fetchall())
    final = max(published)
    ckpt = job_dir / "checkpoints" / f"v{final:08d}" / "model.safetensors"
    from safetensors.torch import load_file

    model = build_model(ModelSpec.from_dict(spec.model_spec_dict()))
    model.load_state_dict(load_file(str(ckpt)))
    learner_bits = to_bits(export_state(model, spec.publish_dtype))
    for i in range(3):
        # Every node ends on the final version (the learner serves it after its last step
        # until nobody asks), with the published digest and the learner's exact tensors.
        meta = json.loads((swarm_run / f"node-{i}" / "policy.json").read_text())
        node_state = state_from_bytes((swarm_run / f"node-{i}" / "policy.safetensors").read_bytes())
        assert meta["version"] == final, (i, meta)
        assert state_digest(node_state) == meta["state_digest"] == published[final]
        # ... and so do the weights inside its engine (torch, llama.cpp or vLLM), as the engine
        # itself reads them back.
        assert meta["engine_state_digest"] == published[final], meta
        node_bits = to_bits(node_state)
        assert node_bits.keys() == learner_bits.keys()
        for k in learner_bits:
            assert np.array_equal(learner_bits[k], node_bits[k]), k


def test_synchronous_mode_trains_only_on_the_current_version(
    short_runs: dict[str, SwarmTool],
) -> None:
    """S = 0: leases are for the newest version only and every batch comes from the weights the
    learner holds (staleness 0 in every version's metrics), so the run is on-policy."""
    out = short_runs["sync"].out
    short_runs["sync"].wait()
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "done" and s["versions"] == 12
    trained = [v for v in s["learner_by_version"] if v["version"] > 0]
    assert len(trained) == 12
    assert all(v["staleness_max"] == 0 for v in trained), trained
    assert s["eval_first"] is not None and s["eval_last"] is not None


def test_skip_uniform_groups_trains_only_on_groups_with_an_advantage(
    short_runs: dict[str, SwarmTool],
) -> None:
    """Dynamic sampling through the real programs: groups whose samples all scored the same
    are accepted and credited but set aside, the lease budget replaces them, and every trained
    group has an advantage (unless its version set aside its cap of them)."""
    from echo.coordinator.submissions.submit import UNIFORM_BATCHES

    out = short_runs["ds"].out
    batch = SHORT_BATCH
    short_runs["ds"].wait()
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "done" and s["versions"] == 12
    assert s["rollouts_uniform"] > 0  # the untrained tiny model fails whole groups often
    db = sqlite3.connect(out / "coordinator" / "coordinator.sqlite")
    set_aside = dict(
        db.execute(
            "SELECT version, COUNT(*) FROM rollouts WHERE status='dropped' AND reason='uniform'"
            " GROUP BY version"
        ).fetchall()
    )
    assert sum(set_aside.values()) == s["rollouts_uniform"]
    trained = db.execute("SELECT version, rewards_json FROM rollouts WHERE status='trained'")
    for version, rewards_json in trained.fetchall():
        rewards = json.loads(rewards_json)
        if min(rewards) == max(rewards):
            assert set_aside.get(version, 0) >= UNIFORM_BATCHES * batch, (version, rewards)


def test_nodes_that_hear_no_plan_follow_every_version_through_their_lease_replies(
    short_runs: dict[str, SwarmTool],
) -> None:
    """A node learns of a version one way, its lease reply (issue 29). With no plan ever
    gossiped (broadcast off: as if every announcement were lost), nodes still follow the job
    version by version and end on the final version's exact weights, pulled."""
    out = short_runs["noplan"].out
    short_runs["noplan"].wait()
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "done" and s["versions"] == 12
    db = sqlite3.connect(out / "coordinator" / "coordinator.sqlite")
    published = dict(db.execute("SELECT version, state_digest FROM versions").fetchall())
    # Each node held versions along the way, not only the last one.
    held = dict(
        db.execute(
            "SELECT node_id, COUNT(DISTINCT version) FROM node_versions GROUP BY node_id"
        ).fetchall()
    )
    assert len(held) == 2 and min(held.values()) >= 3, held
    for i in range(2):
        meta = json.loads((out / f"node-{i}" / "policy.json").read_text())
        assert meta["version"] == max(published), (i, meta)
        assert meta["state_digest"] == meta["engine_state_digest"] == published[max(published)]

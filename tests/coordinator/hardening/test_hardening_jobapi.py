"""The job API against hostile specs (issue 26, finding 8), over a real hypercorn server.

Each test is the attack of the finding, made against the real coordinator: bodies that are not a
job table (500 before), tracking folders outside the job's folder, dataset paths outside the
operator's roots and errors quoting a file's content, paths sent to nodes, and the info file's
mode under a permissive umask.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from echo.coordinator.config import CoordinatorConfig
from echo.coordinator.service import Coordinator
from echo.coordinator.store import Store
from echo.learner.tracking import TrackingError, open_tracker
from echo.p2p.identity import Identity
from echo.protocol import ids
from echo.protocol import messages as m
from echo.protocol.jobspec import JobSpec, parse_job
from tests.conftest import TEST_DEADLINE, learner_publish_v0, run_with_coordinator

AUTH = {"Authorization": "Bearer test-token"}
JSON = {**AUTH, "content-type": "application/json"}
DATA = Path(__file__).parents[2] / "data" / "gsm8k_mini.jsonl"
# The first line of the file an attacker points a dataset at: it must never come back.
SECRET = "root:SECRET-FIRST-LINE:0:0"


def run_coordinator(
    tmp: Path, body: Callable[[Coordinator, httpx.AsyncClient], Awaitable[None]], **config: Any
) -> None:
    """Run a coordinator over ``tmp/coord`` with ``config`` sections set (``jobs=...``), and
    ``body(coord, http)`` against its HTTP API."""
    cfg = CoordinatorConfig(
        data_dir=tmp / "coord",
        listen=["/ip4/127.0.0.1/tcp/0"],
        http_port=0,
        api_token="test-token",
        learner={"local": False},
        **config,
    )
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    coord = Coordinator(cfg, Store.open(cfg.data_dir / "db.sqlite"), Identity.generate())

    async def main() -> None:
        with trio.fail_after(TEST_DEADLINE):
            async with trio.open_nursery() as nursery:
                await nursery.start(coord.run)
                async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=20) as http:
                    await body(coord, http)
                nursery.cancel_scope.cancel()
        coord.store.close()

    trio.run(main)


async def post_job(http: httpx.AsyncClient, spec: dict[str, Any]) -> httpx.Response:
    return await http.post("/v1/jobs", content=json.dumps(spec).encode(), headers=JSON)


def dataset_job(path: str, **params: Any) -> dict[str, Any]:
    return {
        "name": "ds",
        "steps": 2,
        "task": {"name": "dataset", "params": {"path": path, "id_field": "id", **params}},
    }


# ---------------------------------------------------------------------- bodies that are not jobs


def test_bodies_that_are_not_a_job_table_are_400_naming_the_problem(tmp_path) -> None:
    deep_json = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion limit
    deep_list = json.loads("[" * 500 + "]" * 500)
    deep_inside = json.dumps({"name": "x", "task": {"params": {"a": deep_list}}})
    deep_toml = "[job]\nname = 'x'\na = " + "[" * 50_000 + "]" * 50_000 + "\n"
    cases = [
        (JSON, '"job"', "a string"),
        (JSON, "null", "null"),
        (JSON, "[]", "a list"),
        (JSON, '["job"]', "a list"),
        (JSON, "42", "a number"),
        (JSON, deep_json, "nested"),
        (JSON, deep_inside, "nested"),
        (AUTH, deep_toml, "nested"),
    ]

    async def body(coord, http) -> None:
        for headers, text, says in cases:
            r = await http.post("/v1/jobs", content=text.encode(), headers=headers)
            assert r.status_code == 400, (text[:40], r.status_code, r.text[:200])
            assert says in r.json()["error"], (text[:40], r.json())
        assert coord.store.jobs() == []
        # A JSON job table still works, bare or under "job".
        for spec in ({"name": "j1"}, {"job": {"name": "j2"}}):
            r = await post_job(http, spec)
            assert r.status_code == 201, r.text

    run_coordinator(tmp_path, body)


# ---------------------------------------------------------------------- tracking folders


def test_tracking_dir_and_run_name_cannot_leave_the_job_folder(tmp_path) -> None:
    bad = [
        ({"dir": "/tmp/elsewhere"}, "tracking.dir"),
        ({"dir": "../../../elsewhere"}, "tracking.dir"),
        ({"dir": "tb/../../x"}, "tracking.dir"),
        ({"run_name": "../../x"}, "tracking.run_name"),
        ({"run_name": "/etc/x"}, "tracking.run_name"),
        ({"run_name": "a/b"}, "tracking.run_name"),
        ({"run_name": ".."}, "tracking.run_name"),
    ]

    async def body(coord, http) -> None:
        for tracking, key in bad:
            spec = {"name": "t", "tracking": {"backend": "tensorboard", **tracking}}
            r = await post_job(http, spec)
            assert r.status_code == 400, (tracking, r.text)
            assert key in r.json()["error"], (tracking, r.json())
        assert coord.store.jobs() == []
        ok = {"name": "t", "tracking": {"backend": "tensorboard", "dir": "tb/x", "run_name": "r1"}}
        r = await post_job(http, ok)
        assert r.status_code == 201, r.text

    run_coordinator(tmp_path, body)


def test_the_learner_refuses_a_stored_tracking_folder_outside_the_job(tmp_path) -> None:
    # A job stored by an older build still loads, but its learner writes nothing outside.
    job_dir = tmp_path / "jobs" / "t-1"
    job_dir.mkdir(parents=True)
    for tracking in ({"dir": str(tmp_path / "out")}, {"dir": "../../out"}, {"run_name": "../../x"}):
        spec = JobSpec.model_validate(
            {"name": "t", "tracking": {"backend": "tensorboard", **tracking}}
        )
        with pytest.raises(TrackingError, match="outside the job's folder"):
            open_tracker(spec.tracking, job_dir, "t-1", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs"]
    assert list(job_dir.iterdir()) == []


# ---------------------------------------------------------------------- dataset roots


def test_dataset_paths_are_read_only_under_the_operators_roots(tmp_path) -> None:
    roots = tmp_path / "datasets"
    roots.mkdir()
    secret = tmp_path / "secret.csv"
    secret.write_text(f"{SECRET},x\n1,2\n")
    (roots / "link.csv").symlink_to(secret)
    good = roots / "gsm.jsonl"
    good.write_bytes(DATA.read_bytes())
    # A file under the roots whose header is not the fields asked for: the error names the
    # field, never the header (the file's first line).
    headerless = roots / "other.csv"
    headerless.write_text(f"{SECRET},x\n1,2\n")
    outside = [
        (str(secret), "task.params.path"),
        (str(roots / ".." / "secret.csv"), "task.params.path"),
        (str(roots / "link.csv"), "task.params.path"),
        ("/etc/passwd", "task.params.path"),
        ("/proc/self/environ", "task.params.path"),
    ]

    async def body(coord, http) -> None:
        for path, key in outside:
            spec = dataset_job(path, format="csv")
            r = await post_job(http, spec)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert key in error and "dataset_roots" in error, error
            assert "SECRET" not in error and "root:" not in error, error
        r = await post_job(http, dataset_job(str(good), eval_path=str(secret)))
        assert r.status_code == 400 and "task.params.eval_path" in r.json()["error"], r.text
        r = await post_job(http, dataset_job(str(headerless), format="csv"))
        assert r.status_code == 400 and "no field 'question'" in r.json()["error"], r.text
        assert "SECRET" not in r.text
        assert coord.store.jobs() == []
        r = await post_job(http, dataset_job(str(good)))
        assert r.status_code == 201, r.text

    run_coordinator(tmp_path, body, jobs={"dataset_roots": [str(roots)]})


def test_by_default_datasets_are_read_only_under_the_data_dir(tmp_path) -> None:
    async def body(coord, http) -> None:
        r = await post_job(http, dataset_job(str(DATA)))
        assert r.status_code == 400, r.text
        assert str(coord.config.data_dir.resolve() / "datasets") in r.json()["error"]
        inside = coord.config.data_dir / "datasets" / "gsm.jsonl"
        inside.parent.mkdir()
        inside.write_bytes(DATA.read_bytes())
        r = await post_job(http, dataset_job(str(inside)))
        assert r.status_code == 201, r.text

    run_coordinator(tmp_path, body)


# ---------------------------------------------------------------------- what nodes see


def test_dataset_paths_never_reach_nodes(tmp_path) -> None:
    data = tmp_path / "coord" / "datasets"
    data.mkdir(parents=True)
    (data / "gsm.jsonl").write_bytes(DATA.read_bytes())

    async def body(coord, client) -> None:
        job_id = coord.submit_job(parse_job(dataset_job(str(data / "gsm.jsonl"))))
        ident, _, report = learner_publish_v0(coord, job_id)
        lc = await client(ident)
        hello = m.LearnerHello(job_id=job_id, peer_id=str(lc.host.peer_id), addrs=[], timestamp=0.0)
        await lc.call(ids.PROTO_LEARNER_HELLO, lc.seal(hello))
        ack = m.decode(m.StepAck, await lc.call(ids.PROTO_LEARNER_REPORT, lc.seal(report)))
        assert ack.ok, ack.message
        node = await client()
        reply = await node.register()
        [info] = reply.jobs
        assert info.task.name == "dataset"
        assert "path" not in info.task.params and "eval_path" not in info.task.params
        assert str(tmp_path) not in m.encode(info).decode("latin-1")

    run_with_coordinator(tmp_path, body)


# ---------------------------------------------------------------------- the info file


def test_the_info_file_and_token_are_private_whatever_the_umask(tmp_path) -> None:
    info = tmp_path / "info.json"
    info.with_suffix(".tmp").write_text("left by an earlier run")  # must not keep its mode
    info.with_suffix(".tmp").chmod(0o644)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "echo.coordinator.cli",
            "serve",
            "--data-dir",
            str(tmp_path / "coord"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--http-port",
            "0",
            "--info-file",
            str(info),
        ],
        preexec_fn=lambda: os.umask(0),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not info.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.1)
        assert stat.S_IMODE(info.stat().st_mode) == 0o600
        assert json.loads(info.read_text())["token"]
        assert stat.S_IMODE((tmp_path / "coord" / "api_token").stat().st_mode) == 0o600
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

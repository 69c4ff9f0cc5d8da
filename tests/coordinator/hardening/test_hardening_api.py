"""Job input at the HTTP API (issue 13, item 4): names, bad specs, stored bad jobs, the token
check and the request body's size, over a real hypercorn server."""

from __future__ import annotations

import hmac

import httpx
import pytest
import trio

from echo.coordinator.store import Store
from tests.conftest import run_with_coordinator

AUTH = {"Authorization": "Bearer test-token"}


def job(name: str = "ok", task: str = "addition", model: str = "") -> bytes:
    return (
        f'[job]\nname = "{name}"\nsteps = 3\n{model}[job.task]\nname = "{task}"\n'
        "params = { max_operand = 5 }\n"
    ).encode()


def test_job_names_cannot_leave_the_data_dir(tmp_path) -> None:
    async def body(coord, client) -> None:
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:
            for name in ("../../x", "a/b", "..", "x;y", " lead", "é" * 3, "a" * 65):
                r = await http.post("/v1/jobs", content=job(name), headers=AUTH)
                assert r.status_code == 400, (name, r.text)
                assert "name" in r.json()["error"]
            assert coord.store.jobs() == []
            # Nothing was written beside the coordinator's folder.
            assert sorted(p.name for p in tmp_path.iterdir()) == ["coord"]
            r = await http.post("/v1/jobs", content=job("fine_name-1.2"), headers=AUTH)
            assert r.status_code == 201
            # An id that is not one of ours never reaches a path either.
            r = await http.get("/v1/jobs/..%2F..%2Fx/logs", headers=AUTH)
            assert r.status_code in (400, 404)
        with pytest.raises(ValueError, match="job id"):
            coord.job_dir("../../x")

    run_with_coordinator(tmp_path, body)


def test_unknown_task_and_impossible_model_are_400_before_storing(tmp_path) -> None:
    async def body(coord, client) -> None:
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:
            r = await http.post("/v1/jobs", content=job(task="no-such-task"), headers=AUTH)
            assert r.status_code == 400 and "no-such-task" in r.json()["error"]
            shape = "[job.model]\nkind = 'tiny'\nhidden = 64\nheads = 5\n"
            r = await http.post("/v1/jobs", content=job(model=shape), headers=AUTH)
            assert r.status_code == 400 and "heads" in r.json()["error"]
            assert coord.store.jobs() == []

    run_with_coordinator(tmp_path, body)


def test_a_bad_stored_job_is_marked_failed_and_the_coordinator_starts(tmp_path) -> None:
    (tmp_path / "coord").mkdir()
    store = Store.open(tmp_path / "coord" / "db.sqlite")
    store.create_job("broken-1", "broken", {"name": "broken", "task": {"name": "no-such-task"}})
    store.close()

    async def body(coord, client) -> None:
        row = coord.store.job("broken-1")
        assert row.status == "failed" and "no-such-task" in row.error
        assert "broken-1" not in coord.job_control.jobs
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:
            r = await http.post("/v1/jobs", content=job(), headers=AUTH)
            assert r.status_code == 201

    run_with_coordinator(tmp_path, body)


def test_token_is_compared_in_constant_time(tmp_path, monkeypatch) -> None:
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    async def body(coord, client) -> None:
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:
            assert (await http.get("/v1/jobs", headers=AUTH)).status_code == 200
            bad = {"Authorization": "Bearer test-tokem"}
            assert (await http.get("/v1/jobs", headers=bad)).status_code == 401
        assert len(calls) == 2

    run_with_coordinator(tmp_path, body)


def test_body_size_is_checked_before_reading(tmp_path) -> None:
    async def body(coord, client) -> None:
        host, port = coord.http_addrs[0].removeprefix("http://").rsplit(":", 1)
        # Announces 1 GB and sends nothing: the answer must come without waiting for the body.
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-token\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        with trio.fail_after(5):
            head = await stream.receive_some(4096)
        assert head.startswith(b"HTTP/1.1 413")
        await stream.aclose()
        # Chunked (no length announced): the read stops at the cap.
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:

            async def chunks():
                for _ in range(100):
                    yield b"#" * 65536

            r = await http.post("/v1/jobs", content=chunks(), headers=AUTH)
            assert r.status_code == 413

    run_with_coordinator(tmp_path, body)

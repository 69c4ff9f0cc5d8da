"""Two learners of one job (issue 26, finding 9), over real libp2p hosts and the real store.

Before: the only fence was the job folder's ``flock`` (learner/fence.py), which a learner on
another host never sees. With the job's key, learner B's v1 was refused (the ledger had A's v1)
but its v2 was booked, on top of weights the nodes never had. Now every learner request carries
the learner epoch the coordinator issued, and only the newest is heard.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import trio

from echo.coordinator.jobs import learners
from echo.coordinator.store import Store
from echo.learner.link import Superseded
from echo.learner.service import EXIT_SUPERSEDED, Learner
from echo.p2p.identity import Identity
from echo.p2p.rpc import RemoteError
from echo.protocol import ids, signing
from echo.protocol import messages as m
from tests.conftest import run_with_coordinator, submit_job

AUTH = {"Authorization": "Bearer test-token"}


def issued_epoch(coord, job_id: str) -> int:
    """Start a learner the way the coordinator does: the epoch on its command line."""
    cmd = coord.job_control.learner_command(job_id)
    return int(cmd[cmd.index("--epoch") + 1])


def report(ident: Identity, job_id: str, version: int, epoch: int) -> m.StepReport:
    """A step report of ``version`` signed by the job's learner key, under ``epoch``."""
    man = m.Manifest(
        job_id=job_id,
        version=version,
        base_version=version - 1,
        kind="anchor",
        total_size=0,
        chunks=[],
        tensor_digests={},
        state_digest=f"digest-v{version}-{epoch}",
        anchor_version=version,
        created_at=time.time(),
    )
    sealed = signing.seal_record(ident.private_key, man)
    return m.StepReport(job_id=job_id, version=version, manifest=sealed, trained=[], epoch=epoch)


async def send_report(lc, rep: m.StepReport) -> m.StepAck:
    return m.decode(m.StepAck, await lc.call(ids.PROTO_LEARNER_REPORT, lc.seal(rep)))


async def hello(lc, job_id: str, epoch: int) -> m.LearnerHelloReply:
    rec = m.LearnerHello(
        job_id=job_id,
        peer_id=str(lc.host.peer_id),
        addrs=lc.host.listen_multiaddrs,
        timestamp=time.time(),
        epoch=epoch,
    )
    return m.decode(m.LearnerHelloReply, await lc.call(ids.PROTO_LEARNER_HELLO, lc.seal(rec)))


async def batch(lc, job_id: str, epoch: int) -> m.BatchReply:
    req = m.BatchRequest(
        job_id=job_id, max_groups=2, min_version=0, timestamp=time.time(), epoch=epoch
    )
    return m.decode(m.BatchReply, await lc.call(ids.PROTO_LEARNER_BATCH, lc.seal(req)))


async def refused(call, says: str) -> None:
    with pytest.raises(RemoteError) as err:
        await call
    assert err.value.message.startswith(f"{m.LEARNER_EPOCH_REFUSED}:"), err.value.message
    assert says in err.value.message, err.value.message


def test_a_second_learner_is_refused_for_every_version(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = submit_job(coord, steps=10)
        ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
        a = await client(ident)
        b = await client(ident)  # the same key, on another host
        epoch_a = issued_epoch(coord, job_id)
        assert epoch_a == 1
        await hello(a, job_id, epoch_a)
        for v in (0, 1):
            ack = await send_report(a, report(ident, job_id, v, epoch_a))
            assert ack.ok, ack.message
        attached = coord.store.job(job_id).learner_addrs
        # The issue's case: B, run by hand (no epoch), is refused at every version, not only
        # at v1, which the ledger refused anyway; nor may it attach or take a batch.
        await refused(hello(b, job_id, 0), "superseded")
        await refused(batch(b, job_id, 0), "superseded")
        for v in (1, 2, 3):
            await refused(send_report(b, report(ident, job_id, v, 0)), "superseded")
        # Nor with an epoch it guessed ahead of the coordinator.
        for call in (hello(b, job_id, 2), send_report(b, report(ident, job_id, 2, 2))):
            await refused(call, "never issued")
        row = coord.store.job(job_id)
        assert row.current_version == 1 and row.learner_addrs == attached
        assert [v.version for v in coord.store.versions(job_id)] == [0, 1]
        # A goes on; then the coordinator starts learner C (after A's crash, say): A is
        # refused from then on, whatever it sends, and C is heard.
        assert (await send_report(a, report(ident, job_id, 2, epoch_a))).ok
        epoch_c = issued_epoch(coord, job_id)
        assert epoch_c == 2
        c = await client(ident)
        await refused(send_report(a, report(ident, job_id, 3, epoch_a)), "superseded")
        await refused(batch(a, job_id, epoch_a), "superseded")
        await hello(c, job_id, epoch_c)
        assert (await batch(c, job_id, epoch_c)).current_version == 2
        assert (await send_report(c, report(ident, job_id, 3, epoch_c))).ok
        assert coord.store.job(job_id).current_version == 3

    run_with_coordinator(tmp_path, body)


def test_the_epoch_outlives_a_coordinator_restart(tmp_path) -> None:
    job: dict[str, str] = {}

    async def first(coord, client) -> None:
        job["id"] = job_id = submit_job(coord, steps=10)
        ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
        assert [issued_epoch(coord, job_id) for _ in range(2)] == [1, 2]
        lc = await client(ident)
        await hello(lc, job_id, 2)
        assert (await send_report(lc, report(ident, job_id, 0, 2))).ok

    async def second(coord, client) -> None:
        job_id = job["id"]
        ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
        lc = await client(ident)
        # The orphan of the first coordinator's first learner stays fenced out.
        await refused(send_report(lc, report(ident, job_id, 1, 1)), "superseded")
        assert (await send_report(lc, report(ident, job_id, 1, 2))).ok
        assert issued_epoch(coord, job_id) == 3  # never a number handed out before

    run_with_coordinator(tmp_path, first)
    run_with_coordinator(tmp_path, second)


def test_the_operator_hands_a_job_to_an_external_learner(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = submit_job(coord, steps=10)
        ident = Identity.load_or_create(coord.job_dir(job_id) / "learner.key")
        local = issued_epoch(coord, job_id)
        async with httpx.AsyncClient(base_url=coord.http_addrs[0], timeout=10) as http:
            path = f"/v1/jobs/{job_id}/learner-epoch"
            assert (await http.post(path)).status_code == 401
            r = await http.post(path, headers=AUTH)
            assert r.status_code == 200 and r.json() == {"epoch": local + 1}
            lc = await client(ident)
            await refused(send_report(lc, report(ident, job_id, 0, local)), "superseded")
            assert (await send_report(lc, report(ident, job_id, 0, local + 1))).ok
            assert (await http.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)).status_code == 200
            assert (await http.post(path, headers=AUTH)).status_code == 409

    run_with_coordinator(tmp_path, body)


def test_the_learner_stops_when_superseded_and_resends_under_its_own_epoch(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id = submit_job(coord, steps=10)
        job_dir = coord.job_dir(job_id)
        ident = Identity.load_or_create(job_dir / "learner.key")
        old = issued_epoch(coord, job_id)
        # A report its previous life checkpointed under epoch `old` but never sent.
        pending = signing.seal_record(ident.private_key, report(ident, job_id, 0, old))
        new = issued_epoch(coord, job_id)
        learner = Learner(job_dir, job_id, coord.multiaddrs[0], torch.get_num_threads(), epoch=new)
        lc = await client(ident)
        learner.link.host, learner.link.peer = lc.host, lc.coord
        resent = learner.link.for_this_epoch(pending)
        assert signing.open_record(resent, m.StepReport)[1].epoch == new
        await learner._send_report(resent)
        assert coord.store.job(job_id).current_version == 0
        assert (await learner._take_groups(1)).current_version == 0
        issued_epoch(coord, job_id)  # a newer learner is started
        with pytest.raises(Superseded, match="superseded"):
            await learner._take_groups(1)

    run_with_coordinator(tmp_path, body)


def test_a_superseded_learner_is_not_restarted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(learners, "RESTART_DELAY_S", 0.0)
    store = Store.open(tmp_path / "c.db")
    store.create_job("j", "j", {})
    store.set_job_status("j", "running")
    starts = tmp_path / "starts"

    class Host:
        def __init__(self) -> None:
            self.store = store

        def job_dir(self, job_id: str) -> Path:
            return tmp_path

        def learner_command(self, job_id: str) -> list[str]:
            # Stands in for a learner the coordinator refused: it exits as service.main does.
            code = f"open({str(starts)!r}, 'a').write('x'); raise SystemExit({EXIT_SUPERSEDED})"
            return [sys.executable, "-c", code]

    trio.run(learners.supervise_learner, Host(), "j", trio.CancelScope())
    assert starts.read_text() == "x"  # started once, never again
    assert store.job("j").status == "running"  # the newer learner's job goes on
    store.close()


def test_epochs_are_issued_in_order_and_kept_per_job(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "c.db")
    assert store.learner_epoch("a") == 0
    assert [store.issue_learner_epoch("a") for _ in range(3)] == [1, 2, 3]
    assert store.issue_learner_epoch("b") == 1 and store.learner_epoch("a") == 3
    store.close()
    store = Store.open(tmp_path / "c.db")
    assert store.learner_epoch("a") == 3
    store.close()
    # The learner's own flag, as the coordinator passes it.
    out = subprocess.run(
        [sys.executable, "-m", "echo.learner", "--help"], capture_output=True, text=True
    )
    assert "--epoch" in out.stdout

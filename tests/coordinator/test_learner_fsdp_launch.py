"""How the coordinator starts an FSDP2 learner: ``[learner] backend`` and ``nproc_per_node``
in coordinator.toml, the torchrun command line, and the exit status torchrun cannot pass on."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from echo.coordinator.config import CoordinatorConfig, load_config
from echo.coordinator.jobs import learners
from echo.coordinator.service import Coordinator
from echo.coordinator.store import Store
from echo.p2p.identity import Identity
from echo.protocol.jobspec import SpecError


def coordinator(tmp: Path, **learner) -> Coordinator:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = CoordinatorConfig(data_dir=tmp, http_port=0, learner=learner)
    coord = Coordinator(cfg, Store.open(tmp / "db.sqlite"), Identity.generate())
    coord.host = SimpleNamespace(listen_multiaddrs=["/ip4/127.0.0.1/tcp/4001"])
    return coord


def test_fsdp2_learners_start_under_torchrun(tmp_path: Path) -> None:
    cmd = coordinator(tmp_path, backend="fsdp2", nproc_per_node=2).learner_command("job-1")
    assert cmd[:7] == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=0", "-m",
    ]  # fmt: skip
    assert cmd[7] == "echo.learner"
    assert cmd[cmd.index("--backend") + 1] == "fsdp2"
    assert int(cmd[cmd.index("--epoch") + 1]) >= 1
    assert "--activation-checkpointing" not in cmd
    single = coordinator(tmp_path / "single").learner_command("job-1")
    assert single[:3] == [sys.executable, "-m", "echo.learner"] and "--backend" not in single
    recomputing = coordinator(
        tmp_path / "ac", backend="fsdp2", nproc_per_node=2, activation_checkpointing=True
    ).learner_command("job-1")
    assert "--activation-checkpointing" in recomputing


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[learner]\nnproc_per_node = 2\n", 'nproc_per_node > 1 needs backend = "fsdp2"'),
        ('[learner]\nbackend = "ddp"\n', "learner.backend"),
        ('[learner]\nbackend = "fsdp2"\nnproc_per_node = 0\n', "learner.nproc_per_node"),
        ('[learner]\nbackend = "fsdp2"\ndevice = "mps"\n', "not mps"),
        ("[learner]\nactivation_checkpointing = true\n", "activation_checkpointing needs"),
    ],
)
def test_bad_learner_settings_are_refused_by_name(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "coordinator.toml"
    path.write_text(toml)
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        load_config(path)


def test_an_exit_status_left_by_another_learner_epoch_is_ignored(tmp_path: Path) -> None:
    cmd = ["torchrun", "-m", "echo.learner", "--epoch", "7"]
    assert learners.exit_status(1, cmd, tmp_path) == (1, "")  # none left: torchrun's own
    (tmp_path / "learner.exit").write_text("4 6\nsuperseded\n")  # an orphan of epoch 6
    assert learners.exit_status(1, cmd, tmp_path) == (1, "")
    (tmp_path / "learner.exit").write_text("3 7\nthe ledger is ahead\n")
    assert learners.exit_status(1, cmd, tmp_path) == (3, "the ledger is ahead")
    assert learners.exit_status(0, cmd, tmp_path) == (0, "")


class _Host:
    """A :class:`~echo.coordinator.api.ports.LearnerHost` whose job's learner is the real FSDP2
    learner under torchrun, asked for a device this machine lacks."""

    def __init__(self, tmp: Path) -> None:
        self.store = Store.open(tmp / "c.db")
        self.store.create_job("j", "j", {})
        self.store.set_job_status("j", "running")
        self.tmp = tmp
        self.starts = 0

    def job_dir(self, job_id: str) -> Path:
        return self.tmp

    def learner_command(self, job_id: str) -> list[str]:
        self.starts += 1
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", "--max-restarts=0", "-m", "echo.learner",
            "--job-dir", str(self.tmp), "--job-id", "j", "--coordinator",
            "/ip4/127.0.0.1/tcp/1", "--device", "gpu", "--backend", "fsdp2",
            "--epoch", str(self.starts),
        ]  # fmt: skip


@pytest.mark.slow
def test_a_torchrun_learner_that_cannot_resume_fails_the_job_at_once(tmp_path: Path) -> None:
    """torchrun exits 1 for any failed rank; rank 0's status reaches the supervisor all the
    same, so a learner a restart cannot help is not restarted."""
    host = _Host(tmp_path)

    async def supervise() -> None:
        with trio.fail_after(180):
            await learners.supervise_learner(host, "j", trio.CancelScope())

    trio.run(supervise)
    row = host.store.job("j")
    assert host.starts == 1
    assert row.status == "failed" and "device must be" in row.error, row.error

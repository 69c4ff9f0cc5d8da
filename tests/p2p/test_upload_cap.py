"""Upload caps: a volunteer's cap is declared to the coordinator and bounds its relay; the
coordinator's learner pace reaches the learner's command line; a capped relay keeps to it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import trio

from echo.coordinator.config import CoordinatorConfig
from echo.coordinator.service import Coordinator
from echo.coordinator.store import Store
from echo.node.config import NodeConfig
from echo.node.worker import Node
from echo.p2p.budget import UploadLimiter
from echo.p2p.identity import Identity
from echo.p2p.relay import RelayConfig


def test_node_declares_its_cap_until_it_measures(tmp_path: Path) -> None:
    node = Node(NodeConfig(data_dir=tmp_path, engine="torch", max_upload_mbps=4.5))
    assert node.upload_limit_bps == 4.5e6
    assert node._register_record().upload_bps == 4.5e6
    free = Node(NodeConfig(data_dir=tmp_path / "free", engine="torch"))
    assert free.upload_limit_bps == 0 and free._register_record().upload_bps == 0
    assert RelayConfig(upload_limit_bps=free.upload_limit_bps or None).upload_limit_bps is None


def test_learner_pace_reaches_the_learner_command(tmp_path: Path) -> None:
    def command(**broadcast) -> list[str]:
        cfg = CoordinatorConfig(data_dir=tmp_path / str(len(broadcast)), http_port=0,
                                broadcast=broadcast)
        cfg.data_dir.mkdir(parents=True)
        coord = Coordinator(cfg, Store.open(cfg.data_dir / "db.sqlite"), Identity.generate())
        coord.host = SimpleNamespace(listen_multiaddrs=["/ip4/127.0.0.1/tcp/4001"])
        return coord.learner_command("job-1")

    assert "--upload-limit-bps" not in command()
    cmd = command(learner_upload_bps=10e6, learner_pace=0.9)
    assert float(cmd[cmd.index("--upload-limit-bps") + 1]) == 9e6


def test_the_learner_device_reaches_the_learner_command(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(data_dir=tmp_path, http_port=0, learner={"device": "cuda:1"})
    coord = Coordinator(cfg, Store.open(tmp_path / "db.sqlite"), Identity.generate())
    coord.host = SimpleNamespace(listen_multiaddrs=["/ip4/127.0.0.1/tcp/4001"])
    cmd = coord.learner_command("job-1")
    assert cmd[cmd.index("--device") + 1] == "cuda:1"


def test_token_bucket_keeps_to_its_rate() -> None:
    async def main() -> float:
        bucket = UploadLimiter(1e6, burst=64 * 1024)
        start = time.monotonic()
        for _ in range(24):  # 3 MiB in 128 KiB writes, as a relay takes them
            await bucket.take(128 * 1024)
        return time.monotonic() - start

    took = trio.run(main)
    # 3 MiB at 1 MB/s, less the initial burst: at least ~3.1 s (the upper bound only catches a
    # bucket that stalls; a loaded machine oversleeps).
    assert 3.0 <= took <= 10.0, took

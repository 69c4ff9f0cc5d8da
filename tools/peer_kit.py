"""What a stand-in peer needs to talk to a real coordinator: its sealed requests and, for an
in-process coordinator, the loopback configuration tests and benchmarks start one with.

Tests (``tests/conftest.py``), benchmarks (``benchmarks/churn_cost.py``) and the attackers
(:mod:`echo.tools.attackers`) each built the same ``Register`` and ``LeaseRequest`` records and
the same loopback ``CoordinatorConfig`` by hand; a field added to one of them then had to be
added in every copy. Owns nothing at run time; raises what the message classes and
``CoordinatorConfig`` raise for bad values.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from echo.p2p.identity import Identity
from echo.protocol import ids, signing
from echo.protocol import messages as m

# The API token of every coordinator started here (on loopback, for a test or a benchmark).
LOOPBACK_API_TOKEN = "test-token"


def register_record(
    addrs: list[str],
    *,
    software: str = "test",
    upload_bps: float = 0.0,
    tokens_per_s: float = 0.0,
    hardware: m.Hardware | None = None,
) -> m.Register:
    """A ``Register`` record (now) declaring ``addrs``; a small CPU node unless ``hardware``
    says otherwise."""
    return m.Register(
        protocol_version=ids.PROTOCOL_VERSION,
        software=software,
        engine="torch",
        hardware=hardware or m.Hardware(cpu_count=2, ram_bytes=1 << 30),
        tokens_per_s=tokens_per_s,
        upload_bps=upload_bps,
        download_bps=0.0,
        timestamp=time.time(),
        addrs=list(addrs),
    )


def registration(
    ident: Identity,
    addrs: list[str],
    *,
    software: str = "test",
    upload_bps: float = 0.0,
    tokens_per_s: float = 0.0,
    hardware: m.Hardware | None = None,
) -> bytes:
    """``ident``'s sealed :func:`register_record`."""
    reg = register_record(
        addrs,
        software=software,
        upload_bps=upload_bps,
        tokens_per_s=tokens_per_s,
        hardware=hardware,
    )
    return signing.seal_record(ident.private_key, reg)


def lease_request(ident: Identity, job_id: str, have: int = 0, n: int = 1) -> bytes:
    """``ident``'s sealed ``LeaseRequest`` (now) for ``n`` leases of ``job_id``."""
    req = m.LeaseRequest(job_id=job_id, max_leases=n, have_version=have, timestamp=time.time())
    return signing.seal_record(ident.private_key, req)


def loopback_config(
    data_dir: Path, admission: dict[str, Any] | None = None, **verification: Any
) -> Any:
    """A ``CoordinatorConfig`` for a coordinator on 127.0.0.1 (any free port, HTTP too) keeping
    its state in ``data_dir`` (made if missing), with no local learner and
    ``LOOPBACK_API_TOKEN``; ``verification`` overrides ``[verification]`` keys."""
    from echo.coordinator.config import CoordinatorConfig  # the coordinator's imports are heavy

    data_dir.mkdir(parents=True, exist_ok=True)
    return CoordinatorConfig(
        admission=admission or {},
        data_dir=data_dir,
        listen=["/ip4/127.0.0.1/tcp/0"],
        http_port=0,
        api_token=LOOPBACK_API_TOKEN,
        learner={"local": False},
        verification=verification,
    )


__all__ = ["LOOPBACK_API_TOKEN", "lease_request", "loopback_config", "registration"]

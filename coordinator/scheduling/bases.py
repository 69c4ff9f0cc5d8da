"""Which base model each LoRA job adapts, and what moving a node between jobs costs it.

A LoRA job's versions are adapters of one base model, named by its state digest in every
manifest (``messages.AdapterRef.base_digest``, issue 28). Two jobs whose versions name the same
base share it: a node that holds the base for one serves the other with an adapter switch, not
a model load (measured 0.06-0.09 of a load on the tiny model, benchmarks/lora.py). :class:`BaseBook`
owns that knowledge for the coordinator: the base of each job (read once from its version 0,
which the learner signed and the coordinator verified when it was published), the jobs that share
a job's base, and the share of a model load that moving a node to a job costs
(:func:`switch_share`), which the scheduler's hysteresis and node choice use
(:class:`~echo.coordinator.scheduling.assign.NodeSupply`). A node serves every job of its job's
base, so the capacity model counts what it delivers to those other jobs too: a job's need, less
what the nodes of its sibling jobs deliver to it (:meth:`BaseBook.shared_rates`,
:func:`net_need`), is what the nodes placed on it must bring.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from echo.coordinator.scheduling.fit import delivered_rate
from echo.coordinator.store import Store
from echo.protocol import messages as m
from echo.protocol import signing
from echo.protocol.errors import ProtocolError

# The cost of an adapter switch as a share of a model load: the largest measured on any engine
# (torch 0.09, llama.cpp 0.06 on the tiny model; docs/results/2026-12-06-lora.md), rounded up.
ADAPTER_SWITCH_SHARE = 0.1


def net_need(need_rps: float | None, shared_rps: float) -> float | None:
    """A job's need less what nodes placed on other jobs of its base deliver to it (they serve
    it too, switching adapters): what the nodes placed on it must still bring. None (not
    measured) stays None, and an unreachable need (``inf``) stays unreachable."""
    if need_rps is None or shared_rps <= 0:
        return need_rps
    return max(0.0, need_rps - shared_rps)


def switch_share(held_bases: Iterable[str], job_base: str) -> float:
    """The cost of a node starting on a job whose base is ``job_base`` ("" for a full-weight
    job), as a share of a model load, given the bases the node holds: an adapter switch when it
    holds the job's base, else a model load (1.0)."""
    return ADAPTER_SWITCH_SHARE if job_base and job_base in set(held_bases) else 1.0


class BaseBook:
    """The base of each LoRA job, from its signed version 0 (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._bases: dict[str, str] = {}  # job -> base digest ("": full-weight job)

    def base_of(self, job_id: str) -> str:
        """The base digest ``job_id``'s versions adapt, "" for a full-weight job or one without
        a version 0 yet (asked again later)."""
        if job_id in self._bases:
            return self._bases[job_id]
        row = self.store.version(job_id, 0)
        if row is None:
            return ""
        try:
            man = signing.open_record(row.manifest, m.Manifest)[1]
        except ProtocolError:  # stored after verification: cannot happen, but never fatal here
            return ""
        base = man.adapter.base_digest if man.adapter is not None else ""
        self._bases[job_id] = base
        return base

    def same_base(self, a: str | None, b: str | None) -> bool:
        """Both are LoRA jobs of one base model."""
        if not a or not b:
            return False
        base = self.base_of(a)
        return bool(base) and base == self.base_of(b)

    def siblings(self, job_id: str, live: Iterable[str]) -> list[str]:
        """The jobs of ``live`` other than ``job_id`` that share its base, sorted."""
        return sorted(j for j in live if j != job_id and self.same_base(job_id, j))

    def held_bases(self, held: Mapping[str, int]) -> set[str]:
        """The bases a node holds, from the versions it reported holding per job (``held``)."""
        return {b for job, v in held.items() if v >= 0 and (b := self.base_of(job))}

    def shares(self, held: Mapping[str, int], jobs: Iterable[str]) -> dict[str, float]:
        """Per job of ``jobs``, :func:`switch_share` for a node holding versions ``held``; only
        the jobs that cost less than a model load."""
        bases = self.held_bases(held)
        out = {}
        for job in jobs:
            share = switch_share(bases, self.base_of(job))
            if share < 1.0:
                out[job] = share
        return out

    def shared_rates(
        self, nodes: Mapping[str, Any], live: Iterable[str], now: float
    ) -> dict[str, float]:
        """Per live LoRA job, the completions/s the coordinator accepted from nodes placed on
        another job of its base (``RegisterReply.base_jobs``: they serve it between their own
        job's leases), over their current stint (:func:`~echo.coordinator.scheduling.fit.
        delivered_rate`). ``nodes`` maps ids to the placement's nodes (``job``, ``since``,
        ``accepted``)."""
        live = list(live)
        out: dict[str, float] = {}
        for node in nodes.values():
            if not node.job or not self.base_of(node.job):
                continue
            for job in self.siblings(node.job, live):
                rate = delivered_rate(node.accepted.get(job, ()), node.since, now)
                if rate:
                    out[job] = out.get(job, 0.0) + rate
        return out

    def forget(self, live: Iterable[str]) -> None:
        """Drop the jobs that are not in ``live`` (what is kept stays bounded by live jobs)."""
        keep = set(live)
        for job in [j for j in self._bases if j not in keep]:
            del self._bases[job]

"""The ECHO-2 capacity model: will the learner ever wait for rollouts?

With R rollouts per update, T_train per update, T_bcast to disseminate a version, node
throughputs mu_i (rollouts/s) and a version published every kappa = max(1, S - 1) steps, the
learner never waits if ``sum(mu_i) >= kappa * R / (kappa * T_train - T_bcast)`` and
``kappa * T_train > T_bcast``. :func:`plan` measures nothing itself: it takes the terms the
coordinator measured and activates the cheapest nodes per unit of throughput until the rule holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class NodeRate:
    """A node's measured throughput in rollouts/s, and what an hour of it costs."""

    node_id: str
    rollouts_per_s: float
    cost_per_hour: float = 1.0  # unknown costs count equally


@dataclass
class Plan:
    """The model's verdict: the terms it used, the throughput needed and had, which nodes."""

    R: int
    T_train_s: float
    T_bcast_s: float
    kappa: int
    required_rollouts_per_s: float
    available_rollouts_per_s: float
    feasible: bool
    active: list[str] = field(default_factory=list)
    standby: list[str] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        """JSON-safe: an unreachable requirement (``inf``) becomes ``None``."""
        d = asdict(self)
        if math.isinf(d["required_rollouts_per_s"]):
            d["required_rollouts_per_s"] = None
        return d


def required_throughput(R: int, t_train: float, t_bcast: float, kappa: int) -> float:
    """Rollouts/s the swarm must sustain; ``inf`` when broadcast alone outlasts kappa steps."""
    slack = kappa * t_train - t_bcast
    return math.inf if slack <= 0 else kappa * R / slack


def plan(R: int, t_train: float, t_bcast: float, staleness: int,
         nodes: list[NodeRate]) -> Plan:
    """Activate the cheapest nodes per rollout/s until the rule holds; the rest stand by.

    Pure; raises nothing (an unreachable requirement is an infeasible plan with a note).
    """
    kappa = max(1, staleness - 1)
    need = required_throughput(R, t_train, t_bcast, kappa)
    total = sum(n.rollouts_per_s for n in nodes)
    active, standby, have = [], [], 0.0
    for n in sorted(nodes, key=lambda n: n.cost_per_hour / max(n.rollouts_per_s, 1e-12)):
        if have < need:
            active.append(n.node_id)
            have += n.rollouts_per_s
        else:
            standby.append(n.node_id)
    if math.isinf(need):
        note = (f"broadcast ({t_bcast:.2f} s) is slower than {kappa} learner step(s) "
                f"({kappa * t_train:.2f} s): raise the staleness bound or speed up dissemination")
    elif total < need:
        note = f"short by {need - total:.1f} rollouts/s: the learner will wait for rollouts"
    else:
        note = f"{len(active)} node(s) suffice; {len(standby)} on standby"
    return Plan(R, t_train, t_bcast, kappa, need, total, total >= need, active, standby, note)

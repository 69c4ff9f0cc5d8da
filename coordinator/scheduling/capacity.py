"""The ECHO-2 capacity model: will the learner ever wait for rollouts?

With R rollouts per update, T_train per update, T_bcast to disseminate a version, node
throughputs mu_i (rollouts/s) and a version published every kappa = max(1, S - 1) steps, the
learner never waits if ``sum(mu_i) >= kappa * R / (kappa * T_train - T_bcast)`` and
``kappa * T_train > T_bcast``. :func:`plan` measures nothing itself: it takes the terms the
coordinator measured and activates the cheapest nodes per unit of throughput until the rule holds.
:func:`staleness_options` turns the same terms into the researcher's choice of S: how often the
learner can step at each S, and :func:`recommend_staleness` the smallest S that gets (nearly)
all of the speed asynchrony can give.
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


# ECHO-2 ran stably up to S = 6 and diverged at S = 11: never recommend beyond the stable range.
MAX_RECOMMENDED_STALENESS = 6
# An S whose step period is within this factor of the fastest one is "fast enough": each extra
# version of staleness is more off-policy correction for the learner to make, so take the least.
FAST_ENOUGH = 1.05


@dataclass(frozen=True)
class StalenessOption:
    """What staleness bound S buys: the learner's step period and how busy it is."""

    staleness: int
    period_s: float  # seconds between versions
    learner_busy: float  # T_train / period: the share of the learner's time spent training
    speedup_vs_sync: float  # the S = 0 period over this one


def step_period(R: int, t_train: float, t_bcast: float, rollouts_per_s: float,
                staleness: int) -> float:
    """Seconds between versions at staleness bound ``staleness`` (``inf`` without throughput).

    S = 0 is synchronous: every version is broadcast, then sampled, then trained on, one after
    the other. With S >= 1 a version is needed every kappa = max(1, S - 1) steps, so in kappa
    steps the swarm must broadcast once and generate kappa * R rollouts; the learner steps no
    faster than T_train.
    """
    if rollouts_per_s <= 0:
        return math.inf
    gen = R / rollouts_per_s
    if staleness == 0:
        return t_bcast + gen + t_train
    kappa = max(1, staleness - 1)
    return max(t_train, (kappa * gen + t_bcast) / kappa)


def overlapped_period(R: int, t_train: float, t_bcast: float, rollouts_per_s: float,
                      staleness: int) -> float:
    """Seconds between versions when nodes keep sampling while a version spreads, as this
    coordinator's leases let them (``inf`` without throughput).

    :func:`step_period` (ECHO-2's rule) charges the broadcast in series with generation: in
    kappa steps the swarm first receives a version, then generates kappa * R rollouts on it.
    Here a lease needs only a version at most S - 1 behind the current one
    (:meth:`~echo.coordinator.scheduling.leases.Leases.grant`), so with S >= 2 a node keeps
    generating on the version it holds while the next one reaches it: the broadcast costs throughput
    only when it takes longer than S - 1 periods (a latency bound), and the period is the largest of
    the learner's step, the generation of a batch and that bound. With S <= 1 a node must hold
    the newest version, and the broadcast is in series (:func:`step_period`).

    Measured (benchmarks/scheduling.py, S = 2, generation-bound): the period was R / mu within
    1-2% for three jobs whose broadcast took 12-26% of it, where :func:`step_period` adds it.
    """
    if staleness <= 1 or rollouts_per_s <= 0:
        return step_period(R, t_train, t_bcast, rollouts_per_s, staleness)
    return max(t_train, R / rollouts_per_s, t_bcast / (staleness - 1))


def staleness_options(R: int, t_train: float, t_bcast: float, rollouts_per_s: float,
                      max_staleness: int = MAX_RECOMMENDED_STALENESS) -> list[StalenessOption]:
    """:func:`step_period` for S = 0 .. ``max_staleness``. Pure; raises nothing."""
    sync = step_period(R, t_train, t_bcast, rollouts_per_s, 0)
    out = []
    for s in range(max_staleness + 1):
        period = step_period(R, t_train, t_bcast, rollouts_per_s, s)
        busy = t_train / period if math.isfinite(period) and period > 0 else 0.0
        speedup = sync / period if math.isfinite(period) and period > 0 else 1.0
        out.append(StalenessOption(s, period, busy, speedup))
    return out


def recommend_staleness(options: list[StalenessOption]) -> tuple[int, str]:
    """The smallest S whose period is within FAST_ENOUGH of the fastest option, and why."""
    finite = [o for o in options if math.isfinite(o.period_s)]
    if not finite:
        return 2, "no throughput measured yet: keep the default until nodes report"
    best = min(o.period_s for o in finite)
    pick = next(o for o in finite if o.period_s <= best * FAST_ENOUGH)
    sync = options[0]
    if pick.staleness == 0:
        why = "the swarm is too slow for asynchrony to help: train synchronously"
    else:
        why = (f"S = {pick.staleness} steps {pick.speedup_vs_sync:.2f}x as often as S = 0 "
               f"(learner busy {pick.learner_busy:.0%} vs {sync.learner_busy:.0%}); a larger S "
               f"adds staleness without speed")
    return pick.staleness, why

"""How many threads an engine decodes with, chosen step by step by timing the steps.

A decode step of a small model is a few hundred small ops, each ended by a barrier across the
engine's threads (OpenMP in torch, ggml's spinning barrier in llama.cpp). On an idle machine
more threads finish a step sooner; on a machine whose cores are busy with other processes, one
descheduled thread stalls the others at every barrier, and measured on a loaded 2-core machine
(SmolLM2-135M, see ``docs/results/2026-12-07-engines-best.md``) 2 threads decoded 5-10x slower
than 1, for the node's engines and for each engine's own offline generation alike. Which is
faster changes with the load of the moment, so :class:`StepThreads` measures it instead of
guessing: it times the steps run at the current count, now and then times one step at the other
candidate (1 thread, or the configured maximum), and switches when the other is faster. A probe
that confirms the current count doubles the wait before the next one, and waits longer still
when the probe was costly, so that probes cost at most ~2% of the time (up to ``max_interval``
steps): on the tiny model at load 20, 2 threads stepped ~100x slower than 1, and a fixed backoff
to 256 steps had the probes cost as much again as the steps.
"""

from __future__ import annotations

# Weight of a new step time in a count's running estimate: a few steps settle it.
EMA = 0.3
# A probed count must beat the current one by this factor to be switched to (noise margin).
MARGIN = 0.9
# Share of the time that probes of a slower count may cost: a probe that took k steps' time
# waits at least (k - 1) / PROBE_SHARE steps for the next one.
PROBE_SHARE = 0.02


class StepThreads:
    """The thread count for the next decode step: 1 or ``max_threads``, whichever steps faster
    now (see the module docstring). ``adapt=False`` (or ``max_threads`` 1) always answers
    ``max_threads``.

    Use: ``n = st.threads()``, run one step on ``n`` threads, ``st.observe(n, seconds)``.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        adapt: bool = True,
        min_interval: int = 8,
        max_interval: int = 8192,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, not {max_threads}")
        if not 1 <= min_interval <= max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        self.max_threads = max_threads
        self.adapt = adapt and max_threads > 1
        self.min_interval, self.max_interval = min_interval, max_interval
        self.current = max_threads
        self.estimate: dict[int, float] = {}  # seconds per step, per thread count
        self.interval = min_interval
        self._since_probe = 0
        self._probing = False
        self.switches = 0

    def _other(self) -> int:
        return 1 if self.current == self.max_threads else self.max_threads

    @property
    def chosen(self) -> int:
        """The count that steps fastest as far as measured: for work that is not a step (a
        prefill), which is run on it but not timed."""
        return self.current if self.adapt else self.max_threads

    def threads(self) -> int:
        """The thread count to run the next step on."""
        if not self.adapt:
            return self.max_threads
        # The first steps after a start or a switch settle the current estimate first.
        if self._since_probe >= self.interval and self.current in self.estimate:
            self._probing = True
            return self._other()
        return self.current

    def observe(self, threads: int, seconds: float) -> None:
        """Record that one step took ``seconds`` on ``threads`` threads."""
        if not self.adapt:
            return
        old = self.estimate.get(threads)
        self.estimate[threads] = seconds if old is None else old + EMA * (seconds - old)
        if not self._probing:
            self._since_probe += 1
            return
        self._probing = False
        self._since_probe = 0
        # The probe is one step, so it is compared as it is, not through its stale estimate.
        if seconds < MARGIN * self.estimate[self.current]:
            self.current = threads
            self.interval = self.min_interval
            self.switches += 1
        else:
            cost = (seconds / self.estimate[self.current] - 1) / PROBE_SHARE
            self.interval = min(max(2 * self.interval, int(cost)), self.max_interval)

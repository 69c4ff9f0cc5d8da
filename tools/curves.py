"""How the learning benchmarks read an accuracy curve: how often a run is evaluated, and what
counts as a late dip. One definition, shared by ``benchmarks/learning.py`` and
``benchmarks/stability.py``."""

# Held-out greedy accuracy every this many versions, in the baseline as in the swarms (the
# demo job's [job.eval] every).
EVAL_EVERY = 10
# Late dips: an evaluation from LATE_FROM of the run on that reads more than DIP_DEPTH under the
# best accuracy reached before it. How often a run is caught in one is what decides, by chance,
# where its final evaluation lands; the swarm and the baseline are compared on it.
LATE_FROM = 2 / 3
DIP_DEPTH = 0.05

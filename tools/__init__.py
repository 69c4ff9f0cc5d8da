"""Tools that run the product's real processes: the local swarm of the quick start
(:mod:`.local_swarm`, ``python -m echo.tools.local_swarm``; its processes and job API in
:mod:`.swarm`), emulated networks (:mod:`.netem`, :mod:`.netem_nat`, :mod:`.nat_swarm`), the
attack benchmark's attackers (:mod:`.attackers`), the synchronous GRPO baseline
(:mod:`.grpo_local`), the benchmarks' shared harness (:mod:`.bench`, :mod:`.timed_node`,
:mod:`.swarm_probe`, :mod:`.peer_kit`, :mod:`.cpu_meter`), and the broadcast benchmark's relay
agents and their swarm (:mod:`.relay_agent`, :mod:`.relay_swarm`).
Tests and benchmarks import them from here; nothing in the product imports them."""

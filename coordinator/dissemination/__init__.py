"""How each new version reaches the nodes: the coordinator's side of the relay broadcast.

- :mod:`.planning`: the plan of each version (patched on the report path, re-planned in full in
  the background), made from
- :mod:`.relays`: what the coordinator believes of each node as a relay (verified addresses,
  uplinks as receivers confirmed them, demotions, punched paths),
- :mod:`.addresses`: which of a node's addresses a plan may hand to the others, and
- :mod:`.receipts`: each version's receipts timed against its plan, which confirm the relays'
  uplinks and pay their credit;
- :mod:`.planner`: the pure tree planners (striped trees from measured uplinks); the coordinator
  is their only user, so they live here, not in :mod:`echo.p2p`;
- the coordinator's roles in NAT traversal, which feed the planner: :mod:`.dialbacks` (who can be
  dialled), :mod:`.punch_pairs` (which pairs behind NAT to connect) and :mod:`.punching` (the go
  signal). The mechanics they drive (dial-backs, hole punching, circuit relay) are
  :mod:`echo.p2p.nat`; a node's answer to a go signal is :mod:`echo.node.punching`.
"""

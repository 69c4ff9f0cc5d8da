"""NAT traversal mechanics, one module per role: can this address be dialled
(:mod:`.dialback`, the AutoNAT idea on a fresh connection), a coordinated TCP hole punch
(:mod:`.holepunch`), and circuit relay v2: the client that keeps a reservation and dials circuit
addresses (:mod:`.circuit`) and the relay that serves them (:mod:`.circuit_relay`).

Their messages are :mod:`echo.protocol.nat`. The decisions that use them belong to their
roles: whom to probe and which pairs to punch is the coordinator's planning
(:mod:`echo.coordinator.dissemination`), answering a go signal is the node's
(:mod:`echo.node.punching`).
"""

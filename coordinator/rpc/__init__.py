"""The coordinator's libp2p handlers: what nodes ask (:mod:`.node`: register, lease, status,
manifest, relay reports; the submit path is :mod:`echo.coordinator.submissions`), what a learner
asks (:mod:`.learner`: attach, take a batch, publish a version), and the per-peer budget each
RPC gets (:mod:`.budgets`)."""

"""echo.node: a volunteer's node, which generates GRPO groups for the jobs it is placed on.

The program is ``echo-node`` (:mod:`~echo.node.cli`: ``join``, ``status``, ``doctor``,
``service``). A running node is :class:`~echo.node.worker.Node`, the lease loop: it asks for
leases, generates each group and submits it. Beside it, each with a module: the engine it holds
across jobs (:mod:`~echo.node.engine_slot`, over the engines of :mod:`~echo.node.engines`), LoRA
jobs sharing one base (:mod:`~echo.node.base_group`, :mod:`~echo.node.adapter_sync`), its signed
calls to the coordinator (:mod:`~echo.node.session`), following a job's policy
(:mod:`~echo.node.policy`, :mod:`~echo.node.weights`), relaying for other volunteers
(:mod:`~echo.node.relay_slots`, :mod:`~echo.node.punching`), pacing, probing the machine, and what
the volunteer sees (:mod:`~echo.node.display`, the status file :mod:`~echo.node.state` and its
local page :mod:`~echo.node.ui`).
"""

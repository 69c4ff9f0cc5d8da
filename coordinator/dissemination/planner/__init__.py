"""Broadcast planning, pure (no I/O, no clock): striped relay trees from measured uplinks.

:mod:`.plan` says what a plan is and estimates how long a version takes down it; :mod:`.equal`
and :mod:`.weighted` are the two planners; :mod:`.reach` keeps every edge to a dial that can
happen (nodes behind NAT); :mod:`.patch` mends the last plan for joins and leaves in linear time;
:mod:`.best` searches stripe counts and rate targets for the fastest plan and cuts each node's
route from it. A node reads its route from the plan's wire record with
:mod:`echo.p2p.relay.routes`.
"""

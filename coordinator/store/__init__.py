"""The coordinator's durable state in one SQLite database.

Owns every transaction that moves a rollout through its life:
``accepted -> in_batch -> trained`` (or ``rejected`` / ``dropped``). Each method is one
transaction, so a crash at any point leaves either the old or the new state, never half of one:
nothing accepted is lost, and nothing is trained twice (a rollout is marked trained in the same
transaction that records the version it went into).

:class:`Store` is the one object callers hold; its methods live with the tables they own --
:mod:`~echo.coordinator.store.jobs` (jobs, versions, per-job reports),
:mod:`~echo.coordinator.store.nodes` (nodes and their rejections),
:mod:`~echo.coordinator.store.leases` (leases), :mod:`~echo.coordinator.store.ledger` (rollouts,
batches, publishing a version), :mod:`~echo.coordinator.store.prune` (retention),
:mod:`~echo.coordinator.store.credit` (the volunteers' credit ledger),
:mod:`~echo.coordinator.store.dash` (the dashboard's reads) --
over the one connection of :mod:`~echo.coordinator.store.db`, which
also owns the schema and its migrations. Reads return the typed rows of
:mod:`~echo.coordinator.store.rows`.

SQLite calls are short and local; they run on the trio thread deliberately (a thread hop would
cost more than the query).
"""

from __future__ import annotations

from echo.coordinator.store.credit import CreditTables
from echo.coordinator.store.dash import DashReads
from echo.coordinator.store.db import StoreError
from echo.coordinator.store.epochs import LearnerEpochs
from echo.coordinator.store.jobs import JobTables
from echo.coordinator.store.leases import LeaseTables
from echo.coordinator.store.ledger import Ledger
from echo.coordinator.store.nodes import NodeTables
from echo.coordinator.store.prune import Pruning


class Store(
    JobTables, NodeTables, LeaseTables, Ledger, Pruning, LearnerEpochs, CreditTables, DashReads
):
    """One SQLite database file; open with :meth:`open`, close with :meth:`close`.

    One class over one connection: every write is one transaction on it, and the transitions of
    a rollout cross tables (a lease closes as its group is accepted; a version is recorded as its
    batch is marked trained). Its methods live with the tables they own, one mixin per module.

    Write methods raise :class:`StoreError` for a transition the stored state does not allow
    (each says which); nothing is changed then.
    """


__all__ = ["Store", "StoreError"]

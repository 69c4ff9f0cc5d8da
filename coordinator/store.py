"""The coordinator's durable state in one SQLite database.

Owns every transaction that moves a rollout through its life:
``accepted -> in_batch -> trained`` (or ``rejected`` / ``dropped``). Each method is one
transaction, so a crash at any point leaves either the old or the new state, never half of one:
nothing accepted is lost, and nothing is trained twice (a rollout is marked trained in the same
transaction that records the version it went into).

:class:`Store` is the one object callers hold; its methods live with the tables they own --
:mod:`~echo.coordinator.store_jobs` (jobs, versions, per-job reports),
:mod:`~echo.coordinator.store_nodes` (nodes and their rejections),
:mod:`~echo.coordinator.store_leases` (leases), :mod:`~echo.coordinator.store_ledger` (rollouts,
batches, publishing a version), :mod:`~echo.coordinator.store_prune` (retention),
:mod:`~echo.coordinator.store_credit` (the volunteers' credit ledger),
:mod:`~echo.coordinator.store_dash` (the dashboard's reads) --
over the one connection of :mod:`~echo.coordinator.db`, which
also owns the schema and its migrations. Reads return the typed rows of
:mod:`~echo.coordinator.rows`.

SQLite calls are short and local; they run on the trio thread deliberately (a thread hop would
cost more than the query).
"""

from __future__ import annotations

from echo.coordinator.db import StoreError
from echo.coordinator.store_credit import CreditTables
from echo.coordinator.store_dash import DashReads
from echo.coordinator.store_epochs import LearnerEpochs
from echo.coordinator.store_jobs import JobTables
from echo.coordinator.store_leases import LeaseTables
from echo.coordinator.store_ledger import Ledger
from echo.coordinator.store_nodes import NodeTables
from echo.coordinator.store_prune import Pruning


class Store(
    JobTables, NodeTables, LeaseTables, Ledger, Pruning, LearnerEpochs, CreditTables, DashReads
):
    """One SQLite database file; open with :meth:`open`, close with :meth:`close`.

    Write methods raise :class:`StoreError` for a transition the stored state does not allow
    (each says which); nothing is changed then.
    """


__all__ = ["Store", "StoreError"]

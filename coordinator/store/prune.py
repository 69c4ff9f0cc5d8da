"""What the store forgets, and when: the retention rules of ``[retention]``.

:class:`Pruning` is one part of :class:`~echo.coordinator.store.Store` (see its docstring for
the transaction rules). :meth:`Pruning.prune` runs from the coordinator's housekeeping and
deletes, in one transaction, only what nothing reads any more:

- leases that are closed (``submitted``) or ``expired``, once their deadline is older than
  ``closed_leases_s`` and than the expiry penalty's window (an expired lease counts against its
  node until then; a group is stored under its own id, so no rollout needs its lease row);
- the signed envelope of a rollout that will never be batched again (``trained``, ``dropped``
  or ``rejected``) and was accepted more than ``trained_envelopes_s`` ago: the audit copy of
  what the ledger already holds decoded (the stored training group of a trained rollout is
  kept: it is the training record; that of a dropped or rejected one goes with the envelope);
- rejection log rows older than ``rejections_s`` (a node's totals stay on its row);
- nodes that never had a group accepted, are not excluded, hold no open lease and were not
  heard from for ``idle_nodes_s`` (churning identities), with their version log;
- excluded nodes that were excluded and not heard from for ``idle_nodes_s``, with their version
  log. Forgetting one readmits it as a fresh identity, which is no more than anyone gets by
  making a new key (identities are free); keeping every one forever let a churn of excluded
  identities grow the table without bound.

Deleted pages are reused by SQLite, so the file levels off rather than shrinks.
"""

from __future__ import annotations

from echo.coordinator.config import RetentionSection
from echo.coordinator.store.db import Database

_DONE = "('trained', 'dropped', 'rejected')"


class Pruning(Database):
    """Deletes what the retention rules let go; see the module docstring."""

    def prune(
        self,
        now: float,
        retention: RetentionSection,
        lease_window_s: float,
        forgotten: list[str] | None = None,
    ) -> dict[str, int]:
        """Apply ``retention`` as of ``now``; returns how many rows each rule touched. The ids
        of the nodes deleted are appended to ``forgotten``: what the coordinator keeps of them
        in memory (their links and paths) goes with them."""
        lease_cutoff = now - max(retention.closed_leases_s, lease_window_s)
        envelope_cutoff = now - retention.trained_envelopes_s
        node_cutoff = now - retention.idle_nodes_s
        with self._tx() as db:
            out = {
                "leases": db.execute(
                    "DELETE FROM leases WHERE status IN ('submitted', 'expired') AND deadline < ?",
                    (lease_cutoff,),
                ).rowcount,
                "groups": db.execute(
                    "UPDATE rollouts SET training_group=x'' WHERE status IN ('dropped', 'rejected')"
                    " AND created_at < ? AND LENGTH(training_group) > 0",
                    (envelope_cutoff,),
                ).rowcount,
                "envelopes": db.execute(
                    f"UPDATE rollouts SET envelope=x'' WHERE status IN {_DONE}"
                    " AND created_at < ? AND LENGTH(envelope) > 0",
                    (envelope_cutoff,),
                ).rowcount,
                "rejections": db.execute(
                    "DELETE FROM rejections WHERE at < ?", (now - retention.rejections_s,)
                ).rowcount,
            }
            idle = (
                "SELECT node_id FROM nodes WHERE accepted=0 AND excluded=0 AND last_seen < ?"
                " AND NOT EXISTS (SELECT 1 FROM leases WHERE leases.node_id=nodes.node_id"
                " AND leases.status='open')"
            )
            if forgotten is not None:
                forgotten += [r[0] for r in db.execute(idle, (node_cutoff,))]
            db.execute(f"DELETE FROM node_versions WHERE node_id IN ({idle})", (node_cutoff,))
            out["nodes"] = db.execute(
                f"DELETE FROM nodes WHERE node_id IN ({idle})", (node_cutoff,)
            ).rowcount
            # Excluded: its open leases were expired when it was excluded, so none is owed.
            gone = "SELECT node_id FROM nodes WHERE excluded!=0 AND excluded_at<? AND last_seen<?"
            args = (node_cutoff, node_cutoff)
            if forgotten is not None:
                forgotten += [r[0] for r in db.execute(gone, args)]
            db.execute(f"DELETE FROM node_versions WHERE node_id IN ({gone})", args)
            out["excluded_nodes"] = db.execute(
                f"DELETE FROM nodes WHERE node_id IN ({gone})", args
            ).rowcount
            return out

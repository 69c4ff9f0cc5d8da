"""The coordinator's credit book: it prices, signs and appends every payment to a volunteer.

:class:`CreditBook` owns the decision of what earns credit and the coordinator's signature on
it; the price list and the entry are :mod:`echo.protocol.credit`'s (see its docstring for the
formula), the append-only table :mod:`echo.coordinator.store.credit`'s.

What earns credit:

- **Trained groups.** A group pays its node once the learner trained it into a version:
  accepted at submission, not rejected by the learner's re-scoring. One entry per node and
  version names the node's rollouts in it; its amount is their tokens times the job model's
  parameter count / 1000 micro-credits. :meth:`CreditBook.book_trained` pays version after
  version behind a per-job cursor moved in the same transaction, so a crash pays a version
  wholly or not at all, and a restart (or a database migrated from before the ledger) pays what
  was trained meanwhile.
- **Confirmed relaying.** When a child proves it holds a version (its status names the
  version's digest), each relay parent that the dissemination plane credits for it (a credible
  child with accepted work, on another network, that did not report the parent as stalled:
  :meth:`echo.coordinator.dissemination.receipts.Receipts.delivered`) is paid the stripe bytes it
  owed that child (:meth:`CreditBook.relayed`).

Nothing else earns: groups rejected at submission or by re-scoring earn nothing (their reason
is in the node's rejection log, beside its ledger), and neither do groups dropped unscored --
stale ones, or those whose samples all scored the same: the learner never re-scores those, so
paying them would pay for tokens nobody checked.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import trio

from echo.coordinator.scheduling.fit import param_count
from echo.coordinator.store import Store
from echo.coordinator.store.credit import CreditRow, Payment
from echo.p2p.identity import Identity
from echo.protocol import signing
from echo.protocol.credit import MAX_REFS, CreditEntry, price
from echo.protocol.jobspec import SpecError, parse_job

log = logging.getLogger("echo.coordinator.credit")

# How often trained versions are paid (a version is paid within this long of its publication).
BOOK_EVERY_S = 1.0


class CreditBook:
    """Prices and signs payments with the coordinator's ``identity``; see the module docstring."""

    def __init__(self, store: Store, identity: Identity) -> None:
        self.store = store
        self.identity = identity
        self._params: dict[str, int] = {}

    def params_of(self, job_id: str) -> int:
        """Parameters of the job's model (the price of its tokens); 0 for a job whose stored
        spec no longer parses (its groups then earn nothing, and it is logged)."""
        if job_id not in self._params:
            row = self.store.job(job_id)
            try:
                spec = parse_job(row.spec) if row is not None else None
            except SpecError:
                spec = None
            if spec is None:
                log.warning("job %s has no readable spec: its groups are priced at 0", job_id)
                self._params[job_id] = 0
            else:
                self._params[job_id] = param_count(spec.model_spec_dict())
        return self._params[job_id]

    def _seal(self, p: Payment, seq: int, prev: bytes, at: float) -> bytes:
        entry = CreditEntry(
            seq=seq,
            node_id=p.node_id,
            kind=p.kind,  # type: ignore[arg-type]  # "rollouts" or "relay": set by this class
            job_id=p.job_id,
            version=p.version,
            refs=list(p.refs),
            tokens=p.tokens,
            params=p.params,
            nbytes=p.nbytes,
            amount=p.amount,
            at=at,
            prev=prev,
        )
        return signing.seal_record(self.identity.private_key, entry)

    def book_trained(self, now: float | None = None) -> int:
        """Pay every version trained since each job's cursor; returns the entries appended."""
        now = time.time() if now is None else now
        cursors = self.store.credit_cursors()
        appended = 0
        for job in self.store.jobs():
            after = cursors.get(job.job_id, -1)
            if job.current_version <= after:
                continue
            upto = job.current_version
            params = self.params_of(job.job_id)
            groups: dict[tuple[int, str], list[tuple[str, int]]] = defaultdict(list)
            for version, node, rid, tokens in self.store.trained_since(job.job_id, after, upto):
                groups[(version, node)].append((rid, tokens))
            payments = []
            for (version, node), rows in sorted(groups.items()):
                for part in range(0, len(rows), MAX_REFS):
                    chunk = rows[part : part + MAX_REFS]
                    tokens = sum(t for _, t in chunk)
                    payments.append(
                        Payment(
                            node_id=node,
                            kind="rollouts",
                            job_id=job.job_id,
                            version=version,
                            ref_key=f"rollouts/{job.job_id}/{version}/{node}/{part}",
                            amount=price("rollouts", tokens=tokens, params=params),
                            refs=tuple(rid for rid, _ in chunk),
                            tokens=tokens,
                            params=params,
                        )
                    )
            if not payments:  # nothing trained since the cursor: no write (and no fsync)
                continue
            appended += self.store.pay_versions(job.job_id, upto, payments, now, self._seal)
        return appended

    def relayed(
        self, job_id: str, version: int, parent: str, child: str, nbytes: float
    ) -> CreditRow | None:
        """Pay ``parent`` for the ``nbytes`` of ``version`` a credible ``child`` confirmed
        (see the module docstring); None when that transfer was paid already or is empty."""
        n = int(nbytes)
        if n <= 0:
            return None
        return self.store.append_credit(
            Payment(
                node_id=parent,
                kind="relay",
                job_id=job_id,
                version=version,
                ref_key=f"relay/{job_id}/{version}/{parent}/{child}",
                amount=price("relay", nbytes=n),
                refs=(child,),
                nbytes=n,
            ),
            time.time(),
            self._seal,
        )

    async def run_forever(self) -> None:
        """Pay trained versions every :data:`BOOK_EVERY_S` until cancelled; a failing pass is
        logged and retried (the cursor moves only with a pass that committed)."""
        while True:
            try:
                n = self.book_trained()
                if n:
                    log.debug("credit: %d entries appended", n)
            except Exception:  # a bad pass must not stop paying volunteers: retried next time
                log.exception("credit booking failed")
            await trio.sleep(BOOK_EVERY_S)

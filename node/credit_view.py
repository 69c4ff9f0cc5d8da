"""``echo-node credit``: fetch a node's credit ledger from the coordinator's public endpoint,
verify every entry, and show it.

The coordinator's key comes from its peer id -- the ``/p2p/...`` part of the multiaddr the node
joins with -- so a volunteer checks the signatures against the coordinator it chose, not one the
HTTP answer names. Only without a configured coordinator is the answer's own peer id used, and
the output says so. Each entry is checked (:func:`echo.protocol.credit.verify_entries`):
signature, owner, price, and the hash chain from the node's first entry, so an altered, dropped
or reordered entry shows up as an error rather than as a smaller total.
"""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from echo.p2p.identity import public_key_from_peer_id
from echo.protocol.credit import UCREDITS_PER_CREDIT, CreditError, VerifiedLedger, verify_entries
from echo.protocol.errors import ProtocolError

# Pages of entries fetched at most (1000 entries a page): a bound on a lying server's stream.
MAX_PAGES = 10_000
TIMEOUT_S = 15.0


class CreditViewError(RuntimeError):
    """The ledger could not be fetched or did not verify; the message says what to do."""


@dataclass
class Fetched:
    """A node's ledger as fetched and verified."""

    ledger: VerifiedLedger
    answer: dict[str, Any]  # the last page (totals, by kind, recent rejections)
    key_source: str  # where the coordinator's key came from


def coordinator_peer_id(multiaddr: str) -> str | None:
    """The peer id of a ``.../p2p/<id>`` multiaddr, or None."""
    _, sep, tail = multiaddr.rpartition("/p2p/")
    return tail.split("/", 1)[0] if sep and tail else None


def fetch_ledger(api: str, node_id: str, coordinator: str = "") -> Fetched:
    """Fetch every entry of ``node_id`` from ``api`` (the coordinator's HTTP address) and verify
    them against the key of ``coordinator``'s peer id (else the answer's; see the module
    docstring).

    :raises CreditViewError: the coordinator cannot be reached or answers an error, or an entry
        does not verify.
    """
    envelopes: list[bytes] = []
    after, answer = -1, {}
    try:
        with httpx.Client(base_url=api.rstrip("/"), timeout=TIMEOUT_S) as http:
            for _ in range(MAX_PAGES):
                r = http.get(f"/v1/credit/{node_id}", params={"after": after})
                if r.status_code != 200:
                    raise CreditViewError(f"{api} answered {r.status_code}: {r.text[:200]}")
                answer = r.json()
                envelopes += [base64.b64decode(e["envelope"]) for e in answer["entries"]]
                if answer.get("next_after") is None:
                    break
                after = int(answer["next_after"])
    except httpx.HTTPError as exc:
        raise CreditViewError(
            f"cannot reach the coordinator at {api} ({exc}); check --api (its HTTP address, "
            "as echo-coordinator prints it)"
        ) from None
    except (KeyError, ValueError, TypeError) as exc:
        raise CreditViewError(f"{api} did not answer a credit ledger: {exc}") from None
    peer = coordinator_peer_id(coordinator) if coordinator else None
    source = "the coordinator you joined"
    if peer is None:
        peer = str(answer.get("coordinator_peer_id", ""))
        source = "the coordinator's own answer (pass --coordinator to check against yours)"
    try:
        key = public_key_from_peer_id(peer)
        ledger = verify_entries(envelopes, key, node_id)
    except CreditError as exc:
        raise CreditViewError(f"the ledger does not verify: {exc}") from None
    except ProtocolError as exc:
        raise CreditViewError(f"bad coordinator peer id {peer!r}: {exc}") from None
    if ledger.total != answer.get("total_ucredits"):
        raise CreditViewError(
            f"the coordinator's total ({answer.get('total_ucredits')}) is not the sum of its "
            f"signed entries ({ledger.total})"
        )
    return Fetched(ledger, answer, source)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def show(console: Console, node_id: str, got: Fetched, last: int) -> None:
    """Print the node's total, its ``last`` entries and its recent rejections."""
    ledger = got.ledger
    console.print(
        f"node {node_id}\ncredit: [bold]{ledger.total / UCREDITS_PER_CREDIT:.6f}[/bold] "
        f"in {len(ledger.entries)} entries, every one signed by the coordinator and verified "
        f"(key from {got.key_source})"
    )
    if ledger.entries:
        t = Table("#", "when", "for", "job", "version", "what", "credits")
        for e in ledger.entries[-last:]:
            when = datetime.datetime.fromtimestamp(e.at).strftime("%Y-%m-%d %H:%M:%S")
            what = (
                f"{len(e.refs)} groups, {e.tokens} tokens x {_count(e.params)} params"
                if e.kind == "rollouts"
                else f"{e.nbytes / 1e6:.1f} MB to {e.refs[0][-8:]}"
            )
            t.add_row(
                str(e.seq), when, e.kind, e.job_id[:24], str(e.version), what,
                f"{e.amount / UCREDITS_PER_CREDIT:.6f}",
            )
        console.print(t)
    rejections = got.answer.get("recent_rejections") or []
    if rejections:
        console.print("recent rejections (rejected work earns nothing):")
        for r in rejections[:10]:
            when = datetime.datetime.fromtimestamp(r["at"]).strftime("%H:%M:%S")
            console.print(f"  {when} {r['reason']} (job {str(r['job_id'])[:24]})")

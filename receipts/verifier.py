"""``verify``: prove that every receipt matches what it claims (DESIGN.md section 5).

Checks, each failure naming the receipt and the reason:

* every receipt file verifies on read (:mod:`receipts.receipt`);
* every ``committed`` receipt passes its adapter's ``verify_committed``
  (git: the commit exists, the key ref points at it, each output's digest
  equals the blob of that commit);
* no unresolved ``prepared`` receipt: its call is gone (its key lock is
  free: ``recover`` settles it), or it is still held but older than the grace
  period (stuck); no ``unknown`` receipt (a person must look);
* the ledger's hash chain is unbroken, and every receipt's latest state
  (its ``receipt_sha256``) appears in the ledger.

The watcher is never needed for any of this: verify reads the store itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from receipts.errors import CorruptReceipt
from receipts.receipt import Receipt
from receipts.recovery import receipt_age
from receipts.store import ReceiptStore

__all__ = ["Failure", "VerifyReport", "CommitVerifier", "verify", "DEFAULT_GRACE"]

DEFAULT_GRACE = 300.0


class CommitVerifier(Protocol):
    def verify_committed(self, receipt: Receipt) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Failure:
    key: str | None
    path: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "receipt": self.path, "reason": self.reason}


@dataclass(slots=True)
class VerifyReport:
    failures: list[Failure] = field(default_factory=list)
    receipts: int = 0
    ledger_events: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "receipts": self.receipts, "ledger_events": self.ledger_events,
                "failures": [f.to_json() for f in self.failures]}


def verify(
    store: ReceiptStore,
    verifiers: Mapping[str, CommitVerifier],
    *,
    grace: float = DEFAULT_GRACE,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    report = VerifyReport()
    digests: set[str] = set()
    for problem in store.ledger.verify_chain():
        report.failures.append(Failure(None, store.ledger.path, f"ledger line {problem.line}: {problem.reason}"))
    for event in store.ledger.events():
        report.ledger_events += 1
        d = event.get("receipt_sha256")
        if isinstance(d, str):
            digests.add(d)
    now = time.time()
    for item in store.scan():
        report.receipts += 1
        if progress is not None and report.receipts % 10000 == 0:
            progress(report.receipts)
        if item.receipt is None:
            assert item.error is not None
            report.failures.append(Failure(None, item.path, f"corrupt: {item.error.reason}"))
            continue
        r = item.receipt
        if r.digest not in digests:
            report.failures.append(Failure(r.key, item.path, f"latest state '{r.status}' is not in the ledger"))
        if r.status == "prepared":
            unresolved = _unresolved_prepared(store, r, grace, now)
            if unresolved is not None:
                report.failures.append(Failure(r.key, item.path, unresolved))
        elif r.status == "unknown":
            report.failures.append(Failure(r.key, item.path, "outcome unknown: resolve it by hand ('oncepatch resolve')"))
        elif r.status == "committed":
            v = verifiers.get(r.tool)
            if v is None:
                continue
            for reason in v.verify_committed(r):
                report.failures.append(Failure(r.key, item.path, reason))
    return report


def _unresolved_prepared(store: ReceiptStore, r: Receipt, grace: float, now: float) -> str | None:
    """Why a ``prepared`` receipt fails verification, or ``None`` while its call may still be running.

    A call holds its key lock from before it writes ``prepared`` until its final
    write, so a free lock means the call is gone: an orphan, whatever its age
    (the pre-commit hook must see it at once).  A held lock is a live call,
    merely slow: a failure only once older than ``grace`` (stuck).
    """
    age = receipt_age(r, now)
    try:
        lock = store.try_lock(r.key)
    except OSError:  # a read-only store: liveness cannot be told, the age alone decides
        if age > grace:
            return f"unresolved prepared receipt, {age:.0f}s old: run 'oncepatch recover'"
        return None
    if lock is None:
        if age > grace:
            return f"prepared {age:.0f}s ago and its call still holds the key lock: stuck? (grace {grace:g}s)"
        return None
    try:
        # Re-read under the lock: the call may have finished between the scan and now.
        current = store.read(r.key)
    except CorruptReceipt:
        return None  # reported by the scan on its next run; this one read it intact
    finally:
        lock.release()
    if current is None or current.status != "prepared" or current.fencing_token != r.fencing_token:
        return None
    return f"unresolved prepared receipt, {age:.0f}s old, its call is gone: run 'oncepatch recover'"

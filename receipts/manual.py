"""``resolve``: a person settles a receipt no adapter could (``unknown``, or ``prepared`` of a dead owner).

``--as committed`` records that the effect happened (for git: the candidate
is the commit); ``--as rejected`` records that it did not, retryable, so the
next call executes it once.  The note is kept in the receipt and the ledger.
"""

from __future__ import annotations

from receipts.errors import InProgress, ReceiptNotFound, StillUnknown
from receipts.receipt import Receipt
from receipts.store import ReceiptStore

__all__ = ["resolve_by_hand"]


def resolve_by_hand(store: ReceiptStore, key: str, as_: str, note: str, *, lock_timeout: float = 5.0) -> Receipt:
    """Settle ``key``'s receipt as ``committed`` or ``rejected``.

    Raises:
        ReceiptNotFound: no receipt for the key.
        InProgress: a live process holds the key.
        StillUnknown: the receipt is already final (nothing to resolve).
    """
    if as_ not in ("committed", "rejected"):
        raise ValueError(as_)
    found = store.find(key)
    if found is None:
        raise ReceiptNotFound(f"no receipt for key or call_id '{key}'", key=key)
    try:
        with store.lock(found.key, timeout=lock_timeout):
            current = store.read(found.key)
            assert current is not None
            if current.status not in ("prepared", "unknown"):
                raise StillUnknown(f"receipt of '{current.key}' is already {current.status}: nothing to resolve",
                                   key=current.key, next_action="none", error_type="not_resolvable")
            extra = {**current.extra, "resolved_by_hand": note}
            if as_ == "committed":
                new = current.evolve(status="committed", commit=current.commit or current.candidate, error=None,
                                     retryable=None, extra=extra)
            else:
                err = {"type": "resolved_not_applied", "message": note or "resolved by hand as not applied",
                       "retryable": True, "effect_status": "not_applied", "key": current.key,
                       "next_action": "retry"}
                new = current.evolve(status="rejected", retryable=True, error=err, extra=extra)
            store.record(new, "resolved", note=note)
            return new
    except InProgress:
        raise

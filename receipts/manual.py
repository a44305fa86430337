"""``resolve``: a person settles a receipt no adapter could (``unknown``, or ``prepared`` of a dead owner).

``--as committed`` records that the effect happened (for git: the candidate
is the commit); ``--as rejected`` records that it did not, retryable, so the
next call executes it once.  The note is kept in the receipt and the ledger.

A person's word never overrides an adapter that can tell: the receipt's
adapter is asked first (as ``recover`` asks it).  When it finds the effect
applied or not applied, a claim that agrees settles the receipt as
``recover`` would (follow-ups included: for git, the key ref and the
worktrees), and a claim that contradicts it is refused with nothing written.
Only when the adapter cannot tell (or there is none) is the claim recorded
as given.
"""

from __future__ import annotations

from collections.abc import Mapping

from cas.errors import OncepatchError, clip
from receipts.adapter import EffectAdapter, QueryResult
from receipts.engine import settle
from receipts.errors import InProgress, NotResolvable, ReceiptNotFound
from receipts.receipt import Receipt
from receipts.store import ReceiptStore

__all__ = ["resolve_by_hand"]


def _ask(adapter: EffectAdapter, receipt: Receipt) -> QueryResult | None:
    try:
        return adapter.query(receipt)
    except OncepatchError:
        return None  # e.g. its repository is gone: the person's word is all there is


def _refuse_if_contradicted(current: Receipt, as_: str, result: QueryResult) -> None:
    if result.status == _AGREES[as_]:
        return
    found_as = "applied" if result.status == "applied" else "not applied"
    raise NotResolvable(
        f"the {current.tool} adapter finds the call of '{current.key}' {found_as} "
        f"({result.reason}): it cannot be resolved as {as_}; run 'oncepatch recover'",
        key=current.key, effect_status=result.status, next_action="recover",
        details={"found": result.status, "reason": result.reason},
    )

_AGREES = {"committed": "applied", "rejected": "not_applied"}


def resolve_by_hand(store: ReceiptStore, key: str, as_: str, note: str, *, lock_timeout: float = 5.0,
                    adapters: Mapping[str, EffectAdapter] | None = None,
                    probes: Mapping[str, EffectAdapter] | None = None) -> Receipt:
    """Settle ``key``'s receipt as ``committed`` or ``rejected`` (module docstring).

    ``probes``: read-only adapters asked first, so that a refused claim changes
    nothing (a writing adapter's query also clears a dead owner's leftovers);
    ``adapters`` settle a claim the probe agrees with.

    Raises:
        ReceiptNotFound: no receipt for the key.
        InProgress: a live process holds the key.
        NotResolvable: the receipt is already final, or its adapter finds the
            opposite of ``as_`` (nothing written).
    """
    if as_ not in _AGREES:
        raise ValueError(as_)
    found = store.find(key)
    if found is None:
        raise ReceiptNotFound(f"no receipt for key or call_id '{clip(key)}'", key=key)
    try:
        with store.lock(found.key, timeout=lock_timeout):
            current = store.read(found.key)
            assert current is not None
            if current.status not in ("prepared", "unknown"):
                known = "applied" if current.status == "committed" else "not_applied"
                raise NotResolvable(f"receipt of '{current.key}' is already {current.status}: nothing to resolve",
                                    key=current.key, effect_status=known)  # type: ignore[arg-type]
            adapter = (adapters or {}).get(current.tool)
            probe = (probes or {}).get(current.tool, adapter)
            if adapter is not None and probe is not None:
                result = _ask(probe, current)
                if result is not None and result.status != "unknown":
                    _refuse_if_contradicted(current, as_, result)
                    settled = _ask(adapter, current) if probe is not adapter else result
                    if settled is not None and settled.status != "unknown":
                        _refuse_if_contradicted(current, as_, settled)
                        noted = current.evolve(extra={**current.extra, "resolved_by_hand": note})
                        return settle(store, noted, adapter, settled, note=note)
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

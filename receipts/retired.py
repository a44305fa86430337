"""Keys ``oncepatch gc`` retired: their receipts archived and removed, never to run again.

A key is retired when its last event is ``removed``, or when a
``checkpoint`` lists it (``retired``: a compaction carries removed keys on, so
the record that a key went is never compacted away); its ref stays as a
tombstone.  Why a call with it is refused, and how every command reads it:
docs/LIFECYCLE.md, "A removed key is retired".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TYPE_CHECKING = False
if TYPE_CHECKING:
    from receipts.store import ReceiptStore

__all__ = ["RETIRED_FIELD", "retired_keys", "retirement", "retired_entry", "retired_message", "note_attempt",
           "last_attempt"]

#: The checkpoint's field listing the keys whose ``removed`` events it replaced: ``{key: entry}``.
RETIRED_FIELD = "retired"


def retired_entry(event: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps of a ``removed`` event (its seq, time, archive, and what the receipt said)."""
    return {k: event.get(k) for k in ("seq", "at", "bundle_sha256", "receipt_sha256", "status", "commit")}


def retired_keys(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{key: entry}`` of the keys retired in ``events`` (a ledger, in order), by ``removed`` or a checkpoint.

    Any later event of a key (a quarantine, a call made before this rule)
    takes it off the list: its last event says what it is.
    """
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        kind = e.get("event")
        if kind == "checkpoint" and isinstance(e.get(RETIRED_FIELD), dict):
            for k, entry in e[RETIRED_FIELD].items():
                if isinstance(k, str) and isinstance(entry, dict):
                    out[k] = entry
            continue
        k = e.get("key")
        if not isinstance(k, str):
            continue
        if kind == "removed":
            out[k] = retired_entry(e)
        else:
            out.pop(k, None)
    return out


def retirement(store: ReceiptStore, key: str) -> dict[str, Any] | None:
    """The entry of ``key`` when gc retired it (its receipt removed), else ``None`` (one ledger pass).

    Raises:
        CorruptLedger: a complete ledger line is not a JSON object.
    """
    entry = retired_keys(store.ledger.events()).get(key)
    return None if entry is None else {"key": key, **entry}


def retired_message(key: str, entry: dict[str, Any]) -> str:
    """``key was retired by gc on <date> (ledger event N, archive <sha>)``: the subject of every refusal."""
    at = str(entry.get("at") or "?")[:10]
    bundle = str(entry.get("bundle_sha256") or "?")[:12]
    return (f"key '{key}' was retired by 'oncepatch gc' on {at} (ledger event {entry.get('seq')}, "
            f"archive sha256 {bundle}): its receipt is in the archive and the key never runs again")


def note_attempt(tokens: dict[str, int], event: dict[str, Any]) -> None:
    """Fold one ledger event into ``tokens``: each key's highest fencing token.

    A key whose receipt is moved aside (``quarantined``, ``removed``, a
    checkpoint's retired keys) is forgotten: a later receipt of it starts its
    attempts again.  A receipt of a lower token than its key's here is an
    earlier state put back (a rollback): ``verify`` fails it, and a call never
    runs again over it.
    """
    kind = event.get("event")
    if kind == "checkpoint":
        retired = event.get(RETIRED_FIELD)
        if isinstance(retired, dict):
            for k in retired:
                tokens.pop(k, None)
        return
    k = event.get("key")
    if not isinstance(k, str):
        return
    if kind in ("quarantined", "removed"):
        tokens.pop(k, None)
        return
    token = event.get("fencing_token")
    if type(token) is int and token > tokens.get(k, 0):
        tokens[k] = token


def last_attempt(events: Iterable[dict[str, Any]], key: str) -> int:
    """The highest fencing token ``events`` (a ledger, in order) record for ``key`` since its receipt was
    last moved aside (:func:`note_attempt`); 0: none."""
    tokens: dict[str, int] = {}
    for event in events:
        if event.get("key") == key or event.get("event") == "checkpoint":
            note_attempt(tokens, event)
    return tokens.get(key, 0)

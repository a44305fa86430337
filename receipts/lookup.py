"""Looking receipts up: ``status`` of a key or call_id, and where the store is (no pygit2, writes nothing)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from cas.errors import clip
from cas.gitdir import discover
from receipts.errors import CorruptReceipt, InProgress, NotChecked, ReceiptNotFound, only_unreachable
from receipts.receipt import Receipt
from receipts.retired import retired_keys, retired_message
from receipts.store import FILE_MISSING, ReceiptStore

__all__ = ["status", "store_root"]


def store_root(store: str | os.PathLike[str] | None = None, repo: str | os.PathLike[str] | None = None) -> str:
    """``store``, else ``$ONCEPATCH_STORE``, else ``<git-common-dir of repo>/oncepatch``.

    Raises:
        UsageError: no store given and ``repo`` (default: the current folder) is not in a repository.
    """
    if store is not None:
        return os.path.abspath(os.fspath(store))
    if os.environ.get("ONCEPATCH_STORE"):
        return os.path.abspath(os.environ["ONCEPATCH_STORE"])
    return os.path.abspath(os.path.join(discover(os.fspath(repo) if repo is not None else ".").common_dir,
                                        "oncepatch"))


def status(key: str, *, store: ReceiptStore | str | os.PathLike[str] | None = None,
           repo: str | os.PathLike[str] | None = None,
           adapters: Mapping[str, Any] | Callable[[ReceiptStore], Mapping[str, Any]] | None = None) -> Receipt:
    """The verified receipt of ``key`` (or of a call_id) in the store.

    ``adapters``: ``{tool: adapter}`` (or a function of the store giving
    them); a ``committed`` receipt is shown only where its tool's adapter
    (``verify_committed``) finds nothing in the world that contradicts it.

    Raises:
        ReceiptNotFound: no receipt for it.
        InProgress: none yet, and a running call holds the key's lock.
        CorruptReceipt: its file fails verification, or the world contradicts it.
        UsageError: no store can be found.
    """
    rstore = store if isinstance(store, ReceiptStore) else ReceiptStore(store_root(store, repo))
    found = rstore.find(key)
    if found is not None and found.status == "committed" and adapters is not None:
        known = adapters(rstore) if callable(adapters) else adapters
        check = getattr(known.get(found.tool), "verify_committed", None)
        problems = check(found) if check is not None else []
        if only_unreachable(problems):
            raise NotChecked(f"the receipt of key '{found.key}' could not be checked now: {'; '.join(problems)}",
                             key=found.key, details={"path": rstore.receipt_path(found.key)})
        if problems:
            raise CorruptReceipt(rstore.receipt_path(found.key), "; ".join(problems), key=found.key,
                                 next_action="none", details={"contradicted_by": found.tool})
    if found is None:
        if rstore.key_held_elsewhere(key):
            # A first call holds the key and has not written its receipt yet: ask again.
            raise InProgress(f"key '{clip(key)}' is being applied by a running call, which has written no "
                             f"receipt yet: ask again when it ends", key=key)
        removed = _removed_by_gc(rstore, key)
        if removed is not None:
            raise ReceiptNotFound(f"{retired_message(str(removed.get('key')), removed)}: a call with it is refused, "
                                  "use a new key (docs/LIFECYCLE.md)", key=key,
                                  effect_status="unknown", next_action="new_key", details={"removed": removed})
        gone = _recorded_without_file(rstore, key)
        if gone is not None:
            raise CorruptReceipt(rstore.receipt_path(gone), FILE_MISSING, key=gone,
                                 next_action="none")  # recover cannot bring it back: a person looks
        # No receipt and no running call: nothing was done under this key (a call
        # killed before it prepared leaves only objects nothing points at).
        raise ReceiptNotFound(f"no receipt for key or call_id '{clip(key)}': nothing was applied under it (a call "
                              f"killed before it prepared leaves none), so a retry is safe",
                              key=key, retryable=True, effect_status="not_started", next_action="retry")
    return found


def _recorded_without_file(rstore: ReceiptStore, key: str) -> str | None:
    """The key whose receipt the ledger records for ``key`` (a key or call_id), when its file is gone.

    Asked only when no receipt was found: such a store was changed by hand, and
    "no receipt" would say the call never started (verify reports it too).
    """
    for event in rstore.ledger.events():
        named = event.get("key")
        if isinstance(named, str) and key in (named, event.get("call_id")):
            return named if not os.path.exists(rstore.receipt_path(named)) else None
    return None


def _removed_by_gc(rstore: ReceiptStore, key: str) -> dict[str, Any] | None:
    """The retirement of ``key`` (a key or call_id) when gc removed its receipt, else ``None``.

    Its ``removed`` event when that is the key's last one, or the entry a
    checkpoint keeps of it (:mod:`receipts.retired`).
    """
    last: dict[str, Any] | None = None
    events = list(rstore.ledger.events())
    for event in events:
        if key in (event.get("key"), event.get("call_id")):
            last = event
    if last is not None and last.get("event") == "removed":
        return last
    entry = retired_keys(events).get(key)
    return None if entry is None else {"key": key, **entry}

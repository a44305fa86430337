"""Marker files a call writes in ``<store>/tmp`` while it holds git lock files (no pygit2).

git's ``.lock`` files carry no owner.  Just before a call takes a ref lock or
the index lock it writes a marker naming the lock; it removes the marker once
the lock is released.  After a crash the marker outlives its owner, and
recovery (:mod:`patcher.git_adapter`) uses it as proof that a lock file no
older than the marker was left by that dead call — never by a live git.
"""

from __future__ import annotations

import os

from cas.index_lock import index_lock_owner
from receipts.identity import key_hash
from receipts.store import ReceiptStore

__all__ = ["ref_lock_marker", "index_marker", "index_markers", "MARKER_PREFIXES", "INDEX_MARKER_PREFIX"]

#: Name of an index-lock marker, before the key's hash.
INDEX_MARKER_PREFIX = "index-lock-"
MARKER_PREFIXES = ("ref-lock-", INDEX_MARKER_PREFIX)


def ref_lock_marker(rstore: ReceiptStore, key: str) -> str:
    return os.path.join(rstore.tmp_dir, f"ref-lock-{key_hash(key)}")


def index_marker(rstore: ReceiptStore, key: str) -> str:
    return os.path.join(rstore.tmp_dir, f"{INDEX_MARKER_PREFIX}{key_hash(key)}")


def index_markers(rstore: ReceiptStore) -> list[tuple[str, str]]:
    """``(key hash, index.lock path it names)`` of every index-lock marker in the store now."""
    try:
        names = sorted(os.listdir(rstore.tmp_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if name.startswith(INDEX_MARKER_PREFIX):
            try:
                with open(os.path.join(rstore.tmp_dir, name), "rb") as fh:
                    named = fh.read().decode("utf-8", "surrogateescape").strip()
            except OSError:
                continue  # removed meanwhile
            found.append((name[len(INDEX_MARKER_PREFIX):], named))
    return found


def foreign_index_lock(index_lock: str, rstore: ReceiptStore) -> str | None:
    """The other store whose call left ``index_lock``, if that store still has its marker naming it.

    Such a lock protects a change only that store's ``recover`` can settle: this
    store's calls and recovery leave it in place.  ``None`` when the lock names
    this store, no store, or a store with no marker for it (its call died before
    writing one: before its branch moved).
    """
    owner = index_lock_owner(index_lock)
    if owner is None or os.path.abspath(owner) == rstore.root:
        return None
    try:
        other = ReceiptStore(owner)
    except Exception:  # noqa: BLE001 - not a store any more: nothing to settle there
        return None
    return owner if any(named == index_lock for _h, named in index_markers(other)) else None

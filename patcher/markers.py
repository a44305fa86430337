"""Marker files a call writes in ``<store>/tmp`` while it holds git lock files (no pygit2).

git's ``.lock`` files carry no owner.  Just before a call takes a ref lock or
the index lock it writes a marker naming the lock; it removes the marker once
the lock is released.  After a crash the marker outlives its owner, and
recovery (:mod:`patcher.git_adapter`) uses it as proof that a lock file no
older than the marker was left by that dead call — never by a live git.

Markers are :class:`receipts.store.StoreFile` objects: written, read and
removed through a descriptor of ``tmp/`` reached from the store's root
without following a symlink.
"""

from __future__ import annotations

import os
import stat

from cas.index_lock import index_lock_owner
from receipts.errors import CorruptReceipt
from receipts.identity import key_hash
from receipts.store import ReceiptStore, StoreFile

__all__ = ["ref_lock_marker", "index_marker", "index_markers", "refuse_planted_markers", "INDEX_MARKER_PREFIX"]

#: Name of an index-lock marker, before the key's hash.
INDEX_MARKER_PREFIX = "index-lock-"


def ref_lock_marker(rstore: ReceiptStore, key: str) -> StoreFile:
    return rstore.tmp_file(f"ref-lock-{key_hash(key)}")


def index_marker(rstore: ReceiptStore, key: str) -> StoreFile:
    return rstore.tmp_file(f"{INDEX_MARKER_PREFIX}{key_hash(key)}")


def refuse_planted_markers(rstore: ReceiptStore, key: str) -> None:
    """Refuse, before anything is written, a key whose marker names in ``tmp/`` hold something else than a file.

    A marker is written with ``O_NOFOLLOW`` (:class:`receipts.store.StoreFile`),
    so a symlink planted there would only make the call fail half-way, after
    its ``prepared`` receipt: found here, nothing of the call is started.

    Raises:
        CorruptReceipt: a marker name holds a symlink or a folder, or ``tmp/`` is a symlink (``not_started``).
    """
    names = {ref_lock_marker(rstore, key).name, index_marker(rstore, key).name}
    try:
        with rstore.folder_fd(rstore.tmp_dir) as dfd:
            for name in sorted(names):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a file"
                    raise CorruptReceipt(os.path.join(rstore.tmp_dir, name), f"{what}, not a scratch file of the "
                                         "store", effect_status="not_started", key=key)
    except (FileNotFoundError, NotADirectoryError):
        return
    except CorruptReceipt as exc:
        if exc.effect_status != "not_started":
            raise CorruptReceipt(exc.path, exc.reason, effect_status="not_started", key=key) from None
        raise


def index_markers(rstore: ReceiptStore) -> list[tuple[str, str]]:
    """``(key hash, index.lock path it names)`` of every index-lock marker in the store now."""
    found = []
    for name in rstore.tmp_names():
        if name.startswith(INDEX_MARKER_PREFIX):
            try:
                named = rstore.tmp_file(name).read().decode("utf-8", "surrogateescape").strip()
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
    try:
        markers = index_markers(other)
    except CorruptReceipt:  # its tmp/ is a symlink: not read through; the lock is left to that store
        return owner
    return owner if any(named == index_lock for _h, named in markers) else None

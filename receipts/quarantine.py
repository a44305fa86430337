"""Quarantine: evidence a person moves aside, never deletes (docs/RECOVERY.md, "quarantine").

``recover`` never settles a store changed by hand: it reports it, exit 6.  A
person who has looked at it moves it aside: :func:`quarantine_receipt` (one
key's receipt file, or a record of one already gone) or
:func:`quarantine_ledger` (``events.jsonl``, then a new ledger that adopts
every receipt that verifies).  Where each goes and what the ledger records:
docs/RECOVERY.md.

Each quarantine folder holds ``record.json`` (what moved where, its sha256,
when, the note), written after the move: a crash in between leaves the
evidence moved but unrecorded, never lost.  :func:`quarantines` lists them
(``verify`` reports every one).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Any

from cas.durable import open_regular, write_durable
from cas.errors import clip
from receipts import jsonio
from receipts.errors import InvalidKey, ReceiptNotFound
from receipts.flock import flocked
from receipts.identity import check_key
from receipts.receipt import now_iso
from receipts.store import MAX_RECEIPT_BYTES, ReceiptStore

__all__ = ["QUARANTINE_DIR", "quarantine_receipt", "quarantine_ledger", "quarantines", "quarantined_keys"]

#: The folder under the store root that holds quarantined evidence.
QUARANTINE_DIR = "quarantine"
_RECORD = "record.json"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# Every file is opened, moved and written through folder descriptors the store opened without
# following a symlink (ReceiptStore.folder_fd): a store folder swapped for one is never followed.


def _digest(dir_fd: int, name: str) -> tuple[str | None, int]:
    """sha256 and size of the regular file ``name`` in ``dir_fd`` (``None``: not one, or too large to read).

    Raises:
        FileNotFoundError: there is none.
    """
    try:
        fd = open_regular(name, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError:
        return None, os.lstat(name, dir_fd=dir_fd).st_size
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_RECEIPT_BYTES:
            return None, size
        h = hashlib.sha256()
        while chunk := fh.read(1 << 20):
            h.update(chunk)
        return h.hexdigest(), size


def _new_folder(store: ReceiptStore, stack: contextlib.ExitStack, what: str) -> tuple[str, int]:
    """A fresh ``<store>/quarantine/<stamp>-<what>/`` folder (made, its parents synced) and its descriptor."""
    base = os.path.join(store.root, QUARANTINE_DIR)
    base_fd = stack.enter_context(store.folder_fd(base, create=True))
    stamp = now_iso().replace(":", "").replace("-", "")
    n = 0
    while True:
        name = f"{stamp}-{what}" + (f"-{n}" if n else "")
        try:
            os.mkdir(name, 0o755, dir_fd=base_fd)
        except FileExistsError:
            n += 1
            continue
        os.fsync(base_fd)
        return os.path.join(base, name), os.open(name, _DIR_FLAGS, dir_fd=base_fd)


def _move(src_fd: int, dst_fd: int, name: str) -> None:
    """Rename ``name`` from folder ``src_fd`` to ``dst_fd`` (one store: one file system) and sync both."""
    os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
    os.fsync(dst_fd)
    os.fsync(src_fd)


def _write_record(folder_fd: int, record: dict[str, Any]) -> None:
    write_durable(_RECORD, jsonio.dumps(record) + b"\n", dir_fd=folder_fd)


def _last_event(store: ReceiptStore, key: str) -> str | None:
    """The ledger's last event naming ``key`` (``None``: it names it nowhere)."""
    last = None
    for e in store.ledger.events():
        if e.get("key") == key:
            last = str(e.get("event"))
    return last


def quarantine_receipt(store: ReceiptStore, key: str, *, note: str = "", timeout: float = 30.0,
                       evidence: str | None = None) -> dict[str, Any]:
    """Move ``key``'s receipt file aside, under its key lock; return the record.

    A receipt file that is already gone is recorded as ``missing_receipt``
    (nothing moves) when the ledger still names the key or the caller found
    ``evidence`` of it elsewhere (a git key ref): afterwards ``verify`` lists
    the key with the quarantines instead of failing on it.

    Raises:
        ReceiptNotFound: the key has no receipt file, and neither the ledger nor ``evidence`` shows it
            (or it is quarantined already).
        InProgress: a live call holds the key's lock.
        CorruptReceipt: a store folder on the way is a symlink.
    """
    try:
        check_key(key)
    except InvalidKey as exc:  # no call could have used it: nothing to look for, no lock file to make
        raise ReceiptNotFound(f"no receipt for key '{clip(key)}' to quarantine: {exc.message}", key=key) from None
    path = store.receipt_path(key)
    name = os.path.basename(path)
    with store.lock(key, timeout=timeout), contextlib.ExitStack() as stack:
        store.check_folders(path)
        try:
            shard_fd = stack.enter_context(store.folder_fd(os.path.dirname(path)))
            file_sha256, size = _digest(shard_fd, name)
        except FileNotFoundError:
            last = _last_event(store, key)
            if last == "quarantined":
                raise ReceiptNotFound(f"the receipt of '{clip(key)}' is already quarantined", key=key) from None
            if evidence is None and last is None:
                raise ReceiptNotFound(f"no receipt for key '{clip(key)}' to quarantine, and neither the ledger nor "
                                      "a key ref names it", key=key) from None
            return _record_missing(store, stack, key, note, evidence)
        folder, folder_fd = _new_folder(store, stack, "receipt")
        stack.callback(os.close, folder_fd)
        moved_to = os.path.join(folder, "receipts", name)
        os.mkdir("receipts", 0o755, dir_fd=folder_fd)
        os.fsync(folder_fd)
        receipts_fd = os.open("receipts", _DIR_FLAGS, dir_fd=folder_fd)
        stack.callback(os.close, receipts_fd)
        _move(shard_fd, receipts_fd, name)
        record = {"schema": "oncepatch.quarantine/1", "what": "receipt", "key": key, "at": now_iso(),
                  "from": os.path.relpath(path, store.root), "to": os.path.relpath(moved_to, store.root),
                  "file_sha256": file_sha256, "bytes": size, "note": note}
        _write_record(folder_fd, record)
        store.ledger.append({"event": "quarantined", "at": record["at"], "key": key, "what": "receipt",
                             "to": record["to"], "file_sha256": file_sha256, "note": note})
    return record


def _record_missing(store: ReceiptStore, stack: contextlib.ExitStack, key: str, note: str,
                    evidence: str | None) -> dict[str, Any]:
    """Record the quarantine of a receipt file that is already gone (under the key's lock)."""
    folder, folder_fd = _new_folder(store, stack, "missing-receipt")
    stack.callback(os.close, folder_fd)
    record = {"schema": "oncepatch.quarantine/1", "what": "missing_receipt", "key": key, "at": now_iso(),
              "from": os.path.relpath(store.receipt_path(key), store.root), "to": os.path.relpath(folder, store.root),
              "file_sha256": None, "bytes": 0, "evidence": evidence, "note": note}
    _write_record(folder_fd, record)
    store.ledger.append({"event": "quarantined", "at": record["at"], "key": key, "what": "missing_receipt",
                         "to": record["to"], "file_sha256": None, "note": note})
    return record


def quarantine_ledger(store: ReceiptStore, *, note: str = "", timeout: float = 30.0) -> dict[str, Any]:
    """Move ``events.jsonl`` aside and start a new ledger that adopts the receipts that verify.

    Raises:
        ReceiptNotFound: there is no ledger file.
        InProgress: the ledger lock stayed held for ``timeout`` seconds.
        CorruptReceipt: a store folder on the way is a symlink.
    """
    ledger = store.ledger
    name = os.path.basename(ledger.path)
    with contextlib.ExitStack() as stack:
        root_fd = stack.enter_context(store.folder_fd(store.root))
        with flocked(ledger.lock_path, timeout, folder=store.locks_folder):
            try:
                file_sha256, size = _digest(root_fd, name)
            except FileNotFoundError:
                raise ReceiptNotFound(f"no ledger '{ledger.path}' to quarantine") from None
            folder, folder_fd = _new_folder(store, stack, "ledger")
            stack.callback(os.close, folder_fd)
            moved_to = os.path.join(folder, name)
            _move(root_fd, folder_fd, name)
        at = now_iso()
        adopted: list[str] = []
        corrupt: list[str] = []
        ledger.append({"event": "quarantined", "at": at, "what": "ledger", "to": os.path.relpath(moved_to, store.root),
                       "file_sha256": file_sha256, "bytes": size, "note": note})
        for item in store.scan():
            if item.receipt is None:
                corrupt.append(item.path)
                continue
            ledger.append_receipt_event("adopted", item.receipt, reason="ledger_quarantined")
            adopted.append(item.receipt.key)
        record = {"schema": "oncepatch.quarantine/1", "what": "ledger", "at": at,
                  "from": os.path.relpath(ledger.path, store.root), "to": os.path.relpath(moved_to, store.root),
                  "file_sha256": file_sha256, "bytes": size, "note": note, "adopted": adopted,
                  "not_adopted": [os.path.relpath(p, store.root) for p in corrupt]}
        _write_record(folder_fd, record)
    return record


def quarantines(store: ReceiptStore) -> Iterator[dict[str, Any]]:
    """Every quarantine record of the store, oldest first (a folder without one: its files, unrecorded).

    Raises:
        CorruptReceipt: the quarantine folder is a symlink.
    """
    base = os.path.join(store.root, QUARANTINE_DIR)
    try:
        with store.folder_fd(base) as base_fd:
            for name in sorted(os.listdir(base_fd)):
                yield _quarantine_record(store, base_fd, name)
    except FileNotFoundError:
        return


def _quarantine_record(store: ReceiptStore, base_fd: int, name: str) -> dict[str, Any]:
    to = os.path.relpath(os.path.join(store.root, QUARANTINE_DIR, name), store.root)
    try:
        folder_fd = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
    except OSError:
        return {"what": "unrecorded", "to": to, "files": []}  # no folder: nothing in it to list
    try:
        fd = open_regular(_RECORD, dir_fd=folder_fd)
    except OSError:
        files = sorted(os.path.normpath(os.path.join(to, d, f))
                       for d, _dirs, fs, _fd in os.fwalk(".", dir_fd=folder_fd) for f in fs)
        return {"what": "unrecorded", "to": to, "files": files}
    finally:
        os.close(folder_fd)
    with os.fdopen(fd, "rb") as fh:
        try:
            doc = jsonio.loads(fh.read(1 << 20))
        except jsonio.JsonError:
            doc = None
    return doc if isinstance(doc, dict) else {"what": "unreadable", "to": to}


def quarantined_keys(events: Iterator[dict[str, Any]]) -> set[str]:
    """The keys whose last ledger event (of ``events``, in order) is ``quarantined`` (or ``removed``:
    archived and removed by ``oncepatch gc``): no receipt is expected."""
    keys: set[str] = set()
    for e in events:
        k = e.get("key")
        if not isinstance(k, str):
            continue
        if e.get("event") in ("quarantined", "removed"):
            keys.add(k)
        else:
            keys.discard(k)
    return keys

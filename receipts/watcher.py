"""``watch``: flag orphaned ``prepared`` receipts as they appear (docs/DESIGN.md section 5).

A watchdog observer on ``<store>/receipts`` feeds receipt paths (created,
modified, and moved events read by their *destination*, since every receipt
write is an atomic rename) into a queue; a periodic full rescan catches what
events miss (events can be lost, and a writer that crashed emits none).  The
rescan keeps each file's mtime and last status, so files that have not
changed since the previous scan and were final are not parsed again.

A ``prepared`` receipt is flagged once past the grace period **and** its key
lock can be taken without waiting (the kernel dropped its owner's flock): a
live apply that is merely slow holds the lock and is never flagged.  What is
flagged (orphans, corrupt receipts, committed ones whose adapter's optional
``unfinished(receipt)`` names a follow-up left undone) and what ``recover=True``
then does: docs/RECOVERY.md, "watch".  The watcher is never the source of
truth: ``recover`` and ``verify`` find everything it flags without it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from watchdog.events import FileCreatedEvent, FileModifiedEvent, FileMovedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from receipts.adapter import EffectAdapter
from receipts.errors import CorruptReceipt
from receipts.receipt import Receipt
from receipts.engine import settle
from receipts.recovery import receipt_age
from receipts.store import ReceiptStore

__all__ = ["Watcher"]


class Watcher:
    def __init__(
        self,
        store: ReceiptStore,
        adapters: Mapping[str, EffectAdapter],
        *,
        grace: float = 30.0,
        rescan_interval: float = 30.0,
        on_flag: Callable[[dict[str, Any]], None],
        recover: bool = False,
        on_error: Callable[[str], None] | None = None,
        cleanup: Callable[[], list[str]] | None = None,
    ) -> None:
        self.store = store
        self.adapters = adapters
        self.grace = grace
        self.rescan_interval = rescan_interval
        self.on_flag = on_flag
        self.recover = recover
        self.on_error = on_error or (lambda msg: None)
        self.cleanup = cleanup
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._seen: dict[str, tuple[float, str]] = {}  # path -> (mtime, status)
        self._pending: dict[str, float] = {}  # path -> when to look again
        self._flagged: set[tuple[str, int]] = set()
        self._corrupt: set[tuple[str, float]] = set()  # (path, mtime) of corrupt files flagged
        self._unfinished: set[tuple[str, float]] = set()  # (path, mtime) of committed receipts flagged unfinished
        self.flags = 0

    # -- feeding -------------------------------------------------------------------

    def notify(self, path: str) -> None:
        """Called from the observer thread with a receipt path that changed."""
        self._events.put(path)

    def rescan(self) -> None:
        """Walk every receipt file; parse only those new or changed since the last walk."""
        try:
            shards = os.listdir(self.store.receipts_dir)
        except FileNotFoundError:
            return
        for shard in shards:
            folder = os.path.join(self.store.receipts_dir, shard)
            try:
                names = os.listdir(folder)
            except (NotADirectoryError, FileNotFoundError):
                continue
            for name in names:
                if name.endswith(".json") and not name.startswith("."):
                    self._consider(os.path.join(folder, name))

    def _consider(self, path: str) -> None:
        try:
            mtime = os.stat(path).st_mtime
        except FileNotFoundError:
            self._seen.pop(path, None)
            self._pending.pop(path, None)
            return
        seen = self._seen.get(path)
        if seen is not None and seen[0] == mtime and seen[1] != "prepared":
            return
        receipt = self._read(path)
        if receipt is None:
            return
        self._seen[path] = (mtime, receipt.status)
        if receipt.status == "committed" and receipt.extra.get("warnings"):
            self._ask_unfinished(path, mtime, receipt)
        if receipt.status == "prepared":
            due = time.monotonic() + max(0.0, self.grace - receipt_age(receipt))
            self._pending[path] = min(due, self._pending.get(path, due))
        else:
            self._pending.pop(path, None)

    def _read(self, path: str) -> Receipt | None:
        """The verified receipt at ``path`` (read as a regular file only); ``None`` if gone or corrupt (flagged)."""
        item = self.store.read_stored(path)
        if item is None:
            return None
        if item.error is not None:
            self._flag_corrupt(path, item.error)
        return item.receipt

    def _flag_corrupt(self, path: str, exc: CorruptReceipt) -> None:
        try:
            mark = (path, os.lstat(path).st_mtime)
        except OSError:
            return  # gone meanwhile
        if mark in self._corrupt:
            return
        self._corrupt.add(mark)
        self.flags += 1
        self.on_flag({"flag": "corrupt_receipt", "key": exc.key, "receipt": path, "reason": exc.reason,
                      "next_action": "none"})

    def _ask_unfinished(self, path: str, mtime: float, receipt: Receipt) -> None:
        """Flag (and with ``recover``, settle) what a committed receipt's follow-up left undone (docstring)."""
        adapter = self.adapters.get(receipt.tool)
        ask = getattr(adapter, "unfinished", None)
        if ask is None or (path, mtime) in self._unfinished:
            return
        try:
            left = list(ask(receipt))
        except Exception as exc:  # noqa: BLE001 - report and keep watching
            self.on_error(f"looking at what '{receipt.key}' left undone failed: {exc}")
            return
        if not left:
            return
        self._unfinished.add((path, mtime))
        self.flags += 1
        self.on_flag({"flag": "unfinished", "key": receipt.key, "call_id": receipt.call_id, "commit": receipt.commit,
                      "left": left, "receipt": path, "next_action": "recover"})
        if not self.recover or adapter is None:
            return
        lock = self.store.try_lock(receipt.key)
        if lock is None:
            return  # a call on the key runs: its own follow-up (or the next recover) does it
        try:
            done = list(adapter.settle(receipt))
        except Exception as exc:  # noqa: BLE001
            self.on_error(f"follow-up of '{receipt.key}' failed: {exc}")
            return
        finally:
            lock.release()
        self.on_flag({"recovered": receipt.key, "status": receipt.status, "commit": receipt.commit,
                      "removed": [], "done": done})

    # -- judging -------------------------------------------------------------------

    def check_due(self, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for path, due in list(self._pending.items()):
            if due > now:
                continue
            receipt = self._read(path)
            if receipt is None or receipt.status != "prepared":
                self._pending.pop(path, None)
                continue
            age = receipt_age(receipt)
            if age < self.grace:
                self._pending[path] = now + (self.grace - age)
                continue
            self._judge(path, receipt, age, now)

    def _judge(self, path: str, receipt: Receipt, age: float, now: float) -> None:
        lock = self.store.try_lock(receipt.key)
        if lock is None:
            self._pending[path] = now + 1.0  # owner alive: look again later
            return
        recovered: dict[str, Any] | None = None
        try:
            try:
                current = self.store.read(receipt.key) or receipt
            except CorruptReceipt as exc:  # edited since it was read: reported, not acted on
                self._flag_corrupt(path, exc)
                self._pending.pop(path, None)
                return
            if current.status != "prepared":
                self._pending.pop(path, None)
                return
            mark = (current.key, current.fencing_token)
            adapter = self.adapters.get(current.tool)
            on_branch: bool | None = None
            if adapter is not None:
                try:
                    on_branch = adapter.query(current).status == "applied"
                except Exception as exc:  # noqa: BLE001 - report and keep watching
                    self.on_error(f"query of '{current.key}' failed: {exc}")
            if mark not in self._flagged:
                self._flagged.add(mark)
                self.flags += 1
                self.on_flag({
                    "flag": "orphan_prepared",
                    "key": current.key,
                    "call_id": current.call_id,
                    "age_s": round(age, 3),
                    "candidate": current.candidate,
                    "candidate_on_branch": on_branch,
                    "receipt": path,
                    "next_action": "recover",
                })
            if self.recover and adapter is not None:
                try:
                    new = settle(self.store, current, adapter)
                    recovered = {"recovered": current.key, "status": new.status, "commit": new.commit}
                except Exception as exc:  # noqa: BLE001
                    self.on_error(f"recovery of '{current.key}' failed: {exc}")
            self._pending.pop(path, None)
        finally:
            lock.release()
        if recovered is not None:
            # Settled: what the dead call left in the repository goes too, as 'recover' tidies
            # after its resolutions (its key lock released first: the tidying takes locks of its own).
            removed: list[str] = []
            if self.cleanup is not None:
                try:
                    removed = self.cleanup()
                except Exception as exc:  # noqa: BLE001 - report and keep watching
                    self.on_error(f"tidying after '{recovered['recovered']}' failed: {exc}")
            self.on_flag({**recovered, "removed": removed})

    def scan_once(self) -> int:
        """One full scan and judgement of everything due now; returns the number of flags raised."""
        before = self.flags
        self.rescan()
        self.check_due(now=float("inf"))
        return self.flags - before

    # -- running -------------------------------------------------------------------

    def run(self, stop: threading.Event, *, tick: float = 0.1) -> None:
        """Watch until ``stop`` is set: events, due checks, and a full rescan every ``rescan_interval`` s."""
        watcher = self

        def feed(path: bytes | str) -> None:
            name = os.path.basename(os.fsdecode(path))
            if name.endswith(".json") and not name.startswith("."):
                watcher.notify(os.fsdecode(path))

        # Not PatternMatchingEventHandler(patterns=["*.json"]): watchdog 7 matches
        # patterns against the *full* path (PurePath.full_match), where "*.json"
        # never matches ".../receipts/ab/<h>.json" — every event was dropped and
        # only the periodic rescan ever saw a receipt.  Filter by file name here.
        class Handler(FileSystemEventHandler):
            def on_created(self, event: FileSystemEvent) -> None:
                if not event.is_directory:
                    feed(event.src_path)

            def on_modified(self, event: FileSystemEvent) -> None:
                if not event.is_directory:
                    feed(event.src_path)

            def on_moved(self, event: FileSystemEvent) -> None:
                if not event.is_directory:
                    feed(event.dest_path)

        with self.store.folder_fd(self.store.receipts_dir, create=True):  # made without following a symlink
            pass
        observer = Observer()
        try:
            # Only the events the handler reads: inotify then never reports the opens and
            # closes of the store's own folders and receipts (dozens a call, each an event
            # for watchdog's threads to build and drop: most of a watcher's time).
            observer.schedule(Handler(), self.store.receipts_dir, recursive=True,
                              event_filter=[FileCreatedEvent, FileModifiedEvent, FileMovedEvent])
        except TypeError:  # a watchdog before event_filter: every event, filtered here
            observer.schedule(Handler(), self.store.receipts_dir, recursive=True)
        observer.start()
        try:
            self.rescan()
            next_rescan = time.monotonic() + self.rescan_interval
            while not stop.is_set():
                try:
                    path = self._events.get(timeout=tick)
                    self._consider(path)
                    while True:
                        self._consider(self._events.get_nowait())
                except queue.Empty:
                    pass
                if time.monotonic() >= next_rescan:
                    self.rescan()
                    next_rescan = time.monotonic() + self.rescan_interval
                self.check_due()
        finally:
            observer.stop()
            observer.join(timeout=5)

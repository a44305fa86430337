"""The receipt store on disk: sharded receipt files, per-key locks, the event ledger.

Layout under the store root::

    receipts/<h[:2]>/<h>.json     one receipt per key, h = sha256(key)
    locks/<h>.lock                the key's lock (an flock: receipts/flock.py)
    locks/ledger.lock             serialises ledger appends
    events.jsonl                  the hash-chained event ledger
    tmp/                          scratch (check worktrees, outputs)
    allowed_signers.json          a signed store's public keys (receipts/signing.py)
    policy.toml                   who may call what (receipts/policy.py)

Every write goes through :class:`cas.durable.DurableBatch`, and every write,
listing and read -- lock files (:meth:`ReceiptStore.file_lock`) and ``tmp/``
entries (:meth:`ReceiptStore.tmp_file`) too -- goes through folder descriptors
opened from the root with ``O_NOFOLLOW`` (:meth:`ReceiptStore.folder_fd`): a
store folder swapped for a symlink after a check is refused, never followed.  Reads verify
(:func:`receipts.receipt.parse_receipt`); a corrupt receipt raises, it is never
skipped or overwritten silently.  In a signed store every receipt written
is signed and every receipt read must carry a signature by an allowed key
(:mod:`receipts.signing`), else it is corrupt.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import filelock
import orjson

from cas.durable import DurableBatch, NotRegularFile, fsync_dir, make_dirs, open_dir_nofollow, open_regular, write_all
from cas.errors import SHOWN_PATH_CHARS, DurableWriteError, UnsafeWorktreePath, UsageError, clip
from receipts import jsonio
from receipts.environ import env_int
from receipts.errors import TRANSIENT_ERRNOS, AmbiguousCallId, CorruptReceipt, InProgress, ReadFailed
from receipts.flock import FolderLock, file_lock, held_elsewhere
from receipts.identity import key_hash
from receipts.ledger import Ledger
from receipts.receipt import DIGEST_FIELD, SIGNATURE_FIELD, Receipt, parse_receipt, receipt_doc_bytes
from receipts.signing import load_signing

__all__ = ["ReceiptStore", "StoredReceipt", "StoreFile", "DEFAULT_LOCK_TIMEOUT", "FILE_MISSING", "MAX_RECEIPT_BYTES",
           "TRANSIENT_ERRNOS"]

DEFAULT_LOCK_TIMEOUT = 30.0

#: The largest receipt file read.  A receipt holds one output (about 130 bytes and its path) and
#: one touched path per path of its patch; the smallest way to name a path in a patch
#: (``*** Delete File: p``) costs about 19 bytes, so a receipt is at most about 7 times its
#: patch (measured: 300 deletions, a 6,522-byte patch, a 40,163-byte receipt), and a patch at
#: most 64 MiB (ONCEPATCH_MAX_PATCH_BYTES).  Anything larger was not written by a call:
#: refused by its size (fstat), never read.
MAX_RECEIPT_BYTES = env_int("ONCEPATCH_MAX_RECEIPT_BYTES", 512 << 20)


#: The reason given for a key the ledger records a receipt of, whose receipt file is gone.
FILE_MISSING = "the ledger records this key's receipt, but its file is missing"


@dataclass(frozen=True, slots=True)
class StoredReceipt:
    """A receipt file found by a scan: either a verified receipt or the error that file gave."""

    path: str
    key_hash: str
    receipt: Receipt | None
    error: CorruptReceipt | None


class StoreFile:
    """A scratch file of the store (``tmp/<name>``: the markers of patcher/markers.py), opened by its
    name through a descriptor of its folder (:meth:`ReceiptStore.folder_fd`), never following a symlink.

    Implements :class:`cas.index_lock.LockMarker`.  A ``tmp/`` swapped for a
    symlink is refused (:class:`CorruptReceipt`): nothing is written, read or
    removed where it points.
    """

    __slots__ = ("_store", "folder", "name", "path")

    def __init__(self, store: ReceiptStore, folder: str, name: str) -> None:
        self._store = store
        self.folder = folder
        self.name = name
        self.path = os.path.join(folder, name)

    def write(self, data: bytes) -> None:
        """Create or replace the file with ``data`` (not synced: it proves a live process's lock).

        Raises:
            CorruptReceipt: a folder on the way, or the file, is a symlink (nothing is written through it).
            OSError: it cannot be written.
        """
        with self._store.folder_fd(self.folder, create=True) as dfd:
            try:
                fd = os.open(self.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, 0o644, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise CorruptReceipt(self.path, "a symlink, not a scratch file of the store") from None
                raise
            try:
                write_all(fd, data)
            finally:
                os.close(fd)

    def read(self) -> bytes:
        """Its bytes.

        Raises:
            FileNotFoundError: it (or its folder) is gone.
            CorruptReceipt: a folder on the way is a symlink.
            OSError: it is no regular file, or cannot be read.
        """
        with self._store.folder_fd(self.folder) as dfd:
            with os.fdopen(open_regular(self.name, dir_fd=dfd), "rb") as fh:
                return fh.read()

    def stat(self) -> os.stat_result:
        """Its ``lstat``.

        Raises:
            FileNotFoundError: it (or its folder) is gone.
            CorruptReceipt: a folder on the way is a symlink.
        """
        with self._store.folder_fd(self.folder) as dfd:
            return os.stat(self.name, dir_fd=dfd, follow_symlinks=False)

    def remove(self) -> None:
        """Remove it; nothing if it (or its folder) is gone.

        Raises:
            CorruptReceipt: a folder on the way is a symlink (nothing is removed through it).
        """
        try:
            with self._store.folder_fd(self.folder) as dfd:
                os.unlink(self.name, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            pass


def read_receipt_file(path: str, *, dir_fd: int | None = None) -> bytes:
    """The bytes of the receipt file ``path``, which must be a regular file (:func:`cas.durable.open_regular`).

    ``dir_fd``: its folder, already open (the file is opened by its name in it).

    Raises:
        FileNotFoundError: there is none.
        CorruptReceipt: a symlink, a folder, a FIFO or anything else, larger than
            :data:`MAX_RECEIPT_BYTES` (refused unread), or unreadable.
        ReadFailed: a read error that may pass (:data:`TRANSIENT_ERRNOS`): retryable.
    """
    try:
        fd = open_regular(os.path.basename(path), dir_fd=dir_fd) if dir_fd is not None else open_regular(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise CorruptReceipt(path, "a symlink, not a receipt file") from None
        raise
    except NotRegularFile:
        raise CorruptReceipt(path, "not a regular file") from None
    except OSError as exc:
        if exc.errno in TRANSIENT_ERRNOS:
            raise ReadFailed(path, exc) from None
        reason = "a symlink, not a receipt file" if os.path.islink(path) else f"cannot be read ({exc.strerror})"
        raise CorruptReceipt(path, reason) from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_RECEIPT_BYTES:
            raise CorruptReceipt(path, f"{size} bytes, more than a receipt can hold ({MAX_RECEIPT_BYTES}): "
                                       "refused unread")
        data = os.read(fd, size + 1)  # one read, as a rule
        while len(data) > size and (more := os.read(fd, 1 << 20)):  # it grew meanwhile
            data += more
            if len(data) > MAX_RECEIPT_BYTES:
                raise CorruptReceipt(path, f"more than a receipt can hold ({MAX_RECEIPT_BYTES} bytes)")
        return data
    except OSError as exc:
        if exc.errno in TRANSIENT_ERRNOS:
            raise ReadFailed(path, exc) from None
        raise CorruptReceipt(path, f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def _claimed_key(data: bytes) -> str | None:
    """The key a corrupt receipt's text names, if it is JSON with a string ``key`` (for reports only)."""
    try:
        doc = jsonio.loads(data)
    except Exception:  # noqa: BLE001 - not JSON: no key to name
        return None
    key = doc.get("key") if isinstance(doc, dict) else None
    return key if isinstance(key, str) else None


def check_store_root(root: str) -> None:
    """Refuse a store whose folder is a file, lies under one, or is a dangling symlink (a usage error,
    before anything is read).

    A missing folder is made when first written to.
    """
    with contextlib.suppress(OSError):
        if stat.S_ISLNK(os.lstat(root).st_mode) and os.path.exists(root):
            # Followed, it would steer every receipt and lock into the folder it names.
            raise UsageError(f"cannot use the store '{root}': it is a symlink (name the folder itself)")
    path = root
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if os.path.islink(path):
                raise UsageError(f"cannot use the store '{root}': '{path}' is a symlink to nothing") from None
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent
            continue
        except OSError as exc:
            raise UsageError(f"cannot use the store '{clip(root, SHOWN_PATH_CHARS)}': {exc.strerror or exc}") from exc
        if not stat.S_ISDIR(st.st_mode):
            where = "is" if path == root else f"lies under '{path}', which is"
            raise UsageError(f"cannot use the store '{root}': it {where} not a folder")
        return


def _relative(path: str, root: str) -> str:
    """``os.path.relpath(path, root)``; for a plain path below ``root`` (the store's own), a slice of it.

    (A store call asks this about twenty times: ``relpath`` normalises both
    paths first, and cost more than the folder walks it leads to.)
    """
    if path == root:
        return "."
    if path.startswith(root) and path[len(root):len(root) + 1] == "/":
        rest = path[len(root) + 1:]
        if rest and rest[0] != "/" and "//" not in rest and not rest.endswith("/") and "/." not in "/" + rest:
            return rest  # no '', '.' or '..' component: what relpath would give
    return os.path.relpath(path, root)


def _refuse_steering(root: str, path: str, status: Any) -> None:
    """:meth:`ReceiptStore.check_folders`, by ``lstat`` of each folder from ``root`` to ``path``."""
    rel = _relative(path, root)
    here = root
    for part in [] if rel == "." else rel.split(os.sep):
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise CorruptReceipt(here, "a symlink, not a store folder", effect_status=status)
        if not stat.S_ISDIR(st.st_mode):
            if here != path:
                raise CorruptReceipt(here, "not a folder", effect_status=status)
            return  # the file itself (a receipt): its reader opens it without following


class ReceiptStore:
    """Receipts, locks and the ledger of one store folder.

    Cheap to construct; folders are created on first write.

    Raises:
        UsageError: the root is a file, lies under one, or is a symlink (:func:`check_store_root`).
        CorruptReceipt: ``receipts/``, ``locks/`` or ``tmp/`` is a symlink (:meth:`check_folders`).
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        check_store_root(self.root)
        self.receipts_dir = os.path.join(self.root, "receipts")
        self.locks_dir = os.path.join(self.root, "locks")
        self.tmp_dir = os.path.join(self.root, "tmp")
        #: ``None``: an unsigned store; else every receipt and event is signed and checked.
        self.signing = load_signing(self.root)
        self.ledger = Ledger(os.path.join(self.root, "events.jsonl"), os.path.join(self.locks_dir, "ledger.lock"),
                             signing=self.signing, lock_folder=self.locks_folder)
        for folder in (self.receipts_dir, self.locks_dir, self.tmp_dir):
            # Refused before anything is read or written (tmp/ too: check worktrees are made there).
            self.check_folders(folder, before_any_effect=True)
        self._written: dict[str, bytes] = {}  # path -> bytes of the prepared receipt this object wrote last
        self._scan_dir: tuple[str, int] | None = None  # the folder a scan reads, open while it reads there

    def __del__(self) -> None:
        self._forget_scan_dir()

    # -- paths -----------------------------------------------------------------

    def receipt_path(self, key: str) -> str:
        return self.path_for_hash(key_hash(key))

    def path_for_hash(self, h: str) -> str:
        return os.path.join(self.receipts_dir, h[:2], f"{h}.json")

    def lock_path(self, key: str) -> str:
        return os.path.join(self.locks_dir, f"{key_hash(key)}.lock")

    # -- folders ---------------------------------------------------------------

    def check_folders(self, path: str, *, before_any_effect: bool = False) -> None:
        """Refuse a store folder on the way from the root to ``path`` that is a symlink or no folder.

        A folder replaced by a symlink would steer writes and reads outside the
        store: evidence of a store changed by hand, never followed.  Missing
        folders are fine (made when first written to).  ``before_any_effect``:
        the caller has started nothing (the error says ``not_started``).

        Raises:
            CorruptReceipt: a folder on the way is a symlink or something else.
        """
        _refuse_steering(self.root, path, "not_started" if before_any_effect else None)

    def _ensure_dir(self, path: str, *, checked: bool = False) -> None:
        """Create ``path`` and its missing parents, syncing each parent that gained an entry.

        ``checked``: :meth:`check_folders` passed for ``path`` just before (the descriptors
        it is made through still refuse a symlink swapped in since).

        Raises:
            UsageError: a folder cannot be made there (no such place, no permission): nothing was written.
            CorruptReceipt: a store folder on the way is a symlink or no folder.
        """
        if not checked:
            self.check_folders(path)
        try:
            with self.folder_fd(path, create=True):
                pass
        except OSError as exc:
            # A folder that is there but cannot be entered (no search permission for this user) is no
            # folder to make: say which it is, and who was refused.
            there = os.path.isdir(path)
            raise UsageError(f"cannot use the store '{self.root}': cannot {'open the folder' if there else 'make'} "
                             f"'{path}': {exc.strerror or exc} (as uid {os.geteuid()})",
                             details={"path": path, "errno": exc.errno}) from exc

    @contextlib.contextmanager
    def folder_fd(self, folder: str, *, create: bool = False, gained: list[int] | None = None) -> Iterator[int]:
        """A descriptor of the store folder ``folder``, reached from the root without following a symlink.

        ``create``: missing folders are made (the root by its path, which is the
        person's: :func:`check_store_root`), their parents synced, or put in
        ``gained`` (:func:`cas.durable.open_dir_nofollow`).

        Raises:
            FileNotFoundError: it does not exist (without ``create``).
            NotADirectoryError: it is a file.
            CorruptReceipt: a folder on the way is a symlink or no folder.
            OSError: a folder cannot be made (no permission, ...).
        """
        with contextlib.ExitStack() as stack:
            try:
                if create:
                    for made in make_dirs(self.root):
                        fsync_dir(os.path.dirname(made))
                fd = stack.enter_context(open_dir_nofollow(self.root, _relative(folder, self.root),
                                                           create=create, mode=0o755, gained=gained))
            except UnsafeWorktreePath:
                _refuse_steering(self.root, folder, None)  # names the symlink, or the file, on the way
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), folder) from None
            yield fd

    def check_can_sign(self) -> None:
        """Refuse, before anything is written, a writer of a signed store that cannot sign.

        Raises:
            SigningKeyMissing: the store's active private key is not readable here.
        """
        if self.signing is not None:
            self.signing.ready()

    # -- locks -----------------------------------------------------------------

    def locks_folder(self) -> contextlib.AbstractContextManager[int]:
        """A descriptor of ``locks/`` (made if missing), reached from the root without following a symlink.

        Every lock file is opened by its name in it (why: :mod:`receipts.flock`).
        """
        return self.folder_fd(self.locks_dir, create=True)

    def file_lock(self, name: str) -> FolderLock:
        """An unheld lock on ``locks/<name>``, opened through :meth:`locks_folder`."""
        return file_lock(os.path.join(self.locks_dir, name), self.locks_folder)

    def key_lock(self, key: str) -> FolderLock:
        """An unheld lock on the key's ``locks/<h>.lock`` (:meth:`file_lock`)."""
        return self.file_lock(f"{key_hash(key)}.lock")

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = DEFAULT_LOCK_TIMEOUT) -> Iterator[None]:
        """Hold the key's lock (an flock on ``locks/<h>.lock``: :mod:`receipts.flock`) for the ``with`` block.

        Raises:
            InProgress: it is still held after ``timeout`` seconds.
            CorruptReceipt: a store folder on the way to the key's lock or
                receipt is a symlink (:meth:`check_folders`, and again through
                the descriptors the lock is opened by); nothing was started.
            CorruptLedger: the ledger's last line is torn and no append of ours
                (:meth:`Ledger.refuse_foreign_tail`); nothing was started.
        """
        self.check_folders(self.locks_dir, before_any_effect=True)
        self.check_folders(self.path_for_hash(key_hash(key)), before_any_effect=True)
        ledger_lock = self.ledger.lock_path
        if os.path.islink(ledger_lock):
            # The call would write its receipt, then fail to note it (O_NOFOLLOW): refuse first.
            raise CorruptReceipt(ledger_lock, "a symlink, not a lock file", effect_status="not_started", key=key)
        # The call's first write would chain onto (or cut) a ledger changed by hand: refuse first.
        self.ledger.refuse_foreign_tail(effect_status="not_started", key=key)
        lk = self.key_lock(key)
        try:
            self._ensure_dir(self.locks_dir, checked=True)  # (checked above)
            lk.acquire(timeout=timeout, poll_interval=0.01)
        except filelock.Timeout:
            raise InProgress(
                f"another call holds the lock of key '{key}' (waited {timeout:g}s)",
                key=key,
                details={"lock_path": self.lock_path(key)},
            ) from None
        except CorruptReceipt as exc:  # locks/ swapped for a symlink since the check: nothing was started
            raise CorruptReceipt(exc.path, exc.reason, effect_status="not_started", key=key) from None
        except OSError as exc:  # the lock file cannot be made (a store this process may not write, a symlink)
            raise UsageError(f"cannot use the store '{self.root}': cannot take the lock of key '{key}' "
                             f"('{self.lock_path(key)}': {exc.strerror or exc})", key=key) from exc
        try:
            yield
        finally:
            lk.release()

    def try_lock(self, key: str) -> FolderLock | None:
        """Take the key's lock without waiting; ``None`` if a live process holds it."""
        return self.try_lock_hash(key_hash(key))

    def try_lock_hash(self, h: str) -> FolderLock | None:
        """Take the lock of the key whose hash is ``h`` without waiting; ``None`` if a live process holds it."""
        self._ensure_dir(self.locks_dir)
        lk = self.file_lock(f"{h}.lock")
        try:
            lk.acquire(timeout=0)
        except filelock.Timeout:
            return None
        return lk

    def key_held_elsewhere(self, key: str) -> bool:
        """Whether another holder has the key's lock now (creates nothing: :func:`receipts.flock.held_elsewhere`).

        Raises:
            CorruptReceipt: ``locks/`` is a symlink.
        """
        try:
            with self.folder_fd(self.locks_dir) as dfd:
                return held_elsewhere(self.lock_path(key), dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            return False

    # -- tmp/ ------------------------------------------------------------------

    def tmp_file(self, name: str, folder: str | None = None) -> StoreFile:
        """The scratch file ``tmp/<name>`` (or ``<folder>/<name>``, a folder under ``tmp/``), opened through descriptors."""
        return StoreFile(self, folder or self.tmp_dir, name)

    def tmp_names(self, folder: str | None = None) -> list[str]:
        """The names in ``tmp/`` (or ``folder`` under it), sorted, listed through its descriptor; none if it is missing.

        Raises:
            CorruptReceipt: a folder on the way is a symlink.
        """
        try:
            with self.folder_fd(folder or self.tmp_dir) as dfd:
                return sorted(os.listdir(dfd))
        except (FileNotFoundError, NotADirectoryError):
            return []

    # -- receipts --------------------------------------------------------------

    def read(self, key: str, *, before_any_effect: bool = False) -> Receipt | None:
        """The verified receipt of ``key``, or ``None`` when there is none.

        ``before_any_effect``: the caller has started nothing yet (a refused
        store folder says ``not_started``: :meth:`check_folders`).

        Raises:
            CorruptReceipt: the file exists but fails verification, or a store
                folder on the way is a symlink.
            ReadFailed: a read error that may pass.
        """
        h = key_hash(key)
        try:
            path = self.path_for_hash(h)
            self.check_folders(path, before_any_effect=before_any_effect)
            return self._read_checked(h, path)
        except CorruptReceipt as exc:
            if exc.key is None:
                exc.key = key  # the caller's key: the envelope names it
            raise

    def read_hash(self, h: str) -> Receipt | None:
        path = self.path_for_hash(h)
        self.check_folders(path)
        return self._read_checked(h, path)

    def _read_checked(self, h: str, path: str) -> Receipt | None:
        """:meth:`read_hash` once :meth:`check_folders` passed for ``path``."""
        try:
            # Through descriptors reached without following a symlink: a folder swapped for
            # one after the check above is refused, not read through.
            with self.folder_fd(os.path.dirname(path)) as dfd:
                data = read_receipt_file(path, dir_fd=dfd)
        except FileNotFoundError:
            return None
        return self.parse(data, path, h)

    def parse(self, data: bytes, path: str, h: str) -> Receipt:
        """A receipt file's bytes, verified (:func:`parse_receipt`) and, in a signed store, its signature checked.

        Raises:
            CorruptReceipt: it fails either.
        """
        receipt = parse_receipt(data, path=path, expected_key_hash=h)
        if self.signing is not None:
            self.signing.check_receipt(receipt, path)
        return receipt

    def write(self, receipt: Receipt, *, before_replace: Callable[[], None] | None = None,
              batch: DurableBatch | None = None) -> str:
        """Write ``receipt`` durably; return its path (:meth:`record` without a ledger event)."""
        return self.record(receipt, None, before_replace=before_replace, batch=batch)

    def record(self, receipt: Receipt, event: str | None, *, before_replace: Callable[[], None] | None = None,
               batch: DurableBatch | None = None, **fields: Any) -> str:
        """Write ``receipt`` durably and append ``event`` (if any) for it to the ledger; return its path.

        ``batch``: files that become durable with it (the git objects it names),
        synced in the same rounds and renamed before it.  The append follows
        the receipt's rename and is synced in the batch's last round, with the
        receipt's folder.
        """
        path = self.path_for_hash(key_hash(receipt.key))
        self.check_folders(path)
        doc = receipt.to_doc()
        if self.signing is not None:
            doc[SIGNATURE_FIELD] = self.signing.sign_receipt(str(doc[DIGEST_FIELD]))
        data = receipt_doc_bytes(doc)
        batch = batch if batch is not None else DurableBatch()
        gained: list[int] = []  # folders that gained a new folder: synced in the batch's last round
        with contextlib.ExitStack() as stack:
            try:
                dfd = stack.enter_context(self.folder_fd(os.path.dirname(path), create=True, gained=gained))
            except OSError as exc:  # a shard that cannot be made: the write failed, nothing written
                raise DurableWriteError(os.path.dirname(path), exc) from exc
            batch.add_in_dir(dfd, os.path.basename(path), data, shown=path)

            def after_renames() -> list[str | int]:
                self._remember(path, receipt, data)
                if event is None:
                    return [*gained]
                # The digest just written (to_doc is the costly part of a write: canonical JSON and a hash).
                self.ledger.append_receipt_event(event, receipt, sync=False, digest=str(doc[DIGEST_FIELD]),
                                                 **fields)
                return [*gained, self.ledger.path]

            batch.commit(before_replace=before_replace, after_renames=after_renames)
        return path

    def _remember(self, path: str, receipt: Receipt, data: bytes) -> None:
        # Only a prepared receipt is fenced against; a final one is forgotten (bounded memory).
        if receipt.status == "prepared":
            self._written[path] = data
        else:
            self._written.pop(path, None)

    def unchanged_since_written(self, key: str) -> bool:
        """Whether ``key``'s receipt file still holds exactly the bytes this store object last wrote there.

        A cheap check for the fencing path: equal bytes are this process's own
        receipt, already verified when it was written; anything else must be
        read and verified.
        """
        path = self.path_for_hash(key_hash(key))
        mine = self._written.get(path)
        if mine is None:
            return False
        self._forget_scan_dir()  # the folder as it is now, not as a scan opened it
        try:
            return self._read_file(path) == mine
        except (FileNotFoundError, CorruptReceipt):
            return False

    def missing_files(self, keys_by_hash: Mapping[str, str], paths: list[str]) -> list[str]:
        """The keys of ``keys_by_hash`` (key hash -> key; the ledger's) with no receipt file, sorted.

        ``paths``: the receipt files listed (:meth:`receipt_paths`); a file that
        appeared since the listing counts as there.
        """
        present = {os.path.basename(p)[:-5] for p in paths}
        return sorted(k for h, k in keys_by_hash.items()
                      if h not in present and not os.path.exists(self.path_for_hash(h)))

    def receipt_paths(self) -> list[str]:
        """Every receipt file's path, in file order (shard, then name), unread (listed through descriptors).

        Raises:
            CorruptReceipt: the receipts folder or a shard is a symlink, or cannot be listed.
        """
        self._forget_scan_dir()
        try:
            with self.folder_fd(self.receipts_dir) as rfd:
                shards = sorted(name for name in os.listdir(rfd) if len(name) == 2)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CorruptReceipt(self.receipts_dir, f"the receipts folder cannot be listed ({exc.strerror})") from None
        out: list[str] = []
        for folder in [os.path.join(self.receipts_dir, shard) for shard in shards]:
            try:
                with self.folder_fd(folder) as sfd:  # a shard swapped for a symlink meanwhile: refused
                    out += [os.path.join(folder, name) for name in sorted(os.listdir(sfd))
                            if name.endswith(".json") and not name.startswith(".")]
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed since the listing, or a file: no receipts in it
        return out

    def files(self) -> Iterator[tuple[str, str, bytes | CorruptReceipt]]:
        """``(path, key hash, bytes)`` of every receipt file, unparsed (a scan's raw input).

        In place of the bytes, the error of a file that is not one a receipt
        can be read from (a symlink, a FIFO, a folder, one in another shard's folder).
        """
        for path in self.receipt_paths():
            data = self.read_raw(path)
            if data is not None:
                yield path, os.path.basename(path)[:-5], data
        self._forget_scan_dir()

    def read_raw(self, path: str) -> bytes | CorruptReceipt | None:
        """The bytes of the receipt file ``path`` of this store, unparsed (a scan's raw input).

        In place of the bytes, the error of a file a receipt cannot be read
        from (see :meth:`files`); ``None`` when there is none.
        """
        h = os.path.basename(path)[:-5]
        if os.path.basename(os.path.dirname(path)) != h[:2]:
            return CorruptReceipt(path, f"in the wrong folder (a receipt of key hash {h[:12]}… lives in '{h[:2]}')")
        try:
            return self._read_file(path)
        except FileNotFoundError:
            return None
        except CorruptReceipt as exc:
            return exc

    def _read_file(self, path: str) -> bytes:
        """:func:`read_receipt_file` through its folder's descriptor, kept open for the scan's next file there.

        Raises:
            as :func:`read_receipt_file`; CorruptReceipt: a folder on the way is a symlink.
        """
        folder = os.path.dirname(path)
        held = self._scan_dir
        if held is not None and held[0] == folder:
            try:
                return read_receipt_file(path, dir_fd=held[1])
            except FileNotFoundError:
                pass  # the folder may have been made anew since it was opened: look again
        self._forget_scan_dir()
        try:
            with self.folder_fd(folder) as fd:
                self._scan_dir = (folder, os.dup(fd))
                return read_receipt_file(path, dir_fd=fd)
        except NotADirectoryError as exc:
            raise CorruptReceipt(path, f"cannot be read ({exc.strerror})") from None

    def _names_call_id(self, path: str, call_id: str) -> bool:
        """Whether a (corrupt) receipt file says it is the receipt of ``call_id``."""
        try:
            doc = orjson.loads(self._read_file(path))
        except (OSError, CorruptReceipt, orjson.JSONDecodeError):
            return False
        return isinstance(doc, dict) and doc.get("call_id") == call_id

    def _forget_scan_dir(self) -> None:
        held = getattr(self, "_scan_dir", None)  # None too when __init__ refused the store
        if held is not None:
            self._scan_dir = None
            os.close(held[1])

    def parse_stored(self, path: str, h: str, data: bytes | CorruptReceipt) -> StoredReceipt:
        """The receipt file ``path`` (key hash ``h``) from its bytes, verified; a corrupt one with its error."""
        if isinstance(data, CorruptReceipt):
            return StoredReceipt(path, h, None, data)
        try:
            return StoredReceipt(path, h, self.parse(data, path, h), None)
        except CorruptReceipt as exc:
            if exc.key is None:
                exc.key = _claimed_key(data)
            return StoredReceipt(path, h, None, exc)

    def read_stored(self, path: str) -> StoredReceipt | None:
        """One receipt file by path (:meth:`parse_stored`); ``None`` if it is gone."""
        data = self.read_raw(path)
        return None if data is None else self.parse_stored(path, os.path.basename(path)[:-5], data)

    def scan(self) -> Iterator[StoredReceipt]:
        """Every receipt file in the store, verified; corrupt ones are yielded with their error."""
        for path, h, data in self.files():
            yield self.parse_stored(path, h, data)

    def find(self, key_or_call_id: str) -> Receipt | None:
        """Look up by key, else by call_id (a scan: call_ids are not indexed).

        Raises:
            CorruptReceipt: the key's receipt fails verification, or no valid
                receipt has this call_id and a corrupt file names it.
            AmbiguousCallId: several keys' receipts have this call_id.
        """
        found = self.read(key_or_call_id)
        if found is not None:
            return found
        matches: list[Receipt] = []
        corrupt: list[CorruptReceipt] = []
        for item in self.scan():
            if item.receipt is not None and item.receipt.call_id == key_or_call_id:
                matches.append(item.receipt)
            elif item.error is not None and self._names_call_id(item.path, key_or_call_id):
                corrupt.append(item.error)
        if len(matches) > 1:
            keys = sorted(r.key for r in matches)
            raise AmbiguousCallId(
                f"call_id '{key_or_call_id}' is the call of {len(keys)} keys ({', '.join(keys)}): name one key",
                details={"keys": keys},
            )
        if matches:
            return matches[0]
        if corrupt:
            raise corrupt[0]
        return None

"""Locks on files that stay in place: the key locks, the ledger lock, the worktree locks, the writer turn.

Every lock oncepatch takes on a file under ``<store>/locks/`` is a
:class:`FolderLock`: an exclusive ``flock`` on a descriptor of that file, as
filelock's Unix backend takes it (through filelock's public
:func:`filelock.lock_descriptor`, so it contends with a ``filelock.FileLock``
on the same file).  The kernel drops it when the holder dies, so a crashed
process never leaves a key locked.

filelock opens its lock file by path, and its API takes no folder
descriptor; this thin wrapper opens it itself, relative to a descriptor of
its folder (``os.open(name, ..., dir_fd=)``).  The store hands over a
descriptor of ``locks/`` reached from its root without following a symlink
(:meth:`receipts.store.ReceiptStore.folder_fd`); without one, the folder is
opened by its path with ``O_NOFOLLOW``.  So:

* a ``locks/`` folder swapped for a symlink after the store's ``lstat`` check
  is refused when its descriptor is opened: no lock file is ever created where
  it points;
* the lock file itself is opened with ``O_NOFOLLOW``: a symlink planted as a
  lock file is refused (``ELOOP``), never followed to lock or create its target;
* a process that locked an inode another removed meanwhile (recover removes a
  key's lock file, under the lock, once the key has no receipt) sees a link
  count of zero, or the name holding another inode, lets it go and locks the
  file the name holds now: else two processes could hold two inodes of one name;
* the file stays on release, so waiters share one inode; only recover removes
  lock files, under their lock;
* on a file system without flock, acquiring fails with its error: there is no
  fallback to a marker file, which a crashed holder would leave behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import filelock

from receipts.errors import CorruptReceipt, InProgress

__all__ = ["FolderLock", "FolderOpener", "file_lock", "flocked", "held_elsewhere"]

#: ``O_NOFOLLOW``: a symlink planted as a lock file is refused (``ELOOP``), never
#: followed to lock -- or, with ``O_CREAT``, create -- its target (as filelock's Unix backend).
#: ``O_NONBLOCK``: a FIFO planted there cannot hang the open.
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: Yields a descriptor of the lock file's folder (the caller's; closed when the context exits).
FolderOpener = Callable[[], AbstractContextManager[int]]


@contextlib.contextmanager
def _folder_by_path(folder: str) -> Iterator[int]:
    """The folder ``folder`` opened by its path, its last component not followed if a symlink."""
    fd = os.open(folder or ".", _DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


class FolderLock:
    """An unheld flock lock on the file ``path``, opened relative to its folder's descriptor.

    Calling sequence: :meth:`acquire`, then :meth:`release` (from any thread).
    Each object opens its own descriptor, so two objects in one process exclude
    each other as two processes do; one object acquired twice is released
    after its second :meth:`release`.
    """

    def __init__(self, path: str, folder: FolderOpener | None = None) -> None:
        #: The lock file's path, for messages; it is opened by its name in ``folder``.
        self.lock_file = path
        self._name = os.path.basename(path)
        self._folder: FolderOpener = folder if folder is not None else (
            lambda: _folder_by_path(os.path.dirname(path)))
        self._fd: int | None = None
        self._count = 0
        self._guard = threading.Lock()

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float = -1, poll_interval: float = 0.05) -> None:
        """Take the lock, polling every ``poll_interval`` s for up to ``timeout`` s (negative: no limit).

        Raises:
            filelock.Timeout: still held by another holder after ``timeout`` seconds.
            OSError: the folder or the file cannot be opened (``ELOOP``: one is a
                symlink; ``ENOTDIR``: the folder is a file), or cannot be locked.
        """
        with self._guard:
            if self._fd is not None:
                self._count += 1
                return
        deadline = time.monotonic() + timeout if timeout >= 0 else None
        with self._folder() as dfd:
            while True:
                fd = self._try_once(dfd)
                if fd is not None:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise filelock.Timeout(self.lock_file)
                time.sleep(poll_interval if deadline is None else
                           max(0.0, min(poll_interval, deadline - time.monotonic())))
        with self._guard:
            self._fd, self._count = fd, 1

    def _try_once(self, dfd: int) -> int | None:
        """A descriptor of the file now named ``name`` in ``dfd``, locked; ``None`` while another holds it."""
        fd = os.open(self._name, _LOCK_FLAGS, 0o666, dir_fd=dfd)
        try:
            if not filelock.lock_descriptor(fd, blocking=False):
                os.close(fd)
                return None
            # Race guarded: the holder we waited for removed the file (recover, under
            # the lock) and another process made and locked a new one under the name.
            st = os.fstat(fd)
            try:
                now = os.stat(self._name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if st.st_nlink == 0 or now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)  # drops the flock on the removed inode
                return self._try_once(dfd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self.lock_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return fd

    def release(self) -> None:
        """Let the lock go (the file stays); a no-op when not held."""
        with self._guard:
            fd = self._fd
            if fd is None:
                return
            self._count -= 1
            if self._count > 0:
                return
            self._fd = None
        try:
            filelock.unlock_descriptor(fd)
        finally:
            os.close(fd)  # closing drops the flock even if the unlock failed

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def file_lock(path: str, folder: FolderOpener | None = None) -> FolderLock:
    """An unheld flock lock on ``path`` (the file is created when first acquired).

    ``folder``: yields a descriptor of ``path``'s folder (the store's, reached
    without following a symlink); default: the folder opened by its path with
    ``O_NOFOLLOW``.
    """
    return FolderLock(path, folder)


@contextlib.contextmanager
def flocked(path: str, timeout: float, *, poll: float = 0.005, folder: FolderOpener | None = None) -> Iterator[None]:
    """Hold the lock on ``path`` (created if missing; ``folder`` as :func:`file_lock`).

    Raises:
        InProgress: still held by another holder after ``timeout`` seconds.
        CorruptReceipt: the lock file is a symlink (never followed), or ``folder``'s is.
        OSError: as :meth:`FolderLock.acquire`.
    """
    lock = file_lock(path, folder)
    try:
        lock.acquire(timeout=timeout, poll_interval=poll)
    except filelock.Timeout:
        raise InProgress(f"lock '{path}' is held by another process", details={"lock_path": path}) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptReceipt(path, "a symlink, not a lock file") from None
        raise
    try:
        yield
    finally:
        lock.release()


def held_elsewhere(path: str, *, dir_fd: int | None = None) -> bool:
    """Whether another holder has the lock on ``path`` now (creates nothing; a missing file is not held).

    ``dir_fd``: its folder, already open (the file is opened by its name in it).

    A shared, non-blocking flock probe: filelock has no probe that neither
    creates the file nor takes the lock (a momentary exclusive hold would
    make a rival's zero-timeout acquire fail).
    """
    try:
        fd = os.open(os.path.basename(path) if dir_fd is not None else path,
                     os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)

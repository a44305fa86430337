"""Locks on files that stay in place: the key locks, the ledger lock, the worktree locks.

Every lock oncepatch takes on a file under ``<store>/locks/`` is filelock's
``FileLock``, whose Unix backend is an exclusive ``flock`` on a descriptor of
that file.  The kernel drops it when the holder dies, so a crashed process
never leaves a key locked.  :func:`file_lock` sets the options every such
lock needs; filelock already does the rest:

* it opens the file with ``O_NOFOLLOW``: a symlink planted as a lock file is
  refused (``ELOOP``), never followed to lock or create its target;
* a process that locked an inode another removed meanwhile (recover removes a
  key's lock file, under the lock, once the key has no receipt) sees a link
  count of zero, lets it go and locks the file the name holds now: else two
  processes could hold two inodes of one name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator

import filelock

from receipts.errors import InProgress

__all__ = ["file_lock", "flocked", "held_elsewhere"]

#: ``O_NOFOLLOW``: a symlink planted as a lock file is refused (``ELOOP``), never
#: followed to lock -- or, with ``O_CREAT``, create -- its target (as filelock's Unix backend).
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def file_lock(path: str) -> filelock.FileLock:
    """An unheld flock lock on ``path`` (the file is created when first acquired).

    Each object opens its own descriptor, so two objects in one process
    exclude each other as two processes do.  ``fallback_to_soft=False``: on a
    file system without flock, acquiring fails rather than falling back to a
    marker file, which a crashed holder would leave behind.
    ``preserve_lock_file=True``: the file stays on release, so waiters share
    one inode; only recover removes lock files, under their lock.
    ``thread_local=False``: the holder may release from another thread.
    """
    return filelock.FileLock(path, thread_local=False, fallback_to_soft=False, preserve_lock_file=True)


@contextlib.contextmanager
def flocked(path: str, timeout: float, *, poll: float = 0.005) -> Iterator[None]:
    """Hold the lock on ``path`` (created if missing).

    Raises:
        InProgress: still held by another holder after ``timeout`` seconds.
    """
    lock = file_lock(path)
    try:
        lock.acquire(timeout=timeout, poll_interval=poll)
    except filelock.Timeout:
        raise InProgress(f"lock '{path}' is held by another process", details={"lock_path": path}) from None
    try:
        yield
    finally:
        lock.release()


def held_elsewhere(path: str) -> bool:
    """Whether another holder has the lock on ``path`` now (creates nothing; a missing file is not held).

    A shared, non-blocking flock probe: filelock has no probe that neither
    creates the file nor takes the lock (a momentary exclusive hold would
    make a rival's zero-timeout acquire fail).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
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

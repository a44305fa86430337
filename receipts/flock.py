"""flock(2) locks on files that stay in place: the key locks, the ledger lock, the worktree locks.

Every lock oncepatch takes on a file under ``<store>/locks/`` is an exclusive
``flock`` on an open descriptor of that file, as filelock's Unix backend
takes it (filelock's ``FileLock`` and this one exclude each other, which the
tests use).  The kernel drops it when the holder dies, so a crashed process
never leaves a key locked.  It is implemented here rather than imported:
importing filelock 4 costs a cold ``oncepatch apply`` about 18 ms (it brings
``logging``, ``typing``, ``inspect``), and the lock is a dozen lines.  Lock
files are removed only under their lock, and a process that locked a file
another removed meanwhile (its descriptor's inode is no longer the name's)
lets it go and locks the file the name holds now: else two processes could
hold two inodes of one name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator

from receipts.errors import InProgress

__all__ = ["FileLock", "flocked", "held_elsewhere"]

#: ``O_NOFOLLOW``: a symlink planted as a lock file is refused (``ELOOP``), never
#: followed to lock -- or, with ``O_CREAT``, create -- its target (as filelock's Unix backend).
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class FileLock:
    """An exclusive flock on ``path`` (created if missing); see the module docstring.

    Not reentrant: each :meth:`acquire` opens its own descriptor, so two
    holders in one process exclude each other as two processes do.
    """

    __slots__ = ("path", "_fd")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float, *, poll: float = 0.002) -> bool:
        """Take the lock, waiting up to ``timeout`` seconds; ``False`` when it stayed held."""
        if self._fd is not None:
            raise RuntimeError(f"lock '{self.path}' is already held by this object")
        fd = os.open(self.path, _LOCK_FLAGS, 0o644)
        deadline = time.monotonic() + timeout
        delay = poll
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.05)
                continue
            # The file may have been removed while we waited (recover removes a key's lock
            # file, under the lock, once the key has no receipt): a lock on the removed inode
            # excludes no one who opens the name now.  Lock the file the name holds now.
            st = os.fstat(fd)
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                fd = os.open(self.path, _LOCK_FLAGS, 0o644)
                continue
            self._fd = fd
            return True

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops it); nothing when not held."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


@contextlib.contextmanager
def flocked(path: str, timeout: float, *, poll: float = 0.002) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing).

    Raises:
        InProgress: still held by another process after ``timeout`` seconds.
    """
    lock = FileLock(path)
    if not lock.acquire(timeout, poll=poll):
        raise InProgress(f"lock '{path}' is held by another process", details={"lock_path": path})
    try:
        yield
    finally:
        lock.release()


def held_elsewhere(path: str) -> bool:
    """Whether another holder has the lock on ``path`` now (creates nothing; a missing file is not held)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
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

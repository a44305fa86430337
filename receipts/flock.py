"""A minimal flock(2) lock for the ledger's append path (stdlib only).

The key locks use ``filelock`` (the project's lock library); the ledger lock
is taken on every replay, whose start-up must stay lean, so it is a plain
``fcntl.flock`` on its own file.  Like filelock's Unix backend it is an flock:
the kernel drops it when the holder dies, so a crashed appender never leaves
the ledger locked.  The lock file is never deleted (deleting an flock file
lets two processes lock two different inodes of one name).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from receipts.errors import InProgress

__all__ = ["flocked"]


@contextlib.contextmanager
def flocked(path: str, timeout: float, *, poll: float = 0.002) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing).

    Raises:
        InProgress: still held by another process after ``timeout`` seconds.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        deadline = time.monotonic() + timeout
        delay = poll
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise InProgress(f"lock '{path}' is held by another process", details={"lock_path": path}) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)

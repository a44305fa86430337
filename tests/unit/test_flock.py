"""receipts/flock.py: our flock locks and filelock's exclude each other, across processes and within one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from receipts.errors import InProgress
from receipts.flock import FileLock, flocked

HOLD_WITH_FILELOCK = (
    "import sys, filelock\n"
    "lk = filelock.FileLock(sys.argv[1], thread_local=False)\n"
    "lk.acquire()\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)
TRY_WITH_FILELOCK = (
    "import sys, filelock\n"
    "lk = filelock.FileLock(sys.argv[1], thread_local=False)\n"
    "try:\n"
    "    lk.acquire(timeout=0)\n"
    "except filelock.Timeout:\n"
    "    print('held')\n"
    "else:\n"
    "    print('free')\n"
)


def test_acquire_release_and_a_second_holder_in_one_process(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    a, b = FileLock(path), FileLock(path)
    assert a.acquire(0) and a.is_locked
    t0 = time.monotonic()
    assert not b.acquire(0.2)  # each acquire has its own descriptor: excluded like another process
    assert 0.15 <= time.monotonic() - t0 < 2
    a.release()
    assert not a.is_locked
    assert b.acquire(0)
    b.release()
    assert os.path.exists(path)  # the lock file stays
    with pytest.raises(RuntimeError):
        a.acquire(0)
        a.acquire(0)
    a.release()


def test_filelock_holder_excludes_us_and_we_exclude_filelock(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    p = subprocess.Popen([sys.executable, "-c", HOLD_WITH_FILELOCK, path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"locked\n"
        assert not FileLock(path).acquire(0.1)
        with pytest.raises(InProgress):
            with flocked(path, 0.1):
                pass
    finally:
        p.kill()
        p.wait(timeout=10)
    ours = FileLock(path)
    assert ours.acquire(2)  # the kernel dropped the dead holder's lock
    try:
        out = subprocess.run([sys.executable, "-c", TRY_WITH_FILELOCK, path], capture_output=True, check=True)
        assert out.stdout == b"held\n"
    finally:
        ours.release()
    out = subprocess.run([sys.executable, "-c", TRY_WITH_FILELOCK, path], capture_output=True, check=True)
    assert out.stdout == b"free\n"


def test_waits_for_a_release(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    holder = FileLock(path)
    assert holder.acquire(0)
    import threading

    threading.Timer(0.2, holder.release).start()
    waiter = FileLock(path)
    t0 = time.monotonic()
    assert waiter.acquire(5)
    assert 0.1 <= time.monotonic() - t0 < 3
    waiter.release()


def test_a_waiter_that_locked_a_removed_file_takes_the_file_there_now(tmp_path: Path) -> None:
    """H holds the lock and removes its file (recover does, under the lock); W, waiting meanwhile on
    the old inode, must not end up holding that one while X locks a new file of the same name."""
    import threading

    path = str(tmp_path / "k.lock")
    holder = FileLock(path)
    assert holder.acquire(0)
    waiter = FileLock(path)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(waiter.acquire(5, poll=0.01)))
    t.start()
    time.sleep(0.1)  # W has opened the file and is polling
    os.unlink(path)
    holder.release()
    t.join()
    assert got == [True]
    third = FileLock(path)
    assert not third.acquire(0.2)  # W holds the file the name holds now
    waiter.release()
    assert third.acquire(0)
    third.release()

"""receipts/flock.py: the store's locks as filelock takes them, across processes and within one."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import filelock
import pytest

from receipts.errors import CorruptReceipt, InProgress
from receipts.flock import file_lock, flocked, held_elsewhere

HOLD = (
    "import sys\n"
    "from receipts.flock import file_lock\n"
    "lk = file_lock(sys.argv[1])\n"
    "lk.acquire(timeout=0)\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_two_holders_in_one_process_exclude_each_other(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    a, b = file_lock(path), file_lock(path)
    a.acquire(timeout=0)
    assert a.is_locked and held_elsewhere(path)
    t0 = time.monotonic()
    with pytest.raises(filelock.Timeout):
        b.acquire(timeout=0.2, poll_interval=0.01)  # its own descriptor: excluded like another process
    assert 0.15 <= time.monotonic() - t0 < 2
    a.release()
    assert not a.is_locked and not held_elsewhere(path)
    b.acquire(timeout=0)
    b.release()
    assert os.path.exists(path)  # the lock file stays: waiters share one inode


def test_a_killed_holder_leaves_no_lock(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    p = subprocess.Popen([sys.executable, "-c", HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"locked\n"
        assert held_elsewhere(path)
        with pytest.raises(InProgress) as exc:
            with flocked(path, 0.1):
                pass
        assert exc.value.details["lock_path"] == path
    finally:
        p.kill()
        p.wait(timeout=10)
    assert not held_elsewhere(path)  # the kernel dropped the dead holder's lock
    with flocked(path, 2):
        assert held_elsewhere(path)


def test_waits_for_a_release_from_another_thread(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    holder = file_lock(path)
    holder.acquire(timeout=0)
    threading.Timer(0.2, holder.release).start()
    waiter = file_lock(path)
    t0 = time.monotonic()
    waiter.acquire(timeout=5, poll_interval=0.01)
    assert 0.1 <= time.monotonic() - t0 < 3
    waiter.release()


def test_a_waiter_that_locked_a_removed_file_takes_the_file_there_now(tmp_path: Path) -> None:
    """H holds the lock and removes its file (recover does, under the lock); W, waiting meanwhile on
    the old inode, must not end up holding that one while X locks a new file of the same name."""
    path = str(tmp_path / "k.lock")
    holder = file_lock(path)
    holder.acquire(timeout=0)
    waiter = file_lock(path)
    t = threading.Thread(target=lambda: waiter.acquire(timeout=5, poll_interval=0.01))
    t.start()
    time.sleep(0.1)  # W has opened the file and is polling
    os.unlink(path)
    holder.release()
    t.join()
    assert waiter.is_locked
    third = file_lock(path)
    with pytest.raises(filelock.Timeout):
        third.acquire(timeout=0.2, poll_interval=0.01)  # W holds the file the name holds now
    waiter.release()
    third.acquire(timeout=0)
    third.release()


def test_a_symlinked_lock_file_is_refused_and_its_target_not_made(tmp_path: Path) -> None:
    path, target = tmp_path / "k.lock", tmp_path / "elsewhere"
    path.symlink_to(target)
    with pytest.raises(OSError) as exc:
        file_lock(str(path)).acquire(timeout=0)
    assert exc.value.errno == errno.ELOOP
    assert not target.exists()
    with pytest.raises(CorruptReceipt) as refused:  # flocked names it: a symlink, not a lock file
        with flocked(str(path), 0):
            pass
    assert "symlink" in refused.value.reason and not target.exists()
    assert not held_elsewhere(str(path))


def test_a_lock_file_is_opened_in_its_folder_never_through_a_symlinked_one(tmp_path: Path) -> None:
    """The folder is opened first (O_NOFOLLOW|O_DIRECTORY), the file by its name in it: a folder that is a
    symlink gets no lock file where it points."""
    outside = tmp_path / "outside"
    outside.mkdir()
    locks = tmp_path / "locks"
    locks.symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError) as exc:
        file_lock(str(locks / "k.lock")).acquire(timeout=0)
    assert exc.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert list(outside.iterdir()) == []


def test_a_lock_through_a_given_folder_descriptor_uses_that_folder(tmp_path: Path) -> None:
    """The store hands over its descriptor of locks/: the file is made there, whatever the path says now."""
    real = tmp_path / "real"
    real.mkdir()
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    try:
        shown = tmp_path / "renamed-meanwhile" / "k.lock"
        lock = file_lock(str(shown), lambda: contextlib.nullcontext(fd))
        lock.acquire(timeout=0)
        assert lock.is_locked and lock.lock_file == str(shown)
        assert held_elsewhere(str(shown), dir_fd=fd)
        other = file_lock(str(real / "k.lock"))
        with pytest.raises(filelock.Timeout):
            other.acquire(timeout=0)  # the same file, by its path: excluded
        with pytest.raises(filelock.Timeout):
            filelock.FileLock(str(real / "k.lock")).acquire(timeout=0)  # and filelock's own lock contends with it
        lock.release()
        assert os.path.exists(real / "k.lock") and not shown.parent.exists()
    finally:
        os.close(fd)


def test_held_elsewhere_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "k.lock"
    assert not held_elsewhere(str(path))
    assert not path.exists()

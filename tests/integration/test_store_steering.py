"""The store cannot be steered (issue 25, docs/SECURITY.md).

* a store folder (the root, ``receipts/``, a shard, ``locks/``) that is a
  symlink is refused, never followed: nothing is written where it points;
* a key lock file that is a symlink is refused (``O_NOFOLLOW``): its target
  is never created;
* a receipt larger than any call writes is refused by its size, unread;
* a held ledger lock never makes a replay wait: it replays at once, with a warning;
* a transient read error is a retryable ``io_error`` (exit 5), not ``corrupt_receipt``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot

import receipts.store
from receipts.errors import CorruptReceipt, ReadFailed
from receipts.store import ReceiptStore

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+once\n"


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _apply(repo: Repo, key: str, *extra: str, patch: bytes = PATCH) -> Any:
    return run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", key, *extra, input=patch)


def _outside_unchanged(outside: Path) -> list[str]:
    return sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*"))


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return make_repo(tmp_path / "repo", {"README": "hello\n"})


@pytest.mark.parametrize("folder", ["receipts", "shard", "locks", "tmp"])
def test_a_symlinked_store_folder_is_refused_not_followed(repo: Repo, tmp_path: Path, folder: str) -> None:
    first = _apply(repo, "first", patch=b"--- /dev/null\n+++ b/other\n@@ -0,0 +1 @@\n+x\n")
    assert first.code == 0, first.err
    outside = tmp_path / "outside"
    outside.mkdir()
    target = {"receipts": repo.store / "receipts", "locks": repo.store / "locks", "tmp": repo.store / "tmp",
              "shard": repo.store / "receipts" / h("k")[:2]}[folder]
    if target.exists():
        for p in sorted(target.rglob("*"), reverse=True):
            (p.rmdir if p.is_dir() else p.unlink)()
        target.rmdir()
    target.symlink_to(outside, target_is_directory=True)
    before = snapshot(repo)
    r = _apply(repo, "k")
    assert r.code in (2, 6), r.out + r.err
    assert "symlink" in r.json["error"]["message"] and r.json["error"]["effect_status"] == "not_started"
    assert _outside_unchanged(outside) == []  # nothing written where it points
    assert snapshot(repo) == before
    if folder not in ("locks", "tmp"):
        v = run_cli("verify", "--repo", str(repo.path), "--json")
        assert v.code == 6 and "symlink" in v.out, v.out + v.err


def test_a_symlinked_store_root_is_a_usage_error(repo: Repo, tmp_path: Path) -> None:
    real = tmp_path / "real-store"
    real.mkdir()
    link = tmp_path / "store-link"
    link.symlink_to(real, target_is_directory=True)
    before = snapshot(repo)
    r = _apply(repo, "k", "--store", str(link))
    assert r.code == 2 and "symlink" in r.json["error"]["message"], r.out + r.err
    assert list(real.iterdir()) == [] and snapshot(repo) == before


def test_a_symlinked_key_lock_file_is_refused_and_its_target_never_created(repo: Repo, tmp_path: Path) -> None:
    locks = repo.store / "locks"
    locks.mkdir(parents=True)
    target = tmp_path / "created-by-the-lock"
    (locks / f"{h('k')}.lock").symlink_to(target)
    before = snapshot(repo)
    r = _apply(repo, "k")
    assert r.code != 0 and r.json["error"]["effect_status"] == "not_started", r.out + r.err
    assert not target.exists() and snapshot(repo) == before


def test_an_oversized_receipt_is_refused_unread(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _apply(repo, "k").code == 0
    path = ReceiptStore(str(repo.store)).receipt_path("k")
    with open(path, "r+b") as fh:
        fh.truncate(3 << 30)  # a 3 GiB sparse file
    reads: list[int] = []
    real_read = os.read

    def counting_read(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(receipts.store.os, "read", counting_read)
    with pytest.raises(CorruptReceipt) as exc:
        ReceiptStore(str(repo.store)).read("k")
    assert "refused unread" in exc.value.reason and reads == []
    monkeypatch.undo()
    r = _apply(repo, "k")
    assert r.code == 6 and r.json["error"]["type"] == "corrupt_receipt", r.out + r.err


def test_a_held_ledger_lock_never_makes_a_replay_wait(repo: Repo) -> None:
    first = _apply(repo, "k")
    assert first.code == 0
    lock = repo.store / "locks" / "ledger.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        again = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", input=PATCH,
                        timeout=20)
        took = time.monotonic() - start
    finally:
        os.close(fd)
    assert again.code == 0, again.out + again.err
    assert again.json["replayed"] is True and again.json["commit"] == first.json["commit"]
    assert any("lock is held" in w for w in again.json["warnings"])
    assert took < 15  # the ledger lock's timeout is 30 s: no wait on it


@pytest.mark.parametrize("code", [errno.EIO, errno.EINTR, errno.ENOMEM, errno.EAGAIN])
def test_a_transient_read_error_is_retryable_not_corrupt(repo: Repo, monkeypatch: pytest.MonkeyPatch,
                                                         code: int) -> None:
    assert _apply(repo, "k").code == 0
    store = ReceiptStore(str(repo.store))
    real_read = os.read

    def failing_read(fd: int, n: int) -> bytes:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(receipts.store.os, "read", failing_read)
    with pytest.raises(ReadFailed) as exc:
        store.read("k")
    err = exc.value
    assert (err.type, err.exit_code, err.retryable, err.next_action) == ("io_error", 5, True, "retry")
    assert err.effect_status == "unknown"
    monkeypatch.setattr(receipts.store.os, "read", real_read)
    assert store.read("k") is not None  # it passed: the receipt is fine


def test_a_transient_read_error_through_the_api_is_io_error(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    import patcher
    from cas.errors import OncepatchError

    first = patcher.apply(str(repo.path), PATCH, key="k")
    before = snapshot(repo)

    real_read = os.read

    def failing_read(fd: int, n: int) -> bytes:
        # (os is one module: git's small files are read with os.read too; only the receipts fail)
        if "/receipts/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        return real_read(fd, n)

    monkeypatch.setattr(receipts.store.os, "read", failing_read)
    with pytest.raises(OncepatchError) as exc:
        patcher.apply(str(repo.path), PATCH, key="k")
    assert exc.value.type == "io_error" and exc.value.retryable is True
    monkeypatch.undo()
    assert snapshot(repo) == before
    again = patcher.apply(str(repo.path), PATCH, key="k")
    assert again.replayed and again.commit == first.commit


def test_a_symlinked_ledger_lock_is_refused_before_anything_is_written(repo: Repo, tmp_path: Path) -> None:
    locks = repo.store / "locks"
    locks.mkdir(parents=True)
    target = tmp_path / "created-by-the-ledger-lock"
    (locks / "ledger.lock").symlink_to(target)
    before = snapshot(repo)
    r = _apply(repo, "k")
    assert r.code == 6, r.out + r.err
    err = r.json["error"]
    assert (err["type"], err["effect_status"]) == ("corrupt_receipt", "not_started") and "symlink" in err["message"]
    assert not target.exists() and snapshot(repo) == before


def test_a_shard_swapped_for_a_symlink_after_the_check_is_not_read_through(
        repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read goes through folder descriptors opened with O_NOFOLLOW: the lstat check is not the only guard."""
    assert _apply(repo, "k").code == 0
    store = ReceiptStore(str(repo.store))
    shard = Path(store.receipt_path("k")).parent
    outside = tmp_path / "outside"
    shard.rename(outside)
    shard.symlink_to(outside, target_is_directory=True)
    monkeypatch.setattr(ReceiptStore, "check_folders", lambda self, path, **kw: None)  # the swap came after it
    with pytest.raises(CorruptReceipt) as exc:
        store.read("k")
    assert "symlink" in exc.value.reason

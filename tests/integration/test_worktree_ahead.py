"""The worktree written ahead of the branch's move, put back when the move does not happen.

The apply protocol writes the touched files of a checked-out branch before
the branch moves (docs/DESIGN.md section 4).  A call refused after that
write, before the move, must leave the repository as it found it: refs,
index and worktree byte for byte (bytes and modes, the deleted file and the
renamed one back, the added one and the folders made for it gone), and an
envelope saying nothing was applied.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

import cas.durable
import patcher.execute
from cas.errors import OncepatchError
from conftest import Repo, make_repo, snapshot
from patcher.protocol import apply

KEY = "ahead-1"


def _repo(tmp_path: Path) -> tuple[Repo, bytes]:
    """A repository whose patch adds (in a new folder), modifies an executable, deletes and renames."""
    repo = make_repo(tmp_path / "repo", {"src/util.py": "def f():\n    return 1\n", "docs/guide.txt": "guide\n",
                                         "other.txt": "x\n"})
    repo.write("bin/run.sh", "#!/bin/sh\necho run\n", mode=0o755)
    base = repo.commit_all("exec")
    repo.write("pkg/new/added.txt", "brand new\n")
    repo.write("bin/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    repo.git("rm", "-q", "docs/guide.txt")
    repo.git("mv", "src/util.py", "src/helpers.py")
    repo.git("add", "-A")
    patch = repo.git("diff", "--cached", "--full-index", "-M").encode()
    repo.git("reset", "-q", "--hard", base)
    assert repo.git("status", "--porcelain") == ""
    return repo, patch


class _FailingWrites:
    """``os`` as :mod:`cas.durable` sees it: once armed, its next ``write`` fails with ENOSPC (once)."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: Any) -> int:
        if self.armed and not self.fired:
            self.fired += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)


def _arm_at(monkeypatch: pytest.MonkeyPatch, point: str, arm: Any) -> None:
    real = patcher.execute.crash_point

    def at(name: str) -> None:
        if name == point:
            arm()
        real(name)

    monkeypatch.setattr(patcher.execute, "crash_point", at)


def test_a_file_that_cannot_be_written_ahead_puts_everything_back(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    repo, patch = _repo(tmp_path)
    before = snapshot(repo)
    faulty = _FailingWrites()
    monkeypatch.setattr(cas.durable, "os", faulty)

    def arm() -> None:
        faulty.armed = True

    # Armed once the index is staged: the deletions have been made by then, the
    # new folders created, and the batch of new files fails on its first write.
    _arm_at(monkeypatch, "after-index-ahead", arm)
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), patch, key=KEY)
    assert faulty.fired == 1
    err = info.value.envelope()
    assert (err["effect_status"], err["retryable"], err["next_action"]) == ("not_applied", True, "retry"), err
    after = snapshot(repo)
    assert {k: v for k, v in after.items() if k != "store"} == {k: v for k, v in before.items() if k != "store"}
    assert (repo.path / "bin/run.sh").stat().st_mode & 0o777 == 0o755
    assert not (repo.path / "pkg").exists() and (repo.path / "docs/guide.txt").read_text() == "guide\n"
    assert not (repo.path / ".git/index.lock").exists()
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))

    monkeypatch.setattr(cas.durable, "os", os)
    done = apply(str(repo.path), patch, key=KEY)  # the retry lands it once
    assert done.status == "committed" and repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert (repo.path / "src/helpers.py").exists() and not (repo.path / "src/util.py").exists()


def test_a_move_that_fails_before_the_rename_puts_everything_back(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The ref write fails after files and index were written ahead (libgit2 before its rename)."""
    from cas.errors import GitStoreError
    from cas.objects import GitStore

    repo, patch = _repo(tmp_path)
    before = snapshot(repo)
    swap = GitStore.compare_and_swap
    written: list[bool] = []

    def failing(self: GitStore, *args: Any, **kw: Any) -> None:
        precondition = kw["precondition"]

        def then_fail() -> None:
            precondition()  # the fence, the index, the files
            written.append((repo.path / "pkg/new/added.txt").exists())
            raise GitStoreError("cannot update ref 'refs/heads/main': No space left on device")

        kw["precondition"] = then_fail
        swap(self, *args, **kw)

    monkeypatch.setattr(GitStore, "compare_and_swap", failing)
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), patch, key=KEY)
    assert written == [True]  # the worktree was ahead when the move failed
    err = info.value.envelope()
    assert err["effect_status"] == "not_applied", err
    after = snapshot(repo)
    assert {k: v for k, v in after.items() if k != "store"} == {k: v for k, v in before.items() if k != "store"}

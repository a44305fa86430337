"""The branch lock's content is written and synced with the prepared receipt; unused, it is removed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cas.errors import RefLockedError
from cas.objects import GitStore
from conftest import make_repo, run_cli
from patcher.protocol import apply

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"


def _leftovers(git_dir: Path) -> list[str]:
    return sorted(p.name for p in git_dir.iterdir() if p.name.startswith(".ref"))


def test_a_move_to_a_restaged_candidate_takes_its_lock_as_before(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n", "other.txt": "x\n"})
    repo.git("branch", "side")
    repo.git("checkout", "-q", "-b", "elsewhere")
    repo.write("other.txt", "y\n")
    moved = repo.commit_all("moves side meanwhile")
    repo.git("checkout", "-q", "main")
    real = GitStore.stage_ref_content
    staged: list[str] = []

    def stage_then_move(self: GitStore, ref: str, new: str, batch: Any) -> None:
        real(self, ref, new, batch)
        staged.append(new)
        repo.git("update-ref", "refs/heads/side", moved)  # another writer lands first

    monkeypatch.setattr(GitStore, "stage_ref_content", stage_then_move)
    res = apply(str(repo.path), PATCH, branch="side", key="k1")
    assert res.status == "committed" and res.commit is not None
    assert res.commit != staged[0]  # re-staged onto the moved branch
    assert repo.git("rev-parse", f"{res.commit}~1").strip() == moved
    assert repo.git("show", "side:README") == "hello there\n" and repo.git("show", "side:other.txt") == "y\n"
    assert _leftovers(repo.path / ".git") == []
    repo.git("fsck", "--strict", "--no-dangling")


def test_a_held_branch_lock_leaves_no_content_file_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo")
    repo.git("branch", "side")
    lock = repo.path / ".git" / "refs" / "heads" / "side.lock"
    real = GitStore.stage_ref_content

    def stage_then_lock(self: GitStore, ref: str, new: str, batch: Any) -> None:
        real(self, ref, new, batch)
        lock.write_bytes(b"")  # a git holding the branch's lock

    monkeypatch.setattr(GitStore, "stage_ref_content", stage_then_lock)
    before = repo.git("rev-parse", "side")
    with pytest.raises(RefLockedError):
        apply(str(repo.path), PATCH, branch="side", key="k1")
    assert repo.git("rev-parse", "side") == before
    assert lock.read_bytes() == b""  # theirs, left alone
    assert _leftovers(repo.path / ".git") == []


def test_long_lived_calls_leave_no_content_files(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    repo.git("branch", "side")
    stores: dict[str, Any] = {}
    for i in range(5):
        patch = f"--- /dev/null\n+++ b/f{i}.txt\n@@ -0,0 +1 @@\n+{i}\n".encode()
        for branch in ("side", "main"):
            assert apply(str(repo.path), patch, branch=branch, key=f"{branch}{i}", _stores=stores).status == "committed"
    assert _leftovers(repo.path / ".git") == []
    assert repo.git("status", "--porcelain") == ""


def test_a_call_fenced_off_after_prepare_leaves_no_content_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from receipts.engine import Call
    from receipts.errors import FencedOff

    repo = make_repo(tmp_path / "repo")
    repo.git("branch", "side")
    real = GitStore.stage_ref_content
    staged: list[str] = []

    def stage(self: GitStore, ref: str, new: str, batch: Any) -> None:
        real(self, ref, new, batch)
        staged.append(new)

    def fence(*_args: Any) -> None:
        if staged:
            raise FencedOff("another attempt owns the key")

    monkeypatch.setattr(GitStore, "stage_ref_content", stage)
    monkeypatch.setattr(Call, "fence", fence)
    before = repo.git("rev-parse", "side")
    with pytest.raises(FencedOff):
        apply(str(repo.path), PATCH, branch="side", key="k1")
    assert staged and repo.git("rev-parse", "side") == before
    assert _leftovers(repo.path / ".git") == []


def test_a_crash_after_prepare_leaves_the_content_file_to_recover(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    repo.git("branch", "side")
    patch = tmp_path / "p.diff"
    patch.write_bytes(PATCH)
    crashed = run_cli("apply", str(patch), "--branch", "side", "--key", "k", cwd=repo.path,
                      env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    assert crashed.code == 137
    left = _leftovers(repo.path / ".git")
    assert len(left) == 1  # synced with the prepared receipt, never linked
    r = run_cli("recover", "--json", cwd=repo.path)
    assert r.code == 0, r.out + r.err
    assert _leftovers(repo.path / ".git") == []
    retry = run_cli("apply", str(patch), "--branch", "side", "--key", "k", "--attempt", "2", cwd=repo.path)
    assert retry.code == 0, retry.out + retry.err
    assert repo.git("show", "side:README") == "hello there\n"

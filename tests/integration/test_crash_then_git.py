"""A crash, then git's own advice: remove ``index.lock``, commit (issue 31).

A call killed after its branch moved (crash point ``after-ref``) leaves its
marked ``index.lock`` and the worktree's touched files as they were.  git
says "remove the file manually"; a person who does so and commits must end
with the change kept or with a clear error, never a silent revert:

* with the pre-commit hook, any ``git commit`` is refused, naming
  ``oncepatch recover``; after it, the commit keeps the change;
* without it, ``git commit`` of what the person staged keeps the change (the
  index already holds it), and ``recover`` brings the worktree along;
* without it, ``git commit -a`` commits the stale files, a revert git cannot
  be stopped from making: ``recover`` then says so, naming the path.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import Repo, make_repo, run_cli

PATCH = b"--- a/greet.py\n+++ b/greet.py\n@@ -1 +1 @@\n-hello\n+hello world\n"


def _crashed(tmp_path: Path, *, hook: bool) -> Repo:
    repo = make_repo(tmp_path / "repo", {"greet.py": "hello\n", "other.txt": "x\n"})
    if hook:
        assert run_cli("install-hook", "--repo", str(repo.path)).code == 0
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "k1", input=PATCH,
                env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert r.code == 137, r.out + r.err
    assert (repo.path / ".git" / "index.lock").exists()  # what git then complains about
    assert repo.git("show", "HEAD:greet.py") == "hello world\n"  # the branch moved
    assert (repo.path / "greet.py").read_text() == "hello\n"  # the worktree did not follow
    # git's advice, taken: "remove the file manually to continue"
    (repo.path / ".git" / "index.lock").unlink()
    (repo.path / "other.txt").write_text("x\ny\n")
    return repo


def _git_commit(repo: Repo, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "commit", "-q", "-m", "mine", *args], cwd=repo.path, capture_output=True,
                          text=True, check=False)


def test_with_the_hook_git_commit_is_refused_until_recover_then_keeps_the_change(tmp_path: Path) -> None:
    repo = _crashed(tmp_path, hook=True)
    repo.git("add", "-A")  # stages the stale greet.py too: a revert, were it committed
    head = repo.head()
    refused = _git_commit(repo)
    assert refused.returncode != 0 and "oncepatch recover" in refused.stderr, refused.stderr
    assert repo.head() == head
    rec = run_cli("recover", "--repo", str(repo.path))
    assert rec.code == 0, rec.out + rec.err
    assert (repo.path / "greet.py").read_text() == "hello world\n"
    done = _git_commit(repo)
    assert done.returncode == 0, done.stderr
    assert repo.git("show", "HEAD:greet.py") == "hello world\n"  # kept
    assert repo.git("show", "HEAD:other.txt") == "x\ny\n"  # and the person's own change committed
    assert repo.git("status", "--porcelain") == ""


def test_without_the_hook_git_commit_of_the_staged_change_keeps_it(tmp_path: Path) -> None:
    repo = _crashed(tmp_path, hook=False)
    repo.git("add", "other.txt")
    assert _git_commit(repo).returncode == 0
    assert repo.git("show", "HEAD:greet.py") == "hello world\n"  # the index held the change: kept
    rec = run_cli("recover", "--repo", str(repo.path))
    assert rec.code == 0 and "warning" not in rec.out, rec.out + rec.err
    assert (repo.path / "greet.py").read_text() == "hello world\n"  # the worktree brought along
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


@pytest.mark.parametrize("how", ["commit -a", "add -A"])
def test_without_the_hook_a_commit_of_the_stale_files_is_named_by_recover(tmp_path: Path, how: str) -> None:
    repo = _crashed(tmp_path, hook=False)
    if how == "add -A":
        repo.git("add", "-A")
        assert _git_commit(repo).returncode == 0
    else:
        assert _git_commit(repo, "-a").returncode == 0
    assert repo.git("show", "HEAD:greet.py") == "hello\n"  # git committed the stale file: a revert
    v = run_cli("verify", "--repo", str(repo.path))
    assert v.code == 6 and "run 'oncepatch recover'" in v.out  # the orphan is still reported
    rec = run_cli("recover", "--repo", str(repo.path))
    assert rec.code == 0, rec.out + rec.err
    assert "warning:" in rec.out and "'greet.py' back as before this call" in rec.out, rec.out
    assert "git revert" in rec.out

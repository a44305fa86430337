"""A worktree's HEAD or the store's ``locks/`` this user cannot read: refused before anything is written, saying so.

Root reads through any mode, so the calls run as a user made with ``useradd``
(the ``owner`` fixture of test_dirs_unreadable.py).  Each refusal is checked
for its envelope and exit code, and for the repository, index, worktrees and
store left byte-for-byte as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from conftest import Repo, make_repo, snapshot
from test_dirs_unreadable import Owner, owner, pytestmark  # noqa: F401 - the fixture and its skip

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello world\n"


def _files(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and ".git" not in p.parts}


def _owned_repo(owner: Owner) -> Repo:
    repo = make_repo(owner.base / "r")
    repo.git("config", "--global", "--add", "safe.directory", "*")  # (the test's own git, as root)
    (owner.base / "p.diff").write_bytes(PATCH)
    return repo


def _chown(owner: Owner, *paths: Path) -> None:
    subprocess.run(["chown", "-R", f"{owner.user.uid}:{owner.user.gid}", *map(str, paths)], check=True)


def test_an_unreadable_worktree_head_is_refused_not_read_as_not_checked_out(owner: Owner) -> None:
    """Read as "not checked out there", the call moved 'feature' under the worktree and left it stale."""
    repo = _owned_repo(owner)
    repo.git("branch", "feature")
    wt = owner.base / "wt"
    repo.git("worktree", "add", "-q", str(wt), "feature")
    _chown(owner, repo.path, wt, owner.base / "p.diff")
    head = repo.path / ".git" / "worktrees" / "wt" / "HEAD"
    head.chmod(0)
    before, wt_before = snapshot(repo), _files(wt)

    res = owner.oncepatch("apply", "p.diff", "--repo", str(repo.path), "--branch", "feature", "--key", "k1", "--json")
    assert res.returncode == 2, res
    err = json.loads(res.stdout)["error"]
    assert (err["type"], err["effect_status"], err["reason"]) == ("usage", "not_started", "worktree_head_unreadable")
    assert err["path"] == str(head) and "Permission denied" in err["message"] and "'refs/heads/feature'" in err["message"]
    assert snapshot(repo) == before and _files(wt) == wt_before

    head.chmod(0o644)  # readable again: the call goes through, and the worktree follows its branch
    res = owner.oncepatch("apply", "p.diff", "--repo", str(repo.path), "--branch", "feature", "--key", "k1", "--json")
    assert res.returncode == 0, res
    assert (wt / "README").read_bytes() == b"hello world\n"


def test_a_locks_folder_this_user_cannot_enter_says_so_and_nothing_is_written(owner: Owner) -> None:
    repo = _owned_repo(owner)
    _chown(owner, repo.path, owner.base / "p.diff")
    locks = repo.store / "locks"
    locks.mkdir(parents=True)
    os.chown(repo.store, owner.user.uid, owner.user.gid)
    locks.chmod(0o700)  # root's: there, but not to be entered by the user
    before = snapshot(repo)

    res = owner.oncepatch("apply", "p.diff", "--repo", str(repo.path), "--key", "k1", "--json")
    assert res.returncode == 2, res
    err = json.loads(res.stdout)["error"]
    assert (err["type"], err["effect_status"], err["next_action"]) == ("usage", "not_started", "fix_input")
    assert f"cannot open the folder '{locks}': Permission denied (as uid {owner.user.uid})" in err["message"], err
    assert (err["path"], err["errno"]) == (str(locks), 13)
    assert snapshot(repo) == before

    locks.rmdir()
    repo.store.chmod(0o555)  # now the folder is not there and cannot be made
    res = owner.oncepatch("apply", "p.diff", "--repo", str(repo.path), "--key", "k1", "--json")
    err = json.loads(res.stdout)["error"]
    assert res.returncode == 2 and err["effect_status"] == "not_started", res
    assert f"cannot make '{locks}': Permission denied" in err["message"], err
    repo.store.chmod(0o755)

"""A crash, then git's own advice: remove ``index.lock``, commit (issue 31).

``git add`` after a killed call says "remove the index.lock file manually".
A person who does so (the pre-commit hook not installed) and runs ``git
commit -a`` or ``git add -A && git commit`` must end with the change kept or
with a clear error, never a silent revert.  The apply protocol writes the
worktree's touched files, then its index, before the branch moves
(docs/DESIGN.md section 4), so at every crash point of the checked-out path:

* before the worktree is touched (``after-stage``, ``after-prepare``): the
  commit holds only the person's own change; ``recover`` says the call did
  not happen and its retry lands it once;
* the index staged, the files not yet written (``after-index-ahead``): git
  refuses, naming the branch's lock the dead call left; removed too, the
  person's commit holds nothing of the change (``-a`` and ``add -A`` stage
  the old files again), and the call is retried as one that did not happen;
* index and files written, the branch not moved (``after-worktree-ahead``):
  git refuses the same way; removed too, the person's commit holds the whole
  change, which ``recover`` leaves alone (the call is rejected, the commit kept);
* after the move (``after-ref`` and later): worktree, index and HEAD agree,
  so the commit has nothing to revert; ``recover`` settles the call committed.

Each case then ends with ``recover`` and ``verify`` consistent, and the
change in HEAD's tree exactly once.  The same with the hook installed: any
commit is refused until ``recover`` has run.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Repo, make_repo, run_cli
from test_crash_matrix import _delete, _modify, _new_file, _rename

BASE: dict[str, str | bytes] = {
    "src/app.py": "".join(f"line {i}\n" for i in range(1, 13)),
    "src/util.py": "def f():\n    return 1\n",
    "docs/guide.txt": "guide\n",
    "other.txt": "x\n",
}


#: The crash matrix's edits (its base holds the same paths): a new file, a modified line, a deletion, a rename.
EDITS: dict[str, Callable[[Repo], None]] = {"add": _new_file, "modify": _modify, "delete": _delete, "rename": _rename}

#: crash point of the checked-out path, in the order a call passes them -> where it stops:
#: "untouched" (the worktree not written), "staged" (the index staged, under the branch's
#: lock), "ahead" (index and files written, the branch not moved) or "moved".
POINTS = {
    "after-stage": "untouched",
    "after-prepare": "untouched",
    "after-index-ahead": "staged",
    "after-worktree-ahead": "ahead",
    "after-ref": "moved",
    "after-materialise": "moved",
    "before-receipt-replace": "moved",
}
COMMITS = ["commit -a", "add -A"]


def _prepare(tmp_path: Path, edit: Callable[[Repo], None]) -> tuple[Repo, Path, str, str]:
    """A clean repository at its base commit, the patch of ``edit``, the base and the target tree."""
    repo = make_repo(tmp_path / "repo", BASE)
    base = repo.head()
    edit(repo)
    repo.git("add", "-A")
    patch = tmp_path / "change.diff"
    patch.write_bytes(repo.git("diff", "--cached", "--full-index", "-M").encode())
    target = repo.git("write-tree").strip()
    repo.git("reset", "-q", "--hard", base)
    assert repo.git("status", "--porcelain") == ""
    return repo, patch, base, target


def _user_commit(repo: Repo, how: str) -> subprocess.CompletedProcess[str]:
    """What git's advice leads to: the person's own edit, then ``git commit -a`` or ``git add -A && git commit``."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=repo.path, capture_output=True, text=True, check=False)

    if how == "add -A":
        added = git("add", "-A")
        if added.returncode != 0:
            return added
        return git("commit", "-q", "-m", "mine")
    return git("commit", "-q", "-a", "-m", "mine")


def _changed(repo: Repo, a: str, b: str) -> list[str]:
    return repo.git("diff", "--name-only", "--no-renames", a, b).split()


@pytest.mark.parametrize("how", COMMITS)
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("point", list(POINTS))
def test_crash_then_rm_index_lock_then_commit_keeps_the_change_or_fails_clearly(
        tmp_path: Path, point: str, edit: str, how: str) -> None:
    repo, patch, base, target = _prepare(tmp_path, EDITS[edit])
    touched = _changed(repo, base, target)
    crashed = run_cli("apply", str(patch), "--repo", str(repo.path), "--key", "k1",
                      env={"ONCEPATCH_CRASH_AT": point})
    assert crashed.code == 137, crashed.out + crashed.err
    stage = POINTS[point]
    lock = repo.path / ".git" / "index.lock"
    assert lock.exists() is (stage in ("staged", "ahead") or point == "after-ref")
    lock.unlink(missing_ok=True)  # git's advice, taken
    (repo.path / "other.txt").write_text("x\ny\n")  # and the person's own edit
    head = repo.head()

    done = _user_commit(repo, how)

    if stage in ("staged", "ahead"):
        # The branch's lock the dead call held is still there: git refuses, saying which file.
        assert done.returncode != 0, done.stdout + done.stderr
        assert "refs/heads/main.lock" in done.stderr and "File exists" in done.stderr, done.stderr
        assert repo.head() == head == base
        # Removed as well (git's advice again): the person's commit holds the change as theirs.
        (repo.path / ".git" / "refs" / "heads" / "main.lock").unlink()
        done = _user_commit(repo, how)
    assert done.returncode == 0, done.stdout + done.stderr
    mine = repo.head()
    assert repo.git("rev-parse", f"{mine}^").strip() == (base if stage != "moved" else head)
    if stage == "moved":
        assert head != base and repo.head(f"{head}^{{tree}}") == target  # the call's commit landed
    # Never a revert, nor half the change: HEAD has all of it (or nothing) and the person's edit.
    kept = stage in ("ahead", "moved")
    want = target if kept else repo.head(f"{base}^{{tree}}")
    assert _changed(repo, want, mine) == ["other.txt"], (touched, _changed(repo, want, mine))

    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    report = rec.json
    assert report["ok"] is True and report["corrupt"] == [] and report["skipped"] == []
    to = [row["to"] for row in report["rows"]]
    assert to == ([] if point == "after-stage" else ["committed"] if stage == "moved" else ["rejected"]), report
    assert repo.head() == mine  # the person's commit is kept
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert not lock.exists() and not list((repo.path / ".git").glob("index.oncepatch-base.*"))
    verified = run_cli("verify", "--repo", str(repo.path), "--grace", "0")
    assert verified.code == 0, verified.out + verified.err

    # The call's key, asked again: landed once (replayed), or executed now (nothing was
    # applied), or found in the person's commit: the change is there once.
    again = run_cli("apply", str(patch), "--repo", str(repo.path), "--key", "k1", "--json")
    if stage == "ahead" and edit in ("delete", "rename"):
        # (A deletion already made is not recognised as applied, nor a pure rename whose
        # patch names no blob: docs/FORMATS.md, "Operations". Refused, nothing written.)
        assert again.code == 4 and again.json["error"]["type"] == "context_not_found", again.out
    else:
        assert again.code == 0, again.out + again.err
        assert again.json["replayed"] is (stage == "moved")
    assert _changed(repo, target, "HEAD") == ["other.txt"]
    assert repo.head() == (mine if kept else again.json["commit"])
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert run_cli("verify", "--repo", str(repo.path), "--grace", "0").code == 0


def test_put_back_leaves_a_file_edited_since_the_crash_alone(tmp_path: Path) -> None:
    """``recover`` puts back only what the dead call wrote: an edit made since is the person's."""
    repo, patch, base, _target = _prepare(tmp_path, _modify)
    assert run_cli("apply", str(patch), "--repo", str(repo.path), "--key", "k1",
                   env={"ONCEPATCH_CRASH_AT": "after-worktree-ahead"}).code == 137
    assert "line seven" in (repo.path / "src/app.py").read_text()  # written ahead of the move
    (repo.path / ".git" / "index.lock").unlink()
    (repo.path / ".git" / "refs" / "heads" / "main.lock").unlink()
    edited = "my own version\n"
    (repo.path / "src/app.py").write_text(edited)
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    assert [r["to"] for r in rec.json["rows"]] == ["rejected"]
    assert (repo.path / "src/app.py").read_text() == edited  # not clobbered
    # The index no longer stages the call's version on a branch that never moved.
    assert repo.git("diff", "--cached", "--name-only") == ""
    assert repo.head() == base and not list((repo.path / ".git").glob("index.oncepatch-base.*"))


def test_put_back_leaves_a_folder_holding_a_new_file_alone(tmp_path: Path) -> None:
    """A file the call turned into a folder, where a person added a file since: ``recover`` settles the call
    (the call's own file removed, the person's kept), instead of failing on the folder every time."""
    repo = make_repo(tmp_path / "repo", {"x": "one\n", "other.txt": "x\n"})
    base = repo.head()
    repo.git("rm", "-q", "x")
    repo.write("x/y", "y\n")
    repo.git("add", "-A")
    patch = tmp_path / "change.diff"
    patch.write_bytes(repo.git("diff", "--cached", "--full-index").encode())
    repo.git("reset", "-q", "--hard", base)
    assert run_cli("apply", str(patch), "--repo", str(repo.path), "--key", "k1",
                   env={"ONCEPATCH_CRASH_AT": "after-worktree-ahead"}).code == 137
    assert (repo.path / "x" / "y").is_file()  # written ahead of the move
    (repo.path / "x" / "z").write_text("mine\n")
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    assert [r["to"] for r in rec.json["rows"]] == ["rejected"], rec.json
    assert (repo.path / "x" / "z").read_text() == "mine\n" and not (repo.path / "x" / "y").exists()
    assert repo.head() == base and repo.git("diff", "--cached", "--name-only") == ""


def test_with_the_hook_git_commit_is_refused_until_recover_then_keeps_the_change(tmp_path: Path) -> None:
    repo, patch, base, target = _prepare(tmp_path, _modify)
    assert run_cli("install-hook", "--repo", str(repo.path)).code == 0
    assert run_cli("apply", str(patch), "--repo", str(repo.path), "--key", "k1",
                   env={"ONCEPATCH_CRASH_AT": "after-ref"}).code == 137
    (repo.path / ".git" / "index.lock").unlink()
    (repo.path / "other.txt").write_text("x\ny\n")
    head = repo.head()
    refused = _user_commit(repo, "add -A")
    assert refused.returncode != 0 and "oncepatch recover" in refused.stderr, refused.stderr
    assert repo.head() == head
    rec = run_cli("recover", "--repo", str(repo.path), "--json")
    assert rec.code == 0, rec.out + rec.err
    assert [(r["to"], r["commit"]) for r in rec.json["rows"]] == [("committed", head)]
    done = _user_commit(repo, "add -A")
    assert done.returncode == 0, done.stderr
    assert _changed(repo, target, "HEAD") == ["other.txt"]  # kept, and the person's own change committed
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path)).code == 0

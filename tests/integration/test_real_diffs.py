"""Shapes of real `git diff` output that a sweep over released source trees met, checked against git.

Each test builds its small tree here, makes the change with git, sends git's
own diff through `oncepatch apply` (the CLI), and compares the branch's tree
with the one `git apply --index` gives on the same base, and the worktree's
files with git's checkout of it; a refusal must change nothing (as
tests/integration/test_rejections.py checks them).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cas.worktree import originals_of, put_back
from conftest import Repo, git, make_repo, run_cli, snapshot
from test_rejections import refuse


def _files(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel == ".git" or rel.startswith(".git/"):
            continue
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = f"{oct(p.stat().st_mode)}:{p.read_bytes()!r}"
    return out


def _diff(repo: Repo, change) -> bytes:  # type: ignore[no-untyped-def]
    """git's diff of ``change`` made on HEAD; the repository is put back at HEAD (its reflog emptied)."""
    base = repo.head()
    change(repo.path)
    repo.git("add", "-A")
    repo.git("commit", "-q", "-m", "target")
    data = git(repo.path, "diff", "--binary", "-M", base, "HEAD").encode("utf-8", "surrogateescape")
    repo.git("reset", "-q", "--hard", base)
    repo.git("reflog", "expire", "--expire=all", "--all")
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    return data


def _git_apply(tmp_path: Path, repo: Repo, patch: bytes) -> tuple[str, dict[str, str]]:
    """The tree and the worktree's files `git apply --index` makes of ``patch`` on a clone of ``repo``."""
    oracle = tmp_path / "oracle"
    git(tmp_path, "clone", "-q", str(repo.path), str(oracle))
    git(oracle, "apply", "--index", "-", input=patch)
    return git(oracle, "write-tree").strip(), _files(oracle)


def _symlink_to_folder(root: Path) -> None:
    (root / "d").unlink()
    (root / "d").mkdir()
    (root / "d" / "f").write_bytes(b"a file where the link was\n")


def _base_with_link(tmp_path: Path) -> Repo:
    repo = make_repo(tmp_path / "repo", {"target/a": "a\n", "keep": "k\n"})
    os.symlink("target", repo.path / "d")
    repo.commit_all("a link to a folder")
    return repo


@pytest.mark.parametrize("checked_out", [True, False], ids=["checked-out", "other-branch"])
def test_symlink_replaced_by_a_folder_applies_as_git_applies_it(tmp_path: Path, checked_out: bool) -> None:
    # git diff writes the typechange as a deletion of the link 'd' and an addition of 'd/f':
    # the path goes through 'd' only in the base, and the patch removes the link first.
    repo = _base_with_link(tmp_path)
    patch = _diff(repo, _symlink_to_folder)
    want_tree, want_files = _git_apply(tmp_path, repo, patch)
    base = repo.head()
    repo.git("branch", "other")
    extra = [] if checked_out else ["--branch", "other"]
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "typechange", *extra, input=patch)
    assert r.code == 0, r.out + r.err
    ref = "main" if checked_out else "other"
    assert repo.head(f"{ref}^{{tree}}") == want_tree == r.json["tree"]
    assert repo.head(f"{ref}~1") == base
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    if checked_out:
        assert _files(repo.path) == want_files
        assert (repo.path / "d").is_dir() and not (repo.path / "d").is_symlink()
    else:
        assert repo.head() == base and (repo.path / "d").is_symlink()


def test_untracked_file_where_a_new_folder_goes_is_refused_with_nothing_changed(tmp_path: Path) -> None:
    # 'git apply --index' refuses too ("already exists in working directory"); the refusal
    # used to come only when the files were written: the index held the new entry, its
    # index.lock stayed held, and the envelope said 'not_applied' over a changed index.
    repo = make_repo(tmp_path / "repo", {"keep": "k\n"})
    patch = _diff(repo, lambda root: (root / "x" / "y").mkdir(parents=True)
                  or (root / "x" / "y" / "z.txt").write_bytes(b"new\n"))
    (repo.path / "x").write_bytes(b"someone's untracked notes\n")
    err = refuse(repo, patch, code=4, type="dirty_path", retryable=True, next_action="retry")
    assert err["paths"] == ["x"]
    assert (repo.path / "x").read_bytes() == b"someone's untracked notes\n"
    assert not (repo.path / ".git" / "index.lock").exists()
    (repo.path / "x").unlink()  # once it is moved away, the same call goes through
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", input=patch)
    assert r.code == 0, r.out + r.err
    assert (repo.path / "x" / "y" / "z.txt").read_bytes() == b"new\n"
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""


def test_put_back_passes_over_a_file_where_a_folder_of_the_path_goes(tmp_path: Path) -> None:
    # A write that never got past the file 'x' left nothing below it to remove: putting
    # the worktree back must not fail there (it did, and left the call's index.lock held).
    work = tmp_path / "w"
    work.mkdir()
    (work / "x").write_bytes(b"untracked\n")
    (work / "kept").write_bytes(b"kept\n")
    originals = originals_of(str(work), ["x/y/z.txt", "kept"])
    (work / "kept").write_bytes(b"written ahead\n")
    put_back(originals)
    assert (work / "x").read_bytes() == b"untracked\n"
    assert (work / "kept").read_bytes() == b"kept\n"
    put_back(originals)  # safe to repeat


def test_untracked_symlink_where_a_new_folder_goes_is_still_refused(tmp_path: Path) -> None:
    # Only a link the patch itself replaces gives way; any other is never written through.
    repo = make_repo(tmp_path / "repo", {"keep": "k\n"})
    outside = tmp_path / "outside"
    outside.mkdir()
    patch = _diff(repo, lambda root: (root / "x").mkdir() or (root / "x" / "z.txt").write_bytes(b"new\n"))
    os.symlink(str(outside), repo.path / "x")
    before = snapshot(repo)
    refuse(repo, patch, code=4, type="unsafe_path")
    assert snapshot(repo) == before and list(outside.iterdir()) == []


def test_diff_ruN_of_a_tree_dated_at_the_epoch_applies(tmp_path: Path) -> None:
    # A reproducible tarball dates its files at the epoch; 'diff -ruN old new' then dates a
    # changed file's new side as 'diff -N' dates an absent one.  Its hunks have lines on that side.
    old, new = tmp_path / "old", tmp_path / "new"
    for root, meta, added in ((old, b"Version: 1\nName: x\n", None), (new, b"Version: 2\nName: x\n", b"n\n")):
        root.mkdir()
        (root / "PKG-INFO").write_bytes(meta)
        (root / "same.txt").write_bytes(b"s\n")
        if added is not None:
            (root / "added.txt").write_bytes(added)
    for p in new.iterdir():
        os.utime(p, (0, 0))
    diff = subprocess.run(["diff", "-ruN", "old", "new"], cwd=tmp_path, capture_output=True)
    assert diff.returncode == 1 and b"\t1970-01-01 00:00:00" in diff.stdout, diff
    repo = make_repo(tmp_path / "repo", {"PKG-INFO": "Version: 1\nName: x\n", "same.txt": "s\n"})
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "ruN", input=diff.stdout)
    assert r.code == 0, r.out + r.err
    assert {o["path"]: o["op"] for o in r.json["outputs"]} == {"PKG-INFO": "modify", "added.txt": "add"}
    assert _files(repo.path) == _files(new)
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""

"""The branch moved through a libgit2 reference transaction (cas.refs), checked against git itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cas.errors import RefLockedError, RefMovedError
from cas.objects import GitStore, TreeEntry
from tests.conftest import Repo, git, make_repo

BLOB = 0o100644


def new_commit(gs: GitStore, parent: str, content: bytes = b"x\n") -> str:
    tree = gs.edit_tree(gs.commit_tree(parent), {"cand.txt": TreeEntry(gs.write_blob(content), BLOB)})
    return gs.create_commit(tree, [parent], "candidate\n")


def state(repo: Repo) -> dict[str, bytes]:
    """Every file under refs/, logs/, packed-refs and the git dir's top level, by content."""
    root = repo.path / ".git"
    out = {}
    for sub in ("refs", "logs"):
        for p in sorted((root / sub).rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = p.read_bytes()
    for p in sorted(root.iterdir()):
        if p.is_file() and p.name != "index":
            out[p.name] = p.read_bytes()
    return out


def reflog(repo: Repo, ref: str) -> list[str]:
    return repo.git("reflog", "show", "--format=%H %gs", ref).splitlines()


def test_checked_out_branch_moves_with_its_reflog_and_heads(repo: Repo) -> None:
    gs = GitStore(str(repo.path))
    base = repo.head()
    cand = new_commit(gs, base)
    head_log = reflog(repo, "HEAD")
    gs.compare_and_swap("refs/heads/main", base, cand, "oncepatch: opc1:one")
    assert repo.git("rev-parse", "refs/heads/main").strip() == cand
    assert reflog(repo, "main")[0] == f"{cand} oncepatch: opc1:one"
    assert reflog(repo, "HEAD") == [f"{cand} oncepatch: opc1:one", *head_log]  # HEAD names the branch
    line = (repo.path / ".git/logs/refs/heads/main").read_bytes().splitlines()[-1]
    assert line.startswith(f"{base} {cand} ".encode()) and line.endswith(b"\toncepatch: opc1:one")
    assert (repo.path / ".git/refs/heads/main").read_bytes() == cand.encode() + b"\n"
    assert not (repo.path / ".git/refs/heads/main.lock").exists()
    repo.git("fsck", "--strict")


def test_other_branch_leaves_heads_reflog_alone(repo: Repo) -> None:
    repo.git("branch", "side")
    gs = GitStore(str(repo.path))
    base = repo.head("side")
    head_log = (repo.path / ".git/logs/HEAD").read_bytes()
    cand = new_commit(gs, base)
    gs.compare_and_swap("refs/heads/side", base, cand, "oncepatch: side")
    assert repo.head("side") == cand and reflog(repo, "side")[0] == f"{cand} oncepatch: side"
    assert (repo.path / ".git/logs/HEAD").read_bytes() == head_log


@pytest.mark.parametrize("ref", ["refs/heads/main", "refs/heads/feat/deep/x"])
def test_packed_only_branch_gets_a_loose_ref(repo: Repo, ref: str) -> None:
    name = ref.removeprefix("refs/heads/")
    if name != "main":
        repo.git("branch", name)
    repo.git("pack-refs", "--all", "--prune")
    assert not (repo.path / ".git" / ref).exists()
    packed = (repo.path / ".git/packed-refs").read_bytes()
    gs = GitStore(str(repo.path))
    base = repo.head(ref)
    cand = new_commit(gs, base)
    gs.compare_and_swap(ref, base, cand, "oncepatch: packed")
    assert repo.git("rev-parse", ref).strip() == cand
    assert (repo.path / ".git" / ref).read_bytes() == cand.encode() + b"\n"
    assert (repo.path / ".git/packed-refs").read_bytes() == packed  # as git does: the loose ref wins
    assert reflog(repo, ref)[0] == f"{cand} oncepatch: packed"
    repo.git("fsck", "--strict")
    repo.git("pack-refs", "--all")  # and git packs ours again
    assert repo.git("rev-parse", ref).strip() == cand


def test_moved_ref_changes_nothing(repo: Repo) -> None:
    gs = GitStore(str(repo.path))
    base = repo.head()
    cand = new_commit(gs, base)
    gs.flush_objects()
    repo.write("README", "moved by someone else\n")
    moved = repo.commit_all("concurrent")
    before = state(repo)
    with pytest.raises(RefMovedError) as ei:
        gs.compare_and_swap("refs/heads/main", base, cand, "m")
    assert (ei.value.actual, ei.value.expected) == (moved, base)
    assert state(repo) == before


def test_failed_precondition_changes_nothing(repo: Repo) -> None:
    gs = GitStore(str(repo.path))
    base = repo.head()
    cand = new_commit(gs, base)
    gs.flush_objects()
    before = state(repo)

    def fenced() -> None:
        assert (repo.path / ".git/refs/heads/main.lock").exists()  # run under the branch's lock
        raise RuntimeError("fenced off")

    with pytest.raises(RuntimeError, match="fenced off"):
        gs.compare_and_swap("refs/heads/main", base, cand, "m", precondition=fenced)
    assert state(repo) == before


def test_held_lock_is_reported_and_left(repo: Repo) -> None:
    gs = GitStore(str(repo.path))
    base = repo.head()
    cand = new_commit(gs, base)
    gs.flush_objects()
    lock = repo.path / ".git/refs/heads/main.lock"
    lock.write_bytes(b"")  # a live git's
    before = state(repo)
    with pytest.raises(RefLockedError):
        gs.compare_and_swap("refs/heads/main", base, cand, "m", lock_timeout=0.05)
    assert state(repo) == before and lock.read_bytes() == b""


def test_git_and_oncepatch_alternate_on_one_branch(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "a\n"})
    gs = GitStore(str(repo.path))
    for i in range(3):
        base = repo.head()
        cand = new_commit(gs, base, b"%d\n" % i)
        gs.compare_and_swap("refs/heads/main", base, cand, f"oncepatch {i}")
        repo.git("reset", "-q", "--hard", cand)
        repo.write("a.txt", f"git {i}\n")
        repo.commit_all(f"git {i}")
    log = reflog(repo, "main")
    assert [s.split(" ", 1)[1] for s in log[:6:2]] == ["commit: git 2", "commit: git 1", "commit: git 0"]
    assert subprocess.run(["git", "fsck", "--strict"], cwd=repo.path, capture_output=True).returncode == 0


# -- what git would read differently, or where the files backend cannot be used ---------------------

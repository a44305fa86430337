"""The branch moved the way git's files backend moves it (cas.loose_refs), checked against git itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cas.errors import RefLockedError, RefMovedError
from cas.loose_refs import Unsupported, read_ref
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
    assert not [n for n in os.listdir(repo.path / ".git") if ".optmp-" in n]
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
    assert read_ref(str(repo.path / ".git"), ref) == base
    cand = new_commit(gs, base)
    gs.compare_and_swap(ref, base, cand, "oncepatch: packed")
    assert repo.git("rev-parse", ref).strip() == cand
    assert (repo.path / ".git" / ref).read_bytes() == cand.encode() + b"\n"
    assert (repo.path / ".git/packed-refs").read_bytes() == packed  # as git does: the loose ref wins
    assert reflog(repo, ref)[0] == f"{cand} oncepatch: packed"
    repo.git("fsck", "--strict")
    repo.git("pack-refs", "--all")  # and git packs ours again
    assert repo.git("rev-parse", ref).strip() == cand


def test_loose_ref_wins_over_a_stale_packed_line(repo: Repo) -> None:
    base = repo.head()
    repo.git("pack-refs", "--all")  # packs main, keeps the loose file
    repo.write("README", "second\n")
    second = repo.commit_all("second")
    git_dir = str(repo.path / ".git")
    assert read_ref(git_dir, "refs/heads/main") == second != base
    assert read_ref(git_dir, "refs/heads/absent") is None


def test_symbolic_or_odd_refs_are_left_to_libgit2(repo: Repo) -> None:
    git_dir = repo.path / ".git"
    repo.git("symbolic-ref", "refs/heads/alias", "refs/heads/main")
    with pytest.raises(Unsupported):
        read_ref(str(git_dir), "refs/heads/alias")
    (git_dir / "refs/heads/odd").write_bytes(b"not an oid\n")
    with pytest.raises(Unsupported):
        read_ref(str(git_dir), "refs/heads/odd")
    (git_dir / "refs/heads/odd").unlink()
    # Through the store: the symbolic ref goes to libgit2, which moves it as before.
    gs = GitStore(str(repo.path))
    base = repo.head()
    cand = new_commit(gs, base)
    gs.compare_and_swap("refs/heads/alias", base, cand, "oncepatch: alias")
    assert repo.git("rev-parse", "refs/heads/alias").strip() == cand
    assert not list(git_dir.rglob("*.lock"))


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
    assert gs.take_unsynced() == []


def test_failed_precondition_changes_nothing(repo: Repo) -> None:
    gs = GitStore(str(repo.path))
    base = repo.head()
    cand = new_commit(gs, base)
    gs.flush_objects()
    before = state(repo)

    def fenced() -> None:
        assert (repo.path / ".git/refs/heads/main.lock").read_bytes() == cand.encode() + b"\n"  # born complete
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


def test_log_all_ref_updates_decides_which_reflogs_are_made(repo: Repo) -> None:
    gs = GitStore(str(repo.path))
    git_dir = repo.path / ".git"
    base = repo.head()
    repo.git("branch", "nolog")
    (git_dir / "logs/refs/heads/nolog").unlink()

    repo.git("config", "core.logAllRefUpdates", "false")
    c1 = new_commit(gs, base, b"1")
    gs.compare_and_swap("refs/heads/nolog", base, c1, "no log made")
    assert not (git_dir / "logs/refs/heads/nolog").exists()
    c2 = new_commit(gs, base, b"2")
    gs.compare_and_swap("refs/heads/main", base, c2, "an existing log is kept up")
    assert reflog(repo, "main")[0] == f"{c2} an existing log is kept up"

    repo.git("update-ref", "--no-deref", "refs/other/x", base)
    repo.git("config", "core.logAllRefUpdates", "true")
    c3 = new_commit(gs, base, b"3")
    gs.compare_and_swap("refs/other/x", base, c3, "not a branch")
    assert not (git_dir / "logs/refs/other/x").exists()
    c4 = new_commit(gs, c1, b"4")
    gs.compare_and_swap("refs/heads/nolog", c1, c4, "log made")
    assert reflog(repo, "nolog") == [f"{c4} log made"]

    repo.git("config", "core.logAllRefUpdates", "always")
    c5 = new_commit(gs, c3, b"5")
    gs.compare_and_swap("refs/other/x", c3, c5, "always")
    assert (git_dir / "logs/refs/other/x").read_bytes().endswith(b"\talways\n")


def test_bare_repository_makes_no_new_reflog(tmp_path: Path, repo: Repo) -> None:
    bare = tmp_path / "bare.git"
    git(tmp_path, "clone", "-q", "--bare", str(repo.path), str(bare))
    gs = GitStore(str(bare))
    base = git(bare, "rev-parse", "refs/heads/main").strip()
    cand = new_commit(gs, base)
    gs.compare_and_swap("refs/heads/main", base, cand, "bare")
    assert git(bare, "rev-parse", "refs/heads/main").strip() == cand
    assert not (bare / "logs/refs/heads/main").exists()


def test_deferred_sync_names_the_folders_changed(repo: Repo) -> None:
    repo.git("branch", "feat/new")
    repo.git("pack-refs", "--all", "--prune")
    for sub in ("refs/heads/feat", "logs/refs/heads/feat"):  # no loose ref, no reflog, no folders
        folder = repo.path / ".git" / sub
        if folder.exists():
            for p in folder.glob("*"):
                p.unlink()
            folder.rmdir()
    gs = GitStore(str(repo.path))
    base = repo.head("feat/new")
    cand = new_commit(gs, base)
    gs.compare_and_swap("refs/heads/feat/new", base, cand, "deferred", defer_sync=True)
    git_dir = os.path.realpath(repo.path / ".git")
    todo = gs.take_unsynced()
    # the ref's folder (and its parent: the folder is new), the new reflog, its folder and its parent
    assert set(todo) == {f"{git_dir}/refs/heads", f"{git_dir}/refs/heads/feat", f"{git_dir}/logs/refs/heads",
                         f"{git_dir}/logs/refs/heads/feat", f"{git_dir}/logs/refs/heads/feat/new"}, todo
    assert gs.take_unsynced() == []
    gs.compare_and_swap("refs/heads/main", base, new_commit(gs, base, b"y"), "now")
    assert gs.take_unsynced() == []  # synced at once without defer_sync
    assert repo.head("feat/new") == cand


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


@pytest.mark.parametrize(("line", "made"), [("logAllRefUpdates", True), ("logAllRefUpdates =", False),
                                            ("logAllRefUpdates = 2", True)],
                         ids=["no-value", "empty", "two"])
def test_log_all_ref_updates_is_read_as_git_reads_a_boolean(repo: Repo, line: str, made: bool) -> None:
    with open(repo.path / ".git/config", "a") as fh:
        fh.write(f"[core]\n\t{line}\n")
    repo.git("branch", "fresh")
    (repo.path / ".git/logs/refs/heads/fresh").unlink(missing_ok=True)
    gs = GitStore(str(repo.path))
    base = repo.head("fresh")
    gs.compare_and_swap("refs/heads/fresh", base, new_commit(gs, base), "m")
    assert (repo.path / ".git/logs/refs/heads/fresh").exists() is made


def test_a_symlinked_ref_is_left_to_libgit2(repo: Repo) -> None:
    git_dir = repo.path / ".git"
    os.symlink("main", git_dir / "refs/heads/link")  # git's old way of writing a symbolic ref
    with pytest.raises(Unsupported):
        read_ref(str(git_dir), "refs/heads/link")


def test_packed_refs_without_a_final_newline_is_left_to_libgit2(repo: Repo) -> None:
    repo.git("pack-refs", "--all", "--prune")
    packed = repo.path / ".git/packed-refs"
    packed.write_bytes(packed.read_bytes().rstrip(b"\n"))
    with pytest.raises(Unsupported):
        read_ref(str(repo.path / ".git"), "refs/heads/absent")


def test_a_value_that_is_not_an_object_id_is_never_written(repo: Repo) -> None:
    gs = GitStore(str(repo.path))
    base = repo.head()
    before = (repo.path / ".git/refs/heads/main").read_bytes()
    with pytest.raises(Exception):
        gs.compare_and_swap("refs/heads/main", base, "main~1", "m")
    assert (repo.path / ".git/refs/heads/main").read_bytes() == before
    assert not list((repo.path / ".git").rglob("*.lock"))


def test_an_empty_folder_where_the_reflog_goes_is_left_to_libgit2(repo: Repo) -> None:
    repo.git("branch", "odd")
    log = repo.path / ".git/logs/refs/heads/odd"
    log.unlink()
    log.mkdir()
    gs = GitStore(str(repo.path))
    base = repo.head("odd")
    cand = new_commit(gs, base)
    gs.compare_and_swap("refs/heads/odd", base, cand, "m")  # libgit2 clears the empty folder, as git does
    assert repo.head("odd") == cand
    assert not list((repo.path / ".git").rglob("*.lock"))


def test_no_hard_links_falls_back_to_libgit2(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def no_link(src: str, dst: str) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    gs = GitStore(str(repo.path))
    base = repo.head()
    cand = new_commit(gs, base)
    gs.flush_objects()
    monkeypatch.setattr(os, "link", no_link)  # refs/ on another file system
    gs.compare_and_swap("refs/heads/main", base, cand, "m")
    assert repo.head("main") == cand
    assert not [n for n in os.listdir(repo.path / ".git") if ".optmp-" in n]


@pytest.mark.parametrize("branch", ["main", "side"], ids=["checked-out", "not-checked-out"])
def test_a_failed_sync_of_the_moved_branch_ends_unknown(repo: Repo, monkeypatch: pytest.MonkeyPatch,
                                                       branch: str) -> None:
    """The branch's folder sync is made in a later round (a worktree's, or the finalise batch's).
    If it fails there, the call never retries it as if nothing happened (a second fsync after a
    failed one can succeed with the data lost): the receipt says unknown."""
    import errno

    import cas.durable
    from cas.errors import RefUpdateUnknown
    from patcher.protocol import apply
    from receipts.store import ReceiptStore

    repo.git("branch", "side")
    heads = os.path.realpath(repo.path / ".git/refs/heads")
    real = cas.durable._fsync_path
    failures = [OSError(errno.EIO, "Input/output error")]  # once, as Linux reports a lost write-back once

    def failing(target: Any) -> None:
        if target == heads and failures:
            raise failures.pop()
        real(target)

    monkeypatch.setattr(cas.durable, "_fsync_path", failing)
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"
    with pytest.raises(RefUpdateUnknown):
        apply(str(repo.path), patch, key="k1", branch=branch)
    receipt = ReceiptStore(str(repo.path / ".git" / "oncepatch")).read("k1")
    assert receipt is not None and receipt.status == "unknown"

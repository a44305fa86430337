"""cas.objects (pygit2) against git itself: tree edits, ref compare-and-swap, key refs."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import pygit2

from cas.errors import RefLockedError, RefMovedError
from cas.hashing import git_blob_oid
from cas.objects import KEY_REF_PREFIX, GitStore, TreeEntry
from tests.conftest import Repo, make_repo

BLOB = 0o100644
EXEC = 0o100755
LINK = 0o120000

Change = tuple[int, bytes] | None  # (mode, content) or delete


@pytest.fixture
def gs(repo: Repo) -> GitStore:
    return GitStore(str(repo.path))


def head_tree(repo: Repo) -> str:
    return repo.git("rev-parse", "HEAD^{tree}").strip()


def git_tree_after(repo: Repo, base_tree: str | None, changes: dict[str, tuple[int, str] | None],
                   index: Path) -> str:
    """The tree git itself writes for the same change (a scratch index, update-index, write-tree)."""
    env = dict(os.environ, GIT_INDEX_FILE=str(index))

    def run(*args: str) -> str:
        res = subprocess.run(["git", *args], cwd=repo.path, env=env, capture_output=True, text=True, check=False)
        assert res.returncode == 0, f"git {args}: {res.stderr}"
        return res.stdout

    if index.exists():
        index.unlink()
    if base_tree is None:
        run("read-tree", "--empty")
    else:
        run("read-tree", base_tree)
    for path, entry in changes.items():
        if entry is None:
            run("update-index", "--force-remove", path)
    for path, entry in changes.items():
        if entry is not None:
            run("update-index", "--add", "--replace", "--cacheinfo", f"{entry[0]:o},{entry[1]},{path}")
    return run("write-tree").strip()


def edit_both(repo: Repo, gs: GitStore, base_tree: str | None, changes: dict[str, Change],
              tmp_path: Path) -> tuple[str, str]:
    oids: dict[str, tuple[int, str] | None] = {}
    for path, ch in changes.items():
        oids[path] = None if ch is None else (ch[0], gs.write_blob(ch[1]))
    ours = gs.edit_tree(base_tree, {p: None if e is None else TreeEntry(e[1], e[0]) for p, e in oids.items()})
    gs.flush_objects()  # staged until now: git reads them from disk
    theirs = git_tree_after(repo, base_tree, oids, tmp_path / "scratch-index")
    return ours, theirs


CASES: dict[str, dict[str, Change]] = {
    "add-root-file": {"NEW": (BLOB, b"new\n")},
    "modify-nested": {"src/app.py": (BLOB, b"rewritten\n")},
    "delete-root-file": {"README": None},
    "delete-nested": {"src/util.py": None},
    "add-into-new-folders": {"a/b/c/new.txt": (BLOB, b"deep\n")},
    "add-into-existing-folder": {"src/extra/x.py": (BLOB, b"x\n")},
    "delete-last-file-removes-folder": {"docs/guide.txt": None},
    "delete-whole-folder-by-files": {"src/app.py": None, "src/util.py": None},
    "exec-bit": {"src/util.py": (EXEC, b"def f():\n    return 1\n")},
    "symlink": {"link": (LINK, b"README")},
    "git-sort-order": {"src.c": (BLOB, b"c\n"), "src-x": (BLOB, b"-\n"), "src0/x": (BLOB, b"0\n"),
                       "src/z": (BLOB, b"z\n")},
    "file-to-folder": {"README": None, "README/inner": (BLOB, b"inner\n")},
    "delete-missing-is-noop": {"nope/never.txt": None, "absent": None},
    "many-at-once": {"README": None, "src/app.py": (BLOB, b"1\n"), "docs/guide.txt": None,
                     "docs/new/deeper/n.txt": (BLOB, b"n\n"), "top": (EXEC, b"#!/bin/sh\n")},
    "delete-everything": {"README": None, "src/app.py": None, "src/util.py": None, "docs/guide.txt": None},
}


@pytest.mark.parametrize("name", list(CASES))
def test_edit_tree_equals_the_tree_git_writes(repo: Repo, gs: GitStore, tmp_path: Path, name: str) -> None:
    ours, theirs = edit_both(repo, gs, head_tree(repo), CASES[name], tmp_path)
    assert ours == theirs
    assert repo.git("cat-file", "-t", ours).strip() == "tree"


def test_edit_tree_from_nothing(repo: Repo, gs: GitStore, tmp_path: Path) -> None:
    changes: dict[str, Change] = {"a": (BLOB, b"a"), "x/y/z": (EXEC, b"z"), "x/w": (LINK, b"a")}
    ours, theirs = edit_both(repo, gs, None, changes, tmp_path)
    assert ours == theirs


def test_empty_result_is_gits_empty_tree(repo: Repo, gs: GitStore) -> None:
    assert gs.edit_tree(None, {}) == "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
    assert gs.edit_tree(None, {"a/b": None}) == "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def test_no_change_gives_the_same_tree(repo: Repo, gs: GitStore) -> None:
    t = head_tree(repo)
    assert gs.edit_tree(t, {}) == t
    blob = repo.git("rev-parse", "HEAD:src/app.py").strip()
    assert gs.edit_tree(t, {"src/app.py": TreeEntry(blob, BLOB)}) == t


def test_folder_to_file(repo: Repo, gs: GitStore, tmp_path: Path) -> None:
    ours, theirs = edit_both(repo, gs, head_tree(repo), {"docs/guide.txt": None, "docs": (BLOB, b"now a file\n")},
                             tmp_path)
    assert ours == theirs


def test_edit_tree_matches_a_commit_made_by_git(repo: Repo, gs: GitStore) -> None:
    base = repo.head()
    base_tree = gs.commit_tree(base)
    repo.write("src/app.py", "changed\n")
    repo.write("tools/run.sh", "#!/bin/sh\n", mode=0o755)
    os.symlink("README", repo.path / "lnk")
    repo.git("rm", "-q", "docs/guide.txt")
    theirs = repo.commit_all("by git")
    ours = gs.edit_tree(base_tree, {
        "src/app.py": TreeEntry(gs.write_blob(b"changed\n"), BLOB),
        "tools/run.sh": TreeEntry(gs.write_blob(b"#!/bin/sh\n"), EXEC),
        "lnk": TreeEntry(gs.write_blob(b"README"), LINK),
        "docs/guide.txt": None,
    })
    assert ours == gs.commit_tree(theirs)


class _CountingOdb:
    """``repo.odb`` of a :class:`CountingRepo`: raw reads counted too."""

    def __init__(self, real: Any, reads: list[str]) -> None:
        self._real = real
        self._reads = reads

    def read(self, key: Any) -> Any:
        self._reads.append(str(key))
        return self._real.read(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __contains__(self, key: Any) -> bool:
        return key in self._real


class CountingRepo:
    """A thin stand-in for ``GitStore.repo`` that records every object read and every tree handed
    to a TreeBuilder (libgit2 reads that one itself), and forwards everything else."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.reads: list[str] = []

    def __getitem__(self, key: Any) -> Any:
        self.reads.append(str(key))
        return self._real[key]

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads.append(str(key))
        return self._real.get(key, default)

    def git_object_lookup_prefix(self, key: Any) -> Any:
        self.reads.append(str(key))
        return self._real.git_object_lookup_prefix(key)

    @property
    def odb(self) -> Any:
        return _CountingOdb(self._real.odb, self.reads)

    def TreeBuilder(self, *args: Any) -> Any:  # noqa: N802 - pygit2's name
        if args:
            source = args[0]
            self.reads.append(str(getattr(source, "id", source)))
        return self._real.TreeBuilder(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def wide_repo(tmp_path_factory: pytest.TempPathFactory) -> Repo:
    """2000 folders, each with its own file, imported in one pack (fast)."""
    path = tmp_path_factory.mktemp("wide") / "repo"
    path.mkdir()
    # module scope runs before the function-scoped hermetic fixture: build a clean env by hand
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(path.parent), XDG_CONFIG_HOME=str(path.parent), GIT_CONFIG_NOSYSTEM="1")
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=path, env=env, check=True)
    lines = ["commit refs/heads/main", "committer T <t@e> 1700000000 +0000", "data 4", "wide"]
    for i in range(2000):
        body = f"file {i}\n".encode()
        lines += [f"M 100644 inline d{i:04}/f.txt", f"data {len(body)}", body.decode().rstrip("\n")]
    stream = ("\n".join(lines) + "\n").encode()
    subprocess.run(["git", "fast-import", "--quiet"], cwd=path, input=stream, env=env, check=True)
    return Repo(path)


@pytest.mark.parametrize(
    ("path", "entry_content"),
    [("d1000/f.txt", b"edited\n"), ("d1000/new/deeper/n.txt", b"n\n"), ("d1999/f.txt", None), ("zz/top", b"t")],
)
def test_edit_tree_reads_only_trees_on_the_changed_path(
    wide_repo: Repo, tmp_path: Path, path: str, entry_content: bytes | None
) -> None:
    gs = GitStore(str(wide_repo.path))
    base_tree = wide_repo.git("rev-parse", "main^{tree}").strip()
    assert len(wide_repo.git("ls-tree", base_tree).splitlines()) == 2000
    entry = None if entry_content is None else TreeEntry(gs.write_blob(entry_content), BLOB)
    counter = CountingRepo(gs.repo)
    with mock.patch.object(gs, "repo", counter):
        ours = gs.edit_tree(base_tree, {path: entry})
    # only the root and the trees that exist along the changed path are read, each at most once
    parts = path.split("/")
    on_path = {base_tree}
    for i in range(1, len(parts)):
        res = subprocess.run(["git", "rev-parse", "-q", "--verify", f"{base_tree}:{'/'.join(parts[:i])}"],
                             cwd=wide_repo.path, capture_output=True, text=True, check=False)
        if res.returncode == 0:
            on_path.add(res.stdout.strip())
    assert counter.reads, "nothing counted: the wrapper no longer sees the reads"
    assert set(counter.reads) <= on_path, counter.reads
    assert len(counter.reads) <= len(on_path) + 1, counter.reads
    gs.flush_objects()
    theirs = git_tree_after(wide_repo, base_tree, {path: None if entry is None else (BLOB, entry.oid)},
                            tmp_path / "idx")
    assert ours == theirs


# -- reading -------------------------------------------------------------------------------


def test_lookup_path_and_blocked_by(repo: Repo, gs: GitStore) -> None:
    os.symlink("src", repo.path / "lnk")
    repo.commit_all("link")
    tree = head_tree(repo)
    found = gs.lookup_path(tree, "src/app.py")
    assert found.entry is not None and found.entry.mode == BLOB
    assert gs.read_blob(found.entry.oid) == (repo.path / "src/app.py").read_bytes()
    assert gs.lookup_path(tree, "src/none.py").entry is None
    blocked = gs.lookup_path(tree, "lnk/app.py")
    assert blocked.entry is None and blocked.blocked_by == "lnk" and blocked.blocked_mode == LINK
    assert gs.lookup_path(tree, "README/x").blocked_by == "README"


def test_written_trees_and_commit_are_read_back_without_libgit2(repo: Repo, gs: GitStore) -> None:
    """The next call's base is usually the last call's commit: its commit and the trees it wrote are
    answered from the store, and every answer is the one libgit2 gives for the same tree."""
    os.symlink("src", repo.path / "lnk")
    repo.write("old/inner/file.txt", "old\n")
    repo.commit_all("link")
    base = repo.git("rev-parse", "HEAD").strip()
    blob = gs.write_blob(b"new\n")
    tree = gs.edit_tree(gs.commit_tree(base), {"src/deep/new.txt": TreeEntry(blob, BLOB),
                                               "src/deep/x.sh": TreeEntry(blob, EXEC)})
    commit = gs.create_commit(tree, [base], "made\n")
    gs.flush_objects()
    fresh = GitStore(str(repo.path))  # reads everything through libgit2
    paths = ["src/deep/new.txt", "src/deep/x.sh", "src/deep", "src", "src/app.py", "src/none.py",
             "src/deep/none/x", "src/deep/new.txt/x", "lnk/app.py", "README/x", "README", "none/x",
             "src/app.py/x/y", "old/inner/file.txt", "old/inner", "old/inner/none", "old/inner/file.txt/x/y",
             "src/", "src//app.py", "src/deep/", "/src", ""]
    counter = CountingRepo(gs.repo)
    with mock.patch.object(gs, "repo", counter):
        assert gs.commit_tree(commit) == tree == repo.git("rev-parse", f"{commit}^{{tree}}").strip()
        made = {p: gs.lookup_path(tree, p) for p in ["src/deep/new.txt", "src/deep/x.sh", "src/deep",
                                                     "src/deep/none/x", "src/deep/new.txt/x", "lnk/app.py",
                                                     "README/x", "none/x"]}
    assert counter.reads == [], "read through libgit2, not from the batch's trees"
    for path in paths:
        ours = made[path] if path in made else gs.lookup_path(tree, path)
        assert ours == fresh.lookup_path(tree, path), path
    assert made["lnk/app.py"].blocked_by == "lnk" and made["src/deep/new.txt/x"].blocked_by == "src/deep/new.txt"
    # below the batch's trees, libgit2 walks on (a path blocked there is still named from the top)
    assert gs.lookup_path(tree, "old/inner/file.txt/x/y").blocked_by == "old/inner/file.txt"


def test_a_failed_write_keeps_nothing_at_hand(repo: Repo, gs: GitStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what was written is answered from memory: after a failed write, libgit2 is asked."""
    from cas.errors import GitStoreError

    base = repo.git("rev-parse", "HEAD").strip()
    tree = gs.edit_tree(gs.commit_tree(base), {"src/new.txt": TreeEntry(gs.write_blob(b"n\n"), BLOB)})
    gs.create_commit(tree, [base], "failed\n")

    def failing(odb: pygit2.Odb, oid: str, header: bytes, data: bytes) -> None:
        raise GitStoreError(f"cannot write object '{oid}': no space left on device")

    with mock.patch("cas.loose_objects.write_object", failing), pytest.raises(GitStoreError):
        gs.flush_objects()
    gs.discard_pending()
    counter = CountingRepo(gs.repo)
    with mock.patch.object(gs, "repo", counter), pytest.raises(KeyError):  # the tree was never written
        gs.lookup_path(tree, "src/new.txt")
    assert counter.reads == [tree], "answered from objects that were never written"


def test_objects_are_written_loose_never_packed(repo: Repo, gs: GitStore) -> None:
    """A call's objects are loose files, as git's own writers make them; nothing in objects/pack changes."""
    packs_before = sorted(os.listdir(repo.path / ".git/objects/pack"))
    base = repo.head()
    blobs = [gs.write_blob(b"loose %d\n" % i) for i in range(5)]
    tree = gs.edit_tree(gs.commit_tree(base), {f"d/f{i}.txt": TreeEntry(b, BLOB) for i, b in enumerate(blobs)})
    commit = gs.create_commit(tree, [base], "loose\n")
    gs.flush_objects()
    for oid in [*blobs, tree, commit]:
        assert (repo.path / ".git/objects" / oid[:2] / oid[2:]).is_file(), oid
    assert sorted(os.listdir(repo.path / ".git/objects/pack")) == packs_before
    assert repo.git("cat-file", "-t", commit).strip() == "commit"
    repo.git("fsck", "--full", "--strict")


def test_compare_and_swap_writes_pruned_objects_again_under_the_lock(repo: Repo, gs: GitStore) -> None:
    """A 'git gc --prune=now' between the write and the move removed the unreferenced objects: the move
    writes them again under the ref's lock, never pointing the ref at a missing object."""
    base = repo.head()
    cand = new_commit(gs, base, b"pruned")
    gs.flush_objects()
    repo.git("gc", "-q", "--prune=now")
    assert subprocess.run(["git", "cat-file", "-e", cand], cwd=repo.path).returncode != 0, "gc kept it"
    gs.compare_and_swap("refs/heads/main", base, cand, "oncepatch: pruned")
    assert repo.head("refs/heads/main") == cand
    repo.git("fsck", "--full", "--strict")


def test_compare_and_swap_refuses_a_missing_object_it_cannot_write(repo: Repo, gs: GitStore) -> None:
    """An object the move needs and this store never wrote cannot be written again: rejected, nothing moved."""
    from cas.errors import ObjectsMissing

    base = repo.head()
    other = GitStore(str(repo.path))
    cand = new_commit(other, base, b"elsewhere")
    other.flush_objects()
    repo.git("gc", "-q", "--prune=now")
    with pytest.raises(ObjectsMissing) as ei:
        gs.compare_and_swap("refs/heads/main", base, cand, "oncepatch: missing")
    assert ei.value.retryable and ei.value.effect_status == "not_applied" and cand in ei.value.missing
    assert repo.head("refs/heads/main") == base
    assert not (repo.path / ".git/refs/heads/main.lock").exists()


def test_verification_asks_the_repository_not_the_last_batch(repo: Repo) -> None:
    """A long-lived caller's store verifies what the repository holds now: a commit pruned since is gone."""
    import patcher

    with patcher.Client(repo.path) as client:
        client.apply("--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hi\n", key="pruned")
        commit = repo.git("rev-parse", "HEAD").strip()
        # Taken away by hand: the branch and the key ref go back, the commit is pruned.
        repo.git("reset", "-q", "--hard", "HEAD~1")
        for ref in repo.git("for-each-ref", "--format=%(refname)", "refs/oncepatch/").split():
            repo.git("update-ref", "-d", ref)
        repo.git("reflog", "expire", "--expire=now", "--all")
        repo.git("gc", "-q", "--prune=now")
        assert repo.git("cat-file", "-t", commit, check=False).strip() != "commit"
        report = client.verify()
    assert not report.ok
    assert any(f"commit {commit} does not exist" in f.reason for f in report.failures), report.to_json()


def test_git_blob_oid_agrees_with_git(repo: Repo, tmp_path: Path) -> None:
    for data in (b"", b"hello\n", bytes(range(256)) * 50):
        f = tmp_path / "f"
        f.write_bytes(data)
        assert git_blob_oid(data) == repo.git("hash-object", str(f)).strip()


# -- compare_and_swap ----------------------------------------------------------------------


def new_commit(gs: GitStore, parent: str, content: bytes = b"x\n", msg: str = "candidate") -> str:
    tree = gs.edit_tree(gs.commit_tree(parent), {"cand.txt": TreeEntry(gs.write_blob(content), BLOB)})
    return gs.create_commit(tree, [parent], msg + "\n\nOncepatch-Call: opc1:test\n")


def test_compare_and_swap_moves_the_ref_with_a_reflog_entry(repo: Repo, gs: GitStore) -> None:
    base = repo.head()
    cand = new_commit(gs, base)
    gs.compare_and_swap("refs/heads/main", base, cand, "oncepatch: opc1:abc")
    assert repo.head("refs/heads/main") == cand == gs.resolve("refs/heads/main")
    assert repo.git("log", "-g", "--format=%H %gs", "-1", "refs/heads/main").strip() == f"{cand} oncepatch: opc1:abc"
    assert not os.path.exists(repo.path / ".git/refs/heads/main.lock")
    assert repo.git("log", "--format=%H", "-2").split() == [cand, base]
    repo.git("fsck", "--strict")


def test_compare_and_swap_creates_a_ref_expected_absent(repo: Repo, gs: GitStore) -> None:
    cand = new_commit(gs, repo.head())
    gs.compare_and_swap("refs/heads/fresh", None, cand, "create")
    assert repo.head("refs/heads/fresh") == cand


def test_compare_and_swap_refuses_when_the_ref_moved(repo: Repo, gs: GitStore) -> None:
    base = repo.head()
    cand = new_commit(gs, base)
    repo.write("README", "moved by someone else\n")
    moved = repo.commit_all("concurrent")
    with pytest.raises(RefMovedError) as ei:
        gs.compare_and_swap("refs/heads/main", base, cand, "m")
    err = ei.value
    assert (err.ref, err.actual, err.expected) == ("refs/heads/main", moved, base)
    assert err.message == f"cannot lock ref 'refs/heads/main': is at {moved[:12]} but expected {base[:12]}"
    assert err.effect_status == "not_applied" and err.retryable
    assert repo.head("refs/heads/main") == moved  # not moved by us
    assert cand not in repo.git("log", "-g", "--format=%H", "refs/heads/main").split()
    assert not os.path.exists(repo.path / ".git/refs/heads/main.lock")
    with pytest.raises(RefMovedError):
        gs.compare_and_swap("refs/heads/main", None, cand, "expected absent")
    assert repo.head("refs/heads/main") == moved


def test_compare_and_swap_refuses_a_held_lock_and_leaves_it(repo: Repo, gs: GitStore) -> None:
    base = repo.head()
    cand = new_commit(gs, base)
    lock = repo.path / ".git" / "refs" / "heads" / "main.lock"
    lock.write_text("held by another git\n")
    t0 = time.monotonic()
    with pytest.raises(RefLockedError) as ei:
        gs.compare_and_swap("refs/heads/main", base, cand, "m", lock_timeout=0.2)
    assert time.monotonic() - t0 >= 0.2  # waited for it, like git's core.filesRefLockTimeout
    assert ei.value.lock_path == str(lock)
    assert f"'{lock}'" in ei.value.message
    assert ei.value.details["lock_path"] == str(lock) and ei.value.exit_code == 5
    assert lock.read_text() == "held by another git\n"  # someone else's lock: never removed
    assert repo.head("refs/heads/main") == base


def test_compare_and_swap_waits_for_a_briefly_held_lock(repo: Repo, gs: GitStore) -> None:
    base = repo.head()
    cand = new_commit(gs, base)
    lock = repo.path / ".git" / "refs" / "heads" / "main.lock"
    lock.write_text("")
    timer = threading.Timer(0.2, lock.unlink)
    timer.start()
    try:
        gs.compare_and_swap("refs/heads/main", base, cand, "after wait", lock_timeout=5)
    finally:
        timer.cancel()
        timer.join()
    assert repo.head("refs/heads/main") == cand


def test_lock_path_of_a_linked_worktree_is_in_the_common_dir(repo: Repo, tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    repo.git("worktree", "add", "-q", "-b", "feat", str(wt))
    gs = GitStore(str(wt))
    base = repo.head("feat")
    lock = repo.path / ".git" / "refs" / "heads" / "feat.lock"
    lock.write_text("")
    with pytest.raises(RefLockedError) as ei:
        gs.compare_and_swap("refs/heads/feat", base, new_commit(gs, base), "m", lock_timeout=0.05)
    assert ei.value.lock_path == os.path.join(os.path.realpath(repo.path / ".git"), "refs/heads/feat.lock")


def test_git_commit_fails_while_our_transaction_holds_the_lock(repo: Repo, gs: GitStore) -> None:
    base = repo.head()
    cand = new_commit(gs, base)
    seen: dict[str, Any] = {}

    def race() -> None:
        # runs under the ref lock, after the compare: git must be locked out now
        seen["lock_exists"] = os.path.exists(repo.path / ".git/refs/heads/main.lock")
        seen["git"] = subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "racer"], cwd=repo.path,
                                     capture_output=True, text=True, check=False)

    gs.compare_and_swap("refs/heads/main", base, cand, "oncepatch: race", precondition=race)
    assert seen["lock_exists"]
    assert seen["git"].returncode != 0
    assert "main.lock" in seen["git"].stderr
    assert repo.head("refs/heads/main") == cand
    assert repo.count("refs/heads/main") == 2  # initial + ours; git's racer never landed
    assert not os.path.exists(repo.path / ".git/refs/heads/main.lock")


# -- key refs, ancestry, reflog --------------------------------------------------------------


def test_create_key_ref_is_create_only(repo: Repo, gs: GitStore) -> None:
    base = repo.head()
    c1 = new_commit(gs, base, b"1")
    c2 = new_commit(gs, base, b"2")
    ref = KEY_REF_PREFIX + "ab" * 32
    assert gs.create_key_ref(ref, c1, "oncepatch: key") is True
    assert repo.git("for-each-ref", "--format=%(objectname)", ref).strip() == c1
    assert gs.create_key_ref(ref, c1, "again") is False  # idempotent for the same target
    with pytest.raises(RefMovedError) as ei:
        gs.create_key_ref(ref, c2, "elsewhere")
    assert ei.value.actual == c1 and ei.value.expected is None
    assert gs.resolve(ref) == c1
    # a loose ref with its reflog entry (libgit2's): git reads both
    assert (repo.path / ".git" / ref).read_text() == c1 + "\n"
    assert not (repo.path / ".git" / (ref + ".lock")).exists()
    log = repo.git("reflog", "show", "--format=%H %gs", ref).splitlines()
    assert log == [f"{c1} oncepatch: key"]
    repo.git("fsck", "--strict", "--no-dangling")


def _held_key_ref_lock(repo: Repo) -> tuple[str, Path]:
    ref = KEY_REF_PREFIX + "cd" * 32
    lock = repo.path / ".git" / (ref + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    return ref, lock


def test_create_key_ref_with_a_held_lock_raises_ref_locked(repo: Repo, gs: GitStore) -> None:
    ref, lock = _held_key_ref_lock(repo)
    with pytest.raises(RefLockedError):
        gs.create_key_ref(ref, repo.head(), "m")


def test_create_key_ref_with_a_held_lock_creates_nothing(repo: Repo, gs: GitStore) -> None:
    ref, lock = _held_key_ref_lock(repo)
    with pytest.raises((RefLockedError, OSError)):
        gs.create_key_ref(ref, repo.head(), "m")
    assert gs.resolve(ref) is None and lock.exists()


def test_is_ancestor(repo: Repo, gs: GitStore) -> None:
    c0 = repo.head()
    c1 = repo.commit_all("one")
    c2 = repo.commit_all("two")
    side = new_commit(gs, c0, b"side")
    assert gs.is_ancestor(c0, c2) and gs.is_ancestor(c1, c2) and gs.is_ancestor(c2, c2)
    assert not gs.is_ancestor(c2, c0)
    assert not gs.is_ancestor(side, c2) and not gs.is_ancestor(c2, side)
    assert gs.is_ancestor(c0, side)
    assert not gs.is_ancestor("1" * 40, c2)


def test_open_non_repo_is_usage_error(tmp_path: Path) -> None:
    from cas.errors import UsageError

    (tmp_path / "plain").mkdir()
    with pytest.raises(UsageError):
        GitStore(str(tmp_path / "plain"))


def test_store_of_a_second_repo_is_independent(tmp_path: Path) -> None:
    a = make_repo(tmp_path / "a", {"f": "a\n"})
    b = make_repo(tmp_path / "b", {"f": "b\n"})
    ga, gb = GitStore(str(a.path)), GitStore(str(b.path))
    assert ga.resolve("refs/heads/main") == a.head() != gb.resolve("refs/heads/main")
    assert not gb.has_object(a.head()) and ga.has_object(a.head())


# -- objects serialised here, read back by libgit2 and git --------------------------------------

_COMMIT_PROBE = r"""
import json, os, sys
import pygit2
from cas.objects import GitStore, Signature
os.environ["GIT_COMMITTER_NAME"], os.environ["GIT_COMMITTER_EMAIL"] = sys.argv[3], sys.argv[4]
gs = GitStore(sys.argv[1])
tree = gs.commit_tree(gs.resolve("refs/heads/main"))
parent = gs.resolve("refs/heads/main")
oid = gs.create_commit(tree, [parent], sys.argv[2], Signature(sys.argv[3], sys.argv[4]))
gs.flush_objects()
c = gs.repo[pygit2.Oid(hex=oid)]
sig = pygit2.Signature(sys.argv[3], sys.argv[4], c.author.time, c.author.offset)
same = gs.repo.create_commit_string(sig, sig, sys.argv[2], pygit2.Oid(hex=tree), [pygit2.Oid(hex=parent)])
print(json.dumps({"oid": oid, "offset": c.author.offset, "name": c.author.name, "email": c.author.email,
                  "raw": gs.repo.odb.read(pygit2.Oid(hex=oid))[1].decode(), "libgit2": same}))
"""


@pytest.mark.parametrize("tz", ["UTC", "Asia/Kolkata", "America/St_Johns", "Pacific/Kiritimati"])
def test_commit_bytes_equal_libgit2s_in_any_time_zone(repo: Repo, tz: str) -> None:
    import json
    import sys

    env = dict(os.environ, TZ=tz, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    msg = "subject ünïcode\n\nbody\n\nOncepatch-Call: opc1:x\n"
    res = subprocess.run([sys.executable, "-c", _COMMIT_PROBE, str(repo.path), msg, "  Ann Ö. Author ", "ann@ex.org"],
                         env=env, capture_output=True, text=True, check=True)
    out = json.loads(res.stdout)
    assert out["raw"] == out["libgit2"]  # byte for byte what libgit2 would have written
    assert out["name"] == "Ann Ö. Author" and out["email"] == "ann@ex.org"
    repo.git("fsck", "--strict", "--no-dangling")
    assert repo.git("cat-file", "-t", out["oid"]).strip() == "commit"


def test_unusual_modes_are_written_canonical_like_git(repo: Repo, gs: GitStore) -> None:
    """An old tree with a 100664 entry: rewriting its tree writes git's canonical 100644 (as git commit would)."""
    blob = gs.write_blob(b"x\n")
    gs.flush_objects()
    odd = subprocess.run(["git", "mktree"], cwd=repo.path, input=f"100664 blob {blob}\tgroup-writable\n",
                         capture_output=True, text=True, check=True).stdout.strip()
    new = gs.edit_tree(odd, {"added": TreeEntry(blob, BLOB)})
    gs.flush_objects()
    listing = repo.git("ls-tree", new)
    assert listing.splitlines() == [f"100644 blob {blob}\tadded", f"100644 blob {blob}\tgroup-writable"]


def test_a_kept_store_opens_its_object_database_again_once_git_replaced_its_packs(repo: Repo) -> None:
    """A long-lived caller (a server's worker) keeps its GitStore between calls; git's maintenance may remove
    the packs its object database listed.  ``open_store`` opens it again then, as a new process would: a
    server's call beside ``git repack -a -d`` / ``multi-pack-index expire`` failed with libgit2's "invalid
    packfile" on a pack removed since (tests/integration/test_maintenance.py, the served kill soak, 2 runs of
    2 before, none after), call after call for that worker."""
    from cas.objects import open_store

    repo.git("repack", "-q", "-d")
    stores: dict[str, GitStore] = {}
    kept = open_store(str(repo.path), stores)
    head = repo.head()
    assert kept.has_object(head) and not kept.packs_changed()
    assert open_store(str(repo.path), stores) is kept
    repo.write("more.txt", "more\n")
    repo.commit_all("more")
    repo.git("repack", "-q", "-a", "-d")  # the old pack removed, a new one written
    assert kept.packs_changed()
    again = open_store(str(repo.path), stores)
    assert again is kept and not kept.packs_changed()
    assert bytes(kept.repo.odb.read(head)[1]) == bytes(pygit2.Repository(str(repo.path)).odb.read(head)[1])

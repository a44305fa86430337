"""cas.loose_objects: a call's new objects synced together before their final names, and their folders after.

The syscall order of a whole apply is held by test_fsync_order.py (strace); these
record the rounds in process, at the seam (``fsync_all``), against real libgit2 and git.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import cas.loose_objects as lo
from cas.objects import GitStore, TreeEntry
from tests.conftest import Repo

BLOB = 0o100644


class Rounds:
    """Records each ``fsync_all`` round of cas.loose_objects: its paths and which final object files existed then."""

    def __init__(self, objects: Path, oids: list[str], during: Any = None) -> None:
        self.objects, self.oids, self.during = objects, oids, during
        self.seen: list[tuple[list[str], set[str]]] = []
        self.real = lo.fsync_all

    def __call__(self, paths: Any) -> None:
        paths = [str(p) for p in paths]
        present = {oid for oid in self.oids if (self.objects / oid[:2] / oid[2:]).is_file()}
        self.seen.append((paths, present))
        if self.during is not None:
            during, self.during = self.during, None
            during()
        self.real(paths)


def _stage(gs: GitStore, repo: Repo, tag: bytes) -> list[str]:
    """Stage a commit adding one file two folders deep; every object staged (blob, four trees, commit)."""
    base = repo.head()
    blob = gs.write_blob(b"content " + tag + b"\n")
    tree = gs.edit_tree(gs.commit_tree(base), {f"new/{tag.decode()}/file.txt": TreeEntry(blob, BLOB)})
    gs.create_commit(tree, [base], "batch\n")
    return list(gs._pending)


def test_new_objects_are_synced_before_their_final_names_and_their_folders_after(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    gs = GitStore(str(repo.path))
    objects = repo.path / ".git" / "objects"
    oids = _stage(gs, repo, b"one")
    new = [oid for oid in oids if not (objects / oid[:2] / oid[2:]).exists()]
    assert new, oids
    rounds = Rounds(objects, oids)
    monkeypatch.setattr(lo, "fsync_all", rounds)
    gs.flush_objects()

    assert len(rounds.seen) == 2, rounds.seen  # one round for the files, one for their folders
    (files, present_then), (folders, present_after) = rounds.seen
    # round 1: every new object's file, synced in the temporary object folder, none at its final name yet
    assert sorted(os.path.basename(os.path.dirname(p)) + os.path.basename(p) for p in files) == sorted(new)
    tmp_objdir = {os.path.dirname(os.path.dirname(p)) for p in files}
    assert len(tmp_objdir) == 1 and os.path.basename(tmp_objdir.pop()).startswith(lo.TMP_OBJDIR_PREFIX)
    assert not present_then & set(new)
    assert all(Path(p).is_relative_to(objects) for p in files)
    # round 2: every object at its final name, each fan-out folder synced
    assert set(new) <= present_after
    assert {str(objects / oid[:2]) for oid in new} <= set(folders)
    # the temporary folder is kept for the next batch (its fan-out folders too), with no file left in it
    kept = [p for p in objects.iterdir() if p.name.startswith("tmp_")]
    assert [p.name for p in kept] == [os.path.basename(os.path.dirname(os.path.dirname(files[0])))]
    assert not [f for f in kept[0].rglob("*") if not f.is_dir()]
    repo.git("fsck", "--full", "--strict")


def test_a_new_fanout_folder_is_synced_in_objects(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    gs = GitStore(str(repo.path))
    objects = repo.path / ".git" / "objects"
    oids = _stage(gs, repo, b"fanout")
    for oid in oids:  # make every fan-out folder new (git would prune them empty as well)
        folder = objects / oid[:2]
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    made = [oid for oid in oids if not (objects / oid[:2]).exists()]
    assert made
    rounds = Rounds(objects, oids)
    monkeypatch.setattr(lo, "fsync_all", rounds)
    gs.flush_objects()
    assert str(objects) in rounds.seen[-1][0]  # the new folders' entries live in objects/


def test_objects_already_there_are_freshened_not_written_again(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object the repository has (loose here) is freshened by libgit2, as git_odb_write does: no batch, no sync."""
    gs = GitStore(str(repo.path))
    objects = repo.path / ".git" / "objects"
    blob = gs.write_blob(b"content again\n")
    gs.flush_objects()
    path = objects / blob[:2] / blob[2:]
    os.utime(path, (1_000_000_000, 1_000_000_000))
    gs.discard_pending()
    rounds = Rounds(objects, [blob])
    monkeypatch.setattr(lo, "fsync_all", rounds)
    assert gs.write_blob(b"content again\n") == blob
    gs.flush_objects()
    assert rounds.seen == []
    assert path.stat().st_mtime > 1_000_000_000  # freshened: gc's grace period starts again


def test_a_prune_that_removes_the_temporary_folder_mid_batch_is_survived(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """'git prune --expire=now' (unsafe beside writers, git says) removes every tmp_ entry in objects/,
    the batch's folder too: the batch is written again, whole."""
    gs = GitStore(str(repo.path))
    objects = repo.path / ".git" / "objects"
    oids = _stage(gs, repo, b"pruned")
    pruned: list[bool] = []

    def prune() -> None:
        subprocess.run(["git", "prune", "--expire=now"], cwd=repo.path, check=True)
        pruned.append(not [p for p in objects.iterdir() if p.name.startswith(lo.TMP_OBJDIR_PREFIX)])

    rounds = Rounds(objects, oids, during=prune)
    monkeypatch.setattr(lo, "fsync_all", rounds)
    gs.flush_objects()
    assert pruned == [True], "git prune left the temporary object folder"
    assert len(rounds.seen) >= 3  # the first batch's file round, then a whole second batch
    for oid in oids:
        assert (objects / oid[:2] / oid[2:]).is_file(), oid
    repo.git("cat-file", "-e", oids[-1])
    repo.git("fsck", "--full", "--strict")


def test_stale_tmp_objdirs_are_ours_and_old_only(tmp_path: Path) -> None:
    objects = tmp_path / "objects"
    objects.mkdir()
    old, fresh = objects / f"{lo.TMP_OBJDIR_PREFIX}1-aa", objects / f"{lo.TMP_OBJDIR_PREFIX}2-bb"
    for d in (old, fresh):
        (d / "ab").mkdir(parents=True)
        (d / "ab" / "cdef").write_bytes(b"x")
    os.utime(old, (1_000_000_000, 1_000_000_000))
    gits = objects / "tmp_objdir-incoming-cc"  # git's own receive-pack folder: not ours
    gits.mkdir()
    os.utime(gits, (1_000_000_000, 1_000_000_000))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    link = objects / f"{lo.TMP_OBJDIR_PREFIX}3-dd"
    link.symlink_to(target)
    os.utime(link, (1_000_000_000, 1_000_000_000), follow_symlinks=False)

    assert lo.stale_tmp_objdirs(str(objects), 3600, remove=False) == [str(old)]
    assert old.exists()
    assert lo.stale_tmp_objdirs(str(objects), 3600) == [str(old)]
    assert not old.exists() and fresh.exists() and gits.exists() and (target / "keep").exists()


def test_a_repository_is_not_opened_while_libgit2s_syncs_are_off(repo: Repo) -> None:
    """libgit2's ref store takes the fsync switch's value once, when created: a repository opened
    while another thread writes unsynced objects would write its refs unsynced for good."""
    lo.enable_fsync()
    opened = threading.Event()

    def open_it() -> None:
        lo.open_repository(str(repo.path))
        opened.set()

    with lo._unsynced_objects():
        t = threading.Thread(target=open_it)
        t.start()
        # The point of the test is a wait that never ends while the switch is off: a brief one.
        assert not opened.wait(0.2), "a repository was opened while libgit2's syncs were off"
    assert opened.wait(10)
    t.join()


class BatchRounds:
    """Records each ``fsync_all`` round of a DurableBatch: its targets (descriptors resolved) and the object files then."""

    def __init__(self, objects: Path, oids: list[str], during: Any = None) -> None:
        import cas.durable

        self.objects, self.oids, self.during = objects, oids, during
        self.seen: list[tuple[list[str], set[str]]] = []
        self.real = cas.durable.fsync_all

    def __call__(self, paths: Any, **kw: Any) -> None:
        paths = list(paths)
        shown = [os.readlink(f"/proc/self/fd/{p}") if isinstance(p, int) else str(p) for p in paths]
        present = {oid for oid in self.oids if (self.objects / oid[:2] / oid[2:]).is_file()}
        self.seen.append((shown, present))
        if self.during is not None:
            during, self.during = self.during, None
            during()
        self.real(paths, **kw)


def test_objects_and_a_batch_that_names_them_share_its_two_rounds(
        repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cas.durable

    gs = GitStore(str(repo.path))
    objects = repo.path / ".git" / "objects"
    oids = _stage(gs, repo, b"joined")
    new = [oid for oid in oids if not (objects / oid[:2] / oid[2:]).exists()]
    (tmp_path / "store").mkdir()
    receipt = tmp_path / "store" / "receipt.json"
    seen_at_rename: list[set[str]] = []

    def step(batch: cas.durable.DurableBatch | None) -> str:
        assert batch is not None
        batch.add(str(receipt), b"names the candidate\n")
        batch.commit(before_replace=lambda: seen_at_rename.append(
            {oid for oid in new if (objects / oid[:2] / oid[2:]).is_file()}))
        return "done"

    rounds = BatchRounds(objects, oids)
    monkeypatch.setattr(cas.durable, "fsync_all", rounds)
    assert gs.flush_objects_with(step) == "done"
    assert len(rounds.seen) == 2, rounds.seen  # one round for every file, one for every folder
    (files, present_then), (folders, _after) = rounds.seen
    synced = {os.path.basename(os.path.dirname(p)) + os.path.basename(p) for p in files}
    assert set(new) <= synced and any(cas.durable.TMP_MARK in p for p in files)  # the receipt's tmp file too
    assert not present_then & set(new)  # no object had its name before its bytes were synced
    assert seen_at_rename == [set(new)]  # every object in place before the receipt's rename
    assert {str(objects / oid[:2]) for oid in new} <= set(folders) and str(receipt.parent) in folders
    assert receipt.read_bytes() == b"names the candidate\n" and gs._pending == {}
    repo.git("fsck", "--full", "--strict")


def test_a_prune_under_a_joined_batch_writes_the_objects_alone_then_the_batch(
        repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cas.durable

    gs = GitStore(str(repo.path))
    objects = repo.path / ".git" / "objects"
    oids = _stage(gs, repo, b"joined-pruned")
    (tmp_path / "store").mkdir()
    receipt = tmp_path / "store" / "receipt.json"
    batches: list[bool] = []

    def step(batch: cas.durable.DurableBatch | None) -> None:
        batches.append(batch is not None)
        batch = batch if batch is not None else cas.durable.DurableBatch()
        batch.add(str(receipt), b"x\n")
        batch.commit()

    def prune() -> None:
        subprocess.run(["git", "prune", "--expire=now"], cwd=repo.path, check=True)

    monkeypatch.setattr(cas.durable, "fsync_all", BatchRounds(objects, oids, during=prune))
    gs.flush_objects_with(step)
    assert batches == [True, False]  # the joined batch renamed nothing; then the objects alone, then the receipt
    assert receipt.read_bytes() == b"x\n" and not [p for p in receipt.parent.iterdir() if p != receipt]
    for oid in oids:
        assert (objects / oid[:2] / oid[2:]).is_file(), oid
    repo.git("fsck", "--full", "--strict")


EXIT_WRITER = r"""
import hashlib
import sys
from cas.loose_objects import write_new
from cas.objects import GitStore
gs = GitStore(sys.argv[1])
blobs = {}
for n in range(int(sys.argv[2])):
    data = b"blob %d\n" % n
    header = b"blob %d\0" % len(data)
    blobs[hashlib.sha1(header + data).hexdigest()] = (header, data)
write_new(gs.repo.odb, sys.argv[1] + "/.git/objects", blobs)
print(len({oid[:2] for oid in blobs}))
"""


@pytest.mark.parametrize("count", [3, 200])
def test_the_temporary_folder_goes_as_the_process_exits(repo: Repo, count: int) -> None:
    # Few fan-out folders are removed in turn, many on threads (lo._RMDIR_AT_ONCE_FROM):
    # either way nothing of the process's temporary folder is left, and the objects are there.
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", EXIT_WRITER, str(repo.path), str(count)], env=env,
                         capture_output=True, text=True, check=True)
    fanouts = int(out.stdout)
    assert (fanouts >= lo._RMDIR_AT_ONCE_FROM) == (count == 200), fanouts
    objects = repo.path / ".git" / "objects"
    assert not [p for p in objects.iterdir() if p.name.startswith(lo.TMP_OBJDIR_PREFIX)]
    repo.git("cat-file", "-e", repo.git("hash-object", "--stdin", input=b"blob 0\n").strip())
    repo.git("fsck", "--full", "--strict")

"""cas.packs and one pack per call, against git itself: format, merging, readers while packs go."""

from __future__ import annotations

import hashlib
import os
import time
import struct
import subprocess
from pathlib import Path

import pygit2
import pytest

from cas import packs
from cas.durable import DurableBatch
from cas.errors import DurableWriteError
from cas.objects import GitStore
from patcher.protocol import apply
from tests.conftest import Repo, make_repo


def blob(data: bytes) -> tuple[str, bytes, bytes]:
    header = b"blob %d\0" % len(data)
    return hashlib.sha1(header + data).hexdigest(), header, data


def write_pack(pack_dir: Path, objects: list[tuple[str, bytes, bytes]]) -> Path:
    b = packs.PackBuilder()
    for oid, header, data in objects:
        b.add_object(oid, header, data)
    checksum, pack, idx = b.build()
    pack_dir.mkdir(parents=True, exist_ok=True)
    stem = pack_dir / f"pack-{checksum}"
    stem.with_suffix(".pack").write_bytes(pack)
    stem.with_suffix(".idx").write_bytes(idx)
    return stem


def pack_names(repo: Repo) -> list[str]:
    return sorted(p.name for p in (repo.path / ".git/objects/pack").glob("pack-*.idx"))


def test_a_built_pack_is_read_by_git(repo: Repo) -> None:
    objects = [blob(b"x" * n + b"\n") for n in range(0, 300, 7)] + [blob(os.urandom(70_000))]
    stem = write_pack(repo.path / ".git/objects/pack", objects)
    out = repo.git("verify-pack", "-v", str(stem.with_suffix(".idx")))
    assert f"non delta: {len(objects)} objects" in out
    for oid, _header, data in objects:
        assert subprocess.run(["git", "cat-file", "blob", oid], cwd=repo.path, capture_output=True,
                              check=True).stdout == data
    assert pygit2.Repository(str(repo.path)).odb.read(objects[-1][0])[1] == objects[-1][2]


def test_entries_read_back_are_the_ones_written(tmp_path: Path) -> None:
    objects = [blob(b"%d\n" % i) for i in range(40)]
    stem = write_pack(tmp_path, objects)
    entries = packs.read_entries(str(stem))
    assert entries is not None
    assert sorted(e[0].hex() for e in entries) == sorted(o[0] for o in objects)
    again = packs.PackBuilder()
    for oid, entry, crc in entries:
        again.add_entry(oid, entry, crc)
    assert again.build()[0] == stem.name[len("pack-"):]  # same entries, same order: the same pack


@pytest.mark.parametrize("damage", ["pack-byte", "idx-byte", "truncated", "no-pack", "crc"])
def test_a_pack_that_is_not_whole_is_never_taken(tmp_path: Path, damage: str) -> None:
    stem = write_pack(tmp_path, [blob(b"a\n"), blob(b"b\n"), blob(b"c\n")])
    pack, idx = stem.with_suffix(".pack"), stem.with_suffix(".idx")
    if damage == "pack-byte":
        data = bytearray(pack.read_bytes())
        data[20] ^= 1
        pack.write_bytes(bytes(data))
    elif damage == "idx-byte":
        data = bytearray(idx.read_bytes())
        data[1040] ^= 1
        idx.write_bytes(bytes(data))
    elif damage == "truncated":
        pack.write_bytes(pack.read_bytes()[:-1])
    elif damage == "no-pack":
        pack.unlink()
    else:  # a CRC that does not match its entry, with both checksums made good again
        data = bytearray(idx.read_bytes())
        n = 3
        data[1032 + 20 * n] ^= 1
        body = bytes(data[:-20])
        idx.write_bytes(body + hashlib.sha1(body).digest())
    assert packs.read_entries(str(stem)) is None


def test_a_pack_with_deltas_is_never_copied(repo: Repo) -> None:
    text = "".join(f"line {i}\n" for i in range(2000))
    for i in range(4):
        repo.write("big.txt", text + f"change {i}\n")
        repo.commit_all(f"c{i}")
    repo.git("repack", "-adq", "--window=10")
    (idx,) = (repo.path / ".git/objects/pack").glob("pack-*.idx")
    assert "delta" in repo.git("verify-pack", "-v", str(idx)).split("non delta")[1]  # it has deltas
    assert packs.read_entries(str(idx.with_suffix(""))) is None


def test_small_packs_leaves_out_what_a_merge_must_not_take(tmp_path: Path) -> None:
    stems = [write_pack(tmp_path, [blob(b"%d-%d\n" % (i, j)) for j in range(i + 1)]) for i in range(8)]
    for stem, ext in zip(stems[1:], (".keep", ".promisor", ".mtimes", ".bitmap", ".rev")):
        stem.with_suffix(ext).write_bytes(b"")
    stems[6].with_suffix(".pack").unlink()
    (tmp_path / "pack-0000.idx").write_bytes(b"x" * 10)  # not an idx v2 size
    (tmp_path / "other.idx").write_bytes(b"")
    found = packs.small_packs(str(tmp_path))
    assert [(os.path.basename(p.stem), p.count) for p in found] == [(stems[0].name, 1), (stems[7].name, 8)]
    assert packs.small_packs(str(tmp_path / "missing")) == []
    (tmp_path / "multi-pack-index").write_bytes(b"")  # it may name them: only git's repack rewrites it
    assert packs.small_packs(str(tmp_path)) == []


def test_choose_merge_is_geometric_and_bounded() -> None:
    def sp(*counts: int) -> list[packs.SmallPack]:
        return [packs.SmallPack(f"p{i}", c) for i, c in enumerate(counts)]

    assert packs.choose_merge(7, sp(*[7] * (packs.MERGE_TRIGGER - 2))) == []  # too few to bother
    assert [p.count for p in packs.choose_merge(7, sp(*[7] * 7))] == [7] * 7
    assert [p.count for p in packs.choose_merge(7, sp(*[7] * 8))] == [7] * 8
    # many packs, but few the rule would take: no merge (it would copy the same packs every call)
    assert packs.choose_merge(7, sp(7, 30, 80, 250, 700, 2000, 3000, 3500)) == []
    # the smallest in turn, while each is smaller than twice what is merged so far
    assert [p.count for p in packs.choose_merge(7, sp(7, 7, 7, 7, 7, 7, 7, 300))] == [7] * 7
    assert [p.count for p in packs.choose_merge(7, sp(7, 7, 7, 7, 7, 7, 7, 60))] == [7] * 7 + [60]
    # never past SMALL_MAX
    assert packs.SMALL_MAX == 4096
    chosen = packs.choose_merge(7, sp(*[7] * 7, 40, 100, 300, 700, 1500, 3000))
    assert [p.count for p in chosen] == [7] * 7 + [40, 100, 300, 700, 1500]


def test_when_durable_runs_after_the_last_round_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    b = DurableBatch()
    b.add(str(tmp_path / "a"), b"a")
    b.when_durable(lambda: ran.append(1))
    b.commit()
    assert ran == [1]
    b = DurableBatch()
    b.add(str(tmp_path / "b"), b"b")
    b.when_durable(lambda: ran.append(2))
    with pytest.raises(ValueError):
        b.commit(defer_folders=[])
    assert not (tmp_path / "b").exists() and ran == [1]

    def fail(fd: int) -> None:
        raise OSError(5, "EIO")

    monkeypatch.setattr(os, "fsync", fail)
    b = DurableBatch()
    b.add(str(tmp_path / "c"), b"c")
    b.when_durable(lambda: ran.append(3))
    with pytest.raises(DurableWriteError):
        b.commit()
    assert ran == [1]


def one_patch(repo: Repo, i: int, branch: str = "side") -> bytes:
    return (f"--- a/f{i % 5}.txt\n+++ b/f{i % 5}.txt\n@@ -1 +1 @@\n-{'v' + str(i // 5) if i >= 5 else 'base'}\n"
            f"+v{i // 5 + 1}\n").encode()


@pytest.fixture
def five(tmp_path: Path) -> Repo:
    files: dict[str, str | bytes] = {f"f{i}.txt": "base\n" for i in range(5)}
    repo = make_repo(tmp_path / "repo", files | {"d/e/g.txt": "deep\n"})
    repo.git("branch", "side")
    return repo


def test_calls_write_one_pack_each_and_merge_them(five: Repo) -> None:
    """Each call's objects land in one pack; the packs are merged as they pile up, and git finds every object."""
    stores: dict[str, object] = {}
    old = pygit2.Repository(str(five.path))  # a long-lived reader opened before any pack came or went
    reader = subprocess.Popen(["git", "cat-file", "--batch-check"], cwd=five.path, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert reader.stdin is not None and reader.stdout is not None
    loose = set((five.path / ".git/objects").glob("[0-9a-f][0-9a-f]/*"))  # git's own, from the set-up
    commits: list[str] = []
    most = 0
    try:
        for i in range(60):
            res = apply(str(five.path), one_patch(five, i), branch="side", _stores=stores)
            assert res.status == "committed" and res.commit is not None
            commits.append(res.commit)
            most = max(most, len(pack_names(five)))
            for c in commits:  # everything written so far is found, by git and by libgit2, while packs go
                reader.stdin.write(f"{c}\n".encode())
                reader.stdin.flush()
                assert reader.stdout.readline().split()[1] == b"commit"
                assert old[c].type == pygit2.enums.ObjectType.COMMIT
    finally:
        reader.stdin.close()
        reader.wait()
    assert set((five.path / ".git/objects").glob("[0-9a-f][0-9a-f]/*")) == loose  # no call wrote a loose object
    # bounded: merged as they pile up, the merged ones kept a while for readers (never near git's 50)
    assert most <= packs.MERGE_TRIGGER + packs.RETIRE_MAX + 3, most
    five.git("fsck", "--strict", "--no-dangling")
    assert five.git("rev-parse", "side") == commits[-1] + "\n"
    assert five.git("show", "side:f4.txt") == "v12\n"
    time.sleep(packs.RETIRE_GRACE + 0.1)
    last = apply(str(five.path), one_patch(five, 60), branch="side", _stores=stores)
    assert last.status == "committed" and last.commit is not None
    commits.append(last.commit)
    assert len(pack_names(five)) <= packs.MERGE_TRIGGER + 3  # once their grace passed, the merged ones went
    five.git("gc", "-q")  # and git repacks them as its own
    assert len(pack_names(five)) == 1 and five.git("rev-parse", "side") == commits[-1] + "\n"


def test_a_single_object_and_a_big_one_stay_loose(five: Repo) -> None:
    gs = GitStore(str(five.path))
    before = pack_names(five)
    oid = gs.write_blob(b"only one\n")
    gs.flush_objects()
    assert (five.path / ".git/objects" / oid[:2] / oid[2:]).exists() and pack_names(five) == before
    big = os.urandom(packs.OBJECT_MAX + 1)
    small = [gs.write_blob(b"small %d\n" % i) for i in range(3)]
    big_oid = gs.write_blob(big)
    gs.flush_objects()
    assert (five.path / ".git/objects" / big_oid[:2] / big_oid[2:]).exists()
    (new,) = set(pack_names(five)) - set(before)
    listed = five.git("verify-pack", "-v", str(five.path / ".git/objects/pack" / new))
    assert all(o in listed for o in small) and big_oid not in listed
    assert five.git("cat-file", "-s", big_oid).strip() == str(len(big))


def test_a_failed_batch_removes_no_merged_pack(five: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    pack_dir = five.path / ".git/objects/pack"
    small = [write_pack(pack_dir, [blob(b"p%d-%d\n" % (i, j)) for j in range(2)]) for i in range(packs.MERGE_TRIGGER)]
    gs = GitStore(str(five.path))
    for i in range(3):
        gs.write_blob(b"new %d\n" % i)

    def fail(fd: int) -> None:
        raise OSError(28, "ENOSPC")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(DurableWriteError):
        gs.flush_objects()
    assert all(s.with_suffix(".idx").exists() and s.with_suffix(".pack").exists() for s in small)
    assert not [p for p in pack_dir.iterdir() if p.name.startswith("tmp_")]
    monkeypatch.undo()
    for i in range(3):
        gs.write_blob(b"new %d\n" % i)
    gs.flush_objects()
    retired = five.path / ".git/objects/info/oncepatch-retired"
    assert all(s.with_suffix(".idx").exists() for s in small)  # merged: noted, kept for readers a while
    assert sorted(line.split()[1] for line in retired.read_text().splitlines()) == sorted(s.name for s in small)
    assert packs.sweep(str(pack_dir), str(retired), time.time() + packs.RETIRE_GRACE + 1) == set()
    assert not any(s.with_suffix(".idx").exists() or s.with_suffix(".pack").exists() for s in small)  # removed
    assert retired.read_text() == ""
    for i in range(packs.MERGE_TRIGGER):
        assert five.git("cat-file", "-p", blob(b"p%d-1\n" % i)[0]) == f"p{i}-1\n"
    five.git("fsck", "--strict")


def deleted_fds() -> int:
    out = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            out += os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")
        except OSError:
            pass
    return out


def test_a_long_lived_store_lets_go_of_removed_packs(five: Repo) -> None:
    """libgit2 keeps every pack it read open until its database is reopened: after merges
    removed them, a long-lived store would run out of descriptors (one per call)."""
    stores: dict[str, object] = {}
    before = deleted_fds()
    for i in range(150):
        assert apply(str(five.path), one_patch(five, i), branch="side", _stores=stores).status == "committed"
    from cas.objects import _REOPEN_AFTER

    assert deleted_fds() - before <= _REOPEN_AFTER + packs.MERGE_TRIGGER


def flushed(gs: GitStore, *contents: bytes) -> list[str]:
    """Stage a blob of each of ``contents`` and write them (one pack for two or more)."""
    oids = [gs.write_blob(c) for c in contents]
    gs.flush_objects()
    return oids


def test_a_merge_never_removes_the_pack_it_writes(tmp_path: Path) -> None:
    """A store that has not seen another process's pack stages exactly its objects: the new pack
    has that pack's name, and the merge that takes that pack must not remove it."""
    repo = make_repo(tmp_path / "repo")
    slow = GitStore(str(repo.path))
    slow._known("0" * 40)  # its backends list the packs of this moment
    for i in range(packs.MERGE_TRIGGER - 1):
        flushed(GitStore(str(repo.path)), *(b"filler %d %d\n" % (i, j) for j in range(8)))
    x, y = flushed(GitStore(str(repo.path)), b"both stage this\n", b"and this\n")
    flushed(slow, b"both stage this\n", b"and this\n")
    assert repo.git("cat-file", "-p", x) == "both stage this\n" and repo.git("cat-file", "-p", y) == "and this\n"


def test_objects_pruned_since_are_written_again(tmp_path: Path) -> None:
    """A pack libgit2 still holds open is not proof: objects git pruned since are written again."""
    repo = make_repo(tmp_path / "repo")
    gs = GitStore(str(repo.path))
    x, y = flushed(gs, b"payload\n", b"payload 2\n")
    gs.forget_recent()
    assert gs.read_blob(x) == b"payload\n"  # libgit2 opened the pack
    repo.git("gc", "-q", "--prune=now")  # nothing names them: pruned
    assert repo.git("cat-file", "-e", x, check=False) == ""
    gs.discard_pending()
    flushed(gs, b"payload\n", b"payload 2\n")
    assert repo.git("cat-file", "-p", x) == "payload\n" and repo.git("cat-file", "-p", y) == "payload 2\n"


def test_a_known_packed_object_has_its_folder_synced(five: Repo) -> None:
    gs = GitStore(str(five.path))
    x = gs.write_blob(b"one\n")
    gs.write_blob(b"two\n")
    gs.flush_objects()
    gs.discard_pending()
    assert gs.read_blob(x) == b"one\n"  # read back through libgit2: the pack is listed
    gs.write_blob(b"one\n")  # in that pack (whose folder may not be durable yet)
    gs.write_blob(b"three\n")
    batch = DurableBatch()
    gs.add_pending_to(batch)
    assert os.path.realpath(five.path / ".git/objects/pack") in batch._also
    batch.commit()
    assert five.git("cat-file", "-p", x) == "one\n"


def test_a_pack_whose_idx_names_other_objects_is_never_copied(tmp_path: Path) -> None:
    """A self-consistent idx (its checksum made good) naming an object the entry does not hold."""
    stem = write_pack(tmp_path, [blob(b"a\n"), blob(b"b\n")])
    idx = stem.with_suffix(".idx")
    data = bytearray(idx.read_bytes())
    data[1032 + 19] ^= 1  # the first object's id, last byte: the sort order holds
    body = bytes(data[:-20])
    idx.write_bytes(body + hashlib.sha1(body).digest())
    assert packs.read_entries(str(stem)) is None


def test_bytes_before_the_first_entry_are_never_copied(tmp_path: Path) -> None:
    stem = write_pack(tmp_path, [blob(b"a\n"), blob(b"b\n")])
    pack, idx = stem.with_suffix(".pack"), stem.with_suffix(".idx")
    raw = pack.read_bytes()
    body = raw[:12] + b"\0" + raw[12:-20]  # one junk byte: every offset moves by one
    checksum = hashlib.sha1(body).digest()
    pack.write_bytes(body + checksum)
    data = bytearray(idx.read_bytes())
    n = 2
    at = 1032 + 24 * n
    offsets = struct.unpack(f">{n}I", data[at:at + 4 * n])
    data[at:at + 4 * n] = struct.pack(f">{n}I", *(o + 1 for o in offsets))
    data[-40:-20] = checksum
    body_idx = bytes(data[:-20])
    idx.write_bytes(body_idx + hashlib.sha1(body_idx).digest())
    assert packs.read_entries(str(stem)) is None


def test_big_packs_and_big_calls_are_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stems = [write_pack(tmp_path, [blob(b"%d\n" % i), blob(os.urandom(2000))]) for i in range(3)]
    monkeypatch.setattr(packs, "MERGE_BYTES_MAX", 1000)
    assert packs.small_packs(str(tmp_path)) == []  # over the byte limit: never read for a merge
    monkeypatch.setattr(packs, "MERGE_BYTES_MAX", 5000)
    found = packs.small_packs(str(tmp_path))
    assert len(found) == 3 and all(p.size > 2000 for p in found)
    monkeypatch.setattr(packs, "MERGE_TRIGGER", 3)
    assert len(packs.choose_merge(2, found)) == 2  # a third would pass the byte limit
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setattr(packs, "PACK_BYTES_MAX", 100)
    gs = GitStore(str(repo.path))
    oids = [gs.write_blob(b"%d" % i * 60) for i in range(3)]
    before = pack_names(repo)
    gs.flush_objects()
    assert pack_names(repo) == before  # over the call's byte limit: written loose
    assert all((repo.path / ".git/objects" / o[:2] / o[2:]).exists() for o in oids)
    assert stems


WRITER = """
import sys
from patcher.protocol import apply
repo, branch, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
stores = {}
for i in range(n):
    patch = (f"--- a/{branch}.txt\\n+++ b/{branch}.txt\\n@@ -1 +1 @@\\n-{branch} {i}\\n+{branch} {i + 1}\\n").encode()
    res = apply(repo, patch, branch=branch, _stores=stores)
    print(res.commit, flush=True)
"""


def test_writers_merging_at_once_lose_nothing(tmp_path: Path) -> None:
    """Four processes write and merge packs at once, each on its own branch, while git reads."""
    import sys

    branches = [f"b{i}" for i in range(4)]
    repo = make_repo(tmp_path / "repo", {f"{b}.txt": f"{b} 0\n" for b in branches})
    for b in branches:
        repo.git("branch", b)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(repo.path), b, "25"], stdout=subprocess.PIPE,
                              env=env) for b in branches]
    reader = subprocess.Popen(["git", "cat-file", "--batch-check"], cwd=repo.path, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert reader.stdin is not None and reader.stdout is not None
    seen: list[str] = []
    try:
        while any(p.poll() is None for p in procs):
            for c in [*seen, *(repo.head(b) for b in branches)]:  # everything so far, while packs go
                reader.stdin.write(f"{c}\n".encode())
                reader.stdin.flush()
                assert reader.stdout.readline().split()[1] == b"commit", c
            seen = [repo.head(b) for b in branches]
    finally:
        reader.stdin.close()
        reader.wait()
    commits = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        commits += out.decode().split()
    assert len(commits) == 100
    for c in commits:
        assert repo.git("cat-file", "-t", c) == "commit\n"
    for b in branches:
        assert repo.git("show", f"{b}:{b}.txt") == f"{b} 25\n"
    repo.git("fsck", "--strict", "--no-dangling")
    assert len(pack_names(repo)) < 50  # git's gc.autoPackLimit


def test_sweep_waits_for_the_grace_but_never_lets_many_wait(tmp_path: Path) -> None:
    pack_dir = tmp_path / "pack"
    stems = [write_pack(pack_dir, [blob(b"s%d\n" % i), blob(b"t%d\n" % i)]) for i in range(packs.RETIRE_MAX + 3)]
    listed = tmp_path / "info" / "oncepatch-retired"
    now = 1000.0
    packs.retire(str(listed), [packs.SmallPack(str(stems[0]), 2)], now - packs.RETIRE_GRACE - 1)  # due
    packs.retire(str(listed), [packs.SmallPack(str(s), 2) for s in stems[1:]], now)  # not yet
    with open(listed, "a") as fh:
        fh.write("junk\nnot-a-time pack-x\n1.0 ../escape\n")
    waiting = packs.sweep(str(pack_dir), str(listed), now)
    # the due one, and the oldest beyond RETIRE_MAX, are removed; the rest wait and are not merged again
    gone = [s for s in stems if not s.with_suffix(".idx").exists()]
    assert gone == stems[:3] and not any(s.with_suffix(".pack").exists() for s in gone)
    assert waiting == {str(s) for s in stems[3:]} and len(waiting) == packs.RETIRE_MAX
    assert len(listed.read_text().splitlines()) == packs.RETIRE_MAX
    assert packs.sweep(str(pack_dir), str(tmp_path / "none"), now) == set()


def test_a_long_lived_store_merges_its_own_packs_without_reading_them_back(
        five: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packs a store built are merged from the entries it kept; any other small pack is read and checked."""
    git_pack = write_pack(five.path / ".git/objects/pack", [blob(b"git's own %d\n" % i) for i in range(2)])
    read: list[str] = []
    real = packs.read_entries

    def counted(stem: str) -> list[tuple[bytes, bytes, int]] | None:
        read.append(stem)
        return real(stem)

    monkeypatch.setattr(packs, "read_entries", counted)
    stores: dict[str, object] = {}
    merged_away: set[str] = set()
    for i in range(40):
        assert apply(str(five.path), one_patch(five, i), branch="side", _stores=stores).status == "committed"
        retired = five.path / ".git/objects/info/oncepatch-retired"
        if retired.exists():
            merged_away |= {line.split()[1] for line in retired.read_text().splitlines()}
    assert len(merged_away - {git_pack.name}) >= 2 * packs.MERGE_TRIGGER  # merges of this store's packs
    assert set(read) <= {str(git_pack)}  # only a pack this store did not build was read back
    five.git("fsck", "--strict", "--no-dangling")
    assert five.git("show", "side:f4.txt") == "v8\n"


def test_sweep_remembers_the_list_until_it_changes_or_a_note_falls_due(tmp_path: Path) -> None:
    pack_dir = tmp_path / "pack"
    a, b = (write_pack(pack_dir, [blob(b"%s1\n" % n), blob(b"%s2\n" % n)]) for n in (b"a", b"b"))
    listed = tmp_path / "info" / "oncepatch-retired"
    seen: dict[str, object] = {}
    now = 1000.0
    packs.retire(str(listed), [packs.SmallPack(str(a), 2)], now)
    assert packs.sweep(str(pack_dir), str(listed), now + 0.1, seen) == {str(a)}
    packs.retire(str(listed), [packs.SmallPack(str(b), 2)], now + 0.2)  # another process notes one more
    assert packs.sweep(str(pack_dir), str(listed), now + 0.3, seen) == {str(a), str(b)}
    assert packs.sweep(str(pack_dir), str(listed), now + 0.4, seen) == {str(a), str(b)}  # unchanged: remembered
    # a's grace has passed: swept although the file did not change (and named as removed)
    removed: set[str] = set()
    assert packs.sweep(str(pack_dir), str(listed), now + packs.RETIRE_GRACE + 0.05, seen, removed) == {str(b)}
    assert not a.with_suffix(".idx").exists() and b.with_suffix(".idx").exists() and removed == {str(a)}
    assert packs.sweep(str(pack_dir), str(listed), now + packs.RETIRE_GRACE + 0.25, seen) == set()
    assert not b.with_suffix(".pack").exists() and listed.read_text() == ""

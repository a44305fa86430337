"""The index updated as bytes (cas/index_raw.py) against git's own view of the result.

Every update here is checked by git: ``git ls-files -s`` (object ids and
modes), the stat data ``git ls-files --debug`` reads, ``git write-tree`` (which
trusts every cached tree still marked valid, so a stale one would show up as a
wrong tree) and ``git fsck``.  A reference copy of each repository is brought
to the same content with ``git add``.  Indexes the raw form does not handle
must go to libgit2 and still come out right.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cas.errors import GitStoreError
from cas.hashing import git_blob_oid
from cas.index import IndexSnapshot
from cas.index_raw import RawIndex, Unsupported
from cas.objects import TreeEntry
from conftest import Repo, git, make_repo, snapshot


def _files(n: int = 40) -> dict[str, str]:
    files: dict[str, str] = {}
    for i in range(n):
        # Every name length from 1 to 16 (every padding), nested folders, suffix twins.
        name = ("abcdefghijklmnop"[: 1 + i % 16]) + f"{i}"
        folder = ["", "a/", "a/b/", "c/", "TREE/", "a/TREE/"][i % 6]
        files[f"{folder}{name}"] = f"content {i}\n"
    files["b.txt"] = "top b\n"
    files["a/b.txt"] = "nested b\n"  # "b.txt\0" occurs inside "a/b.txt\0" before the real entry
    files["xb.txt"] = "xb\n"
    files["x/TREE"] = "a file named TREE\n"
    return files


def _reference(repo: Repo, tmp: Path, changes: dict[str, bytes]) -> Repo:
    ref = Repo(tmp / "reference")
    shutil.copytree(repo.path, ref.path, symlinks=True)
    for path, data in changes.items():
        (ref.path / path).write_bytes(data)
    ref.git("add", "--sparse", "--", *changes)
    return ref


def _raw_update(repo: Repo, changes: dict[str, bytes], modes: dict[str, int] | None = None) -> bool:
    """Write ``changes`` to the worktree and set their entries through IndexSnapshot; whether it stayed raw."""
    snap = IndexSnapshot(str(repo.path / ".git"))
    added = []
    for path, data in changes.items():
        full = repo.path / path
        full.write_bytes(data)
        mode = (modes or {}).get(path, 0o100644)
        full.chmod(0o755 if mode == 0o100755 else 0o644)
        repo.git("hash-object", "-w", "--", path)  # the object a commit would have written
        added.append((path, TreeEntry(git_blob_oid(data), mode)))
    snap.stage(str(repo.path), [], added)
    stayed = snap.raw
    snap.install()
    return stayed


def _debug_stat(repo: Repo, path: str) -> dict[str, str]:
    out = repo.git("ls-files", "--debug", "--", path)
    fields: dict[str, str] = {}
    for line in out.splitlines()[1:]:
        for part in line.strip().replace(":\t", ": ").split("\t"):
            if ":" in part:
                k, v = part.split(":", 1)
                fields[k.strip()] = v.strip()
    return fields


def _assert_like_git(repo: Repo, ref: Repo, changes: dict[str, bytes]) -> None:
    assert repo.git("ls-files", "-s") == ref.git("ls-files", "-s")
    assert repo.git("write-tree") == ref.git("write-tree")
    assert repo.git("diff-files", "--name-only") == ""
    for path in changes:
        st = os.lstat(repo.path / path)
        f = _debug_stat(repo, path)
        assert f["mtime"] == f"{int(st.st_mtime)}:{st.st_mtime_ns % 1_000_000_000}"
        assert f["ctime"] == f"{int(st.st_ctime)}:{st.st_ctime_ns % 1_000_000_000}"
        assert int(f["ino"]) == st.st_ino & 0xFFFFFFFF and int(f["size"]) == st.st_size
        assert int(f["uid"]) == st.st_uid and int(f["gid"]) == st.st_gid
    assert subprocess.run(["git", "fsck", "--no-dangling"], cwd=repo.path, capture_output=True).returncode == 0


def _tree_nodes(index: Path) -> dict[str, int]:
    """folder -> entry count of the cached trees (``-1``: invalid), read with git's own layout rules."""
    raw = RawIndex(str(index))
    start, chain = raw.extensions()
    off, size = next((o, s) for sig, o, s in chain if sig == b"TREE")
    data = raw.data[off + 8: off + 8 + size]
    nodes: dict[str, int] = {}
    pos = 0
    stack: list[list[object]] = []
    while pos < len(data):
        nul = data.index(b"\0", pos)
        nl = data.index(b"\n", nul)
        name = data[pos:nul].decode()
        count, subs = (int(x) for x in data[nul + 1:nl].split(b" "))
        if stack:
            stack[-1][1] = int(stack[-1][1]) - 1  # type: ignore[call-overload]
            folder = f"{stack[-1][0]}/{name}" if stack[-1][0] else name
        else:
            folder = ""
        nodes[folder] = count
        pos = nl + 1 + (20 if count >= 0 else 0)
        if subs:
            stack.append([folder, subs])
        while stack and stack[-1][1] == 0:
            stack.pop()
    return nodes


def test_modified_entries_are_rewritten_in_place_as_git_would_see_them(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", _files())
    assert _tree_nodes(repo.path / ".git" / "index")["c"] >= 0
    changes = {"a/b/abc2": b"changed\n", "b.txt": b"changed top b\n", "x/TREE": b"tree file changed\n"}
    ref = _reference(repo, tmp_path, changes)
    assert _raw_update(repo, changes)
    nodes = _tree_nodes(repo.path / ".git" / "index")
    assert nodes[""] == -1 and nodes["a"] == -1 and nodes["a/b"] == -1 and nodes["x"] == -1
    # Folders the change did not touch keep their cached trees (git write-tree trusts them below).
    assert nodes["c"] >= 0 and nodes["a/TREE"] >= 0 and nodes["TREE"] >= 0
    _assert_like_git(repo, ref, changes)


def test_every_name_length_and_folder_in_turn(tmp_path: Path) -> None:
    files = _files()
    repo = make_repo(tmp_path / "repo", files)
    for i, path in enumerate(sorted(files)):
        changes = {path: f"edit {i}\n".encode()}
        ref = _reference(repo, tmp_path / str(i), changes)
        assert _raw_update(repo, changes), path
        _assert_like_git(repo, ref, changes)
        repo.git("commit", "-q", "-m", f"edit {i}")  # git rebuilds the cached trees it needs


def test_mode_change_and_symlink_target_in_place(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"run.sh": "echo hi\n", "lib/x.py": "x = 1\n"})
    os.symlink("lib/x.py", repo.path / "link")
    repo.commit_all("link")
    snap = IndexSnapshot(str(repo.path / ".git"))
    os.chmod(repo.path / "run.sh", 0o755)
    os.unlink(repo.path / "link")
    os.symlink("run.sh", repo.path / "link")
    repo.git("hash-object", "-w", "--stdin", input=b"run.sh")
    snap.stage(str(repo.path), [], [("run.sh", TreeEntry(git_blob_oid(b"echo hi\n"), 0o100755)),
                                     ("link", TreeEntry(git_blob_oid(b"run.sh"), 0o120000))])
    assert snap.raw
    snap.install()
    assert repo.git("diff-files", "--name-only") == ""
    assert "100755" in repo.git("ls-files", "-s", "run.sh")
    repo.git("add", "-A")  # git agrees: nothing to stage
    assert repo.git("diff", "--cached", "--name-status") == "M\tlink\nM\trun.sh\n"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_repositories_match_libgit2s_update(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    alphabet = "ab-_.xyzZ0"
    files: dict[str, str] = {}
    while len(files) < 120:
        depth = rnd.randint(0, 3)
        parts = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 9))) for _ in range(depth + 1)]
        path = "/".join(parts)
        if parts[-1] in (".", "..") or any(p in (".", "..", ".git") for p in parts):
            continue
        if any(path.startswith(f + "/") or f.startswith(path + "/") for f in files):
            continue
        files[path] = f"{path}\n"
    repo = make_repo(tmp_path / "repo", files)
    for round_ in range(4):
        chosen = rnd.sample(sorted(files), rnd.randint(1, 5))
        changes = {p: f"round {round_} {p}\n".encode() for p in chosen}
        ref = _reference(repo, tmp_path / f"ref{round_}", changes)
        assert _raw_update(repo, changes)
        _assert_like_git(repo, ref, changes)


def test_eoie_and_ieot_are_kept_valid(tmp_path: Path) -> None:
    files = {f"d{i % 7}/f{i:04d}": f"{i}\n" for i in range(2500)}
    repo = make_repo(tmp_path / "repo", files)
    # Files older than the index: not racily clean (2,500 of those would leave it to libgit2).
    old = (os.stat(repo.path / "d0").st_mtime_ns // 10**9 - 3600) * 10**9
    for path in files:
        os.utime(repo.path / path, ns=(old, old))
    cfg = ["-c", "index.threads=4", "-c", "index.recordEndOfIndexEntries=true", "-c", "index.recordOffsetTable=true"]
    repo.git(*cfg, "read-tree", "HEAD")
    repo.git(*cfg, "update-index", "--refresh")
    raw = RawIndex(str(repo.path / ".git" / "index"))
    sigs = [sig for sig, _o, _s in raw.extensions()[1]]
    assert b"EOIE" in sigs and b"IEOT" in sigs and b"TREE" in sigs
    changes = {"d3/f0003": b"new three\n", "d5/f0005": b"new five\n"}
    ref = _reference(repo, tmp_path, changes)
    assert _raw_update(repo, changes)
    again = RawIndex(str(repo.path / ".git" / "index"))
    again.verified()
    assert [sig for sig, _o, _s in again.extensions()[1]] == sigs  # EOIE's hash is checked on reading
    assert repo.git(*cfg, "status", "--porcelain") == "M  d3/f0003\nM  d5/f0005\n"  # staged, files clean
    _assert_like_git(repo, ref, changes)


def _index_prepared(repo: Repo, how: str) -> list[str]:
    """Bring the index to a form the raw update leaves to libgit2; the paths to change."""
    if how == "v4":
        repo.git("update-index", "--index-version", "4")
    elif how == "untracked-cache":
        repo.git("config", "core.untrackedCache", "true")
        repo.git("update-index", "--untracked-cache")
        repo.git("status", "--porcelain")
    elif how == "skip-worktree":
        repo.git("update-index", "--skip-worktree", "c/abcd3")
        return ["c/abcd3"]
    elif how == "assume-unchanged":
        repo.git("update-index", "--assume-unchanged", "c/abcd3")
        return ["c/abcd3"]
    elif how == "no-cache-tree":
        (repo.path / ".git" / "index").unlink()  # entries added one by one: no cached trees
        repo.git("update-index", "--add", "--", *repo.git("ls-tree", "-r", "--name-only", "HEAD").splitlines())
        data = (repo.path / ".git" / "index").read_bytes()
        assert data[-30:-20] == b"xb.txt\0\0\0\0"  # the last entry, then the checksum: no extensions,
        with pytest.raises(Unsupported):  # though "TREE" occurs in paths
            RawIndex(str(repo.path / ".git" / "index")).extensions()
    return ["c/abcd3", "a/b.txt"]


@pytest.mark.parametrize("how", ["v4", "untracked-cache", "skip-worktree", "assume-unchanged", "no-cache-tree"])
def test_forms_left_to_libgit2_still_update_correctly(tmp_path: Path, how: str) -> None:
    repo = make_repo(tmp_path / "repo", _files())
    paths = _index_prepared(repo, how)
    changes = {p: f"changed under {how}\n".encode() for p in paths}
    before = {line.split("\t")[1]: line for line in repo.git("ls-files", "-s").splitlines()}
    assert not _raw_update(repo, changes)
    after = {line.split("\t")[1]: line for line in repo.git("ls-files", "-s").splitlines()}
    for path, data in changes.items():
        assert after.pop(path) == f"100644 {git_blob_oid(data)} 0\t{path}"
        before.pop(path)
    assert after == before
    tree = repo.git("write-tree").strip()
    for path, data in changes.items():
        assert git(repo.path, "cat-file", "blob", f"{tree}:{path}").encode() == data


def test_many_racily_clean_entries_are_left_to_libgit2(tmp_path: Path) -> None:
    import cas.index_raw

    files = {f"f{i:03d}": f"{i}\n" for i in range(cas.index_raw.MAX_RACY + 5)}
    repo = make_repo(tmp_path / "repo", files)
    index = repo.path / ".git" / "index"
    m = os.stat(repo.path / "f000").st_mtime_ns - 10 * 10**9  # seconds before the new index is written
    for path in files:
        os.utime(repo.path / path, ns=(m, m))
    repo.git("update-index", "--really-refresh")
    os.utime(index, ns=(m, m))  # every entry racily clean
    (repo.path / "f001").write_bytes(b"x\n")  # a changed file git must keep seeing
    os.utime(repo.path / "f001", ns=(m, m))
    changes = {"f000": b"changed\n"}
    assert not _raw_update(repo, changes)
    minimal = ["-c", "core.checkStat=minimal", "-c", "core.trustctime=false"]  # stat equal but for ctime
    assert repo.git(*minimal, "diff", "--name-only") == "f001\n"
    # The new index kept the old one's mtime (too many racy entries to check): git still took f001 for
    # racily clean, compared its content, and smudged it when it wrote the index.
    assert _debug_stat(repo, "f001")["size"] == "0"
    assert repo.git("ls-files", "-s", "f000").split()[1] == git_blob_oid(b"changed\n")


@pytest.mark.parametrize("version", [2, 4])
def test_libgit2s_file_gets_stat_data_and_smudged_racy_entries(tmp_path: Path, version: int) -> None:
    """A path new to the index goes through pygit2's Index, which sets no stat data and smudges
    nothing; the pass over the file it wrote (version 4 read entry by entry) does both."""
    files = {f"f{i:03d}": f"{i}\n" for i in range(20)}
    repo = make_repo(tmp_path / "repo", files)
    repo.git("update-index", "--index-version", str(version))
    index = repo.path / ".git" / "index"
    m = os.stat(repo.path / "f000").st_mtime_ns - 10 * 10**9
    for path in files:
        os.utime(repo.path / path, ns=(m, m))
    repo.git("update-index", "--really-refresh")
    os.utime(index, ns=(m, m))  # every entry racily clean
    (repo.path / "f001").write_bytes(b"x\n")  # a changed file git must keep seeing
    os.utime(repo.path / "f001", ns=(m, m))
    (repo.path / "new").mkdir()
    assert not _raw_update(repo, {"new/file.txt": b"new\n", "f000": b"changed\n"})
    assert index.read_bytes()[4:8] == version.to_bytes(4, "big")
    assert os.stat(index).st_mtime_ns > m
    assert _debug_stat(repo, "f001")["size"] == "0"  # smudged by the pass, before git looked
    for path in ("new/file.txt", "f000"):
        assert _debug_stat(repo, path)["size"] != "0", path  # stat data from the file
    assert repo.git("diff-files", "--name-only") == "f001\n"
    assert repo.git("ls-files", "-s", "new/file.txt").split()[1] == git_blob_oid(b"new\n")


def test_split_index_is_left_to_libgit2(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", _files())
    repo.git("update-index", "--split-index")
    with pytest.raises(Unsupported):
        RawIndex(str(repo.path / ".git" / "index"))


def test_new_and_removed_paths_switch_to_libgit2(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", _files())
    snap = IndexSnapshot(str(repo.path / ".git"))
    assert snap.entry("no/such/file") is None and snap.raw  # absent: proven by the bytes
    (repo.path / "new.txt").write_bytes(b"new\n")
    snap.stage(str(repo.path), [], [("new.txt", TreeEntry(git_blob_oid(b"new\n"), 0o100644))])
    assert not snap.raw
    snap.install()
    assert repo.git("ls-files", "-s", "new.txt").split()[1] == git_blob_oid(b"new\n")
    snap = IndexSnapshot(str(repo.path / ".git"))
    os.unlink(repo.path / "b.txt")
    snap.stage(str(repo.path), ["b.txt"], [])
    assert not snap.raw
    snap.install()
    assert repo.git("ls-files", "b.txt") == ""


def test_a_conflicted_path_is_answered_by_libgit2(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"f.txt": "base\n"})
    repo.git("checkout", "-q", "-b", "other")
    repo.write("f.txt", "other\n")
    repo.commit_all("other")
    repo.git("checkout", "-q", "main")
    repo.write("f.txt", "main\n")
    repo.commit_all("main")
    repo.git("merge", "-q", "other", check=False)
    assert "UU f.txt" in repo.git("status", "--porcelain")
    snap = IndexSnapshot(str(repo.path / ".git"))
    assert snap.entry("f.txt") is None  # no stage-0 entry
    assert not snap.raw


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # pygit2's Index.__del__ after a failed open
def test_corrupt_index_is_reported_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              threaded: bool) -> None:
    import cas.index_raw

    if threaded:  # the checksum verified in a thread, as for big indexes
        monkeypatch.setattr(cas.index_raw, "_THREADED_HASH", 0)
    repo = make_repo(tmp_path / "repo", {"src/app.py": "".join(f"line {i}\n" for i in range(1, 9))})
    index = repo.path / ".git" / "index"
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the entries; the checksum no longer matches
    index.write_bytes(bytes(data))
    snap = IndexSnapshot(str(repo.path / ".git"))
    with pytest.raises(GitStoreError):
        snap.entry("src/app.py")
        snap.confirm()
    del snap
    gc.collect()
    before = snapshot(repo)
    patch = b"--- a/src/app.py\n+++ b/src/app.py\n@@ -1,3 +1,3 @@\n-line 1\n+line one\n line 2\n line 3\n"
    res = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", "-"], cwd=repo.path, input=patch,
                         capture_output=True, check=False)
    assert res.returncode != 0, res.stdout
    assert b"index" in res.stderr
    assert snapshot(repo) == before


def test_apply_on_a_checked_out_branch_goes_through_the_bytes(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import cas.index as index_module
    from patcher.protocol import apply

    parsed: list[str] = []
    real = index_module._ParsedIndex.__init__

    def spy(self: index_module._ParsedIndex, git_dir: str) -> None:
        parsed.append(git_dir)
        real(self, git_dir)

    monkeypatch.setattr(index_module._ParsedIndex, "__init__", spy)
    repo = make_repo(tmp_path / "repo", {"src/app.py": "".join(f"line {i}\n" for i in range(1, 9)),
                                         "src/b.py": "b\n", "docs/x.md": "x\n"})
    patch = b"--- a/src/app.py\n+++ b/src/app.py\n@@ -1,3 +1,3 @@\n-line 1\n+line one\n line 2\n line 3\n"
    res = apply(str(repo.path), patch)
    assert res.status == "committed"
    assert parsed == []  # neither the dirty check nor the update parsed the index
    nodes = _tree_nodes(repo.path / ".git" / "index")
    assert nodes["src"] == -1 and nodes["docs"] >= 0
    assert repo.git("status", "--porcelain") == ""
    assert repo.git("write-tree") == repo.git("rev-parse", "HEAD^{tree}")
    # git commits on top from the updated index as usual.
    repo.write("docs/x.md", "y\n")
    repo.git("commit", "-qam", "git on top")
    assert git(repo.path, "show", "HEAD~1:src/app.py").startswith("line one\n")


def test_racily_clean_entries_are_smudged_so_a_same_instant_change_still_shows(tmp_path: Path) -> None:
    """git's racy-git case: a file changed in the same second its entry and the index were written.

    While the index's mtime is that second, git compares the file's contents
    and sees the change.  A new index written later would make the stale stat
    data look current; the raw update smudges such entries (size 0), as git's
    own writer does, so git keeps comparing contents.
    """
    repo = make_repo(tmp_path / "repo", {"e.txt": "aaaa\n", "f.txt": "ffff\n", "g.txt": "gggg\n"})
    minimal = ["-c", "core.checkStat=minimal", "-c", "core.trustctime=false"]
    index = repo.path / ".git" / "index"
    e = repo.path / "e.txt"
    m = e.stat().st_mtime_ns - 10 * 10**9  # seconds before the new index is written
    os.utime(e, ns=(m, m))
    os.utime(repo.path / "g.txt", ns=(m - 5 * 10**9, m - 5 * 10**9))
    repo.git("update-index", "--really-refresh")
    os.utime(index, ns=(m, m))  # the index written in e.txt's second: e.txt is racily clean
    e.write_bytes(b"bbbb\n")  # same size, same mtime: only a content check sees it
    os.utime(e, ns=(m, m))
    assert repo.git(*minimal, "diff-files", "--name-only") == "e.txt\n"
    assert _raw_update(repo, {"f.txt": b"FFFF\n"})
    assert _debug_stat(repo, "e.txt")["size"] == "0"  # smudged
    assert _debug_stat(repo, "g.txt")["size"] == "5"  # an older entry is left as it was
    assert repo.git(*minimal, "diff-files", "--name-only") == "e.txt\n"
    assert repo.git("diff", "--name-only") == "e.txt\n"


def test_a_racy_entry_found_unchanged_is_not_read_again_until_its_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A racily clean entry whose settled file was read once is looked at by ``lstat`` alone after that.

    Its file changed behind the index (same size, mtime put back: only the
    ctime moves) is read again, smudged, and git sees the change.
    """
    import time

    import cas.index_raw

    repo = make_repo(tmp_path / "repo", {"e.txt": "aaaa\n", "f.txt": "ffff\n", "g.txt": "gggg\n"})
    index, e = repo.path / ".git" / "index", repo.path / "e.txt"
    m = e.stat().st_mtime_ns - 10 * 10**9 + 123_456_789  # whole seconds would never be remembered
    os.utime(e, ns=(m, m))
    repo.git("update-index", "--really-refresh")
    settled = e.stat().st_ctime_ns + cas.index_raw._SETTLED_NS
    while time.time_ns() <= settled:  # the utime above set e.txt's ctime: until it is settled
        time.sleep(0.01)
    reads: list[str] = []

    def counting_open(file: str, *args: object, **kwargs: object) -> object:
        reads.append(os.path.basename(file))
        return open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(cas.index_raw, "open", counting_open, raising=False)
    for path in ("f.txt", "g.txt"):
        os.utime(index, ns=(m, m))  # the index written in e.txt's second: e.txt is racily clean
        assert _raw_update(repo, {path: path.upper().encode()})
        assert _debug_stat(repo, "e.txt")["size"] == "5"  # unchanged: not smudged
    assert reads == ["e.txt"]  # read by the first update only
    e.write_bytes(b"bbbb\n")  # same size, same mtime: only the ctime shows it
    os.utime(e, ns=(m, m))
    os.utime(index, ns=(m, m))
    assert _raw_update(repo, {"f.txt": b"f2\n"})
    assert reads == ["e.txt", "e.txt"]
    assert _debug_stat(repo, "e.txt")["size"] == "0"  # smudged
    assert repo.git("diff", "--name-only") == "e.txt\n"
    looked: list[str] = []

    class CountingOs:  # cas.index_raw's os, with its lstat calls counted
        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        def lstat(self, path: str) -> os.stat_result:
            looked.append(os.path.basename(path))
            return os.lstat(path)

    monkeypatch.setattr(cas.index_raw, "os", CountingOs())
    os.utime(index, ns=(m, m))
    assert _raw_update(repo, {"g.txt": b"g2\n"})
    assert "e.txt" not in looked  # smudged already: not looked at again
    assert _debug_stat(repo, "e.txt")["size"] == "0"
    assert repo.git("diff", "--name-only") == "e.txt\n"


def test_the_new_index_keeps_the_old_ones_permissions(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n", "b.txt": "b\n"})
    index = repo.path / ".git" / "index"
    os.chmod(index, 0o640)  # as core.sharedRepository=group leaves it
    assert _raw_update(repo, {"a.txt": b"A\n"})
    assert os.stat(index).st_mode & 0o7777 == 0o640


def test_the_written_index_is_kept_and_reused_as_git_reads_it(tmp_path: Path) -> None:
    """After an install the snapshot maps the file it wrote: the next update starts from it, no re-read."""
    files = _files()
    repo = make_repo(tmp_path / "repo", files)
    index = repo.path / ".git" / "index"
    snap = IndexSnapshot(str(repo.path / ".git"))
    changes: dict[str, bytes] = {}
    for i, path in enumerate(["a/b.txt", "b.txt", "x/TREE", "a/b.txt"]):
        data = f"round {i} of {path}\n".encode()
        changes[path] = data
        (repo.path / path).write_bytes(data)
        repo.git("hash-object", "-w", "--", path)
        assert snap.current()
        snap.stage(str(repo.path), [], [(path, TreeEntry(git_blob_oid(data), 0o100644))])
        assert snap.raw
        snap.install()
        assert snap.raw and snap.current()  # kept: the next call in this process starts from it
        raw = snap._raw
        assert raw is not None and raw._hashed.is_set()  # its checksum was computed, not re-verified
        assert bytes(raw.data) == index.read_bytes()
        assert snap.entry(path) == TreeEntry(git_blob_oid(data), 0o100644)
    _assert_like_git(repo, _reference(make_repo(tmp_path / "base", files), tmp_path, changes), changes)


def test_a_kept_index_still_smudges_an_entry_it_wrote_in_the_same_second(tmp_path: Path) -> None:
    """The stamps carried to the kept file are found again where its entries were rewritten.

    Three updates in one second: the second's entry (b.txt) is then changed
    behind the index with its size and mtime kept, which only a content check
    sees; the third update must smudge it, from the stamps carried over.
    """
    import time

    repo = make_repo(tmp_path / "repo", {"a.txt": "a0\n", "b.txt": "b0\n", "c.txt": "c0\n", "d.txt": "d0\n"})
    carried = False
    for _attempt in range(20):
        time.sleep(1 - time.time() % 1 + 0.01)  # just after a second starts
        snap = IndexSnapshot(str(repo.path / ".git"))

        def update(path: str, data: bytes) -> None:
            (repo.path / path).write_bytes(data)
            repo.git("hash-object", "-w", "--", path)
            snap.stage(str(repo.path), [], [(path, TreeEntry(git_blob_oid(data), 0o100644))])
            snap.install()

        update("a.txt", b"a1\n")
        first = snap._raw
        assert first is not None
        update("b.txt", b"b1\n")
        kept = snap._raw
        assert kept is not None and first.identity is not None and kept.identity is not None
        if first.identity[3] // 10**9 != kept.identity[3] // 10**9:
            continue  # a second boundary fell between the writes: try again
        carried = kept._scanned  # the stamps came over, not scanned
        b = repo.path / "b.txt"
        st = b.stat()
        assert st.st_mtime_ns // 10**9 == kept.identity[3] // 10**9  # racily clean against its index
        b.write_bytes(b"B1\n")
        os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
        update("c.txt", b"c1\n")
        assert _debug_stat(repo, "b.txt")["size"] == "0"  # smudged
        assert _debug_stat(repo, "d.txt")["size"] == "3"
        assert repo.git("diff", "--name-only") == "b.txt\n"
        break
    assert carried


def test_lookups_between_paths_found_before_match_a_whole_scan(tmp_path: Path) -> None:
    """Each lookup searches only between the entries of the nearest paths already found: same answers."""
    files = _files(120)
    repo = make_repo(tmp_path / "repo", files)
    index = str(repo.path / ".git" / "index")
    paths = sorted(files)
    absent = ["a/b.tx", "b.txt0", "a/TREE/zz", "0", "~", "a/", "a/b/", "TRE", "x/TREE/y", "b"]
    rng = random.Random(7)
    asked = paths + absent
    rng.shuffle(asked)
    raw = RawIndex(index)
    for path in asked:
        alone = RawIndex(index)  # nothing found before: the whole file is searched
        try:
            whole: int | None = alone.locate(path)
        except Unsupported:  # its bytes occur elsewhere: the narrower search may prove it absent
            assert path in absent
            with contextlib.suppress(Unsupported):
                assert raw.locate(path) is None
            continue
        assert raw.locate(path) == whole, path
        assert (whole is None) == (path in absent)
    assert len(raw._sorted) == len(paths)


@pytest.mark.parametrize("kind", ["split", "sparse"])
def test_an_index_libgit2_cannot_read_is_refused_before_anything_is_written(tmp_path: Path, kind: str) -> None:
    """A split index (``link``), or a sparse index (``sdir``) given a path new to it (an entry only
    libgit2 could add): a usage error naming the fix, nothing changed."""
    from conftest import run_cli

    repo = make_repo(tmp_path / "repo", {"a/a.txt": "a\n", "b/b.txt": "b\n"})
    if kind == "split":
        repo.git("config", "core.splitIndex", "true")
        repo.git("update-index", "--split-index")
    else:
        repo.git("sparse-checkout", "init", "--cone", "--sparse-index")
        repo.git("sparse-checkout", "set", "a")
    patch = tmp_path / "p.diff"
    patch.write_bytes(b"--- a/a/a.txt\n+++ b/a/a.txt\n@@ -1 +1 @@\n-a\n+A\n" if kind == "split" else
                      b"--- /dev/null\n+++ b/a/new.txt\n@@ -0,0 +1 @@\n+A\n")
    before = snapshot(repo)
    r = run_cli("apply", str(patch), "--key", "k1", "--json", cwd=repo.path)
    assert r.code == 2, r.out + r.err
    message = r.json["error"]["message"]
    assert (f"{kind} index" in message and "nothing was changed" in message), message
    assert "Exception ignored" not in r.err and "Traceback" not in r.err, r.err
    assert snapshot(repo) == before
    # Switched off (a split index's shared file still there): the apply goes through.
    if kind == "split":
        repo.git("config", "core.splitIndex", "false")
        repo.git("update-index", "--no-split-index")
        assert any(p.name.startswith("sharedindex.") for p in (repo.path / ".git").iterdir())
    else:
        repo.git("sparse-checkout", "init", "--cone", "--no-sparse-index")
    r = run_cli("apply", str(patch), "--key", "k1", "--json", cwd=repo.path)
    assert r.code == 0, r.out + r.err
    changed = "a/a.txt" if kind == "split" else "a/new.txt"
    assert repo.git("status", "--porcelain") == "" and (repo.path / changed).read_text() == "A\n"


def test_recover_names_the_fix_for_a_split_index_and_finishes_once_it_is_off(tmp_path: Path) -> None:
    """Crashed after the branch moved; the index became a split index before recover: the follow-up
    is reported as not done with the fix named (no traceback), and done by the recover after the fix."""
    from conftest import run_cli

    repo = make_repo(tmp_path / "repo", {"a/a.txt": "a\n", "b/b.txt": "b\n"})
    patch = tmp_path / "p.diff"
    patch.write_bytes(b"--- a/a/a.txt\n+++ b/a/a.txt\n@@ -1 +1 @@\n-a\n+A\n")
    r = run_cli("apply", str(patch), "--key", "k1", "--json", cwd=repo.path, env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert r.code == 137, r.out + r.err
    (repo.path / ".git/index.lock").unlink(missing_ok=True)  # what git's message tells a user to do
    repo.git("config", "core.splitIndex", "true")
    repo.git("update-index", "--split-index")
    rec = run_cli("recover", "--json", cwd=repo.path)
    assert rec.code == 0, rec.out + rec.err
    assert "Traceback" not in rec.err and "Exception ignored" not in rec.err, rec.err
    (row,) = rec.json["rows"]
    assert row["to"] == "committed"
    assert any("split index" in n and "--no-split-index" in n for n in row["notes"]), row["notes"]
    assert (repo.path / "a/a.txt").read_text() == "A\n", "the file was written ahead of the move"
    repo.git("config", "core.splitIndex", "false")
    repo.git("update-index", "--no-split-index")
    again = run_cli("recover", "--json", cwd=repo.path)
    assert again.code == 0, again.out + again.err
    assert (repo.path / "a/a.txt").read_text() == "A\n"
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", cwd=repo.path).code == 0


@pytest.mark.parametrize("inline_max", [0, 1 << 40])
def test_a_written_index_ends_with_its_checksum_hashed_in_a_thread_or_inline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline_max: int) -> None:
    """Big indexes are hashed in a thread while written (their bulk synced meanwhile), small ones first."""
    import hashlib

    import cas.index as index_module

    monkeypatch.setattr(index_module, "_HASH_INLINE_MAX", inline_max)
    parts = [b"DIRC" + os.urandom(5000), memoryview(os.urandom(300_000)), b"tail"]
    state = hashlib.sha1(parts[0][:1000])
    path = tmp_path / "index.new"
    index_module._write_with_checksum(str(path), parts, state, 1000, 0o644)
    body = b"".join(bytes(p) for p in parts)
    assert path.read_bytes() == body + hashlib.sha1(body).digest()
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_staged_index_hands_its_checksum_prefix_and_cached_trees_to_the_next_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The protocol writes the index twice per call (staged without stat data, then with it): the second
    write starts its checksum where the first left the old file's bytes, and does not walk the cached
    trees again for folders the first invalidated.  Later calls, on paths before and after that point,
    start their checksums from scratch and from the carried state; every file is one git accepts."""
    import hashlib
    import time

    files = {f"d{i % 40:02d}/e{i % 7}/f{i:05d}.txt": f"file {i}\n" for i in range(4000)}
    repo = make_repo(tmp_path / "repo", files)
    # Written in the files' second, every entry is racily clean and the update goes to libgit2
    # (test_many_racily_clean_entries_are_left_to_libgit2): the index is written again a second later.
    time.sleep(1.1)
    repo.git("update-index", "-q", "--really-refresh")
    index = repo.path / ".git" / "index"
    assert index.stat().st_size > 1 << 18  # big enough for the threaded prefix (index_raw._THREADED_HASH)
    walks: list[set[bytes]] = []
    real = RawIndex._tree_invalidated

    def counted(self: RawIndex, off: int, size: int, folders: set[bytes]) -> bytes:
        walks.append(set(folders))
        return real(self, off, size, folders)

    monkeypatch.setattr(RawIndex, "_tree_invalidated", counted)
    snap = IndexSnapshot(str(repo.path / ".git"))
    changes: dict[str, bytes] = {}

    def call(path: str) -> int:
        """One call's two writes of ``path``; returns where the second write's checksum started."""
        data = f"changed {path} {len(changes)}\n".encode()
        te = TreeEntry(git_blob_oid(data), 0o100644)
        assert snap.entry(path) is not None and snap.confirm()
        before = index.read_bytes()
        snap.stage(str(repo.path), [], [(path, te)], {path})
        snap.install(sync=False)
        staged = index.read_bytes()
        assert staged != before and hashlib.sha1(staged[:-20]).digest() == staged[-20:]
        assert _debug_stat(repo, path)["size"] == "0"  # no stat data: git compares the content
        (repo.path / path).write_bytes(data)
        repo.git("hash-object", "-w", "--", path)
        changes[path] = data
        snap.stage(str(repo.path), [], [(path, te)])
        assert snap._pending is not None
        started = snap._pending[2]
        snap.install()
        written = index.read_bytes()
        assert hashlib.sha1(written[:-20]).digest() == written[-20:]
        assert written[:started] == staged[:started] == before[:started]
        return started

    middle = "d20/e6/f00020.txt"
    offset = bytes(RawIndex(str(index)).data).index(middle.encode()) - 62
    assert call(middle) == offset  # the whole prefix carried over: hashed from the entry on
    assert len(walks) == 1 and b"d20/e6" in walks[0]  # the second write copied the cached trees
    nodes = _tree_nodes(index)
    assert nodes[""] == nodes["d20"] == nodes["d20/e6"] == -1 and nodes["d21"] >= 0
    call("d01/e1/f00001.txt")  # before the carried point: hashed from the start again
    call("d39/e2/f03999.txt")  # after it: the carried state extended
    assert len(walks) == 3
    _assert_like_git(repo, _reference(make_repo(tmp_path / "base", files), tmp_path, changes), changes)


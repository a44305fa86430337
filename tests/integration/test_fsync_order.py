"""The order of fsyncs and renames, observed with strace on real processes (docs/DESIGN.md section 4).

* ``write_durable``: openat(tmp, O_EXCL|O_NOFOLLOW) → write → fsync(tmp) → rename(tmp, target)
  → fsync(folder).
* faults injected by strace (``-e inject=SYSCALL:error=ERRNO``): the process reports
  ``DurableWriteError``, the target is unchanged, no tmp file is left.
* a full ``oncepatch apply``: the call's loose objects (written by libgit2 into a
  temporary object folder, synced together, renamed into ``objects/``, their folders
  synced together: ``cas.loose_objects``) → prepared receipt renamed → branch ref
  renamed from its ``.lock`` (libgit2's transaction) → key ref → committed receipt
  renamed, each rename preceded by an fsync of its file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cas.durable import TMP_MARK
from receipts.identity import key_hash
from tests.conftest import Repo, make_repo

ROOT = Path(__file__).resolve().parents[2]
STRACE = shutil.which("strace")


@pytest.fixture(scope="module")
def strace() -> str:
    if STRACE is None:
        pytest.skip("strace is not installed (apt-get install -y strace)")
    probe = subprocess.run([STRACE, "-f", "-o", os.devnull, "-e", "trace=none", "true"], capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here (ptrace not permitted?): {probe.stderr.strip()[:200]}")
    return STRACE


@dataclass(frozen=True)
class Call:
    n: int
    pid: int
    name: str
    args: str
    ret: int
    injected: bool
    #: The absolute paths the call names (an ``openat``'s file, a rename's source and destination, the
    #: file an ``fsync``'s descriptor is), descriptors resolved by :func:`resolve_fds`.
    where: tuple[str, ...] = ()

    def arg(self, i: int) -> str:
        return _split_args(self.args)[i]

    def path_arg(self, i: int) -> str:
        return self.arg(i).strip('"')


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_DONE = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+|\?)(.*)$")
_UNFINISHED = re.compile(r"^(.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")


def _split_args(args: str) -> list[str]:
    out, depth, cur, quoted, esc = [], 0, "", False, False
    for ch in args:
        if quoted:
            cur += ch
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


def parse_trace(text: str) -> list[Call]:
    """Completed syscalls, in order, from ``strace -f -o`` output (unfinished/resumed pairs joined)."""
    calls: list[Call] = []
    pending: dict[int, str] = {}
    for raw in text.splitlines():
        m = _LINE.match(raw)
        if not m:
            continue
        pid, body = int(m.group(1)), m.group(2)
        if body.startswith("+++") or body.startswith("---"):
            continue
        u = _UNFINISHED.match(body)
        if u:
            pending[pid] = u.group(1)
            continue
        r = _RESUMED.match(body)
        if r:
            body = pending.pop(pid, r.group(1) + "(") + r.group(2)
        d = _DONE.match(body)
        if not d or d.group(3) == "?":
            continue
        calls.append(Call(len(calls), pid, d.group(1), d.group(2), int(d.group(3)), "(INJECTED)" in d.group(4)))
    return calls


def resolve_fds(calls: list[Call], cwd: str) -> list[Call]:
    """``calls`` with :attr:`Call.where` filled in: folder descriptors followed from the ``openat`` that made them.

    The store and the worktree are written through folders opened without following links
    (``openat(fd, name)``, ``renameat(fd, name, fd, name)``): their paths are the folder's and the name.
    """
    fds: dict[str, str] = {}

    def at(dirfd: str, name: str) -> str:
        base = cwd if dirfd == "AT_FDCWD" else fds.get(dirfd, f"<fd {dirfd}>")
        return os.path.normpath(os.path.join(base, name))

    out = []
    for c in calls:
        where: tuple[str, ...] = ()
        if c.name == "openat" and c.ret >= 0:
            where = (at(c.arg(0), c.path_arg(1)),)
            fds[str(c.ret)] = where[0]
        elif c.name in ("renameat", "renameat2", "linkat"):
            where = (at(c.arg(0), c.path_arg(1)), at(c.arg(2), c.path_arg(3)))
        elif c.name in ("rename", "link"):
            where = (at("AT_FDCWD", c.path_arg(0)), at("AT_FDCWD", c.path_arg(1)))
        elif c.name in ("fsync", "fdatasync") and c.arg(0) in fds:
            where = (fds[c.arg(0)],)
        elif c.name == "close":
            fds.pop(c.arg(0), None)
        out.append(Call(c.n, c.pid, c.name, c.args, c.ret, c.injected, where))
    return out


def run_traced(strace: str, tmp_path: Path, argv: list[str], trace: str, *, inject: str | None = None,
               cwd: Path | None = None) -> tuple[subprocess.CompletedProcess[str], list[Call]]:
    out = tmp_path / f"trace-{len(list(tmp_path.glob('trace-*')))}.txt"
    cmd = [strace, "-f", "-qq", "-s", "256", "-o", str(out), "-e", f"trace={trace}"]
    if inject:
        cmd += ["-e", f"inject={inject}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    res = subprocess.run(cmd + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    return res, parse_trace(out.read_text(errors="replace"))


WRITER = r"""
import sys
from cas.durable import write_durable
from cas.errors import DurableWriteError
try:
    write_durable(sys.argv[1], b"payload-" * 4096, mode=0o640)
except DurableWriteError as exc:
    sys.exit(100 + (exc.cause.errno or 0))
"""

PAYLOAD_LEN = len(b"payload-") * 4096
DURABLE_TRACE = "openat,write,fchmod,fsync,fdatasync,close,rename,renameat,renameat2,unlink,unlinkat"


def _fd_calls(calls: list[Call], fd: int, start: int, names: set[str]) -> list[Call]:
    """Calls on ``fd`` after ``start`` until it is closed."""
    found = []
    for c in calls[start + 1:]:
        if c.name == "close" and c.arg(0) == str(fd):
            break
        if c.name in names and c.arg(0) == str(fd):
            found.append(c)
    return found


def _tmp_open(calls: list[Call], folder: Path) -> Call:
    opens = [c for c in calls if c.name == "openat" and TMP_MARK in c.args and str(folder) in c.args]
    assert len(opens) == 1, opens
    return opens[0]


def test_write_durable_syscall_order(strace: str, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    target = folder / "state.json"
    target.write_bytes(b"old")
    res, calls = run_traced(strace, tmp_path, [sys.executable, "-c", WRITER, str(target)], DURABLE_TRACE)
    assert res.returncode == 0, res.stderr
    assert target.read_bytes() == b"payload-" * 4096

    op = _tmp_open(calls, folder)
    flags = op.arg(2)
    for flag in ("O_CREAT", "O_EXCL", "O_NOFOLLOW", "O_WRONLY"):
        assert flag in flags, flags
    assert op.arg(3) == "0600"
    tmp, fd = op.path_arg(1), op.ret
    assert os.path.dirname(tmp) == str(folder) and os.path.basename(tmp).startswith(".state.json" + TMP_MARK)

    writes = _fd_calls(calls, fd, op.n, {"write"})
    assert writes and sum(w.ret for w in writes) == PAYLOAD_LEN
    syncs = _fd_calls(calls, fd, op.n, {"fsync"})
    assert len(syncs) == 1
    renames = [c for c in calls if c.name.startswith("rename") and tmp in c.args]
    assert len(renames) == 1
    rename = renames[0]
    assert rename.path_arg(-1) == str(target) and rename.ret == 0
    dir_opens = [c for c in calls if c.n > rename.n and c.name == "openat" and c.path_arg(1) == str(folder)
                 and "O_DIRECTORY" in c.args]
    assert dir_opens, "the folder is never opened after the rename"
    dir_syncs = _fd_calls(calls, dir_opens[0].ret, dir_opens[0].n, {"fsync"})

    # the order: open(tmp) → write… → fsync(tmp) → rename → fsync(folder)
    assert op.n < writes[0].n <= writes[-1].n < syncs[0].n < rename.n < dir_opens[0].n < dir_syncs[0].n
    assert not any(c.name.startswith("unlink") for c in calls if TMP_MARK in c.args)


@pytest.mark.parametrize(
    ("inject", "err"),
    [
        ("fsync:error=EIO", errno.EIO),
        ("write:error=ENOSPC", errno.ENOSPC),
        ("?rename,?renameat,?renameat2:error=EIO", errno.EIO),
    ],
    ids=["fsync-EIO", "write-ENOSPC", "rename-EIO"],
)
def test_injected_fault_leaves_no_residue(strace: str, tmp_path: Path, inject: str, err: int) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    target = folder / "state.json"
    target.write_bytes(b"old state\n")
    target.chmod(0o600)
    res, calls = run_traced(strace, tmp_path, [sys.executable, "-c", WRITER, str(target)], DURABLE_TRACE,
                            inject=inject)
    assert res.returncode == 100 + err, (res.returncode, res.stderr)  # DurableWriteError with that errno
    assert target.read_bytes() == b"old state\n"
    assert (target.stat().st_mode & 0o777) == 0o600
    assert sorted(os.listdir(folder)) == ["state.json"]  # no tmp left
    op = _tmp_open(calls, folder)
    assert any(c.injected for c in calls if c.n > op.n), "the fault was not injected into the write"
    unlinks = [c for c in calls if c.name.startswith("unlink") and op.path_arg(1) in c.args]
    assert len(unlinks) == 1 and unlinks[0].ret == 0
    assert not any(c.name.startswith("rename") and c.ret == 0 for c in calls)


# -- a full apply -------------------------------------------------------------------------------

APPLY_TRACE = "fsync,fdatasync,rename,renameat,renameat2,openat,close,link,linkat"


def _landings(calls: list[Call]) -> list[tuple[Call, str, str]]:
    """Every rename or link that put a file in place: (call, source, destination)."""
    return [(c, c.where[0], c.where[1]) for c in calls
            if c.ret == 0 and c.name in ("rename", "link", "renameat", "renameat2", "linkat")]


def _synced_before(calls: list[Call], path: str, before: int) -> bool:
    """Some fd opened on ``path`` was fsynced before call number ``before`` (and before it was closed).

    A file that became ``path`` by a hard link (a lock born complete) counts
    through the name it was written under.

    The apply is one process; its fsyncs may run on other threads (strace -f
    shows thread ids), so the fd is matched by number, not by thread.
    """
    names = {path} | {src for c, src, dst in _landings(calls) if dst == path and c.name.startswith("link")}
    for c in calls:
        if c.n >= before:
            break
        if c.name == "openat" and c.ret >= 0 and c.where[0] in names:
            for s in _fd_calls(calls, c.ret, c.n, {"fsync", "fdatasync"}):
                if s.n < before:
                    return True
    return False


def _folder_synced_between(calls: list[Call], folder: str, start: int, end: int) -> bool:
    """An fsync of a descriptor of ``folder`` ran between call ``start`` and call ``end``."""
    return any(c.name == "fsync" and c.ret == 0 and c.where == (folder,) for c in calls[start:end])


@pytest.mark.parametrize("name", ["main", "side"], ids=["checked-out", "not-checked-out"])
def test_full_apply_order_of_renames_and_fsyncs(strace: str, tmp_path: Path, name: str) -> None:
    repo: Repo = make_repo(tmp_path / "repo", {"README": "hello\n", "src/a.txt": "a\n"})
    repo.git("branch", "side")
    repo.write("README", "hello\nworld\n")
    diff = repo.git("diff").encode()
    repo.git("checkout", "-q", "README")
    patch = tmp_path / "p.diff"
    patch.write_bytes(diff)
    base = repo.head()

    res, calls = run_traced(strace, tmp_path, [sys.executable, "-m", "patcher.cli", "apply", str(patch), "--json",
                                               "--branch", name], APPLY_TRACE, cwd=repo.path)
    calls = resolve_fds(calls, str(repo.path))
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] and out["status"] == "committed"
    commit = out["commit"]
    assert repo.head(f"refs/heads/{name}") == commit and repo.git("rev-parse", f"{commit}~1").strip() == base
    assert f"Oncepatch-Call: {out['call_id']}" in repo.git("log", "-1", "--format=%B", commit)
    repo.git("fsck", "--strict")  # git agrees with what the receipt says

    git_dir = os.path.realpath(repo.path / ".git")
    h = key_hash(out["key"])
    receipt = os.path.join(git_dir, "oncepatch", "receipts", h[:2], f"{h}.json")
    assert os.path.realpath(out["receipt"]) == receipt
    branch = os.path.join(git_dir, "refs", "heads", name)
    key_ref = os.path.join(git_dir, "refs", "oncepatch", "keys", h)
    objects = os.path.join(git_dir, "objects")

    landings = _landings(calls)
    receipt_moves = [(c, src) for c, src, dst in landings if dst == receipt]
    branch_moves = [(c, src) for c, src, dst in landings if dst == branch]
    key_moves = [c for c, _, dst in landings if dst == key_ref]
    # the call's objects (blob, trees, commit): loose files, written by libgit2; no pack of ours
    object_moves = [(c, src, dst) for c, src, dst in landings
                    if os.path.dirname(os.path.dirname(dst)) == objects and len(os.path.basename(dst)) == 38]
    tree = repo.git("rev-parse", f"{commit}^{{tree}}").strip()
    landed = {os.path.basename(os.path.dirname(dst)) + os.path.basename(dst) for _, _, dst in object_moves}
    assert {commit, tree} <= landed, object_moves
    assert not [dst for _, _, dst in landings if dst.startswith(os.path.join(objects, "pack") + "/")]
    assert len(receipt_moves) == 2, [c.args for c, _ in receipt_moves]  # prepared, then committed
    assert len(branch_moves) == 1 and branch_moves[0][1] == branch + ".lock"
    assert len(key_moves) == 1
    prepared, committed = receipt_moves[0][0], receipt_moves[1][0]
    branch_move = branch_moves[0][0]

    # the protocol's order: objects → prepared receipt → branch ref → key ref → committed receipt
    last_object = max(c.n for c, _, _ in object_moves)
    assert last_object < prepared.n < branch_move.n < key_moves[0].n < committed.n

    # every receipt rename: its tmp file was fsynced before, its folder after
    for move, src in receipt_moves:
        assert os.path.basename(src).startswith("." + h + ".json" + TMP_MARK)
        assert _synced_before(calls, src, move.n), f"receipt tmp {src} renamed without fsync"
    assert _folder_synced_between(calls, os.path.dirname(receipt), prepared.n, branch_move.n), \
        "receipts folder not synced between the prepared receipt and the ref move"
    # every object is synced before its rename into objects/ (one round for all, with the
    # prepared receipt's tmp file: the batch of cas.loose_objects joined to the receipt's), and
    # its folder after it (with the receipt's folder) and before the branch names it
    for move, src, dst in object_moves:
        assert _synced_before(calls, src, move.n), f"object {dst} renamed without fsync"
        assert _folder_synced_between(calls, os.path.dirname(dst), move.n, branch_move.n), dst
    prepared_tmp = next(c for c in calls if c.name == "openat" and c.ret >= 0 and c.where[0] == receipt_moves[0][1])
    first_object = min(c.n for c, _, _ in object_moves)
    assert prepared_tmp.n < first_object and _synced_before(calls, receipt_moves[0][1], first_object), \
        "the prepared receipt's tmp file is not synced in the objects' round"
    # libgit2 wrote them into the temporary object folder with its own syncs off: each
    # object file is synced once, by the batch, and the folder is gone afterwards
    staged = [src for _, src, _ in object_moves]
    tmp_objdir = os.path.dirname(os.path.dirname(staged[0]))
    assert os.path.basename(tmp_objdir).startswith("tmp_objdir-oncepatch-"), staged
    assert all(os.path.dirname(os.path.dirname(src)) == tmp_objdir for src in staged)
    assert not os.path.exists(tmp_objdir)
    libgit2_tmp = [src for c, src, dst in landings if os.path.dirname(dst).startswith(tmp_objdir + "/")]
    assert len(libgit2_tmp) == len(staged)
    assert not any(_synced_before(calls, src, len(calls)) for src in libgit2_tmp), "libgit2 synced an object"
    # the branch's lock file is fsynced before it becomes the ref; the ref's folder after,
    # with the reflog, and both before the committed receipt lands
    assert _synced_before(calls, branch + ".lock", branch_move.n)
    reflog = os.path.join(git_dir, "logs", "refs", "heads", name)
    assert _synced_before(calls, reflog, committed.n), "reflog not synced before the committed receipt"
    assert _folder_synced_between(calls, os.path.dirname(branch), branch_move.n, committed.n), \
        "the branch's folder not synced between its move and the committed receipt"
    # worktree files are renamed inside a folder opened without following links: renameat(fd, name, fd, name)
    worktree_moves = [c for c, _, dst in landings if dst == str(repo.path / "README")]
    if name == "main":  # checked out: index and files are written ahead of the move (docs/DESIGN.md section 4)
        # the index is staged for the candidate first (git commit reads it without a lock),
        # the index it replaced kept until the call ends; then the worktree's file, durable
        # (its folder synced) before the branch moves: a commit after a crash reverts nothing
        staged_moves = [c for c, _, dst in landings if dst == os.path.join(git_dir, "index")]
        assert len(worktree_moves) == 1 and len(staged_moves) == 2
        assert prepared.n < staged_moves[0].n < worktree_moves[0].n < branch_move.n
        kept = [c for c, _, dst in landings if os.path.basename(dst).startswith("index.oncepatch-base.")]
        assert len(kept) == 1 and kept[0].n < staged_moves[0].n
        folder_fd = int(worktree_moves[0].arg(0))  # renameat(dirfd, …): the folder, opened without following links
        assert any(c.n < branch_move.n for c in _fd_calls(calls, folder_fd, worktree_moves[0].n, {"fsync"}))
        # after the move, the index gets the file's stat data, before the committed receipt
        index_moves = staged_moves[1:]
        assert branch_move.n < index_moves[0].n < committed.n
        # the index's folder after its rename, in the finalise batch's first round (with the
        # committed receipt's tmp file, before its rename; libgit2 creates the key ref
        # meanwhile), not in a flush point of its own
        committed_tmp = next(c for c in calls if c.name == "openat" and c.ret >= 0
                             and c.where[0] == receipt_moves[1][1])
        assert index_moves[0].n < committed_tmp.n
        assert _folder_synced_between(calls, git_dir, committed_tmp.n, committed.n)
        assert not _folder_synced_between(calls, git_dir, index_moves[0].n, committed_tmp.n)
    else:
        assert worktree_moves == []
    for src in libgit2_tmp:
        # git prune's names for tmp files in objects/: a killed writer's are removed by recover too
        assert os.path.basename(src).startswith("tmp_object_git2_"), src

    fsyncs = [c for c in calls if c.name in ("fsync", "fdatasync")]
    print(f"full apply: {len(fsyncs)} fsync/fdatasync calls, {len(landings)} renames/links")
    assert len(fsyncs) >= 8


def test_removed_files_folders_synced_in_one_round_before_the_move(strace: str, tmp_path: Path) -> None:
    # A checked-out apply that deletes files in several folders: every removal is made
    # durable (its folder synced after the unlink) before the branch moves, and the folders
    # of all removals are synced together, after the last unlink (not one sync per file in turn).
    files = {"README": "hello\n", "keep/k.txt": "k\n"}
    gone = [f"d{n}/f{m}.txt" for n in range(3) for m in range(2)]
    files.update({p: f"{p}\n" for p in gone})
    repo: Repo = make_repo(tmp_path / "repo", files)
    for p in gone:
        repo.git("rm", "-q", p)
    diff = repo.git("diff", "--cached").encode()
    repo.git("reset", "-q", "--hard")
    patch = tmp_path / "p.diff"
    patch.write_bytes(diff)

    calls = _committed_with_unlinks(strace, tmp_path, repo, patch)
    assert not any((repo.path / p).exists() for p in gone) and (repo.path / "keep" / "k.txt").exists()
    assert not any((repo.path / f"d{n}").exists() for n in range(3))  # emptied folders pruned, as git does
    assert repo.git("status", "--porcelain") == ""

    branch = os.path.join(os.path.realpath(repo.path / ".git"), "refs", "heads", "main")
    branch_move = next(c for c, _, dst in _landings(calls) if dst == branch)
    unlinks = {}
    for c in calls:
        if c.name == "unlinkat" and c.ret == 0:
            fd, name = c.arg(0), c.path_arg(1)
            folder = next((o.where[0] for o in reversed(calls[:c.n]) if o.name == "openat" and str(o.ret) == fd), "")
            rel = os.path.relpath(os.path.join(folder, name), os.path.realpath(repo.path))
            if rel in gone:
                unlinks[rel] = c
    assert sorted(unlinks) == sorted(gone)
    last_unlink = max(c.n for c in unlinks.values())
    assert last_unlink < branch_move.n
    for rel in gone:
        folder = os.path.join(os.path.realpath(repo.path), os.path.dirname(rel))
        assert _folder_synced_between(calls, folder, unlinks[rel].n, branch_move.n), f"{rel}: folder not synced"
        # one round: no folder of a removal is synced between the first and the last unlink
        assert not _folder_synced_between(calls, folder, min(c.n for c in unlinks.values()), last_unlink), rel


def _committed_with_unlinks(strace: str, tmp_path: Path, repo: Repo, patch: Path) -> list[Call]:
    """The calls of a CLI apply of ``patch`` in ``repo`` traced with its unlinks, fds resolved; it committed."""
    res, calls = run_traced(strace, tmp_path, [sys.executable, "-m", "patcher.cli", "apply", str(patch), "--json"],
                            APPLY_TRACE + ",unlink,unlinkat", cwd=repo.path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["status"] == "committed"
    return resolve_fds(calls, str(repo.path))


def test_replaced_files_are_freed_together_after_their_renames(strace: str, tmp_path: Path) -> None:
    # A checked-out apply that rewrites many files: each old file gets a second name (a
    # hard link, '.<name>.optmp-<pid>-…') before the rename over it, so that the renames
    # free no blocks one after another; the second names are unlinked after the renames and
    # before the folders' sync and the branch's move, and none is left behind.
    changed = [f"d{n}/f{m}.txt" for n in range(2) for m in range(6)]
    repo: Repo = make_repo(tmp_path / "repo", {p: f"{p}\n" * 50 for p in changed})
    for p in changed:
        repo.write(p, f"{p}\n" * 50 + "more\n")
    diff = repo.git("diff").encode()
    repo.git("checkout", "-q", "--", ".")
    patch = tmp_path / "p.diff"
    patch.write_bytes(diff)

    calls = _committed_with_unlinks(strace, tmp_path, repo, patch)
    assert all((repo.path / p).read_text() == f"{p}\n" * 50 + "more\n" for p in changed)
    assert repo.git("status", "--porcelain", "--ignored") == ""
    assert not [p for p in repo.path.rglob(f"*{TMP_MARK}*")]

    root = os.path.realpath(repo.path)
    branch = os.path.join(os.path.realpath(repo.path / ".git"), "refs", "heads", "main")
    branch_move = next(c for c, _, dst in _landings(calls) if dst == branch)
    for rel in changed:
        target = os.path.join(root, rel)
        aside = [(c, dst) for c, src, dst in _landings(calls) if c.name in ("link", "linkat") and src == target]
        assert len(aside) == 1, (rel, aside)
        link, second = aside[0]
        assert os.path.basename(second).startswith(f".{os.path.basename(rel)}{TMP_MARK}")
        rename = next(c for c, _, dst in _landings(calls) if dst == target and c.name.startswith("rename"))
        freed = [c for c in calls if c.name == "unlinkat" and c.ret == 0 and c.path_arg(1) == os.path.basename(second)]
        assert len(freed) == 1, rel
        assert link.n < rename.n < freed[0].n < branch_move.n
        assert _folder_synced_between(calls, os.path.dirname(target), freed[0].n, branch_move.n), rel

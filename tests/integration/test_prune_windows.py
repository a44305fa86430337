"""The commands git documents as unsafe beside writers, run in a call's window (issue 23).

``git gc --prune=now`` and ``git prune --expire=now`` delete every object no
ref reaches, however young: git's documentation warns against running them
while another process writes to the repository.  git's own writers still never
leave a ref at a missing object: ``git update-ref`` refuses to point a ref at
an object that does not exist (:func:`test_git_update_ref_refuses_what_prune_removed`,
the baseline).  oncepatch must give the same: a call paused in its window —
its objects staged and its receipt ``prepared`` (``ONCEPATCH_PAUSE_AT=after-prepare``),
or just before it takes the branch's lock (``before-ref``) — while the
command runs, then resumed, either

* lands whole: exit 0, ``committed``, the branch at a commit whose tree holds
  the patch's file with its content (the call re-staged what was pruned), or
* is rejected retryable: exit 4, ``retryable: true``, nothing moved; the same
  key applied again then lands;

never a ref at a missing object.  Afterwards ``git fsck --full --strict`` is
clean and ``oncepatch verify --json`` exits 0.

The call stops itself with SIGSTOP at the point (``patcher/execute.py``); the
test waits until ``/proc/<pid>/stat`` shows state ``T``, runs the command,
then sends SIGCONT.  Every process is reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Repo, make_repo
from maintenance_driver import Procs, apply, apply_argv, fsck_full, key_hash, new_file_patch, outcome_of

DEADLINE = 120.0

UNSAFE = {
    "gc--prune=now": ("gc", "--quiet", "--prune=now"),
    "prune--expire=now": ("prune", "--expire=now"),
}


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return "gone"


def _paused(procs: Procs, argv: list[str], point: str) -> subprocess.Popen[bytes]:
    """Start ``argv`` with ``ONCEPATCH_PAUSE_AT=point``; return once it has stopped itself there."""
    env = dict(os.environ, ONCEPATCH_PAUSE_AT=point)
    proc = procs.start(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + DEADLINE
    while _state(proc.pid) != "T":
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before pausing at '{point}': {out!r} {err!r}")
        assert time.monotonic() < deadline, f"never reached pause point '{point}'"
        time.sleep(0.01)
    return proc


def _repo(tmp_path: Path, checked_out: bool) -> Repo:
    repo = make_repo(tmp_path / "repo", {"README": "prune window\n", "src/a.txt": "a\n"})
    # Earlier applies: their objects are reachable, and a loose key ref and its reflog exist.
    for i in range(2):
        p = tmp_path / f"earlier{i}.diff"
        p.write_bytes(new_file_patch(f"earlier/{i}.txt", f"earlier {i}"))
        res = subprocess.run(apply_argv(repo.path, p, f"earlier-{i}"), capture_output=True, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
    if not checked_out:
        repo.git("checkout", "-q", "-b", "side")
    return repo


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checked_out", [False, True], ids=["branch-not-checked-out", "branch-checked-out"])
@pytest.mark.parametrize("command", list(UNSAFE), ids=list(UNSAFE))
@pytest.mark.parametrize("point", ["after-prepare", "before-ref"])
def test_unsafe_prune_in_the_window_never_leaves_a_ref_at_a_missing_object(
        tmp_path: Path, point: str, command: str, checked_out: bool) -> None:
    repo = _repo(tmp_path, checked_out)
    branch = None if checked_out else "main"
    base = repo.head("main")
    patch = tmp_path / "window.diff"
    patch.write_bytes(new_file_patch("window/new.txt", "landed whole"))
    key = "window"
    procs = Procs()
    try:
        proc = _paused(procs, apply_argv(repo.path, patch, key, branch), point)
        run = subprocess.run(["git", *UNSAFE[command]], cwd=repo.path, capture_output=True, check=False)
        assert run.returncode == 0, f"git {' '.join(UNSAFE[command])}: {run.stderr.decode()}"
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=DEADLINE)
        procs.done(proc)
        first = outcome_of(key, proc.returncode, out, err)
        problems: list[str] = []
        head = repo.git("rev-parse", "main").strip()
        if first.committed:
            assert first.doc is not None
            if first.doc["commit"] != head:
                problems.append(f"committed {first.doc['commit']} but main is at {head}")
        elif first.code == 4 and first.error.get("retryable") is True:
            if head != base:
                problems.append(f"rejected, yet main moved from {base} to {head}")
            again = apply(procs, repo.path, patch, key, branch)
            if not again.committed:
                problems.append(f"the retry after a retryable rejection did not land: {again.describe()}")
        else:
            problems.append(f"neither landed nor rejected retryable: {first.describe()}")
        # Landed whole: the branch's tree holds the file, readable, with its content.
        show = subprocess.run(["git", "cat-file", "blob", "main:window/new.txt"], cwd=repo.path,
                              capture_output=True, check=False)
        if show.returncode != 0 or show.stdout != b"landed whole\n":
            problems.append(f"main:window/new.txt unreadable or wrong ({show.returncode}): "
                            f"{show.stdout!r} {show.stderr.decode(errors='replace').strip()}")
        for ref in ("refs/heads/main", f"refs/oncepatch/keys/{key_hash(key)}"):
            oid = repo.git("rev-parse", "--verify", "-q", ref, check=False).strip()
            exists = subprocess.run(["git", "cat-file", "-e", f"{oid}^{{commit}}"], cwd=repo.path,
                                    capture_output=True, check=False).returncode == 0
            if not oid or not exists:
                problems.append(f"{ref} is at {oid or 'nothing'}: the commit {'exists' if exists else 'is missing'}")
        grew = repo.git("rev-list", "--count", f"{base}..main", check=False).strip()
        if grew != "1":
            problems.append(f"main grew by {grew or '(unreadable)'} commits, not 1")
        clean, fsck_out = fsck_full(repo.path)
        if not clean:
            problems.append("git fsck --full --strict:\n    " + "\n    ".join(fsck_out.splitlines()[:15]))
        code, vout, verr = procs.run([sys.executable, "-m", "patcher.cli", "verify", "--repo", str(repo.path),
                                      "--json"])
        if code != 0:
            problems.append(f"verify --json exited {code}: {vout.decode(errors='replace')[:1000]} "
                            f"{verr.decode(errors='replace')[-300:]}")
        if checked_out:
            status = subprocess.run(["git", "status", "--porcelain"], cwd=repo.path, capture_output=True,
                                    check=False)
            if status.returncode != 0 or status.stdout:
                problems.append(f"git status --porcelain (exit {status.returncode}) is not clean: "
                                f"{(status.stdout + status.stderr).decode(errors='replace')[:500]}")
    finally:
        procs.reap()
    assert not problems, f"first outcome: {first.describe()}\n" + "\n".join(problems)


@pytest.mark.parametrize("command", list(UNSAFE), ids=list(UNSAFE))
def test_git_update_ref_refuses_what_prune_removed(tmp_path: Path, command: str) -> None:
    """The baseline: git's own writer, its objects pruned before its ref move, moves nothing."""
    repo = _repo(tmp_path, checked_out=False)
    base = repo.head("main")
    env = dict(os.environ, GIT_INDEX_FILE=str(tmp_path / "index"))

    def g(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        res = subprocess.run(["git", *args], cwd=repo.path, env=env, capture_output=True, check=False)
        assert not check or res.returncode == 0, f"git {' '.join(args)}: {res.stderr.decode()}"
        return res

    patch = tmp_path / "window.diff"
    patch.write_bytes(new_file_patch("window/new.txt", "landed whole"))
    g("read-tree", base)
    g("apply", "--cached", str(patch))
    tree = g("write-tree").stdout.decode().strip()
    commit = g("commit-tree", tree, "-p", base, "-m", "git writer").stdout.decode().strip()
    g(*UNSAFE[command])  # the window: objects written, ref not yet moved
    assert g("cat-file", "-e", commit, check=False).returncode != 0, "prune kept the unreachable commit"
    moved = g("update-ref", "refs/heads/main", commit, base, check=False)
    assert moved.returncode != 0
    assert b"nonexistent object" in moved.stderr, moved.stderr
    assert repo.head("main") == base
    clean, out = fsck_full(repo.path)
    assert clean, out

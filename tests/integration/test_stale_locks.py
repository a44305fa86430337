"""Stale git lock files left by "a crashed git" (issue 4).

A ``refs/heads/main.lock`` or ``index.lock`` that nobody will ever release
looks exactly like one a live git holds for a moment, so oncepatch waits
(every lock of a call for the one ``--lock-timeout``), then gives up with a clear error —
exit 5, ``in_progress``, the file named, and how to check that it is stale —
and never deletes it.  Nothing moves: the branch, HEAD, the index and the
worktree stay as they were.

What the store keeps (the contract):

* ``index.lock`` is met by the input checks, before the key's lock is taken
  (the dirty-path check reads HEAD and the index under it): nothing at all is
  written — no receipt, no lock file;
* ``refs/heads/<b>.lock`` is met at the compare-and-swap, after ``prepared``:
  the call ends as a ``rejected`` receipt with ``retryable: true`` and the lock
  error inside (type ``in_progress``, ``lock_path``), its ``prepared`` and
  ``rejected`` ledger events, and lock files of its own; the staged objects
  stay unreferenced (``git gc`` prunes them).  Once the file is removed by
  hand, the same call executes with the next fencing token.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, run_cli, snapshot, wait_paused

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+after the stale lock\n"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def allowed_store_change(path: str) -> bool:
    """Store files a call stopped by a held git lock may leave: its receipt, ledger and lock files."""
    h = key_hash("K")
    return path in {f"receipts/{h[:2]}/{h}.json", "events.jsonl", f"locks/{h}.lock", "locks/ledger.lock"} or (
        path.startswith("locks/branch-") and path.endswith(".lock"))


def apply(repo: Repo, patch: Path) -> Any:
    return run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K", "--lock-timeout", "0.5")


@pytest.fixture
def patch(tmp_path: Path) -> Path:
    p = tmp_path / "p.diff"
    p.write_bytes(PATCH)
    return p


def stale_lock_case(repo: Repo, patch: Path, lock: Path, content: bytes, *, receipt_left: bool) -> None:
    lock.write_bytes(content)
    mtime = lock.stat().st_mtime_ns
    before = snapshot(repo)

    r = apply(repo, patch)
    assert r.code == 5, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "in_progress" and err["retryable"] is True and err["key"] == "K"
    assert err["lock_path"] == os.path.realpath(lock)
    assert f"'{err['lock_path']}'" in err["message"]  # names the file ...
    assert "fuser" in err["message"] and "remove the file by hand" in err["message"]  # ... and how to check it
    assert err["effect_status"] in ("not_started", "not_applied")

    # Never deleted or touched.
    assert lock.read_bytes() == content and lock.stat().st_mtime_ns == mtime
    after = snapshot(repo)
    for part in ("refs", "head", "index", "worktree"):
        assert after[part] == before[part], part
    changed = {p for p in set(after["store"]) | set(before["store"])
               if after["store"].get(p) != before["store"].get(p)}
    receipt_file = repo.store / "receipts" / key_hash("K")[:2] / f"{key_hash('K')}.json"
    if receipt_left:
        assert all(allowed_store_change(p) for p in changed), changed
        receipt = json.loads(receipt_file.read_text())
        assert (receipt["status"], receipt["retryable"], receipt["fencing_token"]) == ("rejected", True, 1)
        assert receipt["error"]["type"] == "in_progress" and receipt["error"]["lock_path"] == err["lock_path"]
        assert receipt["commit"] is None
    else:
        assert changed == set() and not receipt_file.exists()

    # recover does not remove someone else's lock either.
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.err
    assert lock.read_bytes() == content
    assert str(lock) not in json.dumps(rec.json["removed"])

    # Checked and removed by hand: the same call now executes, once.
    lock.unlink()
    again = apply(repo, patch)
    assert again.code == 0, again.out + again.err
    assert again.json["replayed"] is False
    receipt = json.loads(Path(again.json["receipt"]).read_text())
    assert (receipt["status"], receipt["fencing_token"]) == ("committed", 2 if receipt_left else 1)
    assert repo.head() == again.json["commit"] and repo.count() == 2
    assert (repo.path / "README").read_text() == "hello\nafter the stale lock\n"
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


def test_stale_branch_lock_is_reported_never_removed(repo: Repo, patch: Path) -> None:
    base = repo.head()
    # What git leaves when it dies holding the ref lock: the new value it was about to write.
    stale_lock_case(repo, patch, repo.path / ".git/refs/heads/main.lock", f"{base}\n".encode(), receipt_left=True)


def test_stale_index_lock_is_reported_never_removed(repo: Repo, patch: Path) -> None:
    """Met by the input checks: nothing is written, not even the key's lock file."""
    # What git leaves when it dies holding the index lock: a (partial) new index.
    stale_lock_case(repo, patch, repo.path / ".git/index.lock", (repo.path / ".git/index").read_bytes()[:100],
                    receipt_left=False)


def test_index_lock_of_a_dead_oncepatch_call_is_removed(repo: Repo, patch: Path) -> None:
    """Provably ours and stale (our mark, this host, no such process): the next call removes it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = repo.path / ".git/index.lock"
    lock.write_bytes(b"oncepatch-index-lock %d %s\n" % (dead.pid, socket.gethostname().encode()))
    r = apply(repo, patch)
    assert r.code == 0, r.out + r.err
    assert not lock.exists() and repo.git("status", "--porcelain") == ""


def test_index_lock_of_a_live_oncepatch_process_is_kept(repo: Repo, patch: Path) -> None:
    lock = repo.path / ".git/index.lock"
    content = b"oncepatch-index-lock %d %s\n" % (os.getpid(), socket.gethostname().encode())
    lock.write_bytes(content)
    r = apply(repo, patch)
    assert r.code == 5 and r.json["error"]["lock_path"] == os.path.realpath(lock), r.out
    assert lock.read_bytes() == content


def test_stale_index_lock_of_a_branch_not_checked_out_does_not_matter(repo: Repo, patch: Path) -> None:
    """Only worktrees that have the branch checked out are locked and written."""
    repo.git("branch", "side")
    lock = repo.path / ".git/index.lock"
    lock.write_bytes(b"")
    r = run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K", "--branch", "side")
    assert r.code == 0, r.out + r.err
    assert repo.head("side") == r.json["commit"] and lock.read_bytes() == b""


# -- the mark an index lock is linked from ---------------------------------------------------------


def lock_tmp_files(repo: Repo) -> list[str]:
    return sorted(p.name for p in (repo.path / ".git").iterdir() if p.name.startswith(".index.lock.optmp-"))


def test_a_kept_mark_serves_the_next_lock_and_is_dropped(repo: Repo) -> None:
    """The apply protocol takes a worktree's index lock twice per call: both are linked from one
    mark file, which is removed as the call ends (even when the kept one was removed meanwhile)."""
    from cas.index_lock import drop_lock_marks, hold_index_lock

    git_dir = os.path.realpath(repo.path / ".git")
    lock_path = repo.path / ".git/index.lock"
    first = hold_index_lock(str(repo.path), timeout=0, git_dir=git_dir, keep_mark=True)
    ino = lock_path.stat().st_ino
    assert lock_path.read_bytes().startswith(b"oncepatch-index-lock %d " % os.getpid())
    first.release()
    assert not lock_path.exists() and len(lock_tmp_files(repo)) == 1  # kept
    second = hold_index_lock(str(repo.path), timeout=0, git_dir=git_dir, keep_mark=True)
    assert lock_path.stat().st_ino == ino  # the same mark: no second file made
    second.release()
    (kept,) = lock_tmp_files(repo)
    os.unlink(repo.path / ".git" / kept)  # removed behind the thread's back
    third = hold_index_lock(str(repo.path), timeout=0, git_dir=git_dir, keep_mark=True)
    (remade,) = lock_tmp_files(repo)
    assert remade != kept and lock_path.read_bytes() == (repo.path / ".git" / remade).read_bytes()
    third.release()
    drop_lock_marks()
    assert lock_tmp_files(repo) == [] and not lock_path.exists()
    plain = hold_index_lock(str(repo.path), timeout=0)  # without keep_mark: nothing stays
    plain.release()
    assert lock_tmp_files(repo) == []


def test_calls_leave_no_mark_behind(repo: Repo) -> None:
    from patcher.errors import DirtyPath
    from patcher.protocol import apply as api_apply

    stores: dict[str, object] = {}
    res = api_apply(str(repo.path), PATCH, key="k1", _stores=stores)
    assert res.status == "committed" and lock_tmp_files(repo) == []
    (repo.path / "README").write_text("dirty\n")
    with pytest.raises(DirtyPath):
        api_apply(str(repo.path), b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+x\n", key="k2",
                  _stores=stores)
    assert lock_tmp_files(repo) == [] and not (repo.path / ".git/index.lock").exists()


def _zombie_state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return fh.read().rsplit(b")", 1)[1].split()[0]


def test_a_crashed_call_not_yet_reaped_is_gone(repo: Repo, tmp_path: Path) -> None:
    """A zombie (exited, its parent has not waited yet) holds nothing: its index.lock is settled at once.

    An agent harness that reaps its children one at a time leaves such zombies; a later
    call used to wait for the dead call's index.lock, then exit 5 telling to remove it by hand.
    """
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc to tell a zombie by")
    first, second = tmp_path / "first.diff", tmp_path / "second.diff"
    first.write_bytes(PATCH)
    second.write_bytes(b"--- a/docs/guide.txt\n+++ b/docs/guide.txt\n@@ -1 +1 @@\n-guide\n+the guide\n")
    env = dict(os.environ, ONCEPATCH_CRASH_AT="after-index-ahead")
    dead = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(first), "--repo", str(repo.path),
                             "--key", "first", "--json"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    from cas.pids import gone

    try:
        # Not waited for: it stays a zombie once it has exited.  Its leader shows Z as soon
        # as its main thread ends; the other threads of its exit_group may run on for a
        # moment (under load, tens of milliseconds), and only then is the process gone.
        for _ in range(600):
            if _zombie_state(dead.pid) == b"Z" and gone(dead.pid):
                break
            time.sleep(0.05)
        assert _zombie_state(dead.pid) == b"Z"
        assert (repo.path / ".git" / "index.lock").exists()
        assert gone(dead.pid) and not gone(os.getpid())
        r = run_cli("apply", str(second), "--repo", str(repo.path), "--key", "second", "--json",
                    "--lock-timeout", "2")
        assert r.code == 0 and r.json["status"] == "committed", r.out + r.err
        assert repo.git("status", "--porcelain") == ""  # the dead call's staged entries did not come along
        assert "after the stale lock" not in repo.git("show", "HEAD:README")
    finally:
        dead.wait()
    assert dead.returncode == 137


def test_a_store_that_cannot_be_made_is_a_usage_error_and_nothing_changes(repo: Repo, patch: Path) -> None:
    before = snapshot(repo)
    r = run_cli("apply", str(patch), "--repo", str(repo.path), "--store", "/proc/no-such-folder/store", "--json")
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and "cannot make" in err["message"]
    assert snapshot(repo) == before


def test_a_process_whose_main_thread_ended_while_others_run_is_not_gone(tmp_path: Path) -> None:
    """Its leader shows as a zombie in /proc, but the process lives on: its locks are still held."""
    if not os.path.exists(f"/proc/{os.getpid()}/task"):
        pytest.skip("no /proc to tell a zombie by")
    from cas.pids import gone

    code = ("import ctypes, os, sys, threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(30), os._exit(0))).start()\n"
            "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for _ in range(200):
            if _zombie_state(proc.pid) == b"Z":
                break
            time.sleep(0.02)
        assert _zombie_state(proc.pid) == b"Z"  # the leader, as /proc shows it
        assert not gone(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert gone(proc.pid)


_HOLDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
os.write(fd, b"held by a live process")
sys.stdout.write("held\\n"); sys.stdout.flush()
sys.stdin.read()
os.close(fd); os.unlink(sys.argv[1])
"""


def _hold(lock: Path) -> subprocess.Popen[bytes]:
    """A live process holding ``lock`` (git's way: the file exists) until its stdin is closed."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    return holder


def _release(holder: subprocess.Popen[bytes]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait() == 0


def test_a_short_lock_timeout_governs_the_index_lock(repo: Repo, patch: Path) -> None:
    """``--lock-timeout 0.5`` against an ``index.lock`` a live process holds: exit 5 at once, nothing written.

    (The index lock used to be waited for 10 s whatever the option said.)
    """
    lock = repo.path / ".git" / "index.lock"
    holder = _hold(lock)
    try:
        before = snapshot(repo)
        t0 = time.monotonic()
        r = run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K", "--lock-timeout", "0.5")
        elapsed = time.monotonic() - t0
        assert r.code == 5, r.out + r.err
        assert r.json["error"]["type"] == "in_progress" and r.json["error"]["lock_path"] == os.path.realpath(lock)
        assert elapsed < 5, elapsed  # 0.5 s of waiting (and the interpreter's start), not 10 s
        after = snapshot(repo)
        for part in ("refs", "head", "index", "worktree"):
            assert after[part] == before[part], part
        assert after["store"] == before["store"]  # met before the key's lock: nothing at all written
        assert lock.read_bytes() == b"held by a live process"
    finally:
        _release(holder)
    assert not lock.exists()
    again = run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K", "--lock-timeout", "0.5")
    assert again.code == 0 and repo.head() == again.json["commit"], again.out + again.err
    assert repo.git("status", "--porcelain") == ""


def test_a_long_lock_timeout_governs_the_branch_lock(repo: Repo, patch: Path) -> None:
    """The branch's lock is waited for as long as ``--lock-timeout`` says (it used to be 1 s whatever it said).

    The call is stopped just before its ref move (the ``ONCEPATCH_PAUSE_AT`` seam), the
    branch's lock taken by a live process, the call resumed: 2 s later it still waits;
    once the lock is let go, it lands.
    """
    env = dict(os.environ, ONCEPATCH_PAUSE_AT="before-ref")
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path),
                             "--json", "--key", "K", "--lock-timeout", "60"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    holder = None
    try:
        wait_paused(proc, 600)  # stopped by itself (SIGSTOP) at the seam
        base = repo.head()
        holder = _hold(repo.path / ".git/refs/heads/main.lock")
        os.kill(proc.pid, signal.SIGCONT)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)  # still waiting for the lock, past the old 1 s
        assert repo.head() == base
        _release(holder)
        holder = None
        out, err = proc.communicate(timeout=60)
    finally:
        if holder is not None:
            _release(holder)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert json.loads(out)["commit"] == repo.head() != base
    assert repo.git("status", "--porcelain") == ""


def test_recover_waits_for_an_index_lock_as_long_as_its_lock_timeout(repo: Repo, patch: Path) -> None:
    """``recover --lock-timeout 0.5``: a worktree whose ``index.lock`` a live process holds is left for later.

    A call killed after writing the worktree ahead of its move, before the move,
    leaves files to put back; while a live git holds ``index.lock``, recover leaves
    the receipt ``prepared`` (skipped, naming the lock) and returns after its own
    timeout (it used to wait 10 s); run again once the lock is let go, it puts the
    files back and settles the call ``rejected``.
    """
    base = (repo.path / "README").read_bytes()
    crashed = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path),
                              "--json", "--key", "K"], env=dict(os.environ, ONCEPATCH_CRASH_AT="after-worktree-ahead"),
                             capture_output=True, check=False)
    assert crashed.returncode == 137, crashed.stderr
    assert (repo.path / "README").read_text() == "hello\nafter the stale lock\n"  # written ahead
    lock = repo.path / ".git/index.lock"
    lock.unlink()  # the dead call's own lock (recover would settle it), taken over by a live git
    holder = _hold(lock)
    try:
        t0 = time.monotonic()
        r = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0", "--lock-timeout", "0.5")
        elapsed = time.monotonic() - t0
        assert r.code == 5, r.out + r.err
        (skipped,) = r.json["skipped"]
        assert skipped["key"] == "K" and str(lock) in skipped["reason"], skipped
        assert elapsed < 5, elapsed
        assert lock.read_bytes() == b"held by a live process"
    finally:
        _release(holder)
    again = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0", "--lock-timeout", "0.5")
    assert again.code == 0, again.out + again.err
    assert [(row["key"], row["to"]) for row in again.json["rows"]] == [("K", "rejected")]
    assert (repo.path / "README").read_bytes() == base
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0

"""``apply --check CMD`` (issue 4): the candidate is checked in a temporary worktree before the branch moves.

* passing → committed; the temporary worktree is gone (folder and git's entry);
* failing → exit 4 ``check_failed`` with ``exit_status`` and the sha256 of the
  captured output, which is saved beside the receipt; branch, index and user
  worktree untouched; a replay does not run the check again;
* timing out → ``check_failed`` with ``timed_out: true``, the command's whole
  process group killed;
* crashing mid-check (``ONCEPATCH_CRASH_AT=check-running``) → 137, the
  temporary worktree left behind; ``recover --tmp-age 0`` removes it and
  ``git worktree list`` no longer shows it.

The overhead of the temporary worktree is measured at 1k files (and at 100k
with ``ONCEPATCH_SLOW=1``); ``-s`` shows the numbers (docs/CONCURRENCY.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, git, make_repo, run_cli, snapshot

ADD = b"--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+added by the patch\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def apply(repo: Repo, patch: Path, *extra: str, key: str = "K", env: dict[str, str] | None = None) -> Any:
    return run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", key, *extra, env=env)


def check_worktrees(repo: Repo) -> list[str]:
    """Worktrees git knows besides the main one."""
    out = repo.git("worktree", "list", "--porcelain")
    paths = [line[len("worktree "):] for line in out.splitlines() if line.startswith("worktree ")]
    return [p for p in paths if os.path.realpath(p) != os.path.realpath(repo.path)]


def tmp_worktree_folder(repo: Repo) -> Path:
    return repo.store / "tmp" / "worktrees"


@pytest.fixture
def patch(tmp_path: Path) -> Path:
    p = tmp_path / "add.diff"
    p.write_bytes(ADD)
    return p


def test_passing_check_commits_and_leaves_no_worktree(repo: Repo, patch: Path, tmp_path: Path) -> None:
    base = repo.head()
    seen = tmp_path / "seen"
    # The check sees the candidate tree, while the user's worktree and branch are still untouched.
    check = (f"test -f new.txt && grep -q 'added by the patch' new.txt && pwd > '{seen}' "
             f"&& test ! -e '{repo.path}/new.txt' && test \"$(git -C '{repo.path}' rev-parse main)\" = {base}")
    r = apply(repo, patch, "--check", check)
    assert r.code == 0, r.out + r.err
    assert r.json["status"] == "committed" and repo.head() == r.json["commit"]
    ran_in = Path(seen.read_text().strip())
    assert ran_in.parent == tmp_worktree_folder(repo).resolve()
    assert not ran_in.exists()
    assert check_worktrees(repo) == []
    assert list(tmp_worktree_folder(repo).iterdir()) == []
    assert (repo.path / "new.txt").read_text() == "added by the patch\n"
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


def test_check_for_the_new_file_passes(repo: Repo, patch: Path) -> None:
    r = apply(repo, patch, "--check", "test -f new.txt")
    assert r.code == 0, r.out + r.err


def test_failing_check_rejects_and_touches_nothing(repo: Repo, patch: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    check = f"echo run >> '{runs}'; echo 'some output'; echo 'on stderr' >&2; exit 3"
    before = snapshot(repo)
    r = apply(repo, patch, "--check", check)
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "check_failed" and err["exit_status"] == 3 and err["timed_out"] is False
    assert err["effect_status"] == "not_applied" and err["retryable"] is False
    saved = Path(err["output_path"])
    output = saved.read_bytes()
    assert output == b"some output\non stderr\n"
    assert err["output_sha256"] == sha256(output) and err["output_bytes"] == len(output)
    receipt_path = repo.store / "receipts" / sha256(b"K")[:2] / f"{sha256(b'K')}.json"
    assert saved.parent == receipt_path.parent  # beside the receipt
    receipt = json.loads(receipt_path.read_text())
    assert receipt["status"] == "rejected" and receipt["error"]["output_sha256"] == err["output_sha256"]

    after = snapshot(repo)
    for part in ("refs", "head", "index", "worktree"):
        assert after[part] == before[part], part
    assert check_worktrees(repo) == [] and list(tmp_worktree_folder(repo).iterdir()) == []

    # A final rejection is replayed: same error, the check is not run again.
    again = apply(repo, patch, "--check", check)
    assert again.code == 4 and again.json["error"]["output_sha256"] == err["output_sha256"]
    assert runs.read_text() == "run\n"
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


def test_check_output_is_capped_but_hashed_whole(repo: Repo, patch: Path) -> None:
    r = apply(repo, patch, "--check", "head -c 3000000 /dev/zero; exit 1")
    assert r.code == 4, r.out
    err = r.json["error"]
    assert err["output_bytes"] == 3_000_000 and err["output_sha256"] == sha256(bytes(3_000_000))
    assert Path(err["output_path"]).stat().st_size == 1 << 20


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return "gone"


def test_check_timeout_kills_the_whole_process_group(repo: Repo, patch: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "sleep.pid"
    before = snapshot(repo)
    started = time.monotonic()
    r = apply(repo, patch, "--check", f"sleep 30 & echo $! > '{pidfile}'; wait", "--check-timeout", "1")
    took = time.monotonic() - started
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "check_failed" and err["timed_out"] is True
    assert "timed out after 1s" in err["message"]
    assert took < 25  # generous: it did not wait for the sleep
    # The background sleep was in the check's process group: killed with it (a zombie at most).
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while _state(pid) not in ("gone", "Z"):
        assert time.monotonic() < deadline, f"sleep {pid} survived the timeout"
        time.sleep(0.05)
    after = snapshot(repo)
    for part in ("refs", "head", "index", "worktree"):
        assert after[part] == before[part], part
    assert check_worktrees(repo) == []


MODIFY = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"


def _started(proc: subprocess.Popen[bytes], repo: Repo) -> None:
    """Wait until the call's check runs (its temporary worktree exists)."""
    deadline = time.monotonic() + 30
    while not check_worktrees(repo):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def test_a_touched_file_edited_while_the_check_runs_is_not_overwritten(repo: Repo, tmp_path: Path) -> None:
    pf = tmp_path / "m.diff"
    pf.write_bytes(MODIFY)
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(pf), "--repo", str(repo.path),
                             "--json", "--key", "K", "--check", "sleep 2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _started(proc, repo)
    repo.write("src/util.py", "def f():\n    return 1\n# my edit\n")
    out, _err = proc.communicate(timeout=60)
    assert proc.returncode == 4, out
    err = json.loads(out)["error"]
    assert err["type"] == "dirty_path" and err["retryable"] and "while --check ran" in err["message"]
    assert (repo.path / "src/util.py").read_text() == "def f():\n    return 1\n# my edit\n"
    assert repo.count() == 1 and repo.git("diff", "--cached") == ""


def test_a_branch_moved_during_the_check_is_a_conflict_not_an_unchecked_commit(repo: Repo, tmp_path: Path) -> None:
    """Re-staged onto the moved head, the candidate would be a tree the check never saw."""
    pf = tmp_path / "m.diff"
    pf.write_bytes(MODIFY)
    repo.git("branch", "side")
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(pf), "--repo", str(repo.path),
                             "--json", "--key", "K", "--branch", "side", "--check", "sleep 2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _started(proc, repo)
    other = tmp_path / "o.diff"
    other.write_bytes(ADD)
    moved = run_cli("apply", str(other), "--repo", str(repo.path), "--json", "--key", "other", "--branch", "side")
    assert moved.code == 0, moved.out + moved.err
    head = repo.head("side")
    out, _err = proc.communicate(timeout=60)
    assert proc.returncode == 4, out
    err = json.loads(out)["error"]
    assert (err["type"], err["reason"], err["retryable"]) == ("conflict", "moved_during_check", True)
    assert repo.head("side") == head
    again = apply(repo, pf, "--branch", "side", "--check", "sleep 2")  # the same call, retried
    assert again.code == 0, again.out + again.err
    assert repo.head("side~1") == head


def test_crash_mid_check_leaves_a_worktree_that_recover_removes(repo: Repo, patch: Path) -> None:
    base = repo.head()
    r = apply(repo, patch, "--check", "true", env={"ONCEPATCH_CRASH_AT": "check-running"})
    assert r.code == 137, r.out + r.err
    left = check_worktrees(repo)
    assert len(left) == 1 and Path(left[0]).parent == tmp_worktree_folder(repo).resolve()
    assert Path(left[0]).is_dir() and (Path(left[0]) / "new.txt").exists()  # the candidate, checked out
    assert repo.head() == base and not (repo.path / "new.txt").exists()

    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.err
    assert any(os.path.realpath(p) == os.path.realpath(left[0]) for p in rec.json["removed"]), rec.json
    assert check_worktrees(repo) == []
    assert not Path(left[0]).exists()
    assert "prunable" not in repo.git("worktree", "list", "--porcelain")

    again = apply(repo, patch, "--check", "true")
    assert again.code == 0, again.out + again.err
    assert check_worktrees(repo) == []
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


def test_recover_leaves_a_running_checks_worktree_alone(repo: Repo, patch: Path, tmp_path: Path) -> None:
    """While a check runs its owner holds the key's lock: recover must not pull the worktree away."""
    release = tmp_path / "release"
    check = f"while [ ! -e '{release}' ]; do sleep 0.02; done"
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path),
                             "--json", "--key", "K", "--check", check], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not check_worktrees(repo):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
        assert rec.code == 0, rec.err
        assert len(check_worktrees(repo)) == 1
        release.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out, err)
    assert check_worktrees(repo) == []


# -- overhead of the temporary worktree ---------------------------------------------------------


def _big_repo(path: Path, n: int) -> Repo:
    """A repository whose ``main`` has ``n`` files, written by ``git fast-import`` (no checkout)."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    lines = [b"commit refs/heads/main", b"committer T <t@e> 1700000000 +0000", b"data 4", b"big", b""]
    for i in range(n):
        data = f"file {i}\n".encode()
        lines += [f"M 100644 inline d{i // 1000:03d}/f{i}.txt".encode(), f"data {len(data)}".encode(), data]
    subprocess.run(["git", "fast-import", "--quiet"], cwd=path, input=b"\n".join(lines) + b"\n", check=True)
    return Repo(path)


SIZES = [1_000] + ([100_000] if os.environ.get("ONCEPATCH_SLOW") else [])


@pytest.mark.parametrize("n", SIZES)
def test_check_overhead(tmp_path: Path, patch: Path, n: int) -> None:
    """apply with ``--check true`` minus apply without, on a branch that is not checked out."""
    repo = _big_repo(tmp_path / "big", n)
    timings: dict[str, list[float]] = {"plain": [], "check": []}
    for i in range(3):
        for kind in ("plain", "check"):
            branch = f"{kind}-{i}"
            repo.git("branch", branch, "main")
            extra = ["--branch", branch] + (["--check", "true"] if kind == "check" else [])
            t0 = time.monotonic()
            r = apply(repo, patch, *extra, key=f"{kind}-{i}")
            timings[kind].append(time.monotonic() - t0)
            assert r.code == 0, r.out + r.err
            assert repo.head(branch) == r.json["commit"]
    assert check_worktrees(repo) == []
    plain, checked = statistics.median(timings["plain"]), statistics.median(timings["check"])
    print(f"\ncheck overhead at {n} files: apply {plain * 1000:.0f} ms, with --check true "
          f"{checked * 1000:.0f} ms: +{(checked - plain) * 1000:.0f} ms (median of 3)")


def test_a_passing_check_that_leaves_a_process_behind_passes_at_once(repo: Repo, tmp_path: Path) -> None:
    """'server &' keeps the output open: the check's exit counts, not that process (it was taken for a
    timeout and the call rejected for good, or waited on far past --check-timeout after 'setsid')."""
    for i, cmd in enumerate(("sleep 30 & exit 0", "setsid sleep 30 & exit 0")):
        pf = tmp_path / f"bg{i}.diff"
        pf.write_bytes(f"--- /dev/null\n+++ b/bg{i}.txt\n@@ -0,0 +1 @@\n+x\n".encode())
        t0 = time.monotonic()
        r = apply(repo, pf, "--check", cmd, "--check-timeout", "20", key=f"bg{i}")
        took = time.monotonic() - t0
        assert r.code == 0, r.out + r.err
        assert took < 15, f"{cmd!r} held the call {took:.1f}s"


def _running(marker: str) -> list[int]:
    """Pids of this host whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    if marker.encode() in fh.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def test_recover_stops_the_check_a_killed_call_left_running(repo: Repo, patch: Path, tmp_path: Path) -> None:
    """The check runs in a session of its own (a timeout kills it whole): a SIGKILLed apply leaves it running."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc to find the check's processes by")
    beacon = tmp_path / "beacon"
    check = f"while true; do date +%s%N > '{beacon}'; sleep 0.05; done"
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path),
                             "--json", "--key", "K", "--check", check], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        try:
            deadline = time.monotonic() + 60
            while not beacon.exists():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
            proc.kill()
        finally:
            proc.communicate(timeout=30)
        assert _running(str(beacon)), "the killed call's check is still going"
        rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
        assert rec.code == 0, rec.out + rec.err
        assert check_worktrees(repo) == []
        deadline = time.monotonic() + 5
        while _running(str(beacon)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(str(beacon)) == [], "recover stopped the check before removing its folder"
        assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0
    finally:
        for pid in _running(str(beacon)):  # whatever the test left running
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_recover_run_from_inside_a_stale_check_worktree_survives_and_removes_it(repo: Repo, patch: Path) -> None:
    """Someone looking around in the check's folder runs recover there, piped into a pager: neither is killed."""
    r = apply(repo, patch, "--check", "true", env={"ONCEPATCH_CRASH_AT": "check-running"})
    assert r.code == 137, r.out + r.err
    (left,) = check_worktrees(repo)
    res = subprocess.run(f"{sys.executable} -m patcher.cli recover --repo '{repo.path}' --json --tmp-age 0 | cat",
                         shell=True, cwd=left, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert any(os.path.realpath(p) == os.path.realpath(left) for p in json.loads(res.stdout)["removed"])
    assert check_worktrees(repo) == []

"""``oncepatch watch``: a real watchdog observer in a real subprocess (docs/DESIGN.md section 5).

* an orphan made by a crash (``after-prepare``) while the watcher runs is
  flagged within the grace and a slack derived from the watcher's own start
  (:meth:`WatchProc.slack`), from its file events (the periodic rescan is
  600 s away);
* a live apply that is merely slow (its key lock held by a live process, the
  receipt ``prepared``) is never flagged — until that process dies;
* an orphan whose events are lost is found: made while no watcher ran (the
  startup scan), or made while the kernel's inotify queue overflowed (the
  periodic ``--rescan``);
* ``--once`` exits 6 with something flagged, 0 with nothing; ``--recover``
  settles what it flags.

Every watcher subprocess is reaped (terminate, then kill) in ``finally``.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli

from receipts.store import ReceiptStore

BASE: dict[str, str | bytes] = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 21))}


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Repo, dict[str, Path]]:
    """A repo and three independent patches (``a``, ``b``, ``c``: each edits its own line)."""
    repo = make_repo(tmp_path / "repo", BASE)
    base = repo.head()
    patches = {}
    for name, line in (("a", 3), ("b", 10), ("c", 17)):
        repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace(f"line {line}\n", f"{name}!\n"))
        patches[name] = tmp_path / f"{name}.diff"
        patches[name].write_bytes(repo.git("diff", "--full-index").encode())
        repo.git("reset", "-q", "--hard", base)
    return repo, patches


def orphan(repo: Repo, patch: Path, key: str) -> Any:
    """A ``prepared`` receipt whose owner died (crash after-prepare); returns the receipt."""
    r = run_cli("apply", "--repo", str(repo.path), "--key", key, "--json", str(patch),
                env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    assert r.code == 137, (r.code, r.out, r.err)
    rec = ReceiptStore(str(repo.store)).read(key)
    assert rec is not None and rec.status == "prepared"
    return rec


class WatchProc:
    """A ``watch --json`` subprocess whose stdout lines are read by a thread into a queue."""

    def __init__(self, repo: Repo, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "patcher.cli", "watch", "--repo", str(repo.path), "--json", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.started = time.monotonic()
        self.startup = 0.0  # seconds from the process's start until it watched (wait_ready)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(json.loads(raw))

    def next_flag(self, deadline: float, key: str | None = None) -> dict[str, Any] | None:
        """The next flag line (for ``key``) before ``deadline`` (monotonic), else ``None``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            self.seen.append(line)
            if "flag" in line and (key is None or line["key"] == key):
                return line

    def slack(self) -> float:
        """Seconds a flag may take beyond the grace on this machine now: derived from how long this
        watcher took to start (wait_ready), which grows with the load the suite's workers share."""
        return max(2.0, 4 * self.startup)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the observer's inotify watches exist (Linux: ``inotify wd:`` in the fd's fdinfo)."""
        deadline = time.monotonic() + timeout
        fd_dir = Path(f"/proc/{self.proc.pid}/fd")
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                for fd in fd_dir.iterdir():
                    if os.readlink(fd) == "anon_inode:inotify":
                        info = (Path(f"/proc/{self.proc.pid}/fdinfo") / fd.name).read_text()
                        if "inotify wd:" in info:
                            time.sleep(0.2)  # the startup scan runs right after the watches
                            self.startup = time.monotonic() - self.started
                            return
            except (FileNotFoundError, PermissionError):
                pass
            time.sleep(0.02)
        raise AssertionError("watcher did not start watching in time: " + self.stderr())

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.pid:
                os.kill(self.proc.pid, signal.SIGCONT)  # in case a test left it stopped
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def watching(repo: Repo, *args: str) -> Iterator[WatchProc]:
    w = WatchProc(repo, *args)
    try:
        yield w
    finally:
        w.close()


def assert_flag(line: dict[str, Any] | None, rec: Any, grace: float) -> None:
    assert line is not None, "no flag in time"
    assert line["flag"] == "orphan_prepared"
    assert line["key"] == rec.key and line["call_id"] == rec.call_id
    assert line["candidate"] == rec.candidate and line["next_action"] == "recover"
    assert line["age_s"] >= grace
    assert line["candidate_on_branch"] is False


# -- events -------------------------------------------------------------------------------------


def test_orphan_made_while_watching_is_flagged_within_the_grace_and_a_little(
        setup: tuple[Repo, dict[str, Path]]) -> None:
    repo, patches = setup
    with watching(repo, "--grace", "1", "--rescan", "600") as w:
        w.wait_ready()
        rec = orphan(repo, patches["a"], "a")
        made = time.monotonic()
        line = w.next_flag(made + 1 + w.slack(), "a")  # by its events: no rescan comes in time
        assert_flag(line, rec, 1.0)
        # Flagged once, not on every tick.
        assert w.next_flag(time.monotonic() + 1.5, "a") is None
    # The watcher only flags: the receipt is still prepared and the branch untouched.
    assert ReceiptStore(str(repo.store)).read("a").status == "prepared"


HOLDER = """
import sys, filelock
lk = filelock.FileLock(sys.argv[1], thread_local=False)
lk.acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def test_live_slow_owner_is_not_flagged_until_it_dies(setup: tuple[Repo, dict[str, Path]]) -> None:
    repo, patches = setup
    rec = orphan(repo, patches["a"], "a")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(repo.store / "locks" / f"{h('a')}.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        with watching(repo, "--grace", "1", "--rescan", "1") as w:
            w.wait_ready()
            # Prepared, older than the grace, rescanned every second: but its owner lives.
            assert w.next_flag(time.monotonic() + 3.5) is None, w.seen
            holder.kill()
            holder.wait()
            assert_flag(w.next_flag(time.monotonic() + 1 + w.slack(), "a"), rec, 1.0)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


# -- lost events ----------------------------------------------------------------------------------


def test_orphan_made_while_no_watcher_ran_is_found_by_the_startup_scan(
        setup: tuple[Repo, dict[str, Path]]) -> None:
    repo, patches = setup
    with watching(repo, "--grace", "1") as w:
        w.wait_ready()
    rec = orphan(repo, patches["a"], "a")  # no watcher runs now: nobody sees its events
    time.sleep(1.0)
    with watching(repo, "--grace", "1", "--rescan", "600") as w:
        w.wait_ready()
        assert_flag(w.next_flag(time.monotonic() + 1 + w.slack(), "a"), rec, 1.0)  # long before a rescan


def _overflow_inotify(folder: Path) -> None:
    """Queue more events than the kernel keeps (fs.inotify.max_queued_events): later ones are lost."""
    try:
        limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    except OSError:
        limit = 16384
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(limit // 2 + 100):  # each file: create, open, modify, close, delete (>= 2 events)
        p = folder / f"noise-{i}"
        p.write_bytes(b"x")
        p.unlink()
    folder.rmdir()


def test_orphan_whose_events_were_lost_is_found_by_the_periodic_rescan(
        setup: tuple[Repo, dict[str, Path]]) -> None:
    repo, patches = setup
    first = orphan(repo, patches["a"], "a")
    with watching(repo, "--grace", "1", "--rescan", "1") as w:
        w.wait_ready()
        assert_flag(w.next_flag(time.monotonic() + 1 + w.slack(), "a"), first, 1.0)  # startup scan
        # Freeze the watcher, overflow its inotify queue, make the orphan: its events are dropped.
        os.kill(w.proc.pid, signal.SIGSTOP)
        try:
            _overflow_inotify(repo.store / "receipts" / "zz-noise")
            rec = orphan(repo, patches["b"], "b")
        finally:
            os.kill(w.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        line = w.next_flag(resumed + 1 + 1 + w.slack(), "b")  # grace + rescan interval + slack
        assert_flag(line, rec, 1.0)


# -- --once and --recover ---------------------------------------------------------------------------


def test_once_exits_6_when_flagged_and_0_when_clean(setup: tuple[Repo, dict[str, Path]]) -> None:
    repo, patches = setup
    quiet = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "0", "--json")
    assert quiet.code == 0, quiet.err
    assert [json.loads(x) for x in quiet.out.splitlines()] == [{"ok": True, "flags": 0}]

    rec = orphan(repo, patches["a"], "a")
    young = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "60", "--json")
    assert young.code == 0, "younger than the grace: not flagged yet"

    flagged = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "0", "--json")
    assert flagged.code == 6, flagged.out + flagged.err
    lines = [json.loads(x) for x in flagged.out.splitlines()]
    assert_flag(lines[0], rec, 0.0)
    assert lines[-1] == {"ok": False, "flags": 1}
    assert ReceiptStore(str(repo.store)).read("a").status == "prepared"  # only flagged

    text = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "0")
    assert text.code == 6 and "orphan: a prepared" in text.out and "oncepatch recover" in text.out

    assert run_cli("recover", "--repo", str(repo.path)).code == 0
    after = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "0", "--json")
    assert after.code == 0, after.out


def test_recover_option_settles_what_it_flags(setup: tuple[Repo, dict[str, Path]]) -> None:
    repo, patches = setup
    base = repo.head()
    orphan(repo, patches["a"], "a")  # died before the commit: rejected, retryable
    r = run_cli("apply", "--repo", str(repo.path), "--key", "b", "--json", str(patches["b"]),
                env={"ONCEPATCH_CRASH_AT": "after-ref"})  # died after the commit: committed
    assert r.code == 137
    with watching(repo, "--grace", "1", "--rescan", "600", "--recover") as w:
        w.wait_ready()
        deadline = time.monotonic() + 2 + 2 * w.slack()  # two recoveries
        recovered: dict[str, str] = {}
        while len(recovered) < 2 and time.monotonic() < deadline:
            try:
                line = w.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if "recovered" in line:
                recovered[line["recovered"]] = line["status"]
        assert recovered == {"a": "rejected", "b": "committed"}, w.seen
    store = ReceiptStore(str(repo.store))
    assert store.read("a").retryable is True
    b = store.read("b")
    assert b.commit == repo.head("main") and repo.git("rev-parse", "main^").strip() == base
    assert repo.git("status", "--porcelain") == ""  # settled: worktree brought along
    assert run_cli("verify", "--repo", str(repo.path), "--grace", "0").code == 0


def test_recover_option_puts_back_what_a_dead_call_left_in_the_worktree(setup: tuple[Repo, dict[str, Path]]) -> None:
    """Killed with its index staged: watch --recover leaves the repository as recover does (lock gone, index back)."""
    repo, patches = setup
    index_before = (repo.path / ".git" / "index").read_bytes()
    r = run_cli("apply", "--repo", str(repo.path), "--key", "a", "--json", str(patches["a"]),
                env={"ONCEPATCH_CRASH_AT": "after-index-ahead"})
    assert r.code == 137
    assert (repo.path / ".git" / "index.lock").exists()
    res = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "0", "--recover", "--json")
    assert res.code == 6, res.out + res.err  # it flagged (and settled) an orphan
    lines = [json.loads(x) for x in res.out.splitlines()]
    done = [x for x in lines if "recovered" in x]
    assert len(done) == 1 and done[0]["status"] == "rejected", lines
    assert str(repo.path / ".git" / "index.lock") in done[0]["removed"]
    assert not (repo.path / ".git" / "index.lock").exists()
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))
    assert (repo.path / ".git" / "index").read_bytes() == index_before  # the staged entries are gone
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path), "--grace", "0").code == 0
    again = run_cli("apply", "--repo", str(repo.path), "--key", "a", "--json", str(patches["a"]))
    assert again.code == 0 and again.json["status"] == "committed", again.out


def test_a_corrupt_receipt_is_flagged_not_skipped(setup: tuple[Repo, dict[str, Path]]) -> None:
    repo, patches = setup
    rec = orphan(repo, patches["a"], "a")
    path = ReceiptStore(str(repo.store)).receipt_path("a")
    text = Path(path).read_text()
    Path(path).write_text(text.replace(f'"fencing_token": {rec.fencing_token}',
                                       f'"fencing_token": {rec.fencing_token + 1}'))
    for extra in ((), ("--recover",)):
        res = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "0", "--json", *extra)
        assert res.code == 6, res.out + res.err
        lines = [json.loads(x) for x in res.out.splitlines()]
        assert lines[0]["flag"] == "corrupt_receipt" and lines[0]["key"] == "a" and lines[0]["receipt"] == path
        assert "receipt_sha256 does not match" in lines[0]["reason"]
        assert lines[-1] == {"ok": False, "flags": 1}
    assert Path(path).read_text() != text  # reported, never rewritten
    human = run_cli("watch", "--repo", str(repo.path), "--once", "--grace", "0")
    assert human.code == 6 and f"corrupt: {path}" in human.out and "'oncepatch quarantine " in human.out

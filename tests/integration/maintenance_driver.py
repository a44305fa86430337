"""git maintenance beside ``oncepatch apply``: the pieces shared by the maintenance tests.

A user's repository is not quiet while an agent applies patches: ``git gc``,
``git maintenance`` (run by cron or by git itself), an IDE's background fetch
and repack.  git documents what is safe beside concurrent writers: every
command of :data:`MAINTENANCE` keeps any object younger than its prune grace
period (two weeks by default) and any object a ref names.  A writer that
follows git's convention — new objects written loose, the ref moved only to an
object that exists (``git update-ref`` refuses a missing one) — is never hurt by
them.  The tests here hold oncepatch to the same standard.

Everything is driven through the documented CLI only (``python -m
patcher.cli apply PATCH --repo R --key K --json``, ``recover``, ``verify``):
each call is its own process, as an agent's would be (forked from the tests' CLI
server, tests/forked_cli.py, except where a call is killed or its time measured).  Every process started
here is registered with a :class:`Procs` and reaped, whatever happens.

The checks after a run (:func:`final_problems`):

* ``git fsck --full --strict`` is clean (dangling objects, a lost race's
  garbage, are fine; a missing object or a ref at one is not);
* every committed receipt's commit is reachable from its branch;
* each key's ``Oncepatch-Key`` trailer is on exactly one commit of the branch;
* the branch grew by exactly one commit per committed key;
* ``oncepatch verify --json`` exits 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import forked_cli

__all__ = [
    "MAINTENANCE",
    "Procs",
    "MaintenanceLoop",
    "Outcome",
    "new_file_patch",
    "apply",
    "apply_argv",
    "apply_until_settled",
    "outcome_of",
    "kill_at",
    "rng_for",
    "run_workers",
    "outcome_problem",
    "measure_apply",
    "fsck_full",
    "tmp_leftovers",
    "worktree_problems",
    "kill_worker_at",
    "kill_paused_at",
    "PAUSE_POINTS",
    "committed_receipts",
    "settled_events",
    "final_problems",
    "key_hash",
    "git_apply_commit",
    "seed_from_env",
    "SEED_ENV",
    "DEADLINE",
]

#: What git supports beside concurrent writers (each keeps young and referenced objects).
MAINTENANCE: tuple[tuple[str, ...], ...] = (
    ("gc", "--quiet"),
    ("repack", "-a", "-d", "-q"),
    ("repack", "--geometric=2", "-d", "-q"),
    ("maintenance", "run", "--task=incremental-repack"),
    ("maintenance", "run", "--task=loose-objects"),
    ("multi-pack-index", "write"),
    ("multi-pack-index", "repack"),
    ("multi-pack-index", "expire"),
    ("commit-graph", "write", "--reachable"),
    ("pack-refs", "--all"),
)

SEED_ENV = "ONCEPATCH_MAINTENANCE_SEED"
DEFAULT_SEED = 20261202

#: A hang detector, never a performance assertion.
DEADLINE = 300.0


#: The seed the run was started with, read at import: the tests' hermetic fixture takes every
#: ONCEPATCH_* variable away before a test runs, so the printed "<SEED_ENV>=<seed> to replay" would
#: otherwise never reach the test it names.
_GIVEN_SEED = os.environ.get(SEED_ENV)


def seed_from_env() -> int:
    return int(os.environ.get(SEED_ENV) or _GIVEN_SEED or DEFAULT_SEED)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def git(cwd: Path, *args: str, check: bool = True, env: dict[str, str] | None = None) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False, env=env)
    if check and res.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed ({res.returncode}): {res.stderr.decode()}")
    return res.stdout.decode("utf-8", "surrogateescape")


class Procs:
    """Every process a test starts, from any thread; :meth:`reap` kills and waits for what still runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen[bytes]] = set()
        self.closed = False

    def start(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self.closed:
                raise RuntimeError("the test is over: no new process")
            proc = subprocess.Popen(list(argv), **kw)
            self._live.add(proc)
            return proc

    def done(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._live.discard(proc)

    def finish(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill ``proc`` if it still runs, wait for it, and forget it (every path out of a call's driver)."""
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        self.done(proc)

    def run(self, argv: Sequence[str], *, timeout: float = DEADLINE, **kw: Any) -> tuple[int, bytes, bytes]:
        proc = self.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{' '.join(argv)} hung past {timeout:g}s") from None
        finally:
            self.finish(proc)
        return proc.returncode, out, err

    def reap(self) -> None:
        with self._lock:
            self.closed = True
            live = list(self._live)
        for proc in live:
            if proc.poll() is None:
                # A process paused at a pause point is stopped: SIGKILL ends it all the same.
                proc.kill()
            proc.communicate()
        with self._lock:
            self._live.clear()


@dataclass
class MaintenanceLoop:
    """A thread running :data:`MAINTENANCE` (or ``commands``) in turn until stopped.

    It runs at least ``min_cycles`` full cycles, so a fast batch of applies
    still meets every command.  Each command's exit status is recorded: git may
    refuse a step beside a writer (a ref lock held, say) and that is not a
    finding of ours, but it is printed with the report.
    """

    repo: Path
    procs: Procs
    commands: tuple[tuple[str, ...], ...] = MAINTENANCE
    min_cycles: int = 1
    env: dict[str, str] | None = None
    runs: int = 0
    cycles: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _started: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def __enter__(self) -> MaintenanceLoop:
        self._thread = threading.Thread(target=self._main, name="maintenance", daemon=True)
        self._thread.start()
        assert self._started.wait(DEADLINE), "the maintenance loop never started"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(DEADLINE)
            assert not self._thread.is_alive(), "the maintenance loop hung"
            self._thread = None
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            while True:
                for cmd in self.commands:
                    rc, _, err = self.procs.run(["git", *cmd], cwd=self.repo, env=self.env)
                    self.runs += 1
                    self._started.set()
                    if rc != 0:
                        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
                        self.failures.append(f"git {' '.join(cmd)}: exit {rc}: {tail[0]}")
                self.cycles += 1
                if self._stop.is_set() and self.cycles >= self.min_cycles:
                    return
        except BaseException as exc:  # reported by stop(), in the test's thread
            self._error = exc
            self._started.set()

    def describe(self) -> str:
        fails = "; ".join(self.failures[:8]) + (" ..." if len(self.failures) > 8 else "")
        return f"maintenance: {self.cycles} cycles, {self.runs} commands, {len(self.failures)} refused" + (
            f" ({fails})" if fails else "")


def new_file_patch(path: str, line: str) -> bytes:
    """A patch adding ``path`` with one line: applies on any base, so distinct keys never conflict."""
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+{line}\n".encode()


@dataclass
class Outcome:
    key: str
    code: int
    doc: dict[str, Any] | None
    stderr: str = ""

    @property
    def committed(self) -> bool:
        return self.code == 0 and self.doc is not None and self.doc.get("status") == "committed"

    @property
    def error(self) -> dict[str, Any]:
        return (self.doc or {}).get("error") or {}

    @property
    def retryable(self) -> bool:
        """Rejected retryable (exit 4) or the key's lock not had in time (exit 5, nothing started)."""
        err = self.error
        if self.code == 4:
            return err.get("retryable") is True
        return self.code == 5 and err.get("type") == "in_progress" and err.get("effect_status") != "unknown"

    def describe(self) -> str:
        if self.doc is None:
            return f"{self.key}: exit {self.code}, no JSON; stderr {self.stderr[-300:]!r}"
        if self.code == 0:
            return f"{self.key}: exit 0 {self.doc.get('status')} {str(self.doc.get('commit'))[:12]}"
        err = self.error
        return (f"{self.key}: exit {self.code} {err.get('type')} effect {err.get('effect_status')} "
                f"retryable {err.get('retryable')}: {str(err.get('message'))[:300]}")


def apply_argv(repo: Path, patch: Path, key: str, branch: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo), "--key", key, "--json"]
    if branch is not None:
        argv += ["--branch", branch]
    return argv


def outcome_of(key: str, code: int, out: bytes, err: bytes) -> Outcome:
    try:
        doc = json.loads(out) if out.strip() else None
    except ValueError:
        doc = None
    return Outcome(key, code, doc, err.decode(errors="replace"))


def apply(procs: Procs, repo: Path, patch: Path, key: str, branch: str | None = None,
          env: dict[str, str] | None = None, fork: bool = True) -> Outcome:
    """One ``apply`` process to its end. Forked from the tests' CLI server (tests/forked_cli.py: a process
    of its own, without the interpreter's start-up) unless ``fork`` is false: a call whose time is
    measured to draw kill moments for real processes must be one itself."""
    argv = apply_argv(repo, patch, key, branch)
    full_env = dict(os.environ if env is None else env)
    if fork and forked_cli.can_fork(full_env):
        if procs.closed:
            raise RuntimeError("the test is over: no new process")
        code, out, err = forked_cli.run(argv[3:], cwd=None, input=None, env=full_env, timeout=DEADLINE)
    else:
        code, out, err = procs.run(argv, env=env)
    return outcome_of(key, code, out, err)


def outcome_problem(o: Outcome) -> str | None:
    """What the contract forbids here: ``internal`` (exit 1), effect ``unknown``, anything not retryable."""
    if o.code == 0 and o.doc is not None and o.doc.get("ok") is True:
        return None
    if o.doc is None:
        return "no JSON envelope: " + o.describe()
    if o.code == 1 or o.error.get("type") == "internal":
        return "internal: " + o.describe()
    if o.error.get("effect_status") == "unknown":
        return "effect unknown: " + o.describe()
    if not o.retryable:
        return "rejected, not retryable: " + o.describe()
    return None


def apply_until_settled(procs: Procs, repo: Path, patch: Path, key: str, branch: str | None = None,
                        attempts: int = 4) -> list[Outcome]:
    """Apply under ``key`` until it commits, ends in a forbidden way, or ``attempts`` retryable rejections."""
    seen: list[Outcome] = []
    for _ in range(attempts):
        o = apply(procs, repo, patch, key, branch)
        seen.append(o)
        if o.committed or outcome_problem(o) is not None:
            break
    return seen


def measure_apply(procs: Procs, repo: Path, patches: Sequence[Path], branch: str | None,
                  workers: int = 1) -> float:
    """Seconds of one clean apply, process start to exit: the median over ``patches`` applied in ``repo``.

    With ``workers`` > 1 they run that many at a time, beside a maintenance
    loop: the time a call takes under the load it will meet in the test (an
    apply that fails there is timed all the same: the test's own checks judge
    outcomes, not the measurement).
    """
    times: list[float] = []

    def work(w: int) -> None:
        for n in range(w, len(patches), workers):
            t0 = time.monotonic()
            o = apply(procs, repo, patches[n], f"measure-{n}", branch, fork=False)
            times.append(time.monotonic() - t0)
            assert workers > 1 or o.committed, f"a clean apply failed: {o.describe()}"

    if workers == 1:
        work(0)
    else:
        with MaintenanceLoop(repo, procs):
            run_workers(workers, work)
    return sorted(times)[len(times) // 2]


def fsck_full(repo: Path) -> tuple[bool, str]:
    """``git fsck --full --strict``: (clean, its output).  Dangling objects (a lost race's garbage) are fine."""
    res = subprocess.run(["git", "fsck", "--full", "--strict", "--no-progress"], cwd=repo, capture_output=True,
                         check=False)
    out = (res.stdout + res.stderr).decode("utf-8", "replace")
    bad = [ln for ln in out.splitlines() if ln and not ln.startswith(("dangling ", "Checking ", "notice: "))]
    return res.returncode == 0 and not bad, out


#: Names of temporary files oncepatch (cas/durable.py, cas/objects.py, cas/loose_refs.py) or the
#: libgit2 it drives (loose objects, ref and index locks) creates; none may outlive ``recover``.
def _is_tmp_name(name: str) -> bool:
    return (".optmp-" in name or name.startswith(("tmp_", ".tmp-", "index.oncepatch-base."))
            or name.endswith(".lock"))


def tmp_leftovers(repo: Path) -> list[str]:
    """Temporary files left in the git dir or the store (``<git dir>/oncepatch``).

    The store's ``locks/`` folder is left out of the ``*.lock`` rule: its key
    and branch lock files stay after every clean call (flock locks: taking one
    is locking the file, not creating it); a tmp file there is still found.
    Every file under the store's ``tmp/`` is a leftover (an empty folder is not).
    """
    git_dir = repo / ".git"
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(git_dir):
        here = Path(dirpath)
        rel = here.relative_to(git_dir)
        in_store_tmp = rel.parts[:2] == ("oncepatch", "tmp")
        in_store_locks = rel.parts[:2] == ("oncepatch", "locks")
        for name in filenames:
            if in_store_tmp or (_is_tmp_name(name) and not (in_store_locks and name.endswith(".lock")
                                                             and ".optmp-" not in name)):
                found.append(str((here / name).relative_to(git_dir)))
        # git's quarantine folders (tmp_objdir-*) and libgit2's: a folder, not a file.
        found += [str((here / name).relative_to(git_dir)) + "/" for name in dirnames if name.startswith("tmp_objdir")]
    # A checked-out worktree: the durable writes' tmp files beside the touched paths.
    for dirpath, dirnames, filenames in os.walk(repo):
        if Path(dirpath) == repo:
            dirnames[:] = [d for d in dirnames if d != ".git"]
        found += [str((Path(dirpath) / name).relative_to(repo)) for name in filenames if ".optmp-" in name]
    return sorted(found)


def _put_back(repo: Path, line: str) -> bool:
    """Whether a ``git diff-index --name-status HEAD`` line is a file put back after a call that never moved
    its branch (docs/RECOVERY.md): the index put back byte for byte, so the entry keeps the stat data the
    file had before the call rewrote it, the file and the entry holding HEAD's version.  An entry with no
    stat data (never given it) or another content is not."""
    status, _, path = line.partition("\t")
    if status != "M" or not path:
        return False

    def out(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, check=False).stdout.decode().strip()

    debug = out("ls-files", "--debug", "--", path)
    if "mtime: 0:0" in debug or "size: 0\t" in debug and (repo / path).stat().st_size:
        return False
    head = out("rev-parse", f"HEAD:{path}")
    staged = out("ls-files", "-s", "--", path).split()
    return bool(head) and staged[1:2] == [head] and out("hash-object", "--", path) == head


def worktree_problems(repo: Path) -> list[str]:
    """A checked-out branch's worktree and index agree with HEAD, without git refreshing anything first.

    ``git diff-index --quiet HEAD`` runs first: it trusts the index's stat data
    (an entry written without it, never refreshed, shows as changed), where
    ``git status`` would refresh the index and hide that.  The one difference
    it may show is a file put back after a call that never moved its branch,
    whose entry the index put back byte for byte keeps the file's old stat
    data (:func:`_put_back`, docs/RECOVERY.md).
    """
    problems: list[str] = []
    res = subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd=repo, capture_output=True, check=False)
    if res.returncode != 0:
        names = subprocess.run(["git", "diff-index", "--name-status", "HEAD", "--"], cwd=repo, capture_output=True,
                               check=False).stdout.decode(errors="replace")
        unexplained = [line for line in names.splitlines() if not _put_back(repo, line)]
        if unexplained:
            problems.append(f"git diff-index --quiet HEAD exited {res.returncode}: {unexplained[:20]}")
    res = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo, capture_output=True,
                         check=False)
    if res.returncode != 0 or res.stdout:
        problems.append(f"git status --porcelain (exit {res.returncode}) is not clean: "
                        f"{(res.stdout + res.stderr).decode(errors='replace')[:1000]}")
    symbolic = subprocess.run(["git", "symbolic-ref", "HEAD"], cwd=repo, capture_output=True, check=False)
    if symbolic.stdout.decode().strip() != "refs/heads/main":
        problems.append(f"HEAD is {symbolic.stdout.decode().strip() or symbolic.stderr.decode().strip()!r}, "
                        "not refs/heads/main")
    return problems


def settled_events(procs: Procs, repo: Path) -> int:
    """How often a receipt a killed call left was settled (ledger events ``recovered`` / ``resolved``).

    Each is a kill that landed inside the protocol, past the process's start-up.
    """
    code, out, err = procs.run([sys.executable, "-m", "patcher.cli", "log", "--repo", str(repo), "--json"])
    assert code == 0, f"log --json exited {code}: {out!r} {err!r}"
    return sum(1 for e in json.loads(out)["events"] if e.get("event") in ("recovered", "resolved"))


def committed_receipts(repo: Path) -> dict[str, dict[str, Any]]:
    """The store's committed receipts by key (read from their files: DESIGN.md section 3)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((repo / ".git" / "oncepatch" / "receipts").glob("*/*.json")):
        doc = json.loads(path.read_bytes())
        if doc.get("status") == "committed":
            out[doc["key"]] = doc
    return out


def final_problems(procs: Procs, repo: Path, branch: str, base_count: int, keys: Sequence[str], *,
                   all_committed: bool) -> list[str]:
    """The checks of the module docstring; ``all_committed``: every key of ``keys`` must have landed."""
    problems: list[str] = []
    clean, out = fsck_full(repo)
    if not clean:
        problems.append("git fsck --full --strict:\n    " + "\n    ".join(out.splitlines()[:20]))
    receipts = committed_receipts(repo)
    listed = subprocess.run(["git", "rev-list", branch], cwd=repo, capture_output=True, check=False)
    if listed.returncode != 0:
        problems.append(f"git rev-list {branch} failed: {listed.stderr.decode(errors='replace').strip()}")
    on_branch = set(listed.stdout.decode().split())
    for key, doc in receipts.items():
        commit = doc.get("commit")
        ref = (doc.get("base") or {}).get("ref")
        if ref not in (branch, f"refs/heads/{branch}"):
            problems.append(f"{key}: committed receipt names branch {ref!r}, expected {branch!r}")
        elif commit not in on_branch:
            exists = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo,
                                    capture_output=True, check=False).returncode == 0
            problems.append(f"{key}: committed receipt's commit {commit} is not reachable from {branch} "
                            f"(the object {'exists' if exists else 'is missing'})")
    missing = [k for k in keys if k not in receipts]
    if all_committed and missing:
        problems.append(f"{len(missing)} keys have no committed receipt: {missing[:10]}")
    trailers = git(repo, "log", branch, "--format=%(trailers:key=Oncepatch-Key,valueonly)", check=False)
    counts: dict[str, int] = {}
    for line in trailers.split():
        counts[line] = counts.get(line, 0) + 1
    for key in receipts:
        if counts.get(key_hash(key), 0) != 1:
            problems.append(f"{key}: its trailer is on {counts.get(key_hash(key), 0)} commits of {branch}, not 1")
    count = len(on_branch)
    if count != base_count + len(receipts):
        problems.append(f"{branch} has {count} commits, expected {base_count} + {len(receipts)} committed keys")
    code, vout, verr = procs.run([sys.executable, "-m", "patcher.cli", "verify", "--repo", str(repo), "--json"])
    if code != 0:
        problems.append(f"verify --json exited {code}: {vout.decode(errors='replace')[:1500]} "
                        f"{verr.decode(errors='replace')[-500:]}")
    return problems


def git_apply_commit(procs: Procs, repo: Path, patch: Path, index: Path, branch: str = "main",
                     attempts: int = 200) -> list[str]:
    """git's own writers, as a script would drive them: apply to a private index, commit-tree, update-ref (CAS).

    A step that fails starts the attempt over: a lost compare-and-swap, or git
    failing to write a loose object because a concurrent ``prune-packed`` /
    ``loose-objects`` removed the empty ``objects/xx`` folder it had just made
    ("unable to create temporary file") — git's writer fails cleanly there and
    nothing is moved.  Returns why each earlier attempt failed; raises when
    ``attempts`` are spent.
    """
    env = dict(os.environ, GIT_INDEX_FILE=str(index))
    failed: list[str] = []

    def run(*args: str) -> str | None:
        code, out, err = procs.run(["git", *args], cwd=repo, env=env)
        if code != 0:
            failed.append(f"git {args[0]}: {err.decode(errors='replace').strip().splitlines()[-1:]}")
            return None
        return out.decode().strip()

    for _ in range(attempts):
        old = run("rev-parse", f"refs/heads/{branch}")
        if old is None or run("read-tree", old) is None or run("apply", "--cached", str(patch)) is None:
            continue
        tree = run("write-tree")
        if tree is None:
            continue
        commit = run("commit-tree", tree, "-p", old, "-m", f"git writer: {patch.name}")
        if commit is None:
            continue
        if run("update-ref", "-m", "git writer", f"refs/heads/{branch}", commit, old) is not None:
            return failed
    raise AssertionError(f"git's writers failed {attempts} times in a row for {patch.name}: {failed[-5:]}")


def run_workers(n: int, work: Callable[[int], None]) -> None:
    """Run ``work(i)`` for ``i in range(n)`` in threads; re-raise the first error after all have ended."""
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), name=f"worker-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE * 4)
        assert not t.is_alive(), f"{t.name} hung"
    if errors:
        raise errors[0]


Ending = tuple[str, int | None, bytes]


def _run_or(procs: Procs, argv: Sequence[str], delay: float,
            on_time_up: Callable[[subprocess.Popen[bytes]], Ending]) -> Ending:
    """Start ``argv``; if it has not ended ``delay`` seconds later, ``on_time_up(proc)`` ends it and says how."""
    proc = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        try:
            out, _ = proc.communicate(timeout=delay)
            return "finished", proc.returncode, out
        except subprocess.TimeoutExpired:
            return on_time_up(proc)
    finally:
        procs.finish(proc)


def _sigkill(proc: subprocess.Popen[bytes], said: str) -> Ending:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    return said, None, b""


def kill_at(procs: Procs, argv: Sequence[str], delay: float) -> Ending:
    """Start ``argv``; SIGKILL it ``delay`` seconds later unless it ended first: ('killed'|'finished', code, out)."""
    return _run_or(procs, argv, delay, lambda proc: _sigkill(proc, "killed"))


def _children(pid: int) -> list[int]:
    """The live children of ``pid`` (``/proc/<pid>/task/*/children``)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def _fd_target(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def kill_worker_at(procs: Procs, argv: Sequence[str], delay: float, server: int) -> Ending:
    """:func:`kill_at` through ``oncepatch serve`` (pid ``server``): SIGKILL the server's worker running the call.

    ``argv`` is the thin client; the call runs in one of the server's workers,
    which takes the client's standard streams: the worker whose stdout is the
    client's stdout pipe is the call's.  When none is (the call not handed
    over yet, or already answered), the client alone is killed.
    ('killed-worker'|'killed-client'|'finished', code, out).
    """
    def kill_its_worker(proc: subprocess.Popen[bytes]) -> Ending:
        pipe = _fd_target(proc.pid, 1)
        victims = [w for w in _children(server) if pipe is not None and _fd_target(w, 1) == pipe]
        for w in victims:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not victims:
            return _sigkill(proc, "killed-client")
        # The server tells the client how its worker ended (137): the client's own end.
        try:
            out, _ = proc.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            return _sigkill(proc, "killed-worker")
        return "killed-worker", proc.returncode, out

    return _run_or(procs, argv, delay, kill_its_worker)


#: The pause points of the apply protocol (docs/CONCURRENCY.md section 6), in the order a call passes them.
PAUSE_POINTS = ("after-prepare", "before-ref", "after-ref", "before-finalise")


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def kill_paused_at(procs: Procs, argv: Sequence[str], point: str) -> tuple[str, int | None, bytes]:
    """Start ``argv`` paused at ``point`` (``ONCEPATCH_PAUSE_AT``, in process) and SIGKILL it once it stopped there.

    A kill inside the protocol every time, wherever the start-up's time goes:
    ('killed'|'finished', code, out) — 'finished' when the call ended without
    reaching the point (a rejection, say).
    """
    env = dict(os.environ, ONCEPATCH_PAUSE_AT=point)
    proc = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + DEADLINE
        while proc.poll() is None and not _stopped(proc.pid):
            assert time.monotonic() < deadline, f"{' '.join(argv)} neither paused at {point} nor ended"
            time.sleep(0.005)  # (a poll of the process's state: the stop is the event waited for)
        if proc.poll() is not None:
            out, _ = proc.communicate()
            return "finished", proc.returncode, out
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        return "killed", None, b""
    finally:
        procs.finish(proc)


def rng_for(seed: int, *parts: object) -> random.Random:
    return random.Random("/".join(str(p) for p in (seed, *parts)))


def apply_each(procs: Procs, repo: Path, patches: dict[str, Path], branch: str | None,
               workers: int) -> dict[str, list[Outcome]]:
    """Every key of ``patches`` applied until settled, the keys shared among ``workers`` threads."""
    keys = list(patches)
    outcomes: dict[str, list[Outcome]] = {}

    def work(w: int) -> None:
        for key in keys[w::workers]:
            outcomes[key] = apply_until_settled(procs, repo, patches[key], key, branch)

    run_workers(workers, work)
    return outcomes


def outcomes_problems(outcomes: dict[str, list[Outcome]], prefix: str = "") -> list[str]:
    """What went wrong in ``outcomes``: a bad answer on any try, or a key that never committed."""
    problems = [f"{prefix}{key}: {p}" for key, seen in outcomes.items() for o in seen
                if (p := outcome_problem(o)) is not None]
    problems += [f"{prefix}{key}: never committed: {[o.describe() for o in seen]}"
                 for key, seen in outcomes.items() if not seen[-1].committed]
    return problems

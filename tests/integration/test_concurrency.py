"""Many agents at once (issue 4): racing processes on one key and on one branch.

Every contender is a real process.  A worker (``WORKER`` below) imports
oncepatch, says it is ready, waits for a *go* file (the barrier: every worker
starts its calls at the same moment), then runs its calls one after the
other through the CLI's ``main`` — the exit code and the ``--json`` output of
each are exactly what ``python -m patcher.cli apply`` would give, without
paying the interpreter start-up per call.  Every process is reaped, also when
an assertion fails; the only time limits are generous deadlines.

* one key, 16 processes → one commit carrying the key's trailer, 15 replays;
  with ``--lock-timeout 0.05`` while a slow first holder keeps the key →
  exit 5 ``in_progress``, ``effect_status: unknown``, ``next_action:
  query_before_retry``; receipts verify;
* 8 processes × 25 distinct patches on one branch → 200 commits, the same
  tree as ``git apply`` of the 200 in another clone, worktree and index equal
  to the head; the parallel run's throughput is printed (``-s`` shows it);
* overlapping patches → each call lands once or is rejected (exit 4), never
  silently dropped; the history holds exactly the landed ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, git, make_repo, run_cli

#: Generous: a deadline is a hang detector, never a performance assertion.
DEADLINE = 600.0

WORKER = r'''
import contextlib, io, json, os, sys, time

import pygit2  # noqa: F401  (loaded before the barrier so every worker starts together)
from patcher import cli


def call(argv):
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8")
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    out.flush()
    return code, raw.getvalue().decode("utf-8")


spec = json.load(open(sys.argv[1]))
with open(spec["ready"], "w"):
    pass
while not os.path.exists(spec["go"]):
    time.sleep(0.001)
results = []
started = time.monotonic()
for job in spec["jobs"]:
    attempts = []
    while True:
        code, out = call(job["argv"])
        attempts.append(code)
        if code not in job.get("retry_on", []) or len(attempts) > job.get("retries", 0):
            break
        time.sleep(0.01)
    results.append({"name": job["name"], "code": code, "out": out, "attempts": attempts})
with open(spec["result"] + ".tmp", "w") as fh:
    json.dump({"results": results, "seconds": time.monotonic() - started}, fh)
os.replace(spec["result"] + ".tmp", spec["result"])
'''


@dataclass
class Result:
    name: str
    code: int
    out: str
    attempts: list[int]

    @property
    def json(self) -> Any:
        return json.loads(self.out)


@dataclass
class Workers:
    """A batch of worker processes released together by a barrier file; always reaped."""

    folder: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    specs: list[Path] = field(default_factory=list)
    started_at: float = 0.0
    elapsed: float = 0.0

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "worker.py").write_text(WORKER)
        self.go = self.folder / "go"

    def add(self, jobs: list[dict[str, Any]], env: dict[str, str] | None = None) -> int:
        n = len(self.specs)
        spec = self.folder / f"spec{n}.json"
        spec.write_text(json.dumps({
            "ready": str(self.folder / f"ready{n}"), "go": str(self.go),
            "result": str(self.folder / f"result{n}.json"), "jobs": jobs,
        }))
        self.specs.append(spec)
        e = dict(os.environ)
        e.update(env or {})
        self.procs.append(subprocess.Popen([sys.executable, str(self.folder / "worker.py"), str(spec)], env=e,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        return n

    def release(self) -> None:
        """Wait until every worker is ready, then open the barrier."""
        deadline = time.monotonic() + DEADLINE
        for n, proc in enumerate(self.procs):
            while not (self.folder / f"ready{n}").exists():
                assert proc.poll() is None, f"worker {n} died before the barrier: {proc.stderr.read()!r}"  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "workers never became ready"
                time.sleep(0.01)
        self.started_at = time.monotonic()
        self.go.touch()

    def wait(self, n: int) -> list[Result]:
        proc = self.procs[n]
        try:
            _, err = proc.communicate(timeout=max(1.0, self.started_at + DEADLINE - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {n} hung past the {DEADLINE:g}s deadline") from None
        assert proc.returncode == 0, f"worker {n} failed ({proc.returncode}): {err.decode(errors='replace')}"
        doc = json.loads((self.folder / f"result{n}.json").read_text())
        return [Result(**r) for r in doc["results"]]

    def run(self) -> list[list[Result]]:
        self.release()
        out = [self.wait(n) for n in range(len(self.procs))]
        self.elapsed = time.monotonic() - self.started_at
        return out

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _kill(proc)
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.send_signal(signal.SIGCONT)  # a stopped process must run to die
        proc.kill()
    except ProcessLookupError:
        pass


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Any]:
    made: list[Workers] = []

    def factory(name: str = "w") -> Workers:
        w = Workers(tmp_path / f"workers-{name}")
        made.append(w)
        return w

    yield factory
    for w in made:
        w.reap()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_hash(key: str) -> str:
    return sha256(key.encode())


def trailer_counts(repo: Repo, ref: str = "main") -> Counter[str]:
    """How many commits on ``ref`` carry each ``Oncepatch-Key`` trailer value."""
    out = repo.git("log", "--format=%(trailers:key=Oncepatch-Key,valueonly)", ref)
    return Counter(line.strip() for line in out.splitlines() if line.strip())


def apply_argv(repo: Repo, patch: Path, key: str, *extra: str) -> list[str]:
    return ["apply", str(patch), "--repo", str(repo.path), "--json", "--key", key, *extra]


def verify_ok(repo: Repo) -> None:
    r = run_cli("verify", "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err


def assert_worktree_equals_head(repo: Repo) -> None:
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert repo.git("diff", "--cached", "--name-only", "HEAD") == ""


# -- one key, many processes --------------------------------------------------------------------


def _one_patch(repo: Repo, tmp_path: Path) -> Path:
    patch = tmp_path / "one.diff"
    patch.write_text("--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+from sixteen agents\n")
    return patch


def test_sixteen_processes_one_key_make_one_commit(repo: Repo, tmp_path: Path, workers: Any) -> None:
    patch = _one_patch(repo, tmp_path)
    base_count = repo.count()
    batch = workers()
    for i in range(16):
        batch.add([{"name": f"p{i}", "argv": apply_argv(repo, patch, "K")}])
    results = [r for rs in batch.run() for r in rs]

    assert [r.code for r in results] == [0] * 16, [r.out for r in results if r.code]
    docs = [r.json for r in results]
    fresh = [d for d in docs if not d["replayed"]]
    assert len(fresh) == 1, "exactly one process executes the key"
    assert sum(d["replayed"] for d in docs) == 15
    assert {d["commit"] for d in docs} == {fresh[0]["commit"]}
    assert {d["status"] for d in docs} == {"committed"}

    assert repo.count() == base_count + 1
    assert repo.head() == fresh[0]["commit"]
    assert trailer_counts(repo) == Counter({key_hash("K"): 1})
    assert (repo.path / "README").read_text() == "hello\nfrom sixteen agents\n"
    assert_worktree_equals_head(repo)
    receipt = json.loads(Path(fresh[0]["receipt"]).read_text())
    assert receipt["status"] == "committed" and receipt["fencing_token"] == 1
    verify_ok(repo)


def test_lock_timeout_with_a_slow_first_holder_gives_in_progress(repo: Repo, tmp_path: Path,
                                                                  workers: Any) -> None:
    """All 16 run the same call with a check that blocks until the test says so.

    Whoever takes the key's lock first holds it through its check; the other
    15 give up after 0.05 s with exit 5 (on the key's lock, or on a rival's
    index.lock in the pre-check).  Only then is the holder released.
    """
    patch = _one_patch(repo, tmp_path)
    release = tmp_path / "release-the-holder"
    check = f"while [ ! -e '{release}' ]; do sleep 0.02; done"
    base_count = repo.count()
    batch = workers()
    argv = apply_argv(repo, patch, "K", "--lock-timeout", "0.05", "--check", check)
    for i in range(16):
        batch.add([{"name": f"p{i}", "argv": argv}])
    batch.release()

    # The 15 that lost the lock exit on their own; the holder waits in its check.
    deadline = time.monotonic() + DEADLINE
    while sum(p.poll() is not None for p in batch.procs) < 15:
        assert time.monotonic() < deadline, "the waiters never timed out"
        time.sleep(0.02)
    running = [n for n, p in enumerate(batch.procs) if p.poll() is None]
    assert len(running) == 1
    assert repo.count() == base_count  # the holder has not landed anything yet
    waiters = [r for n in range(16) if n != running[0] for r in batch.wait(n)]
    release.touch()
    holder = batch.wait(running[0])[0]

    for r in waiters:
        assert r.code == 5, r.out
        err = r.json["error"]
        assert err["type"] == "in_progress"
        assert err["retryable"] is True
        assert err["key"] == "K"
        if err["lock_path"].endswith("/index.lock"):
            # The one timeout governs every lock: this waiter met a rival's brief index.lock
            # in its pre-check, before the key's lock, and wrote nothing.
            assert (err["effect_status"], err["next_action"]) == ("not_started", "retry")
            continue
        assert err["effect_status"] == "unknown"
        assert err["next_action"] == "query_before_retry"
        assert err["lock_path"].endswith(key_hash("K") + ".lock")
    assert holder.code == 0, holder.out
    assert holder.json["replayed"] is False

    # Retrying after the holder finished: replays, never a second commit.
    again = workers("again")
    for i in range(15):
        again.add([{"name": f"p{i}", "argv": argv}])
    results = [r for rs in again.run() for r in rs]
    assert [r.code for r in results] == [0] * 15
    assert all(r.json["replayed"] and r.json["commit"] == holder.json["commit"] for r in results)
    assert repo.count() == base_count + 1
    assert trailer_counts(repo) == Counter({key_hash("K"): 1})
    assert_worktree_equals_head(repo)
    verify_ok(repo)


# -- many keys, one branch ------------------------------------------------------------------------

N_PROCS = 8
N_CALLS = 25


def _grid_repo(path: Path) -> Repo:
    files: dict[str, str | bytes] = {
        f"w{w}/f{j}.txt": f"worker {w} file {j}\nsecond line\n" for w in range(N_PROCS) for j in range(N_CALLS)
    }
    return make_repo(path, files)


def _grid_patches(folder: Path) -> dict[tuple[int, int], Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[tuple[int, int], Path] = {}
    for w in range(N_PROCS):
        for j in range(N_CALLS):
            p = folder / f"w{w}-{j}.diff"
            p.write_text(f"--- a/w{w}/f{j}.txt\n+++ b/w{w}/f{j}.txt\n@@ -1,2 +1,3 @@\n worker {w} file {j}\n"
                         f"+changed by worker {w} call {j}\n second line\n")
            out[(w, j)] = p
    return out


def test_eight_processes_twentyfive_patches_each_land_every_one(tmp_path: Path, workers: Any) -> None:
    repo = _grid_repo(tmp_path / "repo")
    serial = Repo(tmp_path / "serial")
    git(tmp_path, "clone", "-q", str(repo.path), str(serial.path))
    assert serial.head() == repo.head()
    patches = _grid_patches(tmp_path / "patches")

    batch = workers("parallel")
    for w in range(N_PROCS):
        batch.add([{"name": f"w{w}-{j}", "argv": apply_argv(repo, patches[(w, j)], f"k-{w}-{j}")}
                   for j in range(N_CALLS)])
    results = [r for rs in batch.run() for r in rs]
    parallel_s = batch.elapsed

    # The same 200 patches applied by plain git, one after the other, in another clone.
    serial.git("apply", "--index", *(str(patches[(w, j)]) for w in range(N_PROCS) for j in range(N_CALLS)))
    serial.commit_all("the 200 patches, applied by git")
    total = N_PROCS * N_CALLS
    print(f"\nthroughput: {N_PROCS} processes x {N_CALLS} patches: {total / parallel_s:.1f} commits/s "
          f"({parallel_s:.2f}s)")

    assert [r.code for r in results] == [0] * total, [r.out for r in results if r.code][:3]
    assert not any(r.json["replayed"] for r in results)
    assert repo.count() == 1 + total
    assert trailer_counts(repo) == Counter({key_hash(f"k-{w}-{j}"): 1 for w in range(N_PROCS)
                                            for j in range(N_CALLS)})
    # Every result names a commit of the branch, and each a different one.
    on_branch = set(repo.git("rev-list", "main").split())
    assert {r.json["commit"] for r in results} <= on_branch
    assert len({r.json["commit"] for r in results}) == total
    # Same final tree as plain git applying all 200 (one after the other, in another order).
    assert repo.head("main^{tree}") == serial.head("main^{tree}")
    assert_worktree_equals_head(repo)
    assert_worktree_equals_head(serial)
    verify_ok(repo)
    git(repo.path, "fsck", "--strict", "--no-dangling", "--no-progress")  # superseded candidates dangle


SLOT_LINES = ("a", "b", "c", "value", "d", "e", "f")


def _hot_text(values: dict[int, str] | None = None) -> str:
    lines = []
    for s in range(N_CALLS):
        for name in SLOT_LINES:
            lines.append(f"slot {s} {name}" + (f" = {(values or {}).get(s, 'orig')}" if name == "value" else ""))
    return "".join(line + "\n" for line in lines)


def _hot_patch(w: int, s: int) -> str:
    """Replace slot ``s``'s value line with worker ``w``'s; the context is the slot's other lines."""
    start = s * len(SLOT_LINES) + 1
    body = [f" slot {s} a", f" slot {s} b", f" slot {s} c", f"-slot {s} value = orig", f"+slot {s} value = w{w}",
            f" slot {s} d", f" slot {s} e", f" slot {s} f"]
    return f"--- a/hot.txt\n+++ b/hot.txt\n@@ -{start},7 +{start},7 @@\n" + "".join(b + "\n" for b in body)


def test_overlapping_patches_land_once_or_are_rejected_never_dropped(tmp_path: Path, workers: Any) -> None:
    """Even calls of every worker fight over the same slot of ``hot.txt``; odd calls touch its own file.

    For each contended slot at most one call lands; every other call gets
    exit 4 — ``conflict`` (retryable, with the paths) when the branch moved
    under a staged call, ``context_not_found`` when the slot was already
    taken before the call read the branch.  Exit codes and the history agree
    call by call.
    """
    files: dict[str, str | bytes] = {"hot.txt": _hot_text()}
    files.update({f"w{w}/own.txt": "".join(f"own {j}\n" for j in range(N_CALLS)) for w in range(N_PROCS)})
    repo = make_repo(tmp_path / "repo", files)
    folder = tmp_path / "patches"
    folder.mkdir()
    batch = workers()
    for w in range(N_PROCS):
        jobs = []
        for j in range(N_CALLS):
            p = folder / f"w{w}-{j}.diff"
            if j % 2 == 0:
                p.write_text(_hot_patch(w, j))
            else:
                p.write_text(f"--- a/w{w}/own.txt\n+++ b/w{w}/own.txt\n@@ -{j + 1} +{j + 1} @@\n-own {j}\n"
                             f"+own {j} done by w{w}\n")
            jobs.append({"name": f"{w}-{j}", "argv": apply_argv(repo, p, f"k-{w}-{j}")})
        batch.add(jobs)
    results = {r.name: r for rs in batch.run() for r in rs}

    landed = {name for name, r in results.items() if r.code == 0}
    rejected = {name for name, r in results.items() if r.code == 4}
    assert landed | rejected == set(results), {n: r.out for n, r in results.items() if r.code not in (0, 4)}
    kinds: Counter[str] = Counter()
    for name in rejected:
        err = results[name].json["error"]
        kinds[err["type"]] += 1
        assert name.split("-")[1] in {str(j) for j in range(0, N_CALLS, 2)}, f"{name} had no rival: {err}"
        if err["type"] == "conflict":
            assert err["retryable"] is True and err["paths"] == ["hot.txt"], err
            assert err["effect_status"] == "not_applied"
        else:
            assert err["type"] == "context_not_found", err
            assert err["effect_status"] == "not_started"
        assert err["key"] == f"k-{name}"
    print(f"\noverlapping: {len(landed)} landed, rejections {dict(kinds)}")

    # Calls without rivals all land; each contended slot is won at most once — here exactly once,
    # since the first call to reach a slot always finds it unchanged.
    for w in range(N_PROCS):
        for j in range(1, N_CALLS, 2):
            assert f"{w}-{j}" in landed
    winners: dict[int, int] = {}
    for s in range(0, N_CALLS, 2):
        won = [w for w in range(N_PROCS) if f"{w}-{s}" in landed]
        assert len(won) == 1, (s, won)
        winners[s] = won[0]

    # The history holds exactly the landed calls, once each, and the files show exactly their edits.
    assert trailer_counts(repo) == Counter({key_hash(f"k-{n}"): 1 for n in landed})
    assert repo.count() == 1 + len(landed)
    assert (repo.path / "hot.txt").read_text() == _hot_text({s: f"w{w}" for s, w in winners.items()})
    for w in range(N_PROCS):
        want = "".join(f"own {j} done by w{w}\n" if j % 2 else f"own {j}\n" for j in range(N_CALLS))
        assert (repo.path / f"w{w}/own.txt").read_text() == want
    for name in landed:
        commit = results[name].json["commit"]
        assert key_hash(f"k-{name}") in repo.git("log", "-1", "--format=%B", commit)
    assert_worktree_equals_head(repo)
    verify_ok(repo)

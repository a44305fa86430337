"""Kill -9 torture for ``oncepatch apply``: the driver shared by ``test_torture.py`` and ``scripts/torture``.

One **round**:

1. a base repository of ``calls`` groups of files (``g<i>/...``) is made twice:
   the *target* (oncepatch works there) and the *reference* (plain git);
2. call ``i`` edits only group ``i`` — the calls are **non-overlapping**, so
   they commute: whatever order the killed and re-run calls land in, the
   final tree is the reference's tree.  The edit kinds cycle through
   modify, new file, delete, rename and a multi-file change (modify + add +
   delete + rename).  Each patch is ``git diff --cached --full-index -M`` of
   that change in the reference, which then commits it: the reference ends
   with every patch applied exactly once;
3. one clean ``apply`` is timed in a scratch copy (the **measured run time**);
4. every call is started as its own ``python -m patcher.cli apply`` process
   (distinct ``--key``) and sent SIGKILL at a moment drawn uniformly from
   ``[0, measured run time)``; a call that finishes first is left finished;
5. ``recover --json --tmp-age 0`` (nothing is live any more), then every call
   runs again and must exit 0;
6. checks: the final tree is the reference's; the branch grew by exactly one
   commit per call; each call's ``Oncepatch-Call:`` trailer is on exactly one
   commit, the one its receipt names; worktree and index match the commit
   (``git status --porcelain`` empty); ``verify`` passes; ``git fsck
   --strict`` is clean.

Everything is drawn from ``random.Random(f"{seed}/{round}")``: a failure names
the seed and the round, and ``scripts/torture --seed S --rounds N`` replays
the same schedule (kill timing on a loaded machine still varies).

Standalone: ``python tests/integration/torture_driver.py --rounds 20 --seed 7``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_SEED",
    "SEED_ENV",
    "RoundResult",
    "run_round",
    "run_soak",
    "git",
    "fsck",
    "commits_with_trailer",
    "hermetic_env",
    "seed_from_env",
]

SEED_ENV = "ONCEPATCH_TORTURE_SEED"
DEFAULT_SEED = 20240917
EDIT_KINDS = ("modify", "new_file", "delete", "rename", "multi_file")


# -- small git helpers (also used by the other recovery tests) ------------------------------


def git(cwd: Path | str, *args: str, check: bool = True, env: dict[str, str] | None = None) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False, env=env)
    if check and res.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed ({res.returncode}): {res.stderr.decode()}")
    return res.stdout.decode("utf-8", "surrogateescape")


def fsck(repo: Path | str) -> tuple[bool, str]:
    """``git fsck --strict``: (clean, its output). Dangling objects (a lost race's garbage) are fine."""
    res = subprocess.run(["git", "fsck", "--strict", "--no-progress"], cwd=repo, capture_output=True, check=False)
    out = (res.stdout + res.stderr).decode("utf-8", "replace")
    bad = [ln for ln in out.splitlines() if ln and not ln.startswith(("dangling ", "Checking ", "notice: "))]
    return res.returncode == 0 and not bad, out


def commits_with_trailer(repo: Path | str, call_id: str, ref: str = "--all") -> list[str]:
    """Commits reachable from ``ref`` whose message carries ``Oncepatch-Call: <call_id>``."""
    out = git(repo, "log", ref, "--format=%H", "--fixed-strings", f"--grep=Oncepatch-Call: {call_id}")
    return out.split()


def hermetic_env(home: Path) -> dict[str, str]:
    """An environment with no developer git config, store or crash point (for standalone runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "ONCEPATCH_"))}
    home.mkdir(parents=True, exist_ok=True)
    (home / ".gitconfig").write_text(
        "[user]\n\tname = Torture\n\temail = torture@example.com\n[init]\n\tdefaultBranch = main\n"
        "[core]\n\tautocrlf = false\n")
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), GIT_CONFIG_NOSYSTEM="1",
               GIT_AUTHOR_NAME="Torture", GIT_AUTHOR_EMAIL="torture@example.com",
               GIT_COMMITTER_NAME="Torture", GIT_COMMITTER_EMAIL="torture@example.com")
    return env


#: The seed the run was started with, read at import: the tests' hermetic fixture takes every
#: ONCEPATCH_* variable away before a test runs, so the printed "<SEED_ENV>=<seed> to replay" would
#: otherwise never reach the test it names.
_GIVEN_SEED = os.environ.get(SEED_ENV)


def seed_from_env() -> int:
    return int(os.environ.get(SEED_ENV) or _GIVEN_SEED or DEFAULT_SEED)


# -- building the calls -------------------------------------------------------------------


def _base_files(n: int, rng: random.Random) -> dict[str, str]:
    files: dict[str, str] = {"README": "torture base\n"}
    for i in range(n):
        body = "".join(f"g{i} line {j} {rng.randrange(10**6)}\n" for j in range(12))
        files[f"g{i}/main.txt"] = body
        files[f"g{i}/old.txt"] = f"g{i} to be deleted or renamed\n"
        files[f"g{i}/keep.txt"] = f"g{i} untouched\n"
    return files


def _edit(root: Path, i: int, kind: str, rng: random.Random, env: dict[str, str]) -> None:
    g = root / f"g{i}"
    if kind in ("modify", "multi_file"):
        lines = (g / "main.txt").read_text().splitlines(keepends=True)
        j = rng.randrange(len(lines))
        lines[j] = f"g{i} CHANGED {rng.randrange(10**6)}\n"
        lines.insert(rng.randrange(len(lines) + 1), f"g{i} inserted\n")
        (g / "main.txt").write_text("".join(lines))
    if kind in ("new_file", "multi_file"):
        (g / "new" / "deep").mkdir(parents=True, exist_ok=True)
        (g / "new" / "deep" / "added.txt").write_text(f"g{i} fresh {rng.randrange(10**6)}\n")
    if kind == "delete":
        git(root, "rm", "-q", f"g{i}/old.txt", env=env)
    if kind in ("rename", "multi_file"):
        src = f"g{i}/keep.txt" if kind == "multi_file" else f"g{i}/old.txt"
        git(root, "mv", src, f"g{i}/renamed.txt", env=env)
    if kind == "multi_file":
        git(root, "rm", "-q", f"g{i}/old.txt", env=env)


def _make_repo(path: Path, files: dict[str, str], env: dict[str, str]) -> None:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main", env=env)
    for rel, data in files.items():
        p = path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(data)
    git(path, "add", "-A", env=env)
    git(path, "commit", "-q", "-m", "base", env=env)


@dataclass(frozen=True)
class Call:
    index: int
    kind: str
    key: str
    patch_file: Path


@dataclass
class RoundResult:
    seed: int
    round: int
    calls: int
    measured_s: float
    kills: int = 0  # SIGKILL delivered to a still-running apply
    finished_first: int = 0  # the apply exited before its kill moment
    problems: list[str] = field(default_factory=list)
    schedule: list[tuple[int, float, str]] = field(default_factory=list)  # (call, kill at s, outcome)
    elapsed_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    recovered: dict[str, int] = field(default_factory=dict)  # recover's rows by new status
    # Receipts a killed attempt left behind and something settled afterwards: recover, or the
    # key's next attempt under its lock (ledger events "recovered" / "resolved").
    settled: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        phases = " ".join(f"{k} {v:.1f}s" for k, v in self.phases.items())
        head = (f"torture seed={self.seed} round={self.round} ({SEED_ENV}={self.seed} to replay): "
                f"{self.kills} kills, {self.finished_first} finished first, measured {self.measured_s:.3f}s, "
                f"recover settled {self.recovered or 'nothing'}, {self.settled} settled in all [{phases}]")
        if self.ok:
            return head
        sched = ", ".join(f"#{c}@{t:.3f}s:{o}" for c, t, o in self.schedule)
        return head + "\n  " + "\n  ".join(self.problems) + f"\n  schedule: {sched}"


def _settled_events(log_json: bytes) -> int:
    """How many times a receipt a killed call left behind was settled, by recover or by the key's next attempt.

    Each is a kill that landed inside the protocol (a ``prepared`` receipt, or a
    receipt renamed before its ledger event), not only in the process's start-up:
    the ledger's ``recovered`` and ``resolved`` events (``oncepatch log --json``).
    """
    return sum(1 for e in json.loads(log_json)["events"] if e.get("event") in ("recovered", "resolved"))


def _git_locks(repo: Path) -> list[str]:
    """``*.lock`` files in the git dir (outside the store), with their size: what blocks a call."""
    git_dir = repo / ".git"
    return sorted(f"{p.relative_to(git_dir)} ({p.stat().st_size} B)" for p in git_dir.rglob("*.lock")
                  if "oncepatch" not in p.relative_to(git_dir).parts)


def _cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "patcher.cli", *args], capture_output=True, env=env,
                          timeout=timeout, check=False)


def _apply_argv(repo: Path, call: Call) -> list[str]:
    return [sys.executable, "-m", "patcher.cli", "apply", "--repo", str(repo), "--key", call.key, "--json",
            "--lock-timeout", "5", str(call.patch_file)]


def _measure(work: Path, files: dict[str, str], calls: list[Call], env: dict[str, str]) -> float:
    """Seconds of one clean apply (process start to exit): the median of three, in a scratch copy."""
    scratch = work / "measure"
    _make_repo(scratch, files, env)
    times = []
    for call in calls[:3]:
        t0 = time.monotonic()
        res = subprocess.run(_apply_argv(scratch, call), capture_output=True, env=env, check=False)
        times.append(time.monotonic() - t0)
        if res.returncode != 0:
            raise AssertionError(f"clean apply of call {call.index} failed: {res.stdout!r} {res.stderr!r}")
    shutil.rmtree(scratch, ignore_errors=True)
    return sorted(times)[len(times) // 2]


def run_round(work: Path, *, seed: int, round_no: int, calls: int = 50, kills_per_call: int = 2,
              env: dict[str, str] | None = None, keep: bool = False) -> RoundResult:
    """One round in the empty folder ``work`` (see the module docstring); never raises on a finding."""
    t_start = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    env.pop("ONCEPATCH_CRASH_AT", None)
    env.pop("ONCEPATCH_STORE", None)
    rng = random.Random(f"{seed}/{round_no}")
    files = _base_files(calls, rng)
    target, reference = work / "target", work / "reference"
    _make_repo(target, files, env)
    _make_repo(reference, files, env)
    base_count = int(git(target, "rev-list", "--count", "main", env=env))

    plan: list[Call] = []
    patches = work / "patches"
    patches.mkdir()
    for i in range(calls):
        kind = EDIT_KINDS[i % len(EDIT_KINDS)]
        _edit(reference, i, kind, rng, env)
        git(reference, "add", "-A", env=env)
        diff = subprocess.run(["git", "diff", "--cached", "--full-index", "-M"], cwd=reference,
                              capture_output=True, env=env, check=True).stdout
        git(reference, "commit", "-q", "-m", f"call {i}", env=env)
        pf = patches / f"{i:03d}-{kind}.diff"
        pf.write_bytes(diff)
        plan.append(Call(i, kind, f"torture-{seed}-{round_no}-{i:03d}-{kind}", pf))
    expected_tree = git(reference, "rev-parse", "main^{tree}", env=env).strip()

    t_phase = time.monotonic()
    result = RoundResult(seed, round_no, calls, _measure(work, files, plan, env))
    result.phases["build"] = t_phase - t_start

    # Phase 1: the calls are started in turn, round-robin, each killed at a moment drawn
    # uniformly from the measured run time, until ``kills_per_call * calls`` kills have
    # landed on a running process (a call that finished first is left finished; its next
    # turn is a replay).  From the second pass on, an attempt finds the leftovers of its
    # own killed attempt (a prepared receipt, a stale lock, a moved branch) and settles
    # them itself under the key lock, without ``recover``.
    t_phase = time.monotonic()
    want = kills_per_call * calls
    turn = 0
    # Turns are bounded, and generous: a call that finished is replayed on its later
    # turns (far quicker than the measured run, so rarely killed), and a machine that
    # got quicker after the measurement lets more calls finish first.
    while result.kills < want and turn < 6 * want:
        call = plan[turn % calls]
        turn += 1
        at = rng.uniform(0.0, result.measured_s)
        proc = subprocess.Popen(_apply_argv(target, call), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        try:
            try:
                code = proc.wait(timeout=at)
                result.finished_first += 1
                result.schedule.append((call.index, at, f"exit{code}"))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                result.kills += 1
                result.schedule.append((call.index, at, "killed"))
        finally:
            if proc.poll() is None:  # always reaped, whatever happened above
                proc.kill()
                proc.wait()
    result.phases["kill"] = time.monotonic() - t_phase

    # Phase 2: recover, then every call again: each must end with exit 0.
    t_phase = time.monotonic()
    rec = _cli(env, "recover", "--repo", str(target), "--json", "--tmp-age", "0")
    if rec.returncode != 0:
        result.problems.append(f"recover exited {rec.returncode}: {rec.stdout!r} {rec.stderr!r}")
    else:
        rows = json.loads(rec.stdout)["rows"]
        for row in rows:
            result.recovered[row["to"]] = result.recovered.get(row["to"], 0) + 1
    call_ids: dict[str, str] = {}
    commits: dict[str, str] = {}
    for n, call in enumerate(plan):
        res = subprocess.run(_apply_argv(target, call), capture_output=True, env=env, check=False, timeout=120)
        if res.returncode != 0:
            result.problems.append(f"re-run of call {call.index} ({call.kind}) exited {res.returncode}: "
                                   f"{res.stdout.decode(errors='replace').strip()} "
                                   f"{res.stderr.decode(errors='replace').strip()[-400:]}\n"
                                   f"  git lock files: {_git_locks(target) or 'none'}")
            # Fail fast: a leftover that blocks one call (a stale lock) blocks the rest,
            # each after its own lock timeout.
            result.problems.append(f"{len(plan) - n - 1} later re-runs skipped")
            break
        doc = json.loads(res.stdout)
        call_ids[call.key] = doc["call_id"]
        commits[call.key] = doc["commit"]

    result.phases["rerun"] = time.monotonic() - t_phase

    # Phase 3: the checks.
    t_phase = time.monotonic()
    tree = git(target, "rev-parse", "main^{tree}", env=env).strip()
    if tree != expected_tree:
        diff = git(target, "diff", "--stat", expected_tree, tree, env=env, check=False)
        result.problems.append(f"final tree {tree} != reference tree {expected_tree}:\n{diff}")
    count = int(git(target, "rev-list", "--count", "main", env=env)) - base_count
    if count != calls:
        result.problems.append(f"branch grew by {count} commits, expected exactly {calls}")
    for call in plan:
        if call.key not in call_ids:
            continue
        found = commits_with_trailer(target, call_ids[call.key])
        if found != [commits[call.key]]:
            result.problems.append(f"call {call.index}: commits with its trailer {found}, receipt names "
                                   f"{commits[call.key]}")
    status = git(target, "status", "--porcelain", env=env)
    if status:
        result.problems.append(f"worktree/index differ from the commit:\n{status}")
    ver = _cli(env, "verify", "--repo", str(target))
    if ver.returncode != 0:
        result.problems.append(f"verify exited {ver.returncode}: {ver.stdout.decode(errors='replace')}")
    clean, out = fsck(target)
    if not clean:
        result.problems.append(f"git fsck --strict: {out}")
    log = _cli(env, "log", "--repo", str(target), "--json")
    if log.returncode != 0:
        result.problems.append(f"log exited {log.returncode}: {log.stdout.decode(errors='replace')}")
    else:
        result.settled = _settled_events(log.stdout)
    result.phases["check"] = time.monotonic() - t_phase
    result.elapsed_s = time.monotonic() - t_start
    if not keep and result.ok:
        shutil.rmtree(work, ignore_errors=True)
    return result


def run_soak(rounds: int, seed: int, calls: int, root: Path, *, kills_per_call: int = 2,
             env: dict[str, str] | None = None, log: Any = None) -> list[RoundResult]:
    results = []
    for r in range(rounds):
        work = root / f"round-{r}"
        res = run_round(work, seed=seed, round_no=r, calls=calls, kills_per_call=kills_per_call, env=env, keep=True)
        results.append(res)
        if log is not None:
            log(res.describe() + f" [{res.elapsed_s:.1f}s]" + ("" if res.ok else f" (kept in {work})"))
        if res.ok:
            shutil.rmtree(work, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torture", description="kill -9 soak of oncepatch apply")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help=f"default ${SEED_ENV} or {DEFAULT_SEED}")
    p.add_argument("--calls", type=int, default=50, help="calls per round")
    p.add_argument("--kills-per-call", type=int, default=2, help="killed attempts of each call before it may finish")
    p.add_argument("--keep", default=None, help="folder for the rounds (failed ones are kept there)")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else seed_from_env()
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="oncepatch-torture-"))
    env = hermetic_env(root / "home")
    results = run_soak(a.rounds, seed, a.calls, root, kills_per_call=a.kills_per_call, env=env, log=lambda s: print(s, flush=True))
    kills = sum(r.kills for r in results)
    failed = [r for r in results if not r.ok]
    print(f"seed {seed}: {len(results)} rounds, {kills} kills, {len(failed)} failed", flush=True)
    if not failed and not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

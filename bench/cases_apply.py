"""Sections 1–3: one-file patches, replays, large changes — each next to the git pair.

Contenders (every one applies a new change per round; commits accumulate):

* ``git pair`` — ``git apply --index p.diff && git commit -q -m x`` through
  ``sh -c`` in a child process, on the checked-out ``main``;
* ``git pair fsync=all`` — the same with ``-c core.fsync=all
  -c core.fsyncMethod=fsync`` on both commands (git's durable mode);
* ``API`` — :func:`patcher.protocol.apply` in this process, with a kept
  ``_stores`` dict (long-lived caller), on ``side`` (checked out nowhere) or on
  ``main`` (checked out: the worktree and index follow);
* ``CLI`` — ``oncepatch apply p.diff --json`` as a cold child process.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from bench.env import ONCEPATCH, PYTHON, Env, run, run_rusage
from bench.repos import BenchRepo, make_repo
from bench.stats import Series, interleave, timed

__all__ = ["Contenders", "section_single", "section_large", "section_concurrency", "importtime_check", "cli_apply_importtime"]

_FSYNC_ALL = "-c core.fsync=all -c core.fsyncMethod=fsync"


def _sh_git_pair(patch_file: str, fsync: bool) -> str:
    g = f"git {_FSYNC_ALL}" if fsync else "git"
    return f"{g} apply --index '{patch_file}' && {g} commit -q -m x"


class Contenders:
    """Builds the measured operations for one repository."""

    def __init__(self, env: Env, repo: BenchRepo, tag: str) -> None:
        from patcher.protocol import apply  # after setup_env: libgit2 sees the bench HOME

        self.env = env
        self.repo = repo
        self.tag = tag
        self.apply = apply
        self.stores: dict[str, Any] = {}
        self.seq = 0
        self.applied: dict[str, list[bytes]] = {}  # contender -> patches it landed (for replays)

    def _patch_file(self, data: bytes) -> str:
        self.seq += 1
        path = os.path.join(self.env.tmp, f"{self.tag}-{self.seq}.diff")
        with open(path, "wb") as fh:
            fh.write(data)
        return path

    def _make(self, branch: str, files: int, label: str) -> bytes:
        if files == -1:
            return self.repo.big_patch(branch, label)
        return self.repo.patch(branch, self.repo.next_paths(branch, files), label)

    def git_pair(self, files: int = 1, *, fsync: bool = False, rusage: bool = False) -> Callable[[int], Any]:
        label = "gitfs" if fsync else "git"

        def op(_r: int) -> tuple[float, dict[str, Any] | None]:
            pf = self._patch_file(self._make("main", files, label))
            cmd = ["sh", "-c", _sh_git_pair(pf, fsync)]
            elapsed, rc, out, err, rss = run_rusage(cmd, cwd=self.repo.path, mem=rusage)
            if rc != 0:
                raise RuntimeError(f"git pair failed ({rc}): {err.decode(errors='replace')[-800:]}")
            return elapsed, {"maxrss_kib": rss} if rusage else None
        return op

    def api(self, branch: str, files: int = 1, *, each: bool = False) -> Callable[[int], Any]:
        """``each``: the call's new objects synced one by one by libgit2 (``cas.loose_objects.BATCH`` off)."""
        import cas.loose_objects

        name = f"api-{branch}" + ("-each" if each else "")

        def op(_r: int) -> tuple[float, dict[str, Any] | None]:
            data = self._make(branch, files, name)
            batch, cas.loose_objects.BATCH = cas.loose_objects.BATCH, not each and cas.loose_objects.BATCH
            try:
                elapsed, res = timed(lambda: self.apply(self.repo.path, data, branch=branch, _stores=self.stores))
            finally:
                cas.loose_objects.BATCH = batch
            if res.replayed or res.status != "committed":
                raise RuntimeError(f"API apply did not commit: {res}")
            self.applied.setdefault(name, []).append(data)
            return elapsed, None
        return op

    def api_child(self, branch: str, files: int = 1) -> Callable[[int], Any]:
        """The API in a fresh child process (for its memory peak); the time is the in-process call."""
        def op(_r: int) -> tuple[float, dict[str, Any] | None]:
            pf = self._patch_file(self._make(branch, files, f"apichild-{branch}"))
            cmd = [PYTHON, "-m", "bench.worker", "apply", self.repo.path, pf, branch]
            _wall, rc, out, err, rss = run_rusage(cmd, cwd=_root(), mem=True)
            if rc != 0:
                raise RuntimeError(f"worker apply failed ({rc}): {err.decode(errors='replace')[-800:]}")
            doc = orjson.loads(out)
            return doc["elapsed_s"], {"maxrss_kib": rss, "floor_kib": doc["maxrss_after_import_kib"]}
        return op

    def cli(self, branch: str | None, files: int = 1, *, rusage: bool = False) -> Callable[[int], Any]:
        name = f"cli-{branch or 'main'}"

        def op(_r: int) -> tuple[float, dict[str, Any] | None]:
            data = self._make(branch or "main", files, name)
            pf = self._patch_file(data)
            cmd = [ONCEPATCH, "apply", pf, "--json", "--repo", self.repo.path]
            if branch:
                cmd += ["--branch", branch]
            elapsed, rc, out, err, rss = run_rusage(cmd, cwd=self.repo.path, mem=rusage)
            if rc != 0:
                raise RuntimeError(f"CLI apply failed ({rc}): {out.decode(errors='replace')[-800:]}"
                                   f"{err.decode(errors='replace')[-800:]}")
            doc = orjson.loads(out)
            if doc.get("replayed"):
                raise RuntimeError("CLI apply replayed unexpectedly")
            self.applied.setdefault(name, []).append(pf.encode())
            return elapsed, {"maxrss_kib": rss} if rusage else None
        return op

    # -- replays -------------------------------------------------------------------------

    def api_replay(self, source: str) -> Callable[[int], Any]:
        patches = self.applied[source]

        def op(r: int) -> tuple[float, dict[str, Any] | None]:
            data = patches[r % len(patches)]
            branch = source.split("-", 1)[1]
            elapsed, res = timed(lambda: self.apply(self.repo.path, data, branch=branch, _stores=self.stores))
            if not res.replayed:
                raise RuntimeError("API replay executed again")
            return elapsed, None
        return op

    def cli_replay(self, source: str) -> Callable[[int], Any]:
        files = self.applied[source]

        def op(r: int) -> tuple[float, dict[str, Any] | None]:
            pf = files[r % len(files)].decode()
            branch = source.split("-", 1)[1]
            cmd = [ONCEPATCH, "apply", pf, "--json", "--repo", self.repo.path, "--branch", branch]
            elapsed, rc, out, err, _rss = run_rusage(cmd, cwd=self.repo.path)
            if rc != 0 or not orjson.loads(out).get("replayed"):
                raise RuntimeError(f"CLI replay did not replay ({rc}): {out[-500:]!r} {err[-500:]!r}")
            return elapsed, None
        return op


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_floor(code: str, *, mem: bool = False) -> Callable[[int], Any]:
    def op(_r: int) -> tuple[float, dict[str, Any] | None]:
        elapsed, rc, _o, err, rss = run_rusage([PYTHON, "-c", code], cwd=_root(), mem=mem)
        if rc != 0:
            raise RuntimeError(err.decode(errors="replace"))
        return elapsed, {"maxrss_kib": rss} if mem else None
    return op


def _row(series: Series, baseline: Series | None, **extra: Any) -> dict[str, Any]:
    doc = series.to_json()
    doc["baseline"] = baseline.name if baseline is not None else None
    doc["baseline_median_s"] = baseline.median if baseline is not None else None
    doc.update(extra)
    return doc


def worktree_clean(repo: BenchRepo) -> bool:
    out = run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo.path).stdout
    return out.strip() == b""


# -- section 1 + 2 -------------------------------------------------------------------------


def section_single(env: Env, repos: dict[str, BenchRepo], rounds: dict[str, int],
                   log: Callable[[str], None], *, both_syncs: bool = False) -> dict[str, Any]:
    """One-file patches at each size; then replays of landed calls.

    ``both_syncs``: the API also with its new objects synced one by one (rows of their own).
    """
    tables: dict[str, Any] = {"single": [], "replay": [], "clean": {}}
    for size, repo in repos.items():
        c = Contenders(env, repo, f"s{size}")
        log(f"[1] one-file patch, {size} files: {rounds[size]} rounds")
        each = [("API, branch not checked out, objects synced one by one", c.api("side", each=True)),
                ("API, branch checked out, objects synced one by one", c.api("main", each=True))]
        res = interleave([
            ("git pair", c.git_pair()),
            ("git pair fsync=all", c.git_pair(fsync=True)),
            ("API, branch not checked out", c.api("side")),
            ("API, branch checked out", c.api("main")),
            *(each if both_syncs else []),
            ("CLI cold, branch not checked out", c.cli("side")),
            ("CLI cold, branch checked out", c.cli(None)),
        ], rounds[size], warmup=1, progress=log)
        base = res["git pair"]
        for name, s in res.items():
            tables["single"].append(_row(s, None if name == "git pair" else base, size=size))
        tables["clean"][size] = worktree_clean(repo)

        n_rep = max(5, rounds[size])
        log(f"[2] replay, {size} files: {n_rep} rounds")
        rep = interleave([
            ("git pair (a new change)", c.git_pair()),
            ("API replay", c.api_replay("api-side")),
            ("CLI replay", c.cli_replay("cli-side")),
            ("python -c pass", python_floor("pass")),
            ("python -c 'import pygit2'", python_floor("import pygit2")),
        ], n_rep, warmup=1)
        base = rep["git pair (a new change)"]
        for name, s in rep.items():
            tables["replay"].append(_row(s, None if s is base else base, size=size))
        if size == next(iter(repos)):
            tables["importtime"] = importtime_check(repo, c.applied["cli-side"][0].decode())
    return tables


def importtime_check(repo: BenchRepo, replay_patch: str) -> dict[str, Any]:
    """Does the CLI replay import pygit2?  ``-X importtime`` of a replay and of a first apply."""
    out: dict[str, Any] = {}
    for what, pf in (("replay", replay_patch),):
        cmd = [*_importtime_cli(), "apply", pf, "--json", "--repo", repo.path, "--branch", "side"]
        res = run(cmd, cwd=repo.path)
        mods = _parse_importtime(res.stderr.decode())
        out[what] = {
            "pygit2_imported": any(m == "pygit2" or m.startswith("pygit2.") for m, _s, _c in mods),
            "modules": len(mods),
            "import_ms": round(sum(s for _m, s, _c in mods) / 1000, 1),
            "top": _top_imports(mods),
        }
    # sys.modules check in a child that runs the CLI entry point in-process.
    code = ("import sys; from patcher.cli import main; rc = main(['apply', sys.argv[1], '--json', '--repo', "
            "sys.argv[2], '--branch', 'side']); sys.stderr.write('PYGIT2=%d RC=%d\\n' % "
            "('pygit2' in sys.modules, rc))")
    res = run([PYTHON, "-c", code, replay_patch, repo.path], cwd=repo.path)
    m = re.search(rb"PYGIT2=(\d) RC=(\d+)", res.stderr)
    out["replay_sys_modules_has_pygit2"] = bool(m and m.group(1) == b"1")
    return out


def _importtime_cli() -> list[str]:
    """The command the CLI rows time (the installed ``oncepatch``), under ``-X importtime``."""
    return [PYTHON, "-X", "importtime", ONCEPATCH] if ONCEPATCH else [PYTHON, "-X", "importtime", "-m", "patcher.cli"]


def _parse_importtime(text: str) -> list[tuple[str, int, int]]:
    mods = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:"):].split("|")
        if len(parts) != 3:
            continue
        mods.append((parts[2].strip(), int(parts[0]), int(parts[1])))
    return mods


def _top_imports(mods: list[tuple[str, int, int]], k: int = 8) -> list[tuple[str, float]]:
    """Top-level packages by cumulative import time (ms)."""
    tops = [(m, c) for m, _s, c in mods if not m.startswith(" ")]
    tops.sort(key=lambda t: -t[1])
    return [(m, round(c / 1000, 1)) for m, c in tops[:k]]


def cli_apply_importtime(repo: BenchRepo, env: Env) -> dict[str, Any]:
    """``-X importtime`` of a first (executing) CLI apply: what the cold start pays for."""
    c = Contenders(env, repo, "imp")
    pf = c._patch_file(repo.patch("side", repo.next_paths("side", 1), "imp"))
    cmd = [*_importtime_cli(), "apply", pf, "--json", "--repo", repo.path, "--branch", "side"]
    res = run(cmd, cwd=repo.path)
    mods = _parse_importtime(res.stderr.decode())
    return {"modules": len(mods), "import_ms": round(sum(s for _m, s, _c in mods) / 1000, 1),
            "top": _top_imports(mods, 12)}


# -- section 3 -------------------------------------------------------------------------------


def section_large(env: Env, repo_500: BenchRepo, size_500: str, big_size: int, rounds_500: int, rounds_big: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    tables: dict[str, Any] = {"files500": [], "bigfile": [], "big_size": big_size}
    c = Contenders(env, repo_500, "m500")
    log(f"[3] 500-file patch on the {size_500}-file repo: {rounds_500} rounds")
    res = interleave([
        ("git pair", c.git_pair(500)),
        ("git pair fsync=all", c.git_pair(500, fsync=True)),
        ("API, branch not checked out", c.api("side", 500)),
        ("API, branch checked out", c.api("main", 500)),
        ("CLI cold, branch checked out", c.cli(None, 500)),
    ], rounds_500, warmup=1 if rounds_500 > 2 else 0)
    base = res["git pair"]
    for name, s in res.items():
        tables["files500"].append(_row(s, None if s is base else base, size=size_500))
    tables["files500_clean"] = worktree_clean(repo_500)

    log(f"[3] {big_size >> 20} MiB file: generating")
    big, gen_s = make_repo(os.path.join(env.out, "repo-big"), 100, big_size=big_size)
    tables["big_gen_s"] = gen_s
    cb = Contenders(env, big, "big")
    log(f"[3] {big_size >> 20} MiB file: {rounds_big} rounds (each in a fresh process, for its memory peak)")
    res = interleave([
        ("git pair", cb.git_pair(-1, rusage=True)),
        ("git pair fsync=all", cb.git_pair(-1, fsync=True, rusage=True)),
        ("API (fresh process), branch not checked out", cb.api_child("side", -1)),
        ("API (fresh process), branch checked out", cb.api_child("main", -1)),
        ("CLI cold, branch checked out", cb.cli(None, -1, rusage=True)),
        ("python: import pygit2 + patcher (memory floor)",
         python_floor("import pygit2, patcher.protocol, patcher.execute, patcher.stage", mem=True)),
    ], rounds_big, warmup=0)
    base = res["git pair"]
    for name, s in res.items():
        tables["bigfile"].append(_row(s, None if s is base else base, size=f"{big_size >> 20} MiB",
                                      maxrss_kib=s.extra_max("maxrss_kib")))
    tables["bigfile_clean"] = worktree_clean(big)
    return tables


def _count_events(repo: BenchRepo, needle: bytes) -> int:
    """Ledger lines containing ``needle`` in the repository's default store."""
    try:
        with open(os.path.join(repo.path, ".git", "oncepatch", "events.jsonl"), "rb") as fh:
            return sum(1 for line in fh if needle in line)
    except FileNotFoundError:
        return 0


# -- issue 4: many agents at once ------------------------------------------------------------


def section_concurrency(env: Env, repo: BenchRepo, size: str, procs: int, per_proc: int, rounds: int,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """``procs`` processes × ``per_proc`` distinct one-file patches on one branch, vs the same count serially.

    Each process is a long-lived caller (``bench.worker batch``: the API with a
    kept store).  Non-overlapping files, so every call must land: the branch
    must advance by exactly ``procs × per_proc`` commits.  Wall time runs from
    starting the processes to the last one's exit (start-up included, in both);
    the span runs from the first apply loop's start to the last one's end.
    """
    import subprocess

    rows = []
    for branch, where in (("side", "not checked out"), ("main", "checked out")):
        for r in range(rounds):
            for mode in ("serial", "parallel"):
                n = procs * per_proc
                files = []
                for k in range(n):
                    pf = os.path.join(env.tmp, f"conc-{branch}-{mode}-{r}-{k}.diff")
                    with open(pf, "wb") as fh:
                        fh.write(repo.patch(branch, repo.next_paths(branch, 1), f"conc-{mode}"))
                    files.append(pf)
                groups = [files] if mode == "serial" else [files[i::procs] for i in range(procs)]
                before = int(run(["git", "rev-list", "--count", f"refs/heads/{branch}"], cwd=repo.path).stdout)
                restaged_before = _count_events(repo, b'"event":"restaged"')
                t0 = time.perf_counter()
                ps = [subprocess.Popen([PYTHON, "-m", "bench.worker", "batch", repo.path, branch, *g],
                                       cwd=_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) for g in groups]
                outs = [p.communicate() for p in ps]
                wall = time.perf_counter() - t0
                after = int(run(["git", "rev-list", "--count", f"refs/heads/{branch}"], cwd=repo.path).stdout)
                docs = [orjson.loads(o) for o, _e in outs if o.strip()]
                if len(docs) != len(ps):
                    raise RuntimeError("batch worker failed: " + " ".join(e.decode(errors="replace")[-400:]
                                                                           for _o, e in outs))
                landed = sum(d["ok"] for d in docs)
                errs: dict[str, int] = {}
                for d in docs:
                    for k, v in d["errors"].items():
                        errs[k] = errs.get(k, 0) + v
                span = max(d["ended"] for d in docs) - min(d["started"] for d in docs)
                restaged = _count_events(repo, b'"event":"restaged"') - restaged_before
                rows.append({"size": size, "branch": where, "mode": mode, "procs": len(groups), "calls": n,
                             "landed": landed, "commits_added": after - before, "errors": errs,
                             "wall_s": wall, "per_s": n / wall, "span_s": span, "span_per_s": n / span,
                             "restaged": restaged})
                log(f"[4*] {mode} {where}: {landed}/{n} landed, +{after - before} commits, {wall:.2f} s")
    return {"rows": rows, "clean": worktree_clean(repo)}


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run scripts/bench")

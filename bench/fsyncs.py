"""Section 6: how many fsyncs one transaction costs, on what, and how much of the time they take.

Two measurements:

* **strace** — ``strace -f -T -y -e trace=fsync,fdatasync,sync_file_range,syncfs``
  around one cold process (``oncepatch apply``, a replay, the git pair):
  the count, the summed time inside the calls (``-T``), and what was synced
  (``-y`` names the file behind each fd), grouped by kind;
* **flush points** — in process, the sync calls counted at their seams: each
  :func:`cas.durable.fsync_all` round (n files synced at once, counted once),
  each ``os.fsync`` made on its own, and — only when the branch was moved
  by a libgit2 transaction — libgit2's own syncs of the branch (ref and
  reflog, one after another: taken from the strace kinds).  strace
  cannot tell concurrency (it serialises the threads it stops), so the
  rounds are counted here;
* **A/B in process** — the API with durability on, interleaved with the API
  with ``os.fsync`` stubbed and libgit2's ``enable_fsync_gitdir`` off: the
  difference of the medians is what the flushes cost, untouched by strace's
  own overhead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import re
import shutil
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from bench.env import ONCEPATCH, Env
from bench.repos import BenchRepo
from bench.stats import interleave

__all__ = ["strace_available", "section_fsync"]

_CALL = re.compile(r"\b(fsync|fdatasync|sync_file_range|syncfs)\((\d+)(?:<([^>]*)>)?")
_TIME = re.compile(r"<(\d+\.\d+)>\s*$")
_SYNCS = "fsync,fdatasync,sync_file_range,syncfs"


def strace_available() -> str | None:
    path = shutil.which("strace")
    if path:
        return path
    # Best effort: the harness sets itself up (apt-get needs root, as on this machine).
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "strace"], capture_output=True)
    return shutil.which("strace")


def _kind(path: str, repo: str) -> str:
    if not path:
        return "?"
    if "/oncepatch/receipts" in path:
        return "receipt"
    if path.endswith("events.jsonl"):
        return "ledger"
    if "/.git/objects" in path:
        return "git object"
    if "/.git/logs" in path:
        return "reflog"
    if "/.git/refs" in path or path.endswith("packed-refs"):
        return "ref"
    if "/oncepatch" in path:
        return "store (other)"
    if path.endswith("/.git/index") or "/.git/index" in path or path.endswith("/.git"):
        return "index / .git"
    if path.startswith(repo):
        return "worktree"
    return "other"


def strace_once(cmd: list[str], cwd: str, repo: str, out: str) -> dict[str, Any]:
    """Run ``cmd`` under strace; return the count, summed fsync seconds and kinds."""
    t0 = time.perf_counter()
    res = subprocess.run(["strace", "-f", "-T", "-y", "-qq", "-e", f"trace={_SYNCS}", "-o", out, *cmd],
                         cwd=cwd, capture_output=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"traced command failed ({res.returncode}): {cmd} {res.stdout[-500:]!r} "
                           f"{res.stderr[-800:]!r}")
    count = 0
    total = 0.0
    kinds: Counter[str] = Counter()
    dirs = 0
    paths: list[str] = []
    pending: dict[str, str] = {}
    with open(out, errors="replace") as fh:
        for line in fh:
            pid = line.split(None, 1)[0]
            m = _CALL.search(line)
            if m:
                count += 1
                path = m.group(3) or ""
                kinds[_kind(path, repo)] += 1
                paths.append(_normal(path, repo))
                if path and os.path.isdir(path):
                    dirs += 1
                if "<unfinished" in line:
                    pending[pid] = path
                    continue
            elif "resumed>" in line:
                pending.pop(pid, None)
            else:
                continue
            t = _TIME.search(line)
            if t:
                total += float(t.group(1))
    return {"count": count, "fsync_s": total, "wall_s": wall, "kinds": dict(kinds), "dirs": dirs, "paths": paths}


def count_flush_points(op: Callable[[int], Any], runs: int) -> dict[str, float]:
    """Median per call of: batched rounds (and the files in them) and single ``os.fsync`` calls from Python."""
    import threading

    import cas.durable as durable

    import cas.objects as objects

    real_all, real_fsync = durable.fsync_all, os.fsync
    real_txn = objects.GitStore._compare_and_swap_once
    inside = threading.local()
    cur = {"rounds": 0, "batched": 0, "single": 0, "libgit2_moves": 0}

    def counting_txn(self: Any, *a: Any, **kw: Any) -> Any:
        cur["libgit2_moves"] += 1  # the branch moved by a libgit2 transaction (its own syncs)
        return real_txn(self, *a, **kw)

    def counting_all(paths: Any) -> None:
        todo = list(dict.fromkeys(paths))
        if todo:
            cur["rounds"] += 1
            cur["batched"] += len(todo)
        inside.on = True
        try:
            real_all(todo)
        finally:
            inside.on = False

    def counting_fsync(fd: int) -> None:
        if not getattr(inside, "on", False) and not threading.current_thread().name.startswith("oncepatch-fsync"):
            cur["single"] += 1
        real_fsync(fd)

    per: list[dict[str, int]] = []
    # Every module that imported fsync_all by name calls it through its own binding.
    holders = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith(("cas.", "patcher.", "receipts."))
               and getattr(m, "fsync_all", None) is real_all]
    for m in holders:
        m.fsync_all = counting_all
    os.fsync = counting_fsync  # type: ignore[assignment]
    objects.GitStore._compare_and_swap_once = counting_txn  # type: ignore[method-assign]
    try:
        for r in range(runs):
            cur.update(rounds=0, batched=0, single=0, libgit2_moves=0)
            op(r)
            per.append(dict(cur))
    finally:
        for m in holders:
            m.fsync_all = real_all
        os.fsync = real_fsync  # type: ignore[assignment]
        objects.GitStore._compare_and_swap_once = real_txn  # type: ignore[method-assign]
    return {k: statistics.median(p[k] for p in per) for k in ("rounds", "batched", "single", "libgit2_moves")}


_HEX = re.compile(r"[0-9a-f]{16,64}")


def _normal(path: str, repo: str) -> str:
    """``path`` relative to the repository, hex runs as ``<h>``, pids and random tmp suffixes dropped."""
    if path.startswith(repo + "/"):
        path = path[len(repo) + 1:]
    path = _HEX.sub("<h>", path)
    path = re.sub(r"(optmp|tmp_object_git2|tmp_objdir-oncepatch)[-_][0-9a-zA-Z_-]+", r"\1-*", path)
    path = re.sub(r"/[0-9a-f]{2}(/|$)", r"/<xx>\1", path)
    return path


def section_fsync(env: Env, repos: dict[str, BenchRepo], rounds: int, ab_rounds: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    from bench.cases_apply import Contenders, _sh_git_pair

    out: dict[str, Any] = {"strace": [], "ab": []}
    if strace_available() is None:
        out["error"] = "strace not installed"
    trace_file = os.path.join(env.tmp, "strace.txt")
    for size, repo in repos.items():
        c = Contenders(env, repo, f"fs{size}")
        replay_src: list[str] = []

        def cli(branch: str | None, files: int = 1) -> list[str]:
            pf = c._patch_file(repo.patch(branch or "main", repo.next_paths(branch or "main", files), "fs"))
            if branch == "side" and files == 1:
                replay_src.append(pf)
            cmd = [ONCEPATCH, "apply", pf, "--json", "--repo", repo.path]
            return cmd + (["--branch", branch] if branch else [])

        def git(fsync: bool) -> list[str]:
            pf = c._patch_file(repo.patch("main", repo.next_paths("main", 1), "fsg"))
            return ["sh", "-c", _sh_git_pair(pf, fsync)]

        cases: list[tuple[str, Callable[[], list[str]]]] = [
            ("oncepatch apply, branch not checked out", lambda: cli("side")),
            ("oncepatch apply, branch checked out", lambda: cli(None)),
            ("oncepatch apply (replay)", lambda: [ONCEPATCH, "apply", replay_src[-1], "--json", "--repo",
                                                  repo.path, "--branch", "side"]),
            ("oncepatch apply, 500 files, branch not checked out", lambda: cli("side", 500)),
            ("git pair", lambda: git(False)),
            ("git pair fsync=all", lambda: git(True)),
        ]
        if "error" not in out:
            log(f"[6] strace, {size} files: {rounds} runs per case")
            for name, make in cases:
                runs = [strace_once(make(), repo.path, repo.path, trace_file) for _ in range(rounds)]
                med = sorted(runs, key=lambda r: r["fsync_s"])[len(runs) // 2]
                out["strace"].append({
                    "size": size, "name": name, "count": statistics.median(r["count"] for r in runs),
                    "fsync_ms": statistics.median(r["fsync_s"] for r in runs) * 1000,
                    "wall_ms": statistics.median(r["wall_s"] for r in runs) * 1000,
                    "kinds": med["kinds"], "dirs": med["dirs"], "paths": med["paths"],
                })
        log(f"[6] flush points in process, {size} files")
        for where, branch in (("not checked out", "side"), ("checked out", "main")):
            out.setdefault("points", []).append({"size": size, "where": where,
                                                 **count_flush_points(c.api(branch), 5)})
        log(f"[6] in-process A/B durable vs fsync stubbed, {size} files: {ab_rounds} rounds")
        res = interleave([
            ("API durable, not checked out", c.api("side")),
            ("API fsync stubbed, not checked out", _no_fsync_op(c.api("side"))),
            ("API durable, checked out", c.api("main")),
            ("API fsync stubbed, checked out", _no_fsync_op(c.api("main"))),
        ], ab_rounds, warmup=1)
        for name, s in res.items():
            out["ab"].append({**s.to_json(), "size": size})
    return out


@contextlib.contextmanager
def _fsync_off() -> Iterator[None]:
    from cas.loose_objects import enable_fsync  # it owns libgit2's switch

    real = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    enable_fsync(False)
    try:
        yield
    finally:
        os.fsync = real  # type: ignore[assignment]
        enable_fsync(True)


def _no_fsync_op(op: Callable[[int], Any]) -> Callable[[int], Any]:
    def wrapped(r: int) -> Any:
        with _fsync_off():
            return op(r)
    return wrapped


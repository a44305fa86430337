#!/usr/bin/env python3
"""Per-call latency of applying one patch: Python API vs MCP server vs CLI vs plain git.

Each way gets its own copy of the same repository (``--files`` files, default
1000) and applies the same ``--n`` distinct patches (default 30; each
changes one line of a different file, one commit each), after one warm-up
call that is not counted.  The calls are interleaved — patch i through every
way (in a rotating order) before patch i+1 — so that other load on the
machine falls on all ways alike:

* ``api``  — ``patcher.Client.apply`` in this process, the client kept open;
* ``mcp``  — ``apply_patch`` through ``oncepatch mcp`` with the SDK's stdio
  client, the server started once (skipped without ``pip install 'oncepatch[mcp]'``);
* ``cli``  — ``python -m patcher.cli apply FILE --key K --json``, a new process per call;
* ``git``  — ``git apply --index FILE && git commit -q``, the baseline without receipts.

Prints a markdown table (median and p90 in milliseconds).  Everything runs in
a temporary folder; nothing outside it is touched.

Usage: scripts/bench_api_mcp.py [--n 30] [--files 1000] [--only api,mcp,cli,git]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
}
LINES = 20


def rel(i: int) -> str:
    return f"src/d{i // 100:02d}/f{i:04d}.txt"


def make_repo(path: Path, files: int) -> None:
    for i in range(files):
        p = path / rel(i)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(f"file {i} line {k}\n" for k in range(1, LINES + 1)))
    env = {**os.environ, **GIT_ENV}
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "config", "user.name", "bench"],
                ["git", "config", "user.email", "bench@example.com"], ["git", "add", "-A"],
                ["git", "commit", "-q", "-m", "initial"]):
        subprocess.run(cmd, cwd=path, env=env, check=True, capture_output=True)


def patch_for(i: int, n: int) -> str:
    """Change line 5 of file ``i`` (patch number ``n``)."""
    f = rel(i)
    ctx = [f"file {i} line {k}" for k in range(3, 8)]
    return (f"--- a/{f}\n+++ b/{f}\n@@ -3,5 +3,5 @@\n {ctx[0]}\n {ctx[1]}\n-{ctx[2]}\n"
            f"+{ctx[2]} changed by patch {n}\n {ctx[3]}\n {ctx[4]}\n")


def stats(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return statistics.median(ordered) * 1000, p90 * 1000, statistics.fmean(ordered) * 1000


# -- the four ways: each a set-up giving ``call(index, key)`` ----------------------------------------


def api_caller(repo: Path, patches: list[str], stack: contextlib.ExitStack) -> Callable[[int, str], None]:
    import patcher

    client = stack.enter_context(patcher.Client(repo))

    def call(i: int, key: str) -> None:
        client.apply(patches[i], key=key)

    return call


def cli_caller(repo: Path, patches: list[str], scratch: Path) -> Callable[[int, str], None]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    files = []
    for k, p in enumerate(patches):
        f = scratch / f"cli-{k}.patch"
        f.write_text(p)
        files.append(f)

    def call(i: int, key: str) -> None:
        r = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", str(files[i]), "--key", key, "--repo",
                            str(repo), "--json"], env=env, capture_output=True)
        if r.returncode != 0:
            raise SystemExit(f"cli apply failed: {r.stdout!r} {r.stderr!r}")

    return call


def git_caller(repo: Path, patches: list[str], scratch: Path) -> Callable[[int, str], None]:
    env = {**os.environ, **GIT_ENV}
    files = []
    for k, p in enumerate(patches):
        f = scratch / f"git-{k}.patch"
        f.write_text(p)
        files.append(f)

    def call(i: int, key: str) -> None:
        subprocess.run(["git", "apply", "--index", str(files[i])], cwd=repo, env=env, check=True,
                       capture_output=True)
        subprocess.run(["git", "commit", "-q", "-m", f"patch {i}"], cwd=repo, env=env, check=True,
                       capture_output=True)

    return call


async def mcp_caller(repo: Path, patches: list[str], stack: contextlib.AsyncExitStack) -> Any:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    params = StdioServerParameters(command=sys.executable, args=["-m", "patcher.cli", "mcp", "--repo", str(repo)],
                                   env=env)
    read, write = await stack.enter_async_context(stdio_client(params))
    session = await stack.enter_async_context(ClientSession(read, write))
    await session.initialize()

    async def call(i: int, key: str) -> None:
        res = await session.call_tool("apply_patch", {"patch": patches[i], "idempotency_key": key})
        if getattr(res, "is_error", getattr(res, "isError", False)):
            raise SystemExit(f"mcp apply_patch failed: {res.content!r}")

    return call


async def run_interleaved(ways: list[str], repos: dict[str, Path], patches: list[str],
                          scratch: Path) -> dict[str, list[float]]:
    """Call i of every way before call i+1 of any, rotating the order: load on the machine hits all alike."""
    samples: dict[str, list[float]] = {w: [] for w in ways}
    async with contextlib.AsyncExitStack() as astack:
        with contextlib.ExitStack() as stack:
            callers: dict[str, Any] = {}
            for way in ways:
                if way == "api":
                    sync = api_caller(repos[way], patches, stack)
                elif way == "cli":
                    sync = cli_caller(repos[way], patches, scratch)
                elif way == "git":
                    sync = git_caller(repos[way], patches, scratch)
                elif way == "mcp":
                    callers[way] = await mcp_caller(repos[way], patches, astack)
                    continue
                else:
                    raise SystemExit(f"unknown way '{way}'")

                async def wrapped(i: int, key: str, sync: Callable[[int, str], None] = sync) -> None:
                    sync(i, key)

                callers[way] = wrapped
            for way in ways:  # warm-up: imports, first open, caches
                await callers[way](0, "warm-up")
            os.sync()  # every way fsyncs: start with no dirty pages from the set-up
            for i in range(1, len(patches)):
                shift = i % len(ways)
                for way in ways[shift:] + ways[:shift]:
                    t0 = time.perf_counter()
                    await callers[way](i, f"bench-{i}")
                    samples[way].append(time.perf_counter() - t0)
    return samples


def commits(repo: Path) -> int:
    return int(subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30, help="measured calls per way (default 30)")
    ap.add_argument("--files", type=int, default=1000, help="files in the repository (default 1000)")
    ap.add_argument("--only", default="api,mcp,cli,git", help="comma-separated subset of api,mcp,cli,git")
    args = ap.parse_args(argv)
    if args.files < args.n + 1:
        ap.error("--files must exceed --n")
    ways = [w.strip() for w in args.only.split(",") if w.strip()]
    patches = [patch_for(i * (args.files // (args.n + 1)), i) for i in range(args.n + 1)]
    notes = {
        "api": "`patcher.Client.apply`, client kept open",
        "mcp": "`apply_patch` via `oncepatch mcp`, SDK stdio client, server kept running",
        "cli": "`oncepatch apply FILE --key K --json`, one process per call",
        "git": "`git apply --index && git commit -q` (no receipt)",
    }
    rows: list[tuple[str, list[float] | None, str]] = []
    if "mcp" in ways:
        try:
            import mcp  # noqa: F401
        except ModuleNotFoundError:
            ways.remove("mcp")
            rows.append(("mcp", None, "skipped: the mcp package is not installed"))
    with tempfile.TemporaryDirectory(prefix="oncepatch-bench-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        make_repo(base, args.files)
        repos = {}
        for way in ways:
            repos[way] = Path(tmp) / way
            shutil.copytree(base, repos[way], symlinks=True)
            # The copy has new inodes and times: refresh the index's stat data (as a clone would have).
            subprocess.run(["git", "update-index", "-q", "--refresh"], cwd=repos[way], capture_output=True)
        before = {way: commits(repos[way]) for way in ways}
        measured = asyncio.run(run_interleaved(ways, repos, patches, Path(tmp)))
        for way in ways:
            made = commits(repos[way]) - before[way]
            if made != args.n + 1:
                raise SystemExit(f"{way}: expected {args.n + 1} commits, found {made}")
            rows.append((way, measured[way], notes[way]))
    print(f"Per-call latency of applying one one-line patch to a {args.files}-file repository, "
          f"{args.n} distinct patches per way after one warm-up call, interleaved "
          f"({platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs).\n")
    print("| way | calls | median ms | p90 ms | mean ms | notes |")
    print("|---|---:|---:|---:|---:|---|")
    for way, samples, note in rows:
        if samples is None:
            print(f"| {way} | 0 | – | – | – | {note} |")
            continue
        med, p90, mean = stats(samples)
        print(f"| {way} | {len(samples)} | {med:.1f} | {p90:.1f} | {mean:.1f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

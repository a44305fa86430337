"""Two versions of the product, call by call: ``python -m bench.pair A_SRC B_SRC [--files N] [--branch B]``.

Each source tree (a checkout of this repository, e.g. ``git worktree add
/tmp/before <rev>``) is served by a long-lived process that generates its own
repository (``bench.repos.make_repo``) and applies one-file patches through
the in-process API, one per request.  The driver alternates the two (A B,
then B A) for ``--rounds`` rounds and prints both medians and their ratio —
the A/B figures quoted in docs/BENCHMARKS.md and docs/DECISIONS.md.  With
``--no-fsync`` both processes stub ``os.fsync`` and libgit2's fsync; with
``--dirty MB`` the driver writes that much, unsynced, before each call (the
benchmark's git pair leaves its new index so, and on ext4's ordered mode the
next fsync writes such blocks out first).

A freshly generated repository's index holds the files' mtime second, so
every entry is racily clean and the index goes through libgit2 until a
second has passed: the server waits for that and refreshes the index
before it reports ready.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(src: str, files: int, branch: str, out: str, no_fsync: bool) -> None:
    sys.path.insert(0, src)
    from bench.env import setup_env  # the served tree's harness

    setup_env(out)
    from bench.repos import make_repo

    repo, _ = make_repo(os.path.join(out, f"pair-{files}-{os.getpid()}"), files)
    time.sleep(1.1)
    subprocess.run(["git", "update-index", "-q", "--really-refresh"], cwd=repo.path, check=False)
    import pygit2

    from patcher.protocol import apply

    if no_fsync:
        os.fsync = lambda fd: None
        try:
            from cas.loose_objects import enable_fsync  # it owns libgit2's switch in this tree
        except ImportError:  # a tree from before it: its first store would switch the syncs on
            import cas.objects

            cas.objects._FSYNC_ON = True  # type: ignore[attr-defined]
            pygit2.settings.enable_fsync_gitdir(False)
        else:
            enable_fsync(False)
    stores: dict[str, object] = {}

    def one() -> float:
        data = repo.patch(branch, repo.next_paths(branch, 1), "pair")
        t = time.perf_counter()
        res = apply(repo.path, data, branch=branch, _stores=stores)
        took = time.perf_counter() - t
        if res.status != "committed" or res.replayed:
            raise RuntimeError(f"apply did not commit: {res}")
        return took

    for _ in range(10):
        one()
    print("ready", flush=True)
    try:
        for _line in sys.stdin:
            print(one(), flush=True)
    finally:
        shutil.rmtree(repo.path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pair", description=__doc__.splitlines()[0])
    ap.add_argument("a_src")
    ap.add_argument("b_src")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--branch", default="side", help="side: not checked out; main: checked out")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--no-fsync", action="store_true")
    ap.add_argument("--dirty", type=float, default=0.0, metavar="MB",
                    help="before each call, write MB unsynced to a scratch file, as the git pair leaves "
                         "its index (section 1 of the benchmark interleaves the two)")
    ap.add_argument("--out", default=os.path.join(HERE, "bench-out", "pair"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.files, args.branch, args.out, args.no_fsync)
        return 0

    def start(src: str) -> subprocess.Popen[str]:
        # This file serves both (an older tree may not have it); the served tree's
        # own product and harness come first on its path.
        cmd = [sys.executable, os.path.abspath(__file__), args.a_src, args.b_src, "--serve", os.path.abspath(src),
               "--files", str(args.files), "--branch", args.branch, "--out", args.out]
        if args.no_fsync:
            cmd.append("--no-fsync")
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=os.path.abspath(src))
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    a, b = start(args.a_src), start(args.b_src)
    times: dict[str, list[float]] = {"A": [], "B": []}
    dirt = os.urandom(int(args.dirty * (1 << 20))) if args.dirty else b""
    try:
        for r in range(args.rounds):
            order = (("A", a), ("B", b)) if r % 2 == 0 else (("B", b), ("A", a))
            for name, p in order:
                assert p.stdin is not None and p.stdout is not None
                if dirt:
                    with open(os.path.join(args.out, "dirty.bin"), "wb") as fh:
                        fh.write(dirt)
                p.stdin.write("go\n")
                p.stdin.flush()
                times[name].append(float(p.stdout.readline()) * 1000)
    finally:
        for p in (a, b):
            if p.stdin is not None:
                p.stdin.close()
            p.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in times.items()}
    print(f"{args.files} files, branch {args.branch}{' (fsync stubbed)' if args.no_fsync else ''}"
          f"{f', {args.dirty:g} MB unsynced before each call' if args.dirty else ''}, "
          f"{args.rounds} calls each: A median {med['A']:.2f} ms (p90 {p90['A']:.2f}), "
          f"B median {med['B']:.2f} ms (p90 {p90['B']:.2f}), B/A {med['B'] / med['A']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Instructions per in-process apply, for one or more versions: ``python -m bench.instructions SRC [SRC ...]``.

Wall time on this machine moves with its load by more than a change worth a
few percent; an instruction count does not.  Each source tree (a checkout of
this repository, e.g. ``git worktree add /tmp/before <rev>``) generates its
own repository (``bench.repos.make_repo``), warms up, and then applies
``--calls`` one-file patches through the in-process API inside one
``functools.reduce`` call, under valgrind's callgrind with collection
switched on only inside that C function (``--collect-atstart=no
--toggle-collect=functools_reduce``): the count is the calls' user-space
instructions (Python, libgit2, zlib, OpenSSL) and nothing of the start-up,
the repository's generation or the warm-up.  Kernel time (fsync, file
creation) is not counted: this measures CPU work, not durability.  The fsync
threads run outside the reduce and are not counted either.

``--repeat`` runs every tree again (in turn, A B A B) to show the spread,
which comes from the state the calls meet (a pack merge in some calls, not
others), not from the machine.  Needs ``valgrind`` (Debian's package).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COLLECTED = re.compile(rb"Collected : (\d+)")


def serve(src: str, files: int, branch: str, calls: int, out: str) -> None:
    """In the child (under valgrind): generate, warm up, then apply ``calls`` patches inside one reduce."""
    sys.path.insert(0, src)
    from bench.env import setup_env  # the served tree's harness

    setup_env(out)
    import functools

    from bench.repos import make_repo

    repo, _ = make_repo(os.path.join(out, f"instr-{files}-{os.getpid()}"), files)
    from patcher.protocol import apply

    stores: dict[str, object] = {}

    def one(_prev: object, data: bytes) -> object:
        res = apply(repo.path, data, branch=branch, _stores=stores)
        if res.status != "committed" or res.replayed:
            raise RuntimeError(f"apply did not commit: {res}")
        return res

    try:
        for _ in range(5):
            one(None, repo.patch(branch, repo.next_paths(branch, 1), "instr"))
        patches = [repo.patch(branch, repo.next_paths(branch, 1), "instr") for _ in range(calls)]
        functools.reduce(one, patches, None)  # the only span callgrind collects
    finally:
        shutil.rmtree(repo.path, ignore_errors=True)


def count(src: str, files: int, branch: str, calls: int, out: str) -> int:
    """Instructions of ``calls`` applies by the product in ``src``."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", "--collect-atstart=no",
           "--toggle-collect=functools_reduce", sys.executable, os.path.abspath(__file__), "--serve",
           os.path.abspath(src), "--files", str(files), "--branch", branch, "--calls", str(calls), "--out", out]
    res = subprocess.run(cmd, capture_output=True, cwd=os.path.abspath(src), check=False)
    found = _COLLECTED.findall(res.stderr)
    if res.returncode != 0 or not found:
        raise RuntimeError(f"callgrind run failed ({res.returncode}): {res.stderr.decode(errors='replace')[-1500:]}")
    return int(found[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    ap.add_argument("srcs", nargs="*", metavar="SRC", help="source trees to measure (the first is the baseline)")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--branch", default="side", help="side: not checked out; main: checked out")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "bench-out", "instructions"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.files, args.branch, args.calls, args.out)
        return 0
    if not args.srcs:
        ap.error("name at least one source tree")
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed (apt-get install valgrind)")
    per_call: dict[str, list[float]] = {src: [] for src in args.srcs}
    for r in range(args.repeat):
        for src in (args.srcs if r % 2 == 0 else args.srcs[::-1]):
            per_call[src].append(count(src, args.files, args.branch, args.calls, args.out) / args.calls)
    base = min(per_call[args.srcs[0]])
    print(f"{args.files} files, branch {args.branch}, {args.calls} calls per run, {args.repeat} runs each "
          f"(instructions per call, min–max):")
    for src, counts in per_call.items():
        lo, hi = min(counts), max(counts)
        print(f"  {src}: {lo / 1e6:.2f}M–{hi / 1e6:.2f}M  ({lo / base:.3f}× the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

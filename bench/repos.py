"""Generated repositories and the patches applied to them.

A repository of ``n`` small text files is written in one ``git fast-import``
stream (seconds even at 100,000 files), then checked out on ``main``; a second
branch ``side`` points at the same commit and is checked out nowhere.  Files
sit in nested folders (``src/mAA/pBB/qCC/fNNNNNN.txt``, about 50 per leaf
folder), ~450 bytes each.  Optionally one large file (``big/data.txt``).

Every patch replaces one known line of a file with a line no patch used
before, so no two patches are the same change and nothing replays by
accident.  The content of every file is a pure function of its index, and
:class:`BenchRepo` remembers the current text of each edited line per branch,
so patches are built in memory without asking git.  Commits accumulate;
nothing is reset between runs.  ``gc.auto = 0`` keeps git from packing in
the middle of a timed call.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import time

from bench.env import run

__all__ = ["BenchRepo", "make_repo", "BIG_PATH"]

BIG_PATH = "big/data.txt"
_FILLER = "lorem ipsum dolor sit amet, consectetur adipiscing"
_BIG_LINE = 80  # bytes per line of the large file
_LINES = 10


def small_path(i: int, n: int) -> str:
    leaves = max(1, math.ceil(n / 50))
    base = max(2, math.ceil(leaves ** (1 / 3)))
    leaf = i // 50
    a, b, c = leaf // (base * base), (leaf // base) % base, leaf % base
    return f"src/m{a:02d}/p{b:02d}/q{c:02d}/f{i:06d}.txt"


def small_line(i: int, j: int) -> str:
    return f"file {i:06d} line {j} {_FILLER}"


def small_content(i: int) -> bytes:
    return ("\n".join(small_line(i, j) for j in range(1, _LINES + 1)) + "\n").encode()


def big_line(j: int) -> str:
    s = f"{j:012d} the quick brown fox jumps over the lazy dog "
    return s + "0123456789abcdef" * ((_BIG_LINE - 1 - len(s)) // 16) + "x" * ((_BIG_LINE - 1 - len(s)) % 16)


def big_content(size: int) -> tuple[bytes, int]:
    nlines = max(8, size // _BIG_LINE)
    return ("\n".join(big_line(j) for j in range(1, nlines + 1)) + "\n").encode(), nlines


class BenchRepo:
    """A generated repository plus the bookkeeping that makes each next patch a new change."""

    def __init__(self, path: str, n: int, big_lines: int = 0) -> None:
        self.path = path
        self.n = n
        self.big_lines = big_lines
        self._lines: dict[tuple[str, str], str] = {}  # (branch, path) -> current text of the edited line
        self._next: dict[str, int] = {}
        self._tags = itertools.count(1)
        # A stride coprime with n walks every file once before repeating, across folders.
        self._stride = next(s for s in (7919, 104729, 1299709, 15485863) if math.gcd(s, n) == 1)

    # -- picking files -------------------------------------------------------------

    def next_paths(self, branch: str, k: int = 1) -> list[str]:
        start = self._next.get(branch, 0)
        self._next[branch] = start + k
        return [small_path(((start + t) * self._stride) % self.n, self.n) for t in range(k)]

    # -- building patches ----------------------------------------------------------

    def _file_line(self, path: str, j: int, branch: str, edited: int) -> str:
        if j == edited:
            cur = self._lines.get((branch, path))
            if cur is not None:
                return cur
        if path == BIG_PATH:
            return big_line(j)
        return small_line(int(path[-10:-4]), j)

    def _hunk(self, branch: str, path: str, line: int, nlines: int, new: str) -> str:
        lo, hi = max(1, line - 3), min(nlines, line + 3)
        old = [self._file_line(path, j, branch, line) for j in range(lo, hi + 1)]
        body = []
        for j, text in zip(range(lo, hi + 1), old):
            if j == line:
                body += [f"-{text}", f"+{new}"]
            else:
                body.append(f" {text}")
        count = hi - lo + 1
        return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
                f"@@ -{lo},{count} +{lo},{count} @@\n" + "\n".join(body) + "\n")

    def patch(self, branch: str, paths: list[str], label: str = "p") -> bytes:
        """A unified diff that changes line 1 of each path to a never-seen line; records the new state.

        The caller must apply it (successfully) before building the next patch
        for the same branch.
        """
        tag = next(self._tags)
        parts = []
        for k, path in enumerate(paths):
            new = f"edit {label} {branch} #{tag}.{k} {time.time_ns()}"
            parts.append(self._hunk(branch, path, 1, _LINES, new))
            self._lines[(branch, path)] = new
        return "".join(parts).encode()

    def big_patch(self, branch: str, label: str = "big") -> bytes:
        """Change one line in the middle of the large file."""
        assert self.big_lines, "repository has no large file"
        line = self.big_lines // 2
        new = big_line(line)[:20] + f" edit {label} {branch} #{next(self._tags)} {time.time_ns()}"
        text = self._hunk(branch, BIG_PATH, line, self.big_lines, new)
        self._lines[(branch, BIG_PATH)] = new
        return text.encode()


def make_repo(path: str, n: int, *, big_size: int = 0, checkout: bool = True) -> tuple[BenchRepo, float]:
    """Create (replacing) a repository of ``n`` small files (and a large one); return it and the seconds taken."""
    t0 = time.perf_counter()
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    run(["git", "init", "-q", "-b", "main", path])
    run(["git", "config", "gc.auto", "0"], cwd=path)
    proc = subprocess.Popen(["git", "fast-import", "--quiet"], cwd=path, stdin=subprocess.PIPE)
    w = proc.stdin
    assert w is not None
    msg = b"initial tree\n"
    w.write(b"commit refs/heads/main\ncommitter Bench <bench@example.com> 1700000000 +0000\n")
    w.write(b"data %d\n%s" % (len(msg), msg))
    for i in range(n):
        data = small_content(i)
        w.write(b"M 100644 inline %s\ndata %d\n%s\n" % (small_path(i, n).encode(), len(data), data))
    big_lines = 0
    if big_size:
        data, big_lines = big_content(big_size)
        w.write(b"M 100644 inline %s\ndata %d\n%s\n" % (BIG_PATH.encode(), len(data), data))
        del data
    w.write(b"\n")
    w.close()
    if proc.wait() != 0:
        raise RuntimeError("git fast-import failed")
    run(["git", "branch", "side", "main"], cwd=path)
    if checkout:
        run(["git", "reset", "-q", "--hard", "main"], cwd=path)
    return BenchRepo(os.path.realpath(path), n, big_lines), time.perf_counter() - t0

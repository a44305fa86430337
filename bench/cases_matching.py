"""Matching cost against input size (issue 25): the matcher in process, ``git apply --check`` beside it.

Each case is made at 1x, 2x and 4x its base size; doubling the input should
at most about double the time (ratio 2x/1x and 4x/2x near 2, never near 4).

* **near-miss context**: a file of ``a`` lines and a unified hunk whose
  context is 40 % of the file's length in ``a`` lines and one ``b`` line: found
  nowhere, after every grade is tried (quadratic before: 95-150 s at 50k/20k
  lines).
* **context at every position**: the same file and an apply_patch envelope
  hunk (no line numbers) of ``a `` lines (trailing blank): at ``rstrip`` it
  matches at every start, so it is ambiguous; the error lists 20 candidates
  and a count (git gets the same lines as a unified hunk at line 1).
* **edit blocks, one file**: 20 search/replace blocks spread over the file,
  each applied to the result of the one before (each reads the whole file).

``git apply --check`` runs in a folder holding the file (no repository), on
the same unified patch (edit blocks: the same changes as one unified hunk
each); its time includes starting the process.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench.stats import median

__all__ = ["section_matching"]

BASE_LINES = 12_500  # the 1x file: 12,500 lines (the 4x one is the 50k)


def _near_miss(n: int) -> tuple[bytes, bytes]:
    m = n * 2 // 5
    patch = (f"--- a/f.txt\n+++ b/f.txt\n@@ -1,{m} +1,{m} @@\n".encode()
             + b" a\n" * (m - 1) + b"-b\n+c\n")
    return b"a\n" * n, patch


def _everywhere(n: int) -> tuple[bytes, bytes, bytes]:
    m = n * 2 // 5
    body = b" a \n" * (m - 1) + b"-a \n+c\n"
    envelope = b"*** Begin Patch\n*** Update File: f.txt\n@@\n" + body + b"*** End Patch\n"
    return b"a\n" * n, envelope, f"--- a/f.txt\n+++ b/f.txt\n@@ -1,{m} +1,{m} @@\n".encode() + body


def _blocks(n: int) -> tuple[bytes, bytes, bytes]:
    data = b"".join(b"line %d\n" % i for i in range(n))
    at = range(n // 40, n, n // 20)
    blocks = b"".join(b"f.txt\n<<<<<<< SEARCH\nline %d\n=======\nLINE %d\n>>>>>>> REPLACE\n\n" % (i, i)
                      for i in at)
    unified = b"--- a/f.txt\n+++ b/f.txt\n" + b"".join(
        b"@@ -%d,3 +%d,3 @@\n line %d\n-line %d\n+LINE %d\n line %d\n" % (i, i, i - 1, i, i, i + 1) for i in at)
    return data, blocks, unified


def _time(fn: Callable[[], Any], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return median(samples)


def _ours(data: bytes, patch: bytes) -> Callable[[], Any]:
    from patcher.budget import work_budget
    from patcher.errors import PatchError
    from patcher.formats import detect, get_format, parse_patch
    from patcher.matching import apply_hunks

    parsed = parse_patch(patch, detect(patch))
    fmt = get_format(parsed.format)
    applier = fmt.apply_file if fmt is not None and fmt.apply_file is not None else apply_hunks
    edit = parsed.edits[0]

    def run() -> str:
        try:
            with work_budget():  # one call's budget, as patcher.stage gives each call
                applier(data, edit.hunks, path=edit.path)
            return "applies"
        except PatchError as exc:
            return exc.type

    return run


def _git(folder: str, unified: bytes) -> Callable[[], Any]:
    with open(os.path.join(folder, "p.diff"), "wb") as fh:
        fh.write(unified)

    def run() -> int:
        return subprocess.run(["git", "apply", "--check", "p.diff"], cwd=folder, capture_output=True).returncode

    return run


def section_matching(env: Any, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for case in ("near-miss context", "context at every position", "edit blocks, one file"):
        for scale in (1, 2, 4):
            n = BASE_LINES * scale
            if case == "near-miss context":
                data, patch = _near_miss(n)
                unified = patch
            else:
                data, patch, unified = (_blocks if case == "edit blocks, one file" else _everywhere)(n)
            folder = os.path.join(env.tmp, f"matching-{scale}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "f.txt"), "wb") as fh:
                fh.write(data)
            log(f"[matching] {case}, {scale}x ({n} lines)")
            ours = _ours(data, patch)
            outcome = ours()
            git = _git(folder, unified)
            git_rc = git()
            rows.append({"case": case, "scale": scale, "file_lines": n, "patch_bytes": len(patch),
                         "outcome": outcome, "median_s": _time(ours, rounds),
                         "git_rc": git_rc, "git_median_s": _time(git, rounds)})
    return {"rows": rows, "rounds": rounds}

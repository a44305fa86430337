"""Hotspots: cProfile over repeated in-process calls, reported per call.

For each profiled operation the report lists the functions with the largest
cumulative time per call (wrappers that only pass the call through are
dropped: anything within 2% of the whole), and the largest self time —
the evidence for what to fix, ranked.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import sys
from collections.abc import Callable
from typing import Any

from bench.env import ROOT

__all__ = ["profile_op", "profile_cli"]


def _short(key: tuple[str, int, str]) -> str:
    file, line, func = key
    if file == "~":
        return func
    for prefix in (ROOT + os.sep, *[p + os.sep for p in sys.path if p and "site-packages" in p]):
        if file.startswith(prefix):
            file = file[len(prefix):]
            break
    else:
        file = os.path.join("…", *file.split(os.sep)[-2:])
    return f"{file}:{line}({func})"


def _rank(prof: cProfile.Profile, ops: int, top: int) -> dict[str, Any]:
    st = pstats.Stats(prof)
    rows = []
    total = max((v[3] for v in st.stats.values()), default=0.0)  # type: ignore[attr-defined]
    for key, (cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"func": _short(key), "calls": nc / ops, "cum_ms": ct * 1000 / ops, "self_ms": tt * 1000 / ops})
    by_cum = [r for r in sorted(rows, key=lambda r: -r["cum_ms"]) if r["cum_ms"] < 0.98 * total * 1000 / ops]
    by_self = sorted(rows, key=lambda r: -r["self_ms"])
    return {"ops": ops, "total_ms": total * 1000 / ops, "by_cum": by_cum[:top], "by_self": by_self[:top]}


def profile_op(op: Callable[[int], Any], ops: int, *, top: int = 15, warmup: int = 1) -> dict[str, Any]:
    """Profile ``ops`` calls of ``op`` (after ``warmup`` unprofiled ones)."""
    for i in range(warmup):
        op(-1 - i)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(ops):
        op(i)
    prof.disable()
    return _rank(prof, ops, top)


def profile_cli(argv: list[str], *, top: int = 15) -> dict[str, Any]:
    """Profile one in-process run of the CLI's ``main`` (stdout discarded)."""
    from patcher.cli import main

    prof = cProfile.Profile()
    sink = io.TextIOWrapper(io.BytesIO())  # main() writes to sys.stdout.buffer
    with contextlib.redirect_stdout(sink), open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        prof.enable()
        try:
            main(argv)
        finally:
            prof.disable()
    return _rank(prof, 1, top)

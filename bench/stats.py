"""Summary statistics and the interleaved A B A B runner."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Series", "median", "p90", "interleave", "fmt_ms", "fmt_ratio"]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: Sequence[float]) -> float:
    """90th percentile, linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = 0.9 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Series:
    """Samples (seconds) of one contender, plus optional per-sample extras (e.g. maxrss)."""

    name: str
    samples: list[float] = field(default_factory=list)
    extras: list[dict[str, Any]] = field(default_factory=list)

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def p90(self) -> float:
        return p90(self.samples)

    def extra_max(self, key: str) -> Any:
        vals = [e[key] for e in self.extras if key in e]
        return max(vals) if vals else None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "n": len(self.samples), "median_s": self.median, "p90_s": self.p90,
                "samples_s": self.samples, "extras": self.extras}


#: A contender: called with the round number, returns (elapsed seconds, extras or None).
Op = Callable[[int], "tuple[float, dict[str, Any] | None]"]


def interleave(contenders: Sequence[tuple[str, Op]], rounds: int, *, warmup: int = 1,
               progress: Callable[[str], None] | None = None) -> dict[str, Series]:
    """Run every contender once per round, A B A B, rotating who goes first each round.

    Rotation keeps any drift (page cache, growing object store, thermal) from
    always favouring the same side.  ``warmup`` rounds run first and are
    discarded.  GC is collected before, and disabled during, each timed call.
    """
    out = {name: Series(name) for name, _ in contenders}
    n = len(contenders)
    for r in range(-warmup, rounds):
        shift = r % n if n else 0
        order = list(contenders[shift:]) + list(contenders[:shift])
        for name, op in order:
            gc.collect()
            gc.disable()
            try:
                elapsed, extra = op(r)
            finally:
                gc.enable()
            if r >= 0:
                out[name].samples.append(elapsed)
                if extra:
                    out[name].extras.append(extra)
        if progress is not None and r >= 0 and (r + 1) % max(1, rounds // 4) == 0:
            progress(f"  round {r + 1}/{rounds}")
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def fmt_ms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "–"
    ms = seconds * 1000
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def fmt_ratio(baseline: float, ours: float) -> str:
    """How many times faster ours is than the baseline (``0.5×`` means twice as slow)."""
    if not ours or ours != ours or baseline != baseline:
        return "–"
    r = baseline / ours
    return f"{r:.1f}×" if r >= 10 else f"{r:.2f}×"

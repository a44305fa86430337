"""Bounded line pairing: the kept lines of a loose match, and an error's ``closest`` hint (pure).

``difflib`` may compare every line of one side with every line of the other;
:func:`opcodes` bounds it (and pays from the call's work budget), and
:func:`closest` finds the region of a file most like a hunk's old lines
without counting every pair (:mod:`patcher.matching`, **Errors** and **Cost**).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from patcher.lines import Lines, line_text

__all__ = ["opcodes", "closest"]

_CLOSEST_LINES = 6
_DIFF_LIMIT = 40
_PAIRS = 40_000  # line pairs difflib compares in full (beyond: the common head and tail first)
_SCORE_PAIRS = 1_000_000  # (hunk line, file line) pairs an error's "closest" counts
_PAIR_COST = 8  # budget units per pair difflib may compare (a dict lookup in Python)
_HINT_LINES = 200  # lines a side that an error's diff compares in full


def opcodes(f: Lines, a: Sequence[Any], b: Sequence[Any], *,
             bound: bool = False) -> list[tuple[str, int, int, int, int]]:
    """``difflib``'s opcodes from ``a`` to ``b``, in bounded time.

    ``SequenceMatcher`` may compare every line of one side with every line of the
    other (20,000 equal lines: 400 million steps).  Up to :data:`_PAIRS` pairs
    (:data:`_HINT_LINES` lines a side for a hint, ``bound``) it runs on the whole;
    beyond, the common head and tail are paired first and it runs on what lies
    between -- which the call's budget pays for, or for a hint, on the first
    :data:`_HINT_LINES` lines of it (the rest is one replaced block).
    """
    from difflib import SequenceMatcher  # only inexact matches and hints need it

    head = tail = 0
    if len(a) * len(b) > (_HINT_LINES ** 2 if bound else _PAIRS):
        top = min(len(a), len(b))
        while head < top and a[head] == b[head]:
            head += 1
        while tail < top - head and a[-1 - tail] == b[-1 - tail]:
            tail += 1
        f.spend(head + tail)
    mid_a, mid_b = list(a[head:len(a) - tail]), list(b[head:len(b) - tail])
    rest: list[tuple[str, int, int, int, int]] = []
    if bound and len(mid_a) * len(mid_b) > _HINT_LINES ** 2:
        cut_a, cut_b = min(len(mid_a), _HINT_LINES), min(len(mid_b), _HINT_LINES)
        rest = [("replace", cut_a, len(mid_a), cut_b, len(mid_b))]
        mid_a, mid_b = mid_a[:cut_a], mid_b[:cut_b]
    f.spend(len(mid_a) * len(mid_b) * _PAIR_COST)
    ops = SequenceMatcher(None, mid_a, mid_b, autojunk=False).get_opcodes() + rest
    out = [("equal", 0, head, 0, head)] if head else []
    out += [(tag, a0 + head, a1 + head, b0 + head, b1 + head) for tag, a0, a1, b0, b1 in ops]
    if tail:
        out.append(("equal", len(a) - tail, len(a), len(b) - tail, len(b)))
    return out


def closest(f: Lines, seq: Sequence[bytes], ref: int) -> dict[str, Any] | None:
    """The window of ``len(seq)`` file lines sharing most lines with ``seq`` under ``strip``.

    Bounded: lines of ``seq`` are counted rarest first, up to :data:`_SCORE_PAIRS` (line of
    ``seq``, line of the file) pairs; lines too common to count (``a`` in a file of
    ``a``) are left out, and if none is left, the window at ``ref`` is taken when it
    shares a line.  The diff is :func:`_opcodes`' (bounded: a hint).
    """
    if not seq or not f.lines:
        return None
    want: dict[bytes, list[int]] = {}
    for k, line in enumerate(seq):
        want.setdefault(line.strip(), []).append(k)
    keys = f.keys("strip", False)
    last = max(len(f.lines) - len(seq), 0)
    from collections import Counter  # errors only

    f.spend(len(keys) * 2)
    counts = Counter(keys)
    pairs = 0
    for key in sorted(want, key=lambda x: len(want[x]) * counts[x]):
        pairs += len(want[key]) * counts[key]
        if pairs > _SCORE_PAIRS:
            del want[key]
    score: dict[int, int] = {}
    for i, key in enumerate(keys):
        for k in want.get(key, ()):
            start = i - k
            if 0 <= start <= last:
                score[start] = score.get(start, 0) + 1
    if not score:
        at = min(max(ref, 0), last)
        shared = sum(1 for x, y in zip(keys[at:at + len(seq)], seq) if x == y.strip())
        if not shared:
            return None
        score[at] = shared
    start = min(score, key=lambda p: (-score[p], abs(p - ref), p))
    found = f.lines[start : start + len(seq)]
    expected_text = [line_text(x) for x in seq]
    found_text = [line_text(x) for x in found]
    diff: list[str] = []
    for tag, a0, a1, b0, b1 in opcodes(f, expected_text, found_text, bound=True):
        if tag == "equal":
            diff.extend(" " + x for x in expected_text[a0:a1])
        else:
            diff.extend("-" + x for x in expected_text[a0:a1])
            diff.extend("+" + x for x in found_text[b0:b1])
    return {
        "line": start + 1,
        "lines": [line_text(x) for x in f.lines[start : start + _CLOSEST_LINES]],
        "diff": diff[:_DIFF_LIMIT],
    }

"""Applying hunks to one file's bytes (pure: no I/O).

The rules every context-based format shares (grades, where a hunk may match,
line endings by position, indentation, already applied, errors, cost) are
docs/FORMATS.md, "Matching"; the functions below cite them by name.  Hunks
are matched in order against the *original* file, each at or after the end
of the previous one's match, except a hunk without ``old_start`` found
nowhere there (:func:`_out_of_order`, as codex takes envelope chunks).  A
false "already applied" is a success with nothing changed, so what counts as
present is narrow.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal

from patcher.budget import WorkBudget, current_budget
from patcher.errors import AmbiguousMatch, ContextNotFound, PartiallyApplied
from patcher.grades import refuse_inexact
from patcher.hints import closest, opcodes
from patcher.indentation import LOOSE_INDENT_GRADES, indent_shift, shifted
from patcher.lines import Lines as _File
from patcher.lines import chomp, cr_eol_of, eol_of, find_all, has_lone_cr, line_text, split_lines
from patcher.lines import key_fn as _key_fn
from patcher.model import AppliedFile, Hunk

__all__ = ["GRADES", "apply_hunks", "split_lines", "chomp", "eol_of", "shown_lines", "capped_candidates"]

GRADES: tuple[str, ...] = ("exact", "rstrip", "strip", "punct")

_SHOWN = 20  # candidate lines an error lists (and how many there are in all)



def _dominant(lines: Sequence[bytes]) -> bytes:
    """``\\r\\n`` if more of ``lines`` end so than with a bare ``\\n``; ``b""`` if none ends."""
    ends = [eol_of(line) for line in lines]
    crlf, lf = ends.count(b"\r\n"), ends.count(b"\n")
    return b"" if crlf == lf == 0 else b"\r\n" if crlf > lf else b"\n"


@dataclass(frozen=True, slots=True)
class _Loc:
    """Where a line sequence was found: one position, or several (ambiguous) at ``grade``."""

    grade: str
    positions: tuple[int, ...]


def _locate(f: _File, seq: Sequence[bytes], *, agnostic: bool, lo: int, expected: int | None,
            starts: Sequence[int] | None, at_eof: bool, at_start: bool = False,
            grades: Sequence[str] = GRADES) -> _Loc | None:
    """Find the non-empty ``seq`` in ``f`` at or after ``lo`` (rules: module docstring)."""
    n, m = len(f.lines), len(seq)
    last = n - m
    if last < lo or (at_start and (lo > 0 or (at_eof and last != 0))):
        return None
    for grade in grades:
        fn = _key_fn(grade, agnostic)
        hkeys = [fn(line) for line in seq]
        if at_eof or at_start:
            pos = last if at_eof else 0
            floor = max(lo, min(starts)) if starts else lo
            if pos >= floor and f.match_at(grade, agnostic, pos, hkeys):
                return _Loc(grade, (pos,))
            continue
        # Fast path, and the rule "the stated position wins": O(hunk) when it matches.
        if expected is not None and starts is None and lo <= expected <= last and f.match_at(
                grade, agnostic, expected, hkeys):
            return _Loc(grade, (expected,))
        cands = f.scan(grade, agnostic, hkeys, lo)
        if not cands:
            continue
        if starts is not None:
            firsts = set()
            for start in starts:
                at = bisect_left(cands, start)
                if at < len(cands):
                    firsts.add(cands[at])
            if firsts:
                return _Loc(grade, tuple(sorted(firsts)))
            continue
        if expected is None:
            return _Loc(grade, tuple(cands))
        best = min(abs(p - expected) for p in cands)
        return _Loc(grade, tuple(p for p in cands if abs(p - expected) == best))
    return None


def _find_line(f: _File, line: bytes, lo: int) -> list[int]:
    """Positions ``>= lo`` of a scope line, at the strictest grade finding any (EOL ignored)."""
    if lo >= len(f.lines):
        return []
    for grade in GRADES:
        key = _key_fn(grade, True)(line)
        found = f.scan(grade, True, [key], lo)
        if found:
            return found
    return []


def _next_line(f: _File, line: bytes, lo: int) -> int | None:
    """``_find_line(f, line, lo)[0]``, found without listing the others."""
    for grade in GRADES:
        found = f.first(grade, True, _key_fn(grade, True)(line), lo)
        if found is not None:
            return found
    return None


def _resolve_scopes(f: _File, scopes: Sequence[bytes], lo: int) -> tuple[list[int], bytes | None]:
    """Positions just after the last scope line, one per occurrence of the first scope line.

    When no occurrence leads through every scope line, also returns the scope line not found.
    """
    starts: list[int] = []
    seen: set[int] = set()
    firsts = _find_line(f, scopes[0], lo)
    if not firsts:
        return [], scopes[0]
    missing: bytes | None = None
    for first in firsts:
        pos = first + 1
        for scope in scopes[1:]:
            found = _next_line(f, scope, pos)
            if found is None:
                missing = scope
                break
            pos = found + 1
        else:
            if pos not in seen:
                seen.add(pos)
                starts.append(pos)
    return starts, (missing if not starts else None)


@dataclass(frozen=True, slots=True)
class _Verdict:
    """How one hunk relates to the file: ``applies`` / ``present`` at ``pos``, or ``missing``."""

    state: Literal["applies", "present", "missing"]
    pos: int = 0
    grade: str = "exact"
    reason: str = ""


class _Failure(Exception):
    """Internal: a hunk cannot be placed; turned into a public error with details by the caller."""

    def __init__(self, kind: type[ContextNotFound | AmbiguousMatch], reason: str, **extra: Any) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.extra = extra


def _judge(f: _File, hunk: Hunk, lo: int, carry: int, shift: int = 0) -> _Verdict:
    """Decide whether ``hunk`` applies at or after ``lo``, is already present, or neither.

    ``shift``: the lines the earlier hunks judged to apply would add (were they there already).

    Raises:
        _Failure: a scope is missing, an insertion point is outside the file, or
            the old side is ambiguous (and the new side not found more strictly).
    """
    starts: list[int] | None = None
    if hunk.scopes:
        starts, missing_scope = _resolve_scopes(f, hunk.scopes, lo)
        if missing_scope is not None or not starts:
            shown = line_text(missing_scope or b"")
            raise _Failure(ContextNotFound, f"scope '{shown}' not found (tried {', '.join(GRADES)})", scope=shown)
    if not hunk.old_lines:
        return _Verdict("applies", _insertion_point(f, hunk, lo, carry, starts))
    expected = None if hunk.old_start is None else hunk.old_start - 1 + carry
    kw: dict[str, Any] = {"agnostic": hunk.eol_agnostic, "lo": lo, "expected": expected, "starts": starts,
                          "at_eof": hunk.at_eof}
    if not (hunk.prefer_start or hunk.prefer_eof):
        return _judge_at(f, hunk, kw, shift)
    # Where git would anchor it first: there it applies, or is present, before anywhere
    # else — unless elsewhere it matches more strictly (an exact match at the stated line
    # beats a whitespace-fuzzy one at the end of the file).
    anchored = _judge_at(f, hunk, {**kw, "at_eof": hunk.at_eof or hunk.prefer_eof,
                                   "at_start": hunk.prefer_start}, shift)
    if anchored.state != "missing" and anchored.grade == GRADES[0] and (
            anchored.state == "applies" or kw["expected"] in (None, anchored.pos)):
        return anchored
    try:
        loose = _judge_at(f, hunk, kw, shift)
    except _Failure:
        if anchored.state != "missing":
            return anchored  # ambiguous elsewhere, placed by its anchor
        raise
    if anchored.state == "missing" or (
            loose.state != "missing" and GRADES.index(loose.grade) < GRADES.index(anchored.grade)):
        return loose
    if (anchored.state == "present" and loose.state == "applies" and loose.grade == GRADES[0]
            and loose.pos == kw["expected"] and anchored.pos != kw["expected"]):
        return loose  # the old lines exactly at the stated line: not the anchor's copy elsewhere
    return anchored


def _judge_at(f: _File, hunk: Hunk, kw: dict[str, Any], shift: int) -> _Verdict:
    """:func:`_judge` for a hunk with an old side, placed by ``kw`` (:func:`_locate`'s arguments)."""
    old = _locate(f, hunk.old_lines, **kw)
    if old is not None and old.grade == "exact" and len(old.positions) == 1:
        # Inside the new lines, applied before?  An insertion whose added lines end with a
        # copy of its context ('' / 'x = 1' / '' / 'class C:' for '' / 'class C:') leaves
        # the old lines once in the file, within the block it inserted: no second copy.
        pos, extra = old.positions[0], len(hunk.new_lines) - len(hunk.old_lines)
        if extra > 0:
            fn = _key_fn(GRADES[0], hunk.eol_agnostic)
            keys = [fn(line) for line in hunk.new_lines]
            old_keys = [fn(line) for line in hunk.old_lines]
            # Only when the new lines hold the old ones at one place (a blank line added
            # before a blank line holds it at two: which one is the context?), and add a line
            # that is none of them (added lines that repeat them -- a blank after a blank,
            # 'a' x4 made 'a' x5, a CSV row duplicated -- stand around the old lines before
            # any application too).  Such hunks are applied, as git applies them.
            f.spend((len(keys) + len(old_keys)) * 4)
            inside = [d for d in find_all(keys, old_keys) if d <= extra][:2]
            begin = pos - inside[0] if len(inside) == 1 else -1
            if kw["expected"] is not None and begin != kw["expected"]:
                # With line numbers, once applied its new lines stand at its stated line
                # (earlier hunks' offsets carried): a copy elsewhere proves nothing.
                begin = -1
            if (begin >= kw["lo"] and set(keys) - set(old_keys)
                    and f.match_at(GRADES[0], hunk.eol_agnostic, begin, keys)):
                return _Verdict("present", begin, GRADES[0])
        return _Verdict("applies", pos, "exact")
    new: _Loc | None = None
    if hunk.new_lines:
        # The new side counts only if found more strictly than the old side ...
        stricter = GRADES if old is None else GRADES[: GRADES.index(old.grade)]
        if old is not None:
            # ... and where the old side was found: a change re-applied (say, of whitespace)
            # left the new lines in its place, not somewhere else in the file.
            at = (len(f.lines) - len(hunk.new_lines),) if kw["at_eof"] else old.positions
            if not kw["at_eof"] and kw["expected"] is not None:
                # ... or at its stated line (a change sent again, whose old lines now match
                # only loosely one line away: a blank line, a brace re-indented).
                at = (*at, kw["expected"])
            new = _at_positions(f, hunk.new_lines, at, stricter, hunk.eol_agnostic)
        elif set(hunk.old_lines) & set(hunk.new_lines):
            new = _locate(f, hunk.new_lines, **kw, grades=stricter)
        elif kw["expected"] is not None:
            # No line kept (no context): the new lines alone prove little (one
            # 'return None' is like another), so only the stated position counts
            # (in the new file's lines too, should the earlier hunks be there).
            at = (kw["expected"], kw["expected"] + shift)
            if kw["at_eof"]:
                # A side without a final newline ends the file: there, and only if that is
                # also the stated position (a symlink retargeted, a one-line file changed).
                end = len(f.lines) - len(hunk.new_lines)
                at = (end,) if end in at else ()
            new = _at_positions(f, hunk.new_lines, at, stricter, hunk.eol_agnostic) if at else None
    if new is not None:
        return _Verdict("present", new.positions[0], new.grade)
    if old is None:
        where = "at end of file " if kw["at_eof"] else ""
        return _Verdict("missing", reason=f"context not found {where}(tried {', '.join(GRADES)})")
    if len(old.positions) > 1:
        raise _Failure(AmbiguousMatch, f"context matches at lines {shown_lines([p + 1 for p in old.positions])} "
                       f"(grade {old.grade}); add context to make it unique",
                       **capped_candidates([p + 1 for p in old.positions]),
                       grade_tried=list(GRADES[: GRADES.index(old.grade) + 1]))
    return _Verdict("applies", old.positions[0], old.grade)


def shown_lines(lines: Sequence[int]) -> str:
    """Line numbers for a message: the first :data:`_SHOWN`, then how many more."""
    text = ", ".join(map(str, lines[:_SHOWN]))
    return text if len(lines) <= _SHOWN else f"{text} and {len(lines) - _SHOWN} more"


def capped_candidates(lines: Sequence[int]) -> dict[str, Any]:
    """An error's ``candidates`` (the first :data:`_SHOWN` lines) and ``candidate_count`` (all of them)."""
    return {"candidates": list(lines[:_SHOWN]), "candidate_count": len(lines)}


def _at_positions(f: _File, seq: Sequence[bytes], positions: Sequence[int], grades: Sequence[str],
                  agnostic: bool) -> _Loc | None:
    """``seq`` at one of ``positions``, at the strictest of ``grades`` that has it there.

    Many positions (an ambiguous old side found at every line) are looked up among
    ``seq``'s starts found by one search, not compared one by one.
    """
    for grade in grades:
        fn = _key_fn(grade, agnostic)
        hkeys = [fn(line) for line in seq]
        if hkeys and len(positions) * len(hkeys) > 4 * (len(f.lines) + len(hkeys)):
            starts = set(f.scan(grade, agnostic, hkeys, 0))
            hits = tuple(p for p in positions if p in starts)
        else:
            hits = tuple(p for p in positions if f.match_at(grade, agnostic, p, hkeys))
        if hits:
            return _Loc(grade, hits)
    return None


def _insertion_point(f: _File, hunk: Hunk, lo: int, carry: int, starts: list[int] | None) -> int:
    n = len(f.lines)
    if starts is not None:
        if hunk.at_eof:
            return n
        if len(starts) > 1:
            raise _Failure(AmbiguousMatch, "insertion point is ambiguous: the scope occurs at several places",
                           **capped_candidates(starts), grade_tried=list(GRADES))
        return max(starts[0], lo)
    if hunk.old_start is None or hunk.at_eof:
        return n
    pos = hunk.old_start + carry
    if not lo <= pos <= n:
        raise _Failure(ContextNotFound, f"insertion after line {hunk.old_start} is outside the file ({n} lines)")
    return pos


def _kept_lines(f: _File, hunk: Hunk, old: list[bytes], new: list[bytes]) -> dict[int, int]:
    """Lines the hunk keeps: new line index -> old line index, as the format says, else paired by content."""
    if hunk.kept is not None:
        return dict(hunk.kept)
    kept: dict[int, int] = {}
    for tag, a0, a1, b0, _b1 in opcodes(f, old, new):
        if tag == "equal":
            for k in range(a1 - a0):
                kept[b0 + k] = a0 + k
    return kept


def _new_block(f: _File, hunk: Hunk, pos: int, grade: str, index: int = 0) -> list[bytes]:
    """The lines that replace the matched old lines (see **Writing** in the module docstring).

    Raises:
        IndentationMismatch: matched ignoring indentation, by unlike deltas.
    """
    if grade == "exact" and not hunk.eol_agnostic:
        return list(hunk.new_lines)
    m = len(hunk.old_lines)
    matched = f.lines[pos : pos + m]
    norm: Callable[[bytes], bytes] = chomp if hunk.eol_agnostic else bytes
    kept = _kept_lines(f, hunk, [norm(x) for x in hunk.old_lines], [norm(x) for x in hunk.new_lines])
    sign, ws = indent_shift(f, hunk, pos, index) if grade in LOOSE_INDENT_GRADES else (0, b"")
    ending_of = cr_eol_of if f.cr_breaks else eol_of
    eol = f.eol
    patch_eol = region_eol = b""
    if not hunk.eol_agnostic:
        patch_eol, region_eol = _dominant(hunk.old_lines), _dominant(matched)
    # Line endings by position (agnostic hunks): a replacing line takes the ending of the
    # old line it replaces (the k-th added for the k-th removed, between two kept lines),
    # an inserted one that of the line before it (the line after it at the start of a file).
    removed_at: dict[int, int] = {}
    if hunk.eol_agnostic:
        pairs = sorted(kept.items())
        prev_new = prev_old = -1
        for nj, oj in [*pairs, (len(hunk.new_lines), m)]:
            for k in range(nj - prev_new - 1):
                if prev_old + 1 + k < oj:
                    removed_at[prev_new + 1 + k] = prev_old + 1 + k
            prev_new, prev_old = nj, oj
    out: list[bytes] = []
    for j, line in enumerate(hunk.new_lines):
        if j in kept:
            out.append(matched[kept[j]])
            continue
        line = shifted(line, sign, ws, f, hunk, index)
        if hunk.eol_agnostic:
            if j in removed_at:
                ending = ending_of(matched[removed_at[j]]) or eol
            elif out:
                ending = ending_of(out[-1]) or eol
            elif pos > 0:
                ending = ending_of(f.lines[pos - 1]) or eol
            elif pos + m < len(f.lines) or m:
                ending = ending_of((matched or f.lines[pos:pos + 1])[0]) or eol
            else:
                ending = eol
            out.append(chomp(line) + ending)
        elif patch_eol and region_eol and patch_eol != region_eol and eol_of(line) == patch_eol:
            out.append(line[: -len(patch_eol)] + region_eol)
        else:
            out.append(line)
    for k in range(len(out) - 1):
        if not ending_of(out[k]):
            out[k] += eol
    n = len(f.lines)
    if hunk.eol_agnostic and out and pos + m == n and n and not ending_of(f.lines[-1]):
        out[-1] = chomp(out[-1])
    return out


def _span(hunk: Hunk, verdict: _Verdict) -> tuple[int, int]:
    """The file lines a planned hunk stands on: ``(start, end)``."""
    return verdict.pos, verdict.pos + len(hunk.old_lines if verdict.state == "applies" else hunk.new_lines)


def _out_of_order(f: _File, hunk: Hunk, spans: list[tuple[int, int]]) -> _Verdict | None:
    """Where a hunk without line numbers stands before the earlier hunks' matches, if anywhere.

    Taken (as codex takes it) only when it is found once in the whole file and its
    lines overlap no earlier hunk's (``spans``, sorted, their lines; an insertion
    must not fall strictly inside one); else ``None`` (the caller's error stands).
    """
    try:
        verdict = _judge(f, hunk, 0, 0)
    except _Failure:
        return None
    if verdict.state == "missing":
        return None
    start, end = _span(hunk, verdict)
    at = bisect_left(spans, (start, start))
    # The spans are disjoint: only the one before and those starting inside can overlap.
    neighbours = spans[max(at - 1, 0):at]
    while at < len(spans) and spans[at][0] <= end:
        neighbours.append(spans[at])
        at += 1
    for o_start, o_end in neighbours:
        if (start < o_end and o_start < end) or (start == end and o_start < start < o_end) \
                or (o_start == o_end and start < o_start < end):
            return None
    return verdict


def _render(f: _File, plan: Sequence[tuple[Hunk, _Verdict, int]]) -> bytes:
    """The new content: the file's unchanged runs as byte ranges of ``f.data``, the new blocks between.

    Memory is what bounds a big file here: joining a list of every line costs
    a buffer record per line (≈ 80 bytes each, more than the lines of a
    100 MiB file hold), so unchanged runs are sliced from the file's bytes by
    their lengths, and ``f``'s lines are dropped before the one join.
    """
    view = memoryview(f.data)
    pieces: list[bytes | memoryview] = []
    ends_line = True  # what is emitted so far ends with "\n" (or is nothing)

    def emit(piece: bytes | memoryview) -> None:
        # Only the old last line can lack '\n'; if anything now follows it, terminate it.
        nonlocal ends_line
        if not piece:
            return
        if not ends_line:
            pieces.append(f.eol)
        pieces.append(piece)
        ends_line = piece[-1:] == b"\n" or f.cr_breaks and piece[-1:] == b"\r"

    lines = f.lines
    walk = iter(lines)  # one pass over the lines for all hunks (islice from 0 per hunk: O(hunks x file))
    prev = off = 0
    for hunk, verdict, index in plan:
        run = sum(map(len, islice(walk, verdict.pos - prev)))
        emit(view[off:off + run])
        emit(b"".join(_new_block(f, hunk, verdict.pos, verdict.grade, index)))
        prev = verdict.pos + len(hunk.old_lines)
        off += run + sum(map(len, islice(walk, len(hunk.old_lines))))
    emit(view[off:])
    del lines
    f.lines, f.keys_cache = [], {}  # the caller is done with them: freed before the join
    return b"".join(pieces)


def _error(f: _File, hunk: Hunk, index: int, path: str, lo: int, expected: int | None,
           failure: _Failure) -> ContextNotFound | AmbiguousMatch:
    details: dict[str, Any] = {"path": path, "hunk": index + 1, "hunk_header": hunk.header,
                               "expected": "\n".join(line_text(x) for x in hunk.old_lines[:3]), "grade_tried": list(GRADES)}
    details.update(failure.extra)
    details["closest"] = closest(f, hunk.old_lines, lo if expected is None else expected)
    message = f"hunk {index + 1} of '{path}' does not apply: {failure.reason}"
    if failure.kind is ContextNotFound and lo > 0 and hunk.old_lines:
        earlier = _locate(f, hunk.old_lines, agnostic=hunk.eol_agnostic, lo=0, expected=None, starts=None,
                          at_eof=False)
        if earlier is not None and earlier.positions[0] < lo:
            # Found, but before the previous hunk's match: hunks go in file order, without overlap.
            line = earlier.positions[0] + 1
            details["found_before_previous_hunk"] = line
            message += (f"; its context is at line {line}, before where hunk {index} matched "
                        f"(hunks must be in file order, without overlap)")
    return failure.kind(message, details=details)


def apply_hunks(original: bytes, hunks: Sequence[Hunk], *, path: str,
                budget: WorkBudget | None = None) -> AppliedFile:
    """Apply ``hunks`` (in order) to ``original`` by the rules of the module docstring.

    ``path`` is used only in messages and error details.  Returns the new
    content with the grade each hunk matched at, or the original content with
    ``already_applied=True`` when every hunk is already present.

    Raises:
        ContextNotFound: a hunk (or one of its scopes) is neither applicable nor present.
        AmbiguousMatch: a hunk matches in several places equally well.
        PartiallyApplied: some hunks are present, the others still apply.
        TooLarge: matching would cost more than the call's work budget
            (``budget``, already allowed for this file; by default
            :func:`patcher.budget.current_budget`, allowed here).
    """
    if budget is None:
        budget = current_budget()
        budget.allow(original.count(b"\n") + 1 + sum(len(h.old_lines) + len(h.new_lines) for h in hunks))
    try:
        return _apply(_File(original, budget, path), original, hunks, path)
    except ContextNotFound as exc:
        # A file that uses a lone CR as a line break ('two\rthree'): its lines as codex
        # reads them.  Only for hunks without line endings of their own, and only when
        # the lines as git reads them (split at LF) did not match.
        if not (hunks and all(h.eol_agnostic for h in hunks) and has_lone_cr(original)):
            raise
        first = exc
    try:
        return _apply(_File(original, budget, path, cr_breaks=True), original, hunks, path)
    except ContextNotFound:
        raise first from None


def _apply(f: _File, original: bytes, hunks: Sequence[Hunk], path: str) -> AppliedFile:
    """:func:`apply_hunks` on ``f``, the lines of ``original``."""
    plan: list[tuple[Hunk, _Verdict]] = []
    spans: list[tuple[int, int]] = []  # the lines each planned hunk stands on, sorted
    lo = carry = shift = 0
    for index, hunk in enumerate(hunks):
        expected = None if hunk.old_start is None else hunk.old_start - 1 + carry
        try:
            verdict = _judge(f, hunk, lo, carry, shift)
        except _Failure as failure:
            raise _error(f, hunk, index, path, lo, expected, failure) from None
        placed = verdict
        if verdict.state == "missing":
            earlier = _out_of_order(f, hunk, spans) if hunk.old_start is None and lo > 0 else None
            if earlier is None:
                raise _error(f, hunk, index, path, lo, expected, _Failure(ContextNotFound, verdict.reason))
            placed = earlier
        plan.append((hunk, placed))
        insort(spans, _span(hunk, placed))
        if placed.state == "applies":
            shift += len(hunk.new_lines) - len(hunk.old_lines)
        if placed is not verdict:
            continue  # placed before an earlier hunk: where the next one may start stays
        size = len(hunk.old_lines if verdict.state == "applies" else hunk.new_lines)
        lo = verdict.pos + size
        if hunk.old_start is not None and hunk.old_lines:
            carry = verdict.pos - (hunk.old_start - 1)
            if verdict.state == "present":
                carry += len(hunk.new_lines) - len(hunk.old_lines)
    grades = tuple(v.grade for _, v in plan)
    present = [i + 1 for i, (_, v) in enumerate(plan) if v.state == "present"]
    if not present:
        refuse_inexact(path, grades, range(len(plan)))
        order = sorted(range(len(plan)), key=lambda i: (plan[i][1].pos, len(plan[i][0].old_lines) > 0, i))
        return AppliedFile(content=_render(f, [(*plan[i], i) for i in order]), grades=grades)
    if len(present) == len(plan):
        return AppliedFile(content=original, grades=grades, already_applied=True)
    missing = [i + 1 for i, (_, v) in enumerate(plan) if v.state == "applies"]
    raise PartiallyApplied(f"patch is partially applied to '{path}': hunks {', '.join(map(str, present))} "
                           f"already present, hunks {', '.join(map(str, missing))} not",
                           details={"path": path, "applied_hunks": present, "missing_hunks": missing})

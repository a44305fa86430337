"""A file's lines, their comparison keys per grade, and linear search over them (pure: no I/O).

Search is linear in the file and the sequence, never a rescan per start
position (docs/FORMATS.md, "Bounded work"): ``list.index`` in C for a few
searches; once a grade's searches walked the file twice, an index (key →
sorted positions) through the sequence's rarest line; and one
Knuth-Morris-Pratt pass when comparing at the starts would cost more than a
few passes.  Every step is paid for from the call's :class:`patcher.budget.WorkBudget`.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from patcher.budget import WorkBudget

__all__ = ["Lines", "split_lines", "chomp", "line_text", "eol_of", "dominant_eol", "key_fn", "find_all", "has_lone_cr", "cr_chomp",
           "cr_eol_of"]

_PUNCT_TABLE = str.maketrans(
    {
        **dict.fromkeys([*range(0x2010, 0x2016), 0x2212], "-"),
        **dict.fromkeys([0x2018, 0x2019, 0x201A, 0x201B], "'"),
        **dict.fromkeys([0x201C, 0x201D, 0x201E, 0x201F], '"'),
        **dict.fromkeys([0x00A0, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000], " "),
    }
)

# What a step costs (budget units), by where it runs: a line walked or compared in C is one.
_SPLIT_COST = 2  # per line split (and later joined again)
_KEY_COST = {"exact": 1, "rstrip": 2, "strip": 2, "punct": 8}  # per line keyed
_INDEX_COST = 4  # per line indexed (a Python loop)
_KMP_COST = 4  # per line of a Knuth-Morris-Pratt pass (a Python loop)
_VERIFY_PASSES = 4  # comparing at candidate starts may cost this many passes before KMP takes over

_LINE = re.compile(rb"[^\n]*\n|[^\n]+\Z")
_CR_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)|[^\r\n]+\Z")


def dominant_eol(data: bytes) -> bytes:
    """``\\r\\n`` if more lines of ``data`` end so than with a bare ``\\n``, else ``\\n``."""
    crlf = data.count(b"\r\n")
    return b"\r\n" if crlf > data.count(b"\n") - crlf else b"\n"


def has_lone_cr(data: bytes) -> bool:
    """Whether ``data`` holds a ``\r`` that is not part of a ``\r\n``."""
    return data.count(b"\r") != data.count(b"\r\n")


def cr_chomp(line: bytes) -> bytes:
    """``line`` without its terminator, a lone ``\r`` included (lines split at it)."""
    return line[:-1] if line.endswith(b"\r") else chomp(line)


def cr_eol_of(line: bytes) -> bytes:
    """The terminator of ``line``, a lone ``\r`` included."""
    return b"\r" if line.endswith(b"\r") else eol_of(line)


def split_lines(data: bytes) -> list[bytes]:
    """Split ``data`` into lines, each keeping its ``\\n``; a lone ``\\r`` does not break a line.

    One pass that makes each line once (``split`` and then appending the
    ``\\n`` held two copies of every line at the peak): ``bytes.splitlines``
    when every ``\\r`` is part of a ``\\r\\n`` (it also breaks at a lone
    ``\\r``), a regular expression (three times slower) otherwise.
    """
    cr = data.count(b"\r")
    if not cr or cr == data.count(b"\r\n"):
        return data.splitlines(keepends=True)
    return _LINE.findall(data)


def chomp(line: bytes) -> bytes:
    """``line`` without its terminator (``\\r\\n`` or ``\\n``)."""
    return line[:-2] if line.endswith(b"\r\n") else line[:-1] if line.endswith(b"\n") else line


def line_text(line: bytes) -> str:
    """``line`` without its terminator, as text for a message (undecodable bytes replaced)."""
    return chomp(line).decode("utf-8", "replace")


def eol_of(line: bytes) -> bytes:
    """The terminator ``line`` ends with (``b""`` for none)."""
    return b"\r\n" if line.endswith(b"\r\n") else b"\n" if line.endswith(b"\n") else b""


def _punct(line: bytes) -> str:
    return line.decode("utf-8", "replace").strip().translate(_PUNCT_TABLE).strip()


def _identity(line: bytes) -> bytes:
    return line


def key_fn(grade: str, agnostic: bool) -> Callable[[bytes], Any]:
    """The comparison key of a line at ``grade`` (``agnostic``: ``exact`` ignores the terminator)."""
    if grade == "exact":
        return chomp if agnostic else _identity
    if grade == "rstrip":
        return bytes.rstrip
    if grade == "strip":
        return bytes.strip
    return _punct


def _chomped(data: bytes) -> list[bytes]:
    """``[chomp(x) for x in split_lines(data)]``, in C: ``\\r\\n`` ends a line only where ``\\n`` does."""
    keys = data.replace(b"\r\n", b"\n").split(b"\n")
    keys.pop()  # after the last '\n' (b'' when the data ends with one), or the unterminated last line
    if data and not data.endswith(b"\n"):
        keys.append(data[data.rfind(b"\n") + 1:])
    return keys


def find_all(keys: Sequence[Any], pattern: Sequence[Any], lo: int = 0) -> list[int]:
    """Every start ``>= lo`` of ``pattern`` (not empty) in ``keys``: Knuth-Morris-Pratt, O(len(keys) + len(pattern))."""
    m = len(pattern)
    fail = [0] * m
    k = 0
    for i in range(1, m):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    found: list[int] = []
    k = 0
    for i in range(lo, len(keys)):
        key = keys[i]
        while k and key != pattern[k]:
            k = fail[k - 1]
        if key == pattern[k]:
            k += 1
            if k == m:
                found.append(i - m + 1)
                k = fail[k - 1]
    return found


class Lines:
    """A file's lines plus per-grade keys and indexes, made when a search first needs them."""

    def __init__(self, data: bytes, budget: WorkBudget, path: str, *, cr_breaks: bool = False) -> None:
        self.data = data
        self.budget = budget
        self.path = path
        #: A lone ``\r`` ends a line too (a file that uses it as a line break: :mod:`patcher.matching`).
        self.cr_breaks = cr_breaks
        self.lines = _CR_LINE.findall(data) if cr_breaks else split_lines(data)
        budget.spend(len(self.lines) * _SPLIT_COST, path)
        self.keys_cache: dict[tuple[str, bool], list[Any]] = {}
        if cr_breaks:
            self.keys_cache[("exact", True)] = [cr_chomp(line) for line in self.lines]
        self._index: dict[tuple[str, bool], dict[Any, list[int]]] = {}
        self._walked: dict[tuple[str, bool], int] = {}  # lines walked by searches, per grade
        self._eol: bytes | None = None

    @property
    def eol(self) -> bytes:
        """The file's dominant terminator: ``\\r\\n`` if more lines end so than with a bare ``\\n``."""
        if self._eol is None:
            self._eol = dominant_eol(self.data)
        return self._eol

    def spend(self, steps: int) -> None:
        self.budget.spend(steps, self.path)

    @staticmethod
    def _slot(grade: str, agnostic: bool) -> tuple[str, bool]:
        return grade, agnostic if grade == "exact" else False

    def keys(self, grade: str, agnostic: bool) -> list[Any]:
        """Every line's key at ``grade``."""
        if grade == "exact" and not agnostic:
            return self.lines
        slot = self._slot(grade, agnostic)
        keys = self.keys_cache.get(slot)
        if keys is None:
            self.spend(len(self.lines) * _KEY_COST[grade])
            if grade == "exact":
                keys = _chomped(self.data)
            else:
                keys = list(map(key_fn(grade, agnostic), self.lines))
            self.keys_cache[slot] = keys
        return keys

    def match_at(self, grade: str, agnostic: bool, pos: int, hkeys: list[Any]) -> bool:
        """Whether ``hkeys`` are the keys of the lines from ``pos``."""
        end = pos + len(hkeys)
        if pos < 0 or end > len(self.lines):
            return False
        self.spend(len(hkeys))
        cached = self.lines if grade == "exact" and not agnostic else self.keys_cache.get(self._slot(grade, agnostic))
        if cached is not None:
            return cached[pos:end] == hkeys
        fn = key_fn(grade, agnostic)
        return all(fn(self.lines[pos + k]) == hkeys[k] for k in range(len(hkeys)))

    def _indexed(self, grade: str, agnostic: bool, keys: list[Any]) -> dict[Any, list[int]] | None:
        """The grade's index, made once its searches have walked the file twice."""
        slot = self._slot(grade, agnostic)
        index = self._index.get(slot)
        if index is None and self._walked.get(slot, 0) > 2 * len(keys):
            self.spend(len(keys) * _INDEX_COST)
            index = {}
            for i, key in enumerate(keys):
                at = index.get(key)
                if at is None:
                    index[key] = [i]
                else:
                    at.append(i)
            self._index[slot] = index
        return index

    def _walk(self, grade: str, agnostic: bool, steps: int) -> None:
        slot = self._slot(grade, agnostic)
        self._walked[slot] = self._walked.get(slot, 0) + steps
        self.spend(steps)

    def _kmp(self, keys: list[Any], hkeys: list[Any], lo: int) -> list[int]:
        self.spend((len(keys) - lo + len(hkeys)) * _KMP_COST)
        return find_all(keys, hkeys, lo)

    def scan(self, grade: str, agnostic: bool, hkeys: list[Any], lo: int) -> list[int]:
        """Every start position ``>= lo`` where ``hkeys`` (not empty) matches, in order."""
        keys = self.keys(grade, agnostic)
        n, m = len(keys), len(hkeys)
        last = n - m
        if last < lo:
            return []
        allowed = _VERIFY_PASSES * (n + m)  # comparing at starts beyond this: one KMP pass instead
        index = self._indexed(grade, agnostic, keys)
        if index is not None:
            rarest: list[int] | None = None
            offset = 0
            for k, key in enumerate(hkeys):
                at = index.get(key)
                if at is None:
                    self.spend(k + 1)
                    return []
                if rarest is None or len(at) < len(rarest):
                    rarest, offset = at, k
            self.spend(m)
            assert rarest is not None
            a, b = bisect_left(rarest, lo + offset), bisect_right(rarest, last + offset)
            if (b - a) * m > allowed:
                return self._kmp(keys, hkeys, lo)
            self.spend((b - a) * m)
            return [p - offset for p in rarest[a:b] if keys[p - offset:p - offset + m] == hkeys]
        found: list[int] = []
        pos = lo
        first = hkeys[0]
        compared = 0
        while pos <= last:
            try:
                hit = keys.index(first, pos, last + 1)
            except ValueError:
                self._walk(grade, agnostic, last + 1 - pos)
                break
            self._walk(grade, agnostic, hit + 1 - pos)
            compared += m
            if compared > allowed:
                return found + self._kmp(keys, hkeys, hit)
            self.spend(m)
            if keys[hit:hit + m] == hkeys:
                found.append(hit)
            pos = hit + 1
        return found

    def first(self, grade: str, agnostic: bool, key: Any, lo: int) -> int | None:
        """The first position ``>= lo`` of a line whose key is ``key``."""
        keys = self.keys(grade, agnostic)
        if lo >= len(keys):
            return None
        index = self._indexed(grade, agnostic, keys)
        if index is not None:
            at = index.get(key)
            self.spend(1)
            if at is None:
                return None
            i = bisect_left(at, lo)
            return at[i] if i < len(at) else None
        try:
            pos = keys.index(key, lo)
        except ValueError:
            self._walk(grade, agnostic, len(keys) - lo)
            return None
        self._walk(grade, agnostic, pos + 1 - lo)
        return pos

"""Search/replace edit blocks and ``str_replace`` JSON edits (pure: no I/O).

Two formats that name a file and the text to replace in it, without line
numbers, and one rule for applying them (:func:`apply_sequential`: each edit
to the result of the one before, each matching exactly once).  Syntax and
rules: docs/FORMATS.md, "`search_replace`", "`str_replace`" and "How edit
blocks and `str_replace` apply".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


from cas.errors import clip
from receipts import jsonio
from patcher.formats.detection import json_items, looks_search_replace, looks_str_replace
from patcher.errors import AmbiguousMatch, ContextNotFound, IndentationMismatch, ParseError, PartiallyApplied
from patcher.formats import Format
from patcher.budget import current_budget
from patcher.grades import STRICT, refuse_inexact
from patcher.indentation import LOOSE_INDENT_GRADES
from patcher.lines import dominant_eol
from patcher.matching import apply_hunks, capped_candidates, chomp, shown_lines, split_lines
from patcher.model import AppliedFile, FileEdit, Hunk, Patch

__all__ = ["SEARCH_REPLACE", "STR_REPLACE", "looks_search_replace", "parse_search_replace", "looks_str_replace",
           "parse_str_replace", "apply_sequential", "FORMATS"]

SEARCH_REPLACE = "search_replace"
STR_REPLACE = "str_replace"

_SEARCH = re.compile(rb"<{5,9} SEARCH>?[ \t]*\r?")
_DIVIDER = re.compile(rb"={5,9}[ \t]*\r?")
_REPLACE = re.compile(rb">{5,9} REPLACE[ \t]*\r?")
_FENCE = re.compile(rb"\s*(```|~~~).*")

_SHOWN = 20  # line numbers an ambiguous match lists (patcher.matching's)
_STR_KEYS = {"path", "old", "new", "old_str", "new_str"}


# --------------------------------------------------------------------------- search/replace blocks


def _error(message: str, **details: Any) -> ParseError:
    if "line" in details:
        message = f"{message} (line {details['line']})"
    return ParseError(message, details=details)


def _file_name(lines: list[bytes], lo: int, hi: int) -> str | None:
    """The file name on the last meaningful line in ``lines[lo:hi]`` (``None``: none there)."""
    for k in range(hi - 1, lo - 1, -1):
        text = chomp(lines[k]).strip()
        if not text or _FENCE.fullmatch(text):
            continue
        name = text.strip(b"`*#").strip()
        if name.endswith(b":"):
            name = name[:-1].strip()
        name = name.strip(b"`*").strip()
        if not name:
            continue
        return name.decode("utf-8", "surrogateescape")
    return None


def parse_search_replace(data: bytes) -> Patch:
    """Parse search/replace blocks into ``Patch(format="search_replace")`` (module docstring).

    Raises:
        ParseError: a block without a file name, unterminated, with no or several
            ``=======`` lines; an empty SEARCH mixed with other blocks; no block at all.
    """
    lines = split_lines(data)
    blocks: list[tuple[str, int, list[bytes], list[bytes]]] = []  # path, line, search, replace
    path: str | None = None
    i = 0
    after_last = 0
    while i < len(lines):
        if not _SEARCH.fullmatch(lines[i].rstrip(b"\n")):
            if _REPLACE.fullmatch(lines[i].rstrip(b"\n")):
                # Outside every block: a block's REPLACE text that holds the marker line
                # itself ended there, and the rest of that text would be dropped unseen.
                raise _error("a '>>>>>>> REPLACE' line outside any block: does a block's "
                             "REPLACE text hold that marker?", line=i + 1)
            i += 1
            continue
        start = i + 1
        name = _file_name(lines, after_last, i)
        if name is not None:
            path = name
        if path is None:
            raise _error("search/replace block has no file name before it", line=start)
        j = i + 1
        dividers: list[int] = []
        end = None
        while j < len(lines):
            text = lines[j].rstrip(b"\n")
            if _REPLACE.fullmatch(text):
                end = j
                break
            if _SEARCH.fullmatch(text):
                break
            if _DIVIDER.fullmatch(text):
                dividers.append(j)
            j += 1
        if end is None:
            raise _error(f"search/replace block for '{path}' is not closed by '>>>>>>> REPLACE'",
                         line=start, path=path)
        if len(dividers) != 1:
            what = "no '=======' line" if not dividers else f"{len(dividers)} '=======' lines (lines " + \
                ", ".join(str(d + 1) for d in dividers) + "): cannot tell where SEARCH ends"
            raise _error(f"search/replace block for '{path}' has {what}", line=start, path=path)
        div = dividers[0]
        blocks.append((path, start, lines[i + 1:div], lines[div + 1:end]))
        i = end + 1
        after_last = i
    if not blocks:
        raise _error("no search/replace block found")
    return Patch(format=SEARCH_REPLACE, edits=_group(blocks, SEARCH_REPLACE))


def _group(blocks: list[tuple[str, int, list[bytes], list[bytes]]], kind: str) -> tuple[FileEdit, ...]:
    """One edit per path (first-appearance order), its blocks as hunks in the order given."""
    order: dict[str, list[tuple[int, list[bytes], list[bytes]]]] = {}
    for path, line, search, replace in blocks:
        order.setdefault(path, []).append((line, search, replace))
    edits: list[FileEdit] = []
    for path, items in order.items():
        creates = [line for line, search, _ in items if not search]
        if creates:
            if len(items) > 1:
                raise _error(f"'{path}' has an empty SEARCH (create the file) and other blocks",
                             line=creates[0], path=path)
            edits.append(FileEdit(op="add", path=path, content=b"".join(items[0][2])))
            continue
        hunks = []
        for n, (line, search, replace) in enumerate(items, 1):
            old = tuple(chomp(x) for x in search)
            new = tuple(chomp(x) for x in replace)
            if old == new:
                raise _error(f"edit {n} of '{path}' changes nothing", line=line, path=path)
            label = "block" if kind == SEARCH_REPLACE else "edit"
            hunks.append(Hunk(old_lines=old, new_lines=new, eol_agnostic=True,
                              header=f"{label} {n} (line {line})" if kind == SEARCH_REPLACE else f"{label} {n}"))
        edits.append(FileEdit(op="modify", path=path, hunks=tuple(hunks)))
    return tuple(edits)


# --------------------------------------------------------------------------- str_replace JSON


def parse_str_replace(data: bytes) -> Patch:
    """Parse ``str_replace`` JSON edits into ``Patch(format="str_replace")``.

    Raises:
        ParseError: not a JSON list of objects, a missing/unknown/non-string
            field, an empty ``old``, or ``old == new``.
    """
    try:
        items = json_items(data, unique=True)
    except jsonio.DuplicateMember as exc:
        # Read as orjson reads it, the last would win: which edit was meant is not ours to guess.
        raise _error(f"{exc}: give each field of an edit once", member=clip(exc.name)) from None
    if items is None:
        raise _error("str_replace edits must be a JSON list of objects {\"path\", \"old\", \"new\"}")
    blocks: list[tuple[str, int, list[bytes], list[bytes]]] = []
    for n, item in enumerate(items, 1):
        unknown = sorted(set(item) - _STR_KEYS)
        if unknown:
            raise _error(f"edit {n}: unknown key(s) {', '.join(map(repr, unknown))} "
                         "(expected path, old, new)", item=n)
        values: dict[str, str] = {}
        for key, alias in (("path", None), ("old", "old_str"), ("new", "new_str")):
            if key in item and alias is not None and alias in item:
                raise _error(f"edit {n}: both '{key}' and '{alias}' given", item=n)
            value = item.get(key, item.get(alias) if alias else None)
            if not isinstance(value, str):
                raise _error(f"edit {n}: '{key}' must be a string", item=n)
            values[key] = value
        if values["old"] == "":
            raise _error(f"edit {n}: 'old' is empty; create files with a whole-file write", item=n)
        if values["old"] == values["new"]:
            raise _error(f"edit {n} of '{values['path']}' changes nothing", item=n)
        try:
            old = split_lines(values["old"].encode("utf-8", "surrogateescape"))
            new = split_lines(values["new"].encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:  # a JSON escape of a lone surrogate ("\ud800")
            raise _error(f"edit {n}: text is not valid Unicode (a lone surrogate)", item=n) from None
        blocks.append((values["path"], n, old, new))
    return Patch(format=STR_REPLACE, edits=_group(blocks, STR_REPLACE))


# --------------------------------------------------------------------------- applying


def _with_index(exc: ContextNotFound | AmbiguousMatch | IndentationMismatch,
                index: int) -> ContextNotFound | AmbiguousMatch | IndentationMismatch:
    """The matcher's error for a one-hunk call, renumbered to the edit's place in the file's list."""
    details = dict(exc.details)
    details["hunk"] = index
    details["sequential"] = True
    message = exc.message
    if message.startswith("hunk 1 of "):
        message = f"hunk {index} of " + message[len("hunk 1 of "):]
    return type(exc)(message, details=details)


def _substring(content: bytes, hunk: Hunk) -> tuple[str, bytes | None, list[int]]:
    """Exact substring lookup: ``("applies", new content, [line])``, ``("ambiguous", None, lines)``,
    ``("present", None, [line])`` or ``("missing", None, [])``."""
    eol = dominant_eol(content)
    old, new = eol.join(hunk.old_lines), eol.join(hunk.new_lines)
    if not old:
        return "missing", None, []
    starts: list[int] = []
    pos = content.find(old)
    while pos >= 0:
        starts.append(pos)
        pos = content.find(old, pos + 1)
    # Line numbers of the first few only (errors list those and a count), each counted from the
    # one before: counting from the start for each of 524,288 one-byte matches was quadratic.
    lines: list[int] = []
    line, prev = 1, 0
    for p in starts[:_SHOWN + 1]:
        line += content.count(b"\n", prev, p)
        prev = p
        lines.append(line)
    lines += [0] * (len(starts) - len(lines))  # counted, not numbered
    if len(starts) == 1:
        at = starts[0]
        # Inside the new text, written before?  ('import os' -> 'import os, sys' sent again:
        # the old text's one occurrence is the start of the new one.)
        k = new.find(old)
        while k >= 0:
            if at >= k and content[at - k:at - k + len(new)] == new:
                return "present", None, lines
            k = new.find(old, k + 1)
        return "applies", content[:at] + new + content[at + len(old):], lines
    if len(starts) > 1:
        return "ambiguous", None, lines
    if new and new in content:
        # The old text is nowhere, the new one somewhere: applied before, or a coincidence
        # ('foo(a)' in 'x = foo(a)' for 'foo(a, b)' -> 'foo(a)').  A false "already
        # applied" is a success with nothing changed, so this is missing, with a hint.
        return "missing", None, [content.count(b"\n", 0, content.find(new)) + 1]
    return "missing", None, []


def _whole_lines(content: bytes, hunk: Hunk) -> bool:
    """Whether the old text's one occurrence is whole lines but for leading whitespace."""
    old = dominant_eol(content).join(hunk.old_lines)
    at = content.find(old)
    begin = content.rfind(b"\n", 0, at) + 1
    end = at + len(old)
    return not content[begin:at].strip(b" \t") and content[end:end + 1] in (b"", b"\n", b"\r")


def apply_sequential(original: bytes, hunks: Sequence[Hunk], *, path: str) -> AppliedFile:
    """Apply ``hunks`` one after another, each to the result of the previous (module docstring).

    Raises:
        ContextNotFound, AmbiguousMatch: an edit matches nowhere / more than once.
        PartiallyApplied: some edits are already present, the others not.
        TooLarge: the edits together cost more than the call's work budget
            (:mod:`patcher.budget`: each edit reads the whole file again).
    """
    budget = current_budget()
    budget.allow(original.count(b"\n") + 1 + sum(len(h.old_lines) + len(h.new_lines) for h in hunks))
    content = original
    grades: list[str] = []
    present: list[int] = []
    applied: list[int] = []
    for index, hunk in enumerate(hunks, 1):
        lined: AppliedFile | None = None
        failure: ContextNotFound | None = None
        mismatch: IndentationMismatch | None = None
        token = STRICT.set(False)  # judged below, once the substring had its chance
        try:
            lined = apply_hunks(content, [hunk], path=path, budget=budget)
        except AmbiguousMatch as exc:
            raise _with_index(exc, index) from None
        except ContextNotFound as exc:
            failure = exc
        except IndentationMismatch as exc:
            mismatch = exc
        finally:
            STRICT.reset(token)
        if lined is not None and lined.grades and lined.grades[0] in ("exact", "rstrip"):
            result = lined
        else:
            state, new_content, lines = _substring(content, hunk)
            if (state == "applies" and lined is not None and lined.grades
                    and lined.grades[0] in LOOSE_INDENT_GRADES and len(hunk.new_lines) > 1
                    and _whole_lines(content, hunk)):
                # Whole lines but for their indentation ('  x = 1' in '    x = 1') becoming
                # several: the matcher shifts every new line by the one delta; in place, only
                # the first would be.
                state = "lines"
            if state == "applies" and new_content is not None:
                result = AppliedFile(new_content, ("substring",))
            elif lined is not None:
                result = lined
            elif state == "ambiguous":
                raise AmbiguousMatch(
                    f"hunk {index} of '{path}' does not apply: its text occurs at lines "
                    f"{shown_lines(lines)}; add context to make it unique",
                    details={"path": path, "hunk": index, "hunk_header": hunk.header,
                             "expected": "\n".join(x.decode("utf-8", "replace") for x in hunk.old_lines[:3]),
                             "grade_tried": ["exact", "rstrip", "strip", "punct", "substring"],
                             **capped_candidates(lines), "sequential": True},
                )
            elif state == "present":
                result = AppliedFile(content, ("substring",), already_applied=True)
            else:
                if mismatch is not None:
                    raise _with_index(mismatch, index) from None
                assert failure is not None
                if lines:  # the new text is in the file (see _substring)
                    failure.details["new_text_at"] = lines[0]
                    failure.message += (f"; its new text is already at line {lines[0]}: if this edit was "
                                        f"applied before, nothing is left to do")
                raise _with_index(failure, index) from None
        grades.append(result.grades[0] if result.grades else "exact")
        if result.already_applied:
            present.append(index)
        else:
            applied.append(index)
            content = result.content
    if not applied:
        return AppliedFile(content=original, grades=tuple(grades), already_applied=True)
    refuse_inexact(path, grades, [i - 1 for i in applied])
    if present:
        raise PartiallyApplied(f"patch is partially applied to '{path}': edits {', '.join(map(str, present))} "
                               f"already present, edits {', '.join(map(str, applied))} not",
                               details={"path": path, "applied_hunks": present, "missing_hunks": applied,
                                        "sequential": True})
    return AppliedFile(content=content, grades=tuple(grades))


FORMATS: list[Format] = [
    Format(SEARCH_REPLACE, looks_search_replace, parse_search_replace, apply_file=apply_sequential),
    Format(STR_REPLACE, looks_str_replace, parse_str_replace, apply_file=apply_sequential),
]

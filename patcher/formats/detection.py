"""Cheap tests that tell which format a patch is in (pure, no parser imported).

``--format auto`` and the replay fast path need the format's name (it is part
of a call's identity) without paying for the parsers' imports, so every
format's ``looks`` test lives here and the format modules re-export it.
Each test is specific: see ``docs/FORMATS.md`` ("Detection").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from receipts import jsonio

__all__ = ["DETECTORS", "json_items", "looks_unified", "looks_envelope", "looks_search_replace", "looks_str_replace",
           "looks_whole_file"]

#: The patterns each test is, in full.  The cheap checks in each test settle what agents
#: send without them (a pattern scans the whole patch, up to 64 MiB).
_PATTERNS: dict[str, tuple[bytes, int]] = {
    # (combined diffs are unified, refused by its parser by name)
    "unified": (rb"^diff --git |^diff --cc |^diff --combined |^--- [^\n]*\n\+\+\+ [^\n]*\n@@ -", re.MULTILINE),
    "envelope": (rb"\A\s*(?:(?:(?:apply_patch|applypatch)\s+)?<<-?\s*['\"]?[A-Za-z_][A-Za-z0-9_]*['\"]?[ \t]*\r?\n\s*)?"
                 rb"\*\*\* Begin Patch[ \t]*(?:\r?\n|\Z)", 0),
    "search": (rb"^<{5,9} SEARCH>?[ \t]*\r?$", re.MULTILINE),
    "replace": (rb"^>{5,9} REPLACE[ \t]*\r?$", re.MULTILINE),
}
_COMPILED = {name: re.compile(source, flags) for name, (source, flags) in _PATTERNS.items()}


#: What ``\s`` matches in a bytes pattern, and what ``bytes.strip()`` strips.
_SPACE = b" \t\n\r\x0b\x0c"
_DIFF_LINES = (b"diff --git ", b"diff --cc ", b"diff --combined ")


def _unified_at_start(data: bytes) -> bool:
    """The second alternative of the unified pattern at offset 0: ``---``, ``+++``, ``@@ -`` lines."""
    if not data.startswith(b"--- "):
        return False
    first = data.find(b"\n")
    if first < 0 or not data.startswith(b"+++ ", first + 1):
        return False
    second = data.find(b"\n", first + 1)
    return second >= 0 and data.startswith(b"@@ -", second + 1)


#: Keys of whole-file items, and of str_replace items: an item with both kinds is neither.
WHOLE_KEYS = frozenset({"content", "content_b64", "delete", "mode"})
EDIT_KEYS = frozenset({"old", "new", "old_str", "new_str"})


def json_items(data: bytes, *, unique: bool = False) -> list[Any] | None:
    """The list of objects a JSON edit format carries (``None``: not a JSON list/object of objects).

    ``unique``: an object naming a member twice raises (the parsers; detection only looks).

    Raises:
        jsonio.DuplicateMember: ``unique``, and a member given twice.
    """
    if data.lstrip()[:1] not in (b"[", b"{"):
        return None
    try:
        doc = jsonio.loads_unique(data) if unique else jsonio.loads(data)
    except jsonio.DuplicateMember:
        raise
    except jsonio.JsonError:
        return None
    items = doc if isinstance(doc, list) else [doc]
    if not items or not all(isinstance(x, dict) for x in items):
        return None
    return items


def looks_unified(data: bytes) -> bool:
    """A ``diff --git`` line, or ``---``/``+++``/``@@ -`` on three consecutive lines."""
    if data.startswith(_DIFF_LINES) or _unified_at_start(data):
        return True  # where git diff and diff -u output begin
    if b"\ndiff --" not in data and not (b"\n+++ " in data and b"\n@@ -" in data):
        return False  # no line could start a match
    return _COMPILED["unified"].search(data) is not None


def looks_envelope(data: bytes) -> bool:
    """``*** Begin Patch`` is the first non-blank line (or the one after a heredoc line)."""
    text = data.lstrip(_SPACE)
    if text.startswith(b"*** Begin Patch"):  # the pattern without its heredoc line, exactly
        rest = text[len(b"*** Begin Patch"):].lstrip(b" \t")
        return not rest or rest.startswith((b"\n", b"\r\n"))
    if not text.startswith((b"apply_patch", b"applypatch", b"<<")) or b"*** Begin Patch" not in text:
        return False  # no heredoc line could come first
    return _COMPILED["envelope"].match(data) is not None


def looks_search_replace(data: bytes) -> bool:
    """A ``<<<<<<< SEARCH`` line and a ``>>>>>>> REPLACE`` line, each at the start of a line."""
    if b"<<<<< SEARCH" not in data or b">>>>> REPLACE" not in data:
        return False
    return _COMPILED["search"].search(data) is not None and _COMPILED["replace"].search(data) is not None


def looks_str_replace(data: bytes) -> bool:
    """JSON objects that all have ``path`` and ``old``/``old_str``, and none of the whole-file keys."""
    items = json_items(data)
    return items is not None and all(
        "path" in x and ("old" in x or "old_str" in x) and not (WHOLE_KEYS & x.keys()) for x in items
    )


def looks_whole_file(data: bytes) -> bool:
    """JSON objects that all have ``path`` and one of ``content``/``content_b64``/``delete``, no edit keys."""
    items = json_items(data)
    return items is not None and all(
        "path" in x and ({"content", "content_b64", "delete"} & x.keys()) and not (EDIT_KEYS & x.keys())
        for x in items
    )


DETECTORS: dict[str, Callable[[bytes], bool]] = {
    "unified": looks_unified,
    "apply_patch": looks_envelope,
    "search_replace": looks_search_replace,
    "str_replace": looks_str_replace,
    "whole_file": looks_whole_file,
}

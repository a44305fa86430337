"""Cheap tests that tell which format a patch is in (pure, no parser imported).

``--format auto`` and the replay fast path need the format's name (it is part
of a call's identity) without paying for the parsers' imports, so every
format's ``looks`` test lives here and the format modules re-export it.
Each test is specific: see ``docs/FORMATS.md`` ("Detection").
"""

from __future__ import annotations

import re
from collections.abc import Callable

from receipts import jsonio

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "DETECTORS",
    "json_items",
    "looks_unified",
    "looks_envelope",
    "looks_search_replace",
    "looks_str_replace",
    "looks_whole_file",
]

_UNIFIED = re.compile(rb"^diff --git |^diff --cc |^diff --combined |^--- [^\n]*\n\+\+\+ [^\n]*\n@@ -",
                      re.MULTILINE)  # (combined diffs are unified, refused by its parser by name)
_ENVELOPE = re.compile(
    rb"\A\s*(?:(?:(?:apply_patch|applypatch)\s+)?<<-?\s*['\"]?[A-Za-z_][A-Za-z0-9_]*['\"]?[ \t]*\r?\n\s*)?"
    rb"\*\*\* Begin Patch[ \t]*(?:\r?\n|\Z)"
)
_SEARCH = re.compile(rb"^<{5,9} SEARCH>?[ \t]*\r?$", re.MULTILINE)
_REPLACE = re.compile(rb"^>{5,9} REPLACE[ \t]*\r?$", re.MULTILINE)
#: Keys of whole-file items, and of str_replace items: an item with both kinds is neither.
WHOLE_KEYS = frozenset({"content", "content_b64", "delete", "mode"})
EDIT_KEYS = frozenset({"old", "new", "old_str", "new_str"})


def json_items(data: bytes) -> list[Any] | None:
    """The list of objects a JSON edit format carries (``None``: not a JSON list/object of objects)."""
    if data.lstrip()[:1] not in (b"[", b"{"):
        return None
    try:
        doc = jsonio.loads(data)
    except jsonio.JsonError:
        return None
    items = doc if isinstance(doc, list) else [doc]
    if not items or not all(isinstance(x, dict) for x in items):
        return None
    return items


def looks_unified(data: bytes) -> bool:
    """A ``diff --git`` line, or ``---``/``+++``/``@@ -`` on three consecutive lines."""
    return _UNIFIED.search(data) is not None


def looks_envelope(data: bytes) -> bool:
    """``*** Begin Patch`` is the first non-blank line (or the one after a heredoc line)."""
    return _ENVELOPE.match(data) is not None


def looks_search_replace(data: bytes) -> bool:
    """A ``<<<<<<< SEARCH`` line and a ``>>>>>>> REPLACE`` line, each at the start of a line."""
    return _SEARCH.search(data) is not None and _REPLACE.search(data) is not None


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

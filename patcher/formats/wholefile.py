"""Whole-file writes and deletes as JSON (pure: no I/O; docs/FORMATS.md, "`whole_file`").

Registered with ``writes_create``: :mod:`patcher.stage` turns a write of a
missing path into an ``add``.  There is no matching, so no grades.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any


from cas.errors import clip
from receipts import jsonio
from patcher.formats.detection import json_items, looks_whole_file
from patcher.errors import ParseError
from patcher.formats import Format
from patcher.model import MODE_EXEC, MODE_FILE, FileEdit, Patch

__all__ = ["WHOLE_FILE", "looks_whole_file", "parse_whole_file", "FORMATS"]

WHOLE_FILE = "whole_file"

_KEYS = {"path", "content", "content_b64", "delete", "mode"}
_MODES: dict[int | str, int] = {
    "100644": MODE_FILE, "644": MODE_FILE, "0644": MODE_FILE, 0o644: MODE_FILE, MODE_FILE: MODE_FILE,
    "100755": MODE_EXEC, "755": MODE_EXEC, "0755": MODE_EXEC, 0o755: MODE_EXEC, MODE_EXEC: MODE_EXEC,
}


def _error(message: str, item: int | None = None, **extra: Any) -> ParseError:
    details: dict[str, Any] = dict(extra)
    if item is not None:
        details["item"] = item
        message = f"item {item}: {message}"
    return ParseError(f"invalid whole-file edit: {message}", details=details)


def _mode(value: Any, n: int) -> int:
    if isinstance(value, (int, str)) and not isinstance(value, bool) and value in _MODES:
        return _MODES[value]  # (a float such as 420.0 equals 0o644, and is refused)
    raise _error(f"'mode' must be \"100644\" or \"100755\", not {value!r}", n)


def parse_whole_file(data: bytes) -> Patch:
    """Parse whole-file JSON into ``Patch(format="whole_file")`` (module docstring).

    Raises:
        ParseError: not JSON objects, a missing or unknown key, bad base64 or
            mode, two items for one path.
    """
    try:
        items = json_items(data, unique=True)
    except jsonio.DuplicateMember as exc:
        # Read as orjson reads it, the last would win: which edit was meant is not ours to guess.
        raise _error(f"{exc}: give each field of an edit once", member=clip(exc.name)) from None
    if items is None:
        raise _error("expected a JSON list of objects {\"path\", \"content\"|\"content_b64\"|\"delete\"}")
    edits: list[FileEdit] = []
    seen: dict[str, int] = {}
    for n, item in enumerate(items, 1):
        unknown = sorted(set(item) - _KEYS)
        if unknown:
            raise _error(f"unknown key(s) {', '.join(map(repr, unknown))} "
                         "(expected path, content, content_b64, mode, delete)", n)
        path = item.get("path")
        if not isinstance(path, str):
            raise _error("'path' must be a string", n)
        if path in seen:
            raise _error(f"'{path}' is also item {seen[path]}", n, path=path)
        seen[path] = n
        given = [k for k in ("content", "content_b64", "delete") if k in item]
        if len(given) != 1:
            raise _error("give exactly one of 'content', 'content_b64', 'delete'", n, path=path)
        if given[0] == "delete":
            if item["delete"] is not True:
                raise _error("'delete' must be true", n, path=path)
            if "mode" in item:
                raise _error("'mode' makes no sense with 'delete'", n, path=path)
            edits.append(FileEdit(op="delete", path=path))
            continue
        if given[0] == "content":
            if not isinstance(item["content"], str):
                raise _error("'content' must be a string (use 'content_b64' for bytes)", n, path=path)
            try:
                content = item["content"].encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:  # a JSON escape of a lone surrogate ("\ud800")
                raise _error("'content' is not valid Unicode (a lone surrogate)", n, path=path) from None
        else:
            raw = item["content_b64"]
            if not isinstance(raw, str):
                raise _error("'content_b64' must be a string", n, path=path)
            try:
                content = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise _error(f"'content_b64' is not valid base64: {exc}", n, path=path) from None
        mode = _mode(item["mode"], n) if "mode" in item else None
        edits.append(FileEdit(op="modify", path=path, content=content, new_mode=mode))
    return Patch(format=WHOLE_FILE, edits=tuple(edits))


FORMATS: list[Format] = [Format(WHOLE_FILE, looks_whole_file, parse_whole_file, writes_create=True)]

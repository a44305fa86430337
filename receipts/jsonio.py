"""Compact JSON bytes in and out, through orjson (no I/O).

The bytes are the ones ``json.dumps(value, ensure_ascii=False,
separators=(",", ":"))`` gives for the values receipts hold — key order as
given, no whitespace, UTF-8, RFC 8785's escapes — which
``tests/unit/test_jsonio.py`` checks over generated values.  NaN and
infinities are refused on load; :mod:`receipts.canonical` refuses floats
before they are dumped (orjson would write ``null``).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from cas.errors import clip

__all__ = ["JsonError", "DuplicateMember", "loads", "loads_unique", "refuse_duplicates", "dumps", "dumps_pretty"]


class JsonError(ValueError):
    """Not JSON (on load), or not encodable (on dump)."""


def loads(data: bytes | str) -> Any:
    """Parse JSON.

    Raises:
        JsonError: not JSON, or NaN/Infinity literals.
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise JsonError(str(exc)) from exc


class DuplicateMember(JsonError):
    """An object names one member twice: which one a reader keeps is the reader's choice."""

    def __init__(self, name: str) -> None:
        super().__init__(f"member '{clip(name)}' is given twice in one object")
        self.name = name


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for name, _value in pairs:
            if name in seen:
                raise DuplicateMember(name)
            seen.add(name)
    return doc


def _no_constant(name: str) -> Any:
    raise JsonError(f"{name} is not JSON")


def loads_unique(data: bytes | str) -> Any:
    """Parse JSON an agent sent, refusing an object that names a member twice.

    orjson (and every parser here) keeps the last of two: an agent whose
    ``"branch"`` is given twice meant one of them, and which is not ours to
    guess.  The standard library's parser with a pairs hook, on agent input
    only (measured: docs/DECISIONS.md).

    Raises:
        DuplicateMember: a member given twice.
        JsonError: not JSON, or NaN/Infinity literals.
    """
    try:
        return json.loads(data, object_pairs_hook=_unique, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        if isinstance(exc, JsonError):
            raise
        raise JsonError(str(exc)) from exc


def refuse_duplicates(data: bytes, written: bytes) -> None:
    """Raise if ``data``, which orjson read, names a member twice; ``written`` is the parsed value
    dumped again as its writer writes it.

    Equal bytes prove there was none (a member dropped changes them) at the cost of a dump;
    only a file written otherwise (by hand, by another tool) is parsed again, by :func:`loads_unique`.

    Raises:
        DuplicateMember: a member given twice.
    """
    if written == data:
        return
    try:
        loads_unique(data)
    except DuplicateMember:
        raise
    except JsonError:
        pass  # orjson read it; what else the standard library's parser minds is not this check's


def dumps(value: Any) -> bytes:
    """Compact JSON bytes of ``value`` (keys in their given order).

    Raises:
        JsonError: a value JSON cannot carry (a lone surrogate, an odd type).
    """
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise JsonError(str(exc)) from exc


def dumps_pretty(value: Any) -> bytes:
    """``value`` indented by two spaces, keys sorted (a receipt file's bytes, without its newline).

    Raises:
        JsonError: a value JSON cannot carry.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise JsonError(str(exc)) from exc

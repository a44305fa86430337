"""Compact JSON bytes in and out, through orjson (no I/O).

The bytes are the ones ``json.dumps(value, ensure_ascii=False,
separators=(",", ":"))`` gives for the values receipts hold — key order as
given, no whitespace, UTF-8, RFC 8785's escapes — which
``tests/unit/test_jsonio.py`` checks over generated values.  NaN and
infinities are refused on load; :mod:`receipts.canonical` refuses floats
before they are dumped (orjson would write ``null``).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["JsonError", "loads", "dumps", "dumps_pretty"]


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

"""Compact JSON bytes in and out, through orjson when it is loaded, else the stdlib (no I/O).

A cold ``oncepatch apply`` that replays, or ``status``, reads one receipt and
appends one ledger line: importing orjson costs more there (≈ 15 ms) than all
the JSON work, and so it does for a cold ``apply`` (:func:`keep_lean`).  Long
scans (``verify``, ``recover``, the watcher) and long-lived callers that apply
import orjson first and get its speed.  Both backends
give the same bytes for the values receipts hold — key order as given, no
whitespace, UTF-8, RFC 8785's escapes — which ``tests/unit/test_jsonio.py``
checks over generated values; NaN and infinities are refused by both.
"""

from __future__ import annotations

import json
import sys

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["JsonError", "loads", "dumps", "dumps_pretty", "use_fast", "keep_lean"]


class JsonError(ValueError):
    """Not JSON (on load), or not encodable (on dump)."""


def _no_constant(name: str) -> Any:
    raise JsonError(f"{name} is not allowed")


_fast_allowed = True


def use_fast() -> None:
    """Load orjson now: the caller is about to do a lot of JSON work (not after :func:`keep_lean`).

    And OpenSSL's sha256 (``hashlib``): with it loaded, :func:`cas.hashing.sha256_hex`
    hashes receipts and ledger lines 3–5× faster than the built-in one.
    """
    if _fast_allowed:
        import hashlib  # noqa: F401
        import orjson  # noqa: F401


def keep_lean() -> None:
    """This process does one call and exits (the CLI's ``apply``): :func:`use_fast` stays a no-op.

    Importing orjson costs a cold process about 12 ms (it imports
    ``dataclasses``, ``inspect``, ``uuid``, ``datetime``), more than the JSON
    of one apply.
    """
    global _fast_allowed
    _fast_allowed = False


def loads(data: bytes | str) -> Any:
    """Parse JSON.

    Raises:
        JsonError: not JSON, or NaN/Infinity literals.
    """
    fast = sys.modules.get("orjson")
    try:
        if fast is not None:
            return fast.loads(data)
        return json.loads(data, parse_constant=_no_constant)
    except ValueError as exc:  # orjson.JSONDecodeError and json.JSONDecodeError are ValueErrors
        raise JsonError(str(exc)) from exc


def dumps_pretty(value: Any) -> bytes:
    """``value`` indented by two spaces, keys sorted (a receipt file's bytes, without its newline).

    Raises:
        JsonError: a value JSON cannot carry.
    """
    fast = sys.modules.get("orjson")
    try:
        if fast is not None:
            return bytes(fast.dumps(value, option=fast.OPT_INDENT_2 | fast.OPT_SORT_KEYS))
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        raise JsonError(str(exc)) from exc


def dumps(value: Any) -> bytes:
    """Compact JSON bytes of ``value`` (keys in their given order).

    Raises:
        JsonError: a value JSON cannot carry (NaN, a lone surrogate, an odd type).
    """
    fast = sys.modules.get("orjson")
    try:
        if fast is not None:
            return bytes(fast.dumps(value))
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as exc:  # orjson.JSONEncodeError is a TypeError
        raise JsonError(str(exc)) from exc

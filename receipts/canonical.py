"""Canonical JSON on a restricted RFC 8785 profile (pure).

Profile: UTF-8; object keys are strings, sorted by UTF-16 code units (RFC 8785
section 3.2.3); no insignificant whitespace; integers within ±(2**53 - 1);
no floats at all (a tool's schema normalises them or refuses); no NaN or
infinities (orjson would silently write ``null``: they are refused first);
values are ``None``, ``bool``, ``int``, ``str``, ``list``/``tuple``, ``dict``.
String escaping matches RFC 8785's (short escapes for ``\\b \\t \\n \\f \\r``,
``\\u00xx`` for other controls, everything else as is); the bytes come from
:mod:`receipts.jsonio` (orjson).
"""

from __future__ import annotations

from typing import Any

from receipts import jsonio
from receipts.errors import CanonicalJsonError

__all__ = ["MAX_SAFE_INT", "canonical_json", "normalise"]

MAX_SAFE_INT = 2**53 - 1


def _utf16_key(s: str) -> bytes:
    return s.encode("utf-16-be", "surrogatepass")


class _Slow(Exception):
    """The fast walk met something it does not judge: the checked walk decides."""


#: Below this character, code-point order (Python's) equals UTF-16 order (RFC 8785's).
_BMP_LOW = "\ue000"


def _fast(value: Any) -> Any:
    """Sorted copy of plain values; raises :class:`_Slow` on anything unusual.

    Strings are not checked here for lone surrogates: orjson refuses them when
    the result is dumped (callers fall back to :func:`_checked` for the message).
    """
    t = type(value)
    if t is str or t is bool or value is None:
        return value
    if t is int:
        if -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
            return value
        raise _Slow
    if t is dict:
        keys = list(value)
        for k in keys:
            if type(k) is not str or not (k.isascii() or max(k) < _BMP_LOW):
                raise _Slow
        keys.sort()
        return {k: _fast(value[k]) for k in keys}
    if t is list or t is tuple:
        return [_fast(v) for v in value]
    raise _Slow


def normalise(value: Any, _where: str = "$") -> Any:
    """Return ``value`` with dict keys in canonical order; refuse anything outside the profile.

    A fast walk handles the usual values; anything else (and every error)
    goes through the checked walk, which names the JSON path of the problem.
    Lone surrogates are refused by :func:`canonical_json` (orjson's dump).

    Raises:
        CanonicalJsonError: the value (at the JSON path named in the message) is not allowed.
    """
    try:
        return _fast(value)
    except (_Slow, RecursionError):
        return _checked(value, _where)


def _checked(value: Any, _where: str = "$") -> Any:
    if value is None or isinstance(value, bool) or isinstance(value, str):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise CanonicalJsonError(f"string at '{_where}' is not valid unicode") from exc
        return value
    if isinstance(value, int):
        if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
            raise CanonicalJsonError(f"integer at '{_where}' is outside ±(2^53-1): {value}")
        return value
    if isinstance(value, float):
        if value != value:
            raise CanonicalJsonError(f"NaN at '{_where}' is not allowed in canonical JSON")
        raise CanonicalJsonError(f"float at '{_where}' is not allowed in canonical JSON: {value!r}")
    if isinstance(value, (list, tuple)):
        return [_checked(v, f"{_where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise CanonicalJsonError(f"object key at '{_where}' is not a string: {k!r}")
            try:
                k.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise CanonicalJsonError(f"object key at '{_where}' is not valid unicode") from exc
        return {k: _checked(value[k], f"{_where}.{k}") for k in sorted(value, key=_utf16_key)}
    raise CanonicalJsonError(f"value at '{_where}' has a type JSON cannot carry: {type(value).__name__}")


def canonical_json(value: Any) -> bytes:
    """The canonical bytes of ``value`` (see the module docstring).

    Raises:
        CanonicalJsonError: the value is outside the profile.
    """
    try:
        return jsonio.dumps(normalise(value))
    except jsonio.JsonError:
        _checked(value)  # names the value orjson refused (a lone surrogate)
        raise

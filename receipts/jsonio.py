"""Compact JSON bytes in and out, through orjson when it is loaded, else the stdlib (no I/O).

A cold ``oncepatch apply`` that replays, or ``status``, reads one receipt and
appends one ledger line: importing orjson costs more there (≈ 15 ms) than all
the JSON work, and so it does for a cold ``apply`` (:func:`keep_lean`).  Long
scans (``verify``, ``recover``, the watcher) and long-lived callers that apply
import orjson first and get its speed.  Both backends
give the same bytes for the values receipts hold — key order as given, no
whitespace, UTF-8, RFC 8785's escapes — which ``tests/unit/test_jsonio.py``
checks over generated values; NaN and infinities are refused by both.

Without orjson, compact dumps and loads go straight to CPython's ``_json``
accelerator (the C scanner and encoder that the ``json`` package wraps):
``import json`` brings ``re`` and ``enum`` with it, which a cold replay never
needs otherwise (≈ 3 ms of its start-up here; docs/DECISIONS.md).  The
calls are the ones ``json.loads`` and ``json.dumps`` make for these options,
with the same results; input ``json`` reads in other encodings (a UTF-16 or
UTF-32 text, a byte order mark) and interpreters without ``_json`` go to the
``json`` package itself.
"""

from __future__ import annotations

import sys

try:
    import _json
except ImportError:  # pragma: no cover - not CPython: the json package decides alone
    _json = None  # type: ignore[assignment]

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


class _ScanContext:
    """What ``_json.make_scanner`` reads off a decoder: ``json.JSONDecoder``'s defaults, constants refused."""

    def __init__(self) -> None:
        self.strict = True
        self.object_hook = None
        self.object_pairs_hook = None
        self.parse_float = float
        self.parse_int = int
        self.parse_constant = _no_constant


#: JSON's insignificant whitespace (``json.decoder.WHITESPACE``).
_WS = " \t\n\r"

_scanner: Any = None


def _scan(text: str) -> Any:
    """``json.JSONDecoder.decode`` through the C scanner: whitespace, one value, whitespace, the end.

    Raises:
        JsonError: no value where one is expected, or data after it.
        ValueError: what the scanner itself refuses (``json.JSONDecodeError``).
    """
    global _scanner
    if _scanner is None:
        _scanner = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]  # (typeshed: a JSONDecoder)
    start = len(text) - len(text.lstrip(_WS))
    try:
        value, end = _scanner(text, start)
    except StopIteration as err:
        raise JsonError(f"Expecting value: char {err.value}") from None
    except SystemError:
        # CPython 3.11's scanner raises its errors as json.decoder.JSONDecodeError,
        # which it looks up in sys.modules only: with the module not loaded it fails
        # with no exception set.  Scanned again with it loaded, the same text gives
        # the package's own error.
        if "json.decoder" in sys.modules:
            raise
        import json.decoder  # noqa: F401

        value, end = _scanner(text, start)
    if text[end:].strip(_WS):
        raise JsonError(f"Extra data: char {end}")
    return value


def _plain_utf8(data: bytes | bytearray) -> bool:
    """Whether ``json.loads`` would read ``data`` as UTF-8 without a byte order mark (``json.detect_encoding``)."""
    if data[:3] == b"\xef\xbb\xbf" or data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return False
    return not (len(data) >= 4 or len(data) == 2) or bool(data[0] and data[1])


def loads(data: bytes | str) -> Any:
    """Parse JSON.

    Raises:
        JsonError: not JSON, or NaN/Infinity literals.
    """
    fast = sys.modules.get("orjson")
    try:
        if fast is not None:
            return fast.loads(data)
        if _json is not None:
            if isinstance(data, str):
                if not data.startswith("\ufeff"):
                    return _scan(data)
            elif _plain_utf8(data):
                return _scan(data.decode("utf-8", "surrogatepass"))
        import json  # another encoding, a byte order mark, or no _json: the package decides

        return json.loads(data, parse_constant=_no_constant)
    except ValueError as exc:  # orjson.JSONDecodeError and json.JSONDecodeError are ValueErrors
        if isinstance(exc, JsonError):
            raise
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
        import json  # indented output is the package's own Python encoder

        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        raise JsonError(str(exc)) from exc


def _not_serializable(value: Any) -> Any:
    raise TypeError(f"Object of type {value.__class__.__name__} is not JSON serializable")


def dumps(value: Any) -> bytes:
    """Compact JSON bytes of ``value`` (keys in their given order).

    Raises:
        JsonError: a value JSON cannot carry (NaN, a lone surrogate, an odd type).
    """
    fast = sys.modules.get("orjson")
    try:
        if fast is not None:
            return bytes(fast.dumps(value))
        if _json is not None:
            # json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False):
            # a new encoder (and cycle markers) per call, as the package makes.
            encode = _json.make_encoder({}, _not_serializable, _json.encode_basestring, None, ":", ",", False,
                                        False, False)
            return "".join(encode(value, 0)).encode("utf-8")
        import json

        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as exc:  # orjson.JSONEncodeError is a TypeError
        raise JsonError(str(exc)) from exc

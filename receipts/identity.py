"""Identity of a call (pure): call_id, args hash, key hash (docs/DESIGN.md section 2).

``call_id`` = ``"opc1:" + sha256(canonical_json(identity))``; the tag is
versioned: a change of this recipe gets a new tag, never a silent collision
with old ids.  ``args_sha256`` covers tool, tool version and args: what a
caller-chosen key binds.  The key is stored under ``key_hash(key)`` (sha256
hex of its UTF-8 bytes): file names and ref names stay fixed-width and safe
whatever the key contains.
"""

from __future__ import annotations

from typing import Any, NewType

from cas.errors import clip
from cas.hashing import sha256_hex
from receipts.canonical import canonical_json
from receipts.errors import InvalidKey

__all__ = [
    "CALL_ID_TAG",
    "MAX_KEY_LEN",
    "CallId",
    "KeyHash",
    "make_identity",
    "compute_call_id",
    "compute_args_sha256",
    "key_hash",
    "check_key",
]

CALL_ID_TAG = "opc1:"
MAX_KEY_LEN = 512

CallId = NewType("CallId", str)
KeyHash = NewType("KeyHash", str)


def make_identity(
    tool: str,
    tool_version: str,
    args: dict[str, Any],
    *,
    contract_sha256: str | None = None,
    attempt: int = 1,
) -> dict[str, Any]:
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise InvalidKey(f"attempt must be a positive integer, not {attempt!r}")
    if contract_sha256 is not None:
        c = contract_sha256.lower()
        if len(c) != 64 or any(ch not in "0123456789abcdef" for ch in c):
            raise InvalidKey(f"contract sha256 must be 64 hex digits: '{clip(contract_sha256)}'")
        contract_sha256 = c
    return {
        "contract_sha256": contract_sha256,
        "attempt": attempt,
        "tool": tool,
        "tool_version": tool_version,
        "args": args,
    }


def compute_call_id(identity: dict[str, Any]) -> CallId:
    return CallId(CALL_ID_TAG + sha256_hex(canonical_json(identity)))


def compute_args_sha256(tool: str, tool_version: str, args: dict[str, Any]) -> str:
    doc = {"tool": tool, "tool_version": tool_version, "args": args}
    return sha256_hex(canonical_json(doc))


def check_key(key: str) -> str:
    """Refuse keys that cannot be stored or shown safely.

    Raises:
        InvalidKey: empty, too long, or containing control characters.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKey("idempotency key must be a non-empty string")
    if len(key) > MAX_KEY_LEN:
        raise InvalidKey(f"idempotency key is longer than {MAX_KEY_LEN} characters")
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in key):  # C0, DEL, C1
        raise InvalidKey("idempotency key contains control characters")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey("idempotency key is not valid unicode") from exc
    return key


#: Recent keys' hashes: one call asks for its key's about a dozen times (paths, refs, locks, fences).
_KEY_HASHES: dict[str, KeyHash] = {}
_KEY_HASHES_MAX = 256


def key_hash(key: str) -> KeyHash:
    found = _KEY_HASHES.get(key)
    if found is None:
        if len(_KEY_HASHES) >= _KEY_HASHES_MAX:
            _KEY_HASHES.clear()  # bounded memory for a long-lived caller of many keys
        found = _KEY_HASHES[key] = KeyHash(sha256_hex(key.encode("utf-8")))
    return found

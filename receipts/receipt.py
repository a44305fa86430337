"""The receipt record (pure): schema ``oncepatch.receipt/1``, parsing and verification.

A receipt is one JSON object per key.  Parsing is tolerant of unknown keys
(kept in ``extra`` and written back unchanged) and strict on missing ones.

Verification on read (:func:`parse_receipt` with ``expected_key_hash``):

* the schema tag is known and every required field has the right type;
* ``call_id`` is recomputed from ``identity``;
* ``args_sha256`` is recomputed from ``identity``'s tool, tool version and args;
* ``tool``/``tool_version`` equal those inside ``identity``;
* the key's hash equals the file name;
* (a redacted receipt, ``redacted``: its bodies replaced by their digests by
  ``oncepatch gc``, keeps call_id and args_sha256 as recorded: they cannot be
  recomputed from digests; docs/LIFECYCLE.md);
* ``receipt_sha256`` (a self-digest: sha256 of the canonical JSON of every
  other field, unknown ones included) matches, so an edit of *any* field —
  status, commit, outputs — is caught, not only edits of the identity.

``signature`` (a signed store's, :mod:`receipts.signing`) is the one field the
digest does not cover: it signs the digest.  It is kept on the record as read
(:attr:`Receipt.signature`), never in ``extra``, and the store checks it.

States: ``prepared`` → ``committed`` | ``rejected`` | ``unknown``
(see :mod:`receipts.states`).
"""

from __future__ import annotations

import re
import time as _time
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from cas.hashing import sha256_hex
from receipts import jsonio

from receipts.canonical import canonical_json, normalise
from receipts.errors import CorruptReceipt
from receipts.identity import CALL_ID_TAG, key_hash
from receipts.states import STATUSES, Status

__all__ = ["SCHEMA", "DIGEST_FIELD", "SIGNATURE_FIELD", "REDACTED_FIELD", "Receipt", "parse_receipt", "receipt_bytes", "receipt_doc_bytes", "now_iso"]

SCHEMA = "oncepatch.receipt/1"

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "key": str,
    "call_id": str,
    "identity": dict,
    "args_sha256": str,
    "tool": str,
    "tool_version": str,
    "status": str,
    "fencing_token": int,
    "owner": dict,
    "created_at": str,
    "updated_at": str,
}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "retryable": (bool, type(None)),
    "base": (dict, type(None)),
    "candidate": (str, type(None)),
    "commit": (str, type(None)),
    "tree": (str, type(None)),
    "outputs": list,
    "error": (dict, type(None)),
    "result": (dict, type(None)),
}
#: The field that holds a receipt's digest over every other field.
DIGEST_FIELD = "receipt_sha256"
#: The field that holds a signed store's signature over the digest (outside the digest).
SIGNATURE_FIELD = "signature"
#: The field a redacted receipt carries (``oncepatch gc``): which bodies were replaced by which digests.
REDACTED_FIELD = "redacted"


def now_iso() -> str:
    # datetime's isoformat, without importing datetime (start-up): 2026-11-29T14:46:20.123456Z
    ns = _time.time_ns()
    return _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(ns // 1_000_000_000)) + f".{ns // 1000 % 1_000_000:06d}Z"


@dataclass(frozen=True, slots=True)
class Receipt:
    key: str
    call_id: str
    identity: dict[str, Any]
    args_sha256: str
    tool: str
    tool_version: str
    status: Status
    fencing_token: int
    owner: dict[str, Any]
    created_at: str
    updated_at: str
    retryable: bool | None = None
    base: dict[str, Any] | None = None
    candidate: str | None = None
    commit: str | None = None
    tree: str | None = None
    outputs: tuple[dict[str, Any], ...] = ()
    error: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA
    #: The verified ``receipt_sha256`` of the file this record was parsed from
    #: (``None`` for a record built in memory); :meth:`evolve` drops it.
    parsed_digest: str | None = field(default=None, compare=False, repr=False)
    #: The ``signature`` of the file this record was parsed from (``None``: none, or built in
    #: memory); :meth:`evolve` drops it, the store signs what it writes.
    signature: Any = field(default=None, compare=False, repr=False)

    @property
    def args(self) -> dict[str, Any]:
        args = self.identity.get("args")
        return args if isinstance(args, dict) else {}

    @property
    def is_final(self) -> bool:
        """Replayed as is: committed, or rejected and not retryable."""
        return self.status == "committed" or (self.status == "rejected" and not self.retryable)

    def evolve(self, **changes: Any) -> Receipt:
        """A copy with ``changes`` and a fresh ``updated_at``."""
        changes.setdefault("updated_at", now_iso())
        changes.setdefault("parsed_digest", None)
        changes.setdefault("signature", None)
        return replace(self, **changes)

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = dict(self.extra)
        doc.update(
            schema=self.schema,
            key=self.key,
            call_id=self.call_id,
            identity=self.identity,
            args_sha256=self.args_sha256,
            tool=self.tool,
            tool_version=self.tool_version,
            status=self.status,
            retryable=self.retryable,
            fencing_token=self.fencing_token,
            owner=self.owner,
            base=self.base,
            candidate=self.candidate,
            commit=self.commit,
            tree=self.tree,
            outputs=list(self.outputs),
            error=self.error,
            result=self.result,
            created_at=self.created_at,
            updated_at=self.updated_at,
        )
        doc.pop(DIGEST_FIELD, None)
        doc[DIGEST_FIELD] = sha256_hex(canonical_json(doc))
        return doc

    @property
    def digest(self) -> str:
        if self.parsed_digest is not None:
            return self.parsed_digest
        return str(self.to_doc()[DIGEST_FIELD])


def receipt_bytes(receipt: Receipt) -> bytes:
    """The file bytes of a receipt: indented, sorted keys, trailing newline (readable, stable)."""
    return receipt_doc_bytes(receipt.to_doc())


def receipt_doc_bytes(doc: dict[str, Any]) -> bytes:
    """The file bytes of a receipt's :meth:`Receipt.to_doc` document (:func:`receipt_bytes`)."""
    return jsonio.dumps_pretty(doc) + b"\n"


def parse_receipt(data: bytes, *, path: str, expected_key_hash: str | None = None) -> Receipt:
    """Parse and verify a receipt file's bytes (checks in the module docstring).

    Raises:
        CorruptReceipt: any check fails; the reason names the first failure.
    """
    try:
        doc = jsonio.loads(data)
    except jsonio.JsonError as exc:
        raise CorruptReceipt(path, f"not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise CorruptReceipt(path, "not a JSON object")
    try:
        # A member given twice: orjson kept the last, another reader may keep the first.
        jsonio.refuse_duplicates(data, receipt_doc_bytes(doc))
    except jsonio.DuplicateMember as exc:
        raise CorruptReceipt(path, str(exc)) from None
    for name, typ in _REQUIRED.items():
        if name not in doc:
            raise CorruptReceipt(path, f"missing field '{name}'")
        if not isinstance(doc[name], typ) or (typ is int and isinstance(doc[name], bool)):
            raise CorruptReceipt(path, f"field '{name}' has the wrong type")
    for name, typ in _OPTIONAL.items():
        if name in doc and not isinstance(doc[name], typ):
            raise CorruptReceipt(path, f"field '{name}' has the wrong type")
    if doc["schema"] != SCHEMA:
        raise CorruptReceipt(path, f"unknown schema '{doc['schema']}'")
    if doc["status"] not in STATUSES:
        raise CorruptReceipt(path, f"unknown status '{doc['status']}'")
    stored_digest = doc.get(DIGEST_FIELD)
    if not isinstance(stored_digest, str):
        why = "missing field" if stored_digest is None else "wrong type of field"
        raise CorruptReceipt(path, f"{why} '{DIGEST_FIELD}'")
    signature = doc.pop(SIGNATURE_FIELD, None)
    body = {k: v for k, v in doc.items() if k != DIGEST_FIELD}
    fast = _fast_hashes(body)
    if fast is not None and fast[0] == stored_digest and fast[1] == doc["call_id"] and fast[2] == doc["args_sha256"]:
        identity = body["identity"]
    else:
        identity = _checked_hashes(body, stored_digest, doc, path)
    if identity.get("tool") != doc["tool"] or identity.get("tool_version") != doc["tool_version"]:
        raise CorruptReceipt(path, "tool or tool_version differs from identity")
    if expected_key_hash is not None and key_hash(doc["key"]) != expected_key_hash:
        raise CorruptReceipt(path, "key does not match the file name")
    _check_outputs(doc.get("outputs"), path)
    known = set(_REQUIRED) | set(_OPTIONAL) | {DIGEST_FIELD}
    extra = {k: v for k, v in doc.items() if k not in known}
    return _build(doc, extra, identity, stored_digest, signature)


_OUTPUT_FIELDS: dict[str, tuple[type, ...]] = {
    "path": (str,), "op": (str,), "sha256": (str, type(None)), "blob": (str, type(None)),
    "mode": (int, type(None)), "from": (str,),
}


def _check_outputs(outputs: Any, path: str) -> None:
    """Each output a ``{path, op, sha256, blob, mode}`` object of the types written (a re-sealed edit is caught).

    Raises:
        CorruptReceipt: an output of another shape.
    """
    for i, out in enumerate(outputs or ()):
        if not isinstance(out, dict) or not isinstance(out.get("path"), str) or not isinstance(out.get("op"), str):
            raise CorruptReceipt(path, f"output {i + 1} is not an object with a path and an op")
        for name, types in _OUTPUT_FIELDS.items():
            value = out.get(name)
            if name in out and (not isinstance(value, types) or isinstance(value, bool)):
                raise CorruptReceipt(path, f"output {i + 1}: field '{name}' has the wrong type")


def written_as_is(doc: dict[str, Any], key_hash_hex: str) -> bool:
    """Whether a parsed receipt document is, by its digest, the one written for its file (a scan's quick check).

    ``True`` only when the digest recomputed from orjson's key-sorted dump
    matches the stored one and the key matches the file name; anything else
    (``False``) needs :func:`parse_receipt`, which decides and names the problem.
    """
    stored = doc.pop(DIGEST_FIELD, None)
    signature = doc.pop(SIGNATURE_FIELD, None)
    try:
        if not isinstance(stored, str) or not isinstance(doc.get("key"), str):
            return False
        # A match proves the document is the one the digest was made of: a key-sorted dump
        # is then the canonical text itself (where the two could differ, they do not match).
        text = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER)
        return sha256_hex(text) == stored and key_hash(doc["key"]) == key_hash_hex
    except Exception:  # noqa: BLE001 - odd values: parse_receipt decides
        return False
    finally:
        if stored is not None:
            doc[DIGEST_FIELD] = stored
        if signature is not None:
            doc[SIGNATURE_FIELD] = signature


def _args_doc(identity: dict[str, Any]) -> dict[str, Any]:
    """The part of an identity ``args_sha256`` covers (keys already in canonical order)."""
    return {"args": identity.get("args", {}), "tool": identity.get("tool", ""),
            "tool_version": identity.get("tool_version", "")}


def _fast_hashes(body: dict[str, Any]) -> tuple[str, str, str] | None:
    """The receipt's three hashes from orjson's key-sorted dumps (``None``: the checked walk decides).

    A match proves the same as the checked walk: the sorted dump of the parsed
    document is then byte for byte the canonical text the digest was made of,
    so the document is the one written.  Anything else (a mismatch, keys whose
    code-point order is not RFC 8785's UTF-16 order) goes to the checked walk,
    which decides and names the problem.
    """
    try:
        # Integers beyond ±(2^53-1) and lone surrogates make orjson raise.
        opt = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER
        text = orjson.dumps(body, option=opt)
        if _BEYOND_BMP_LOW.search(text) or _FLOAT.search(_outside_strings(text)):
            return None  # characters at or above U+E000 anywhere, or a float: the checked walk decides
        identity = body["identity"]
        return (sha256_hex(text),
                CALL_ID_TAG + sha256_hex(orjson.dumps(identity, option=opt)),
                sha256_hex(orjson.dumps(_args_doc(identity), option=opt)))
    except Exception:  # noqa: BLE001 - odd shapes and values: the checked walk reports them
        return None


#: UTF-8 lead bytes of U+E000 and above (where code-point order may differ from UTF-16 order).
_BEYOND_BMP_LOW = re.compile(rb"[\xee-\xf4]")
#: A JSON string in compact text (escapes included).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: A float, once strings are emptied.
_FLOAT = re.compile(rb"[0-9][.eE]")


def _outside_strings(text: bytes) -> bytes:
    """``text`` (compact JSON) without the contents of its strings."""
    if b"\\" not in text:  # no escapes, so every '"' delimits a string: a split is enough
        return b"".join(text.split(b'"')[0::2])
    emptied: bytes = _STRING.sub(b'""', text)
    return emptied


def _checked_hashes(body: dict[str, Any], stored_digest: str, doc: dict[str, Any], path: str) -> dict[str, Any]:
    """Recompute the three hashes through the validating walk; return the identity, or raise CorruptReceipt."""
    try:
        # One validating walk (normalise) gives key-sorted copies; the three hashes
        # are then plain compact dumps of its parts, identical to canonical_json().
        canon = normalise(body)
        actual_digest = sha256_hex(jsonio.dumps(canon))
        identity = canon["identity"]
        call_id = CALL_ID_TAG + sha256_hex(jsonio.dumps(identity))
        args_sha = sha256_hex(jsonio.dumps(_args_doc(identity)))
    except Exception as exc:  # CanonicalJsonError, odd identity shapes
        raise CorruptReceipt(path, f"cannot recompute hashes ({exc})") from exc
    if actual_digest != stored_digest:
        raise CorruptReceipt(path, "receipt_sha256 does not match its content (edited by hand?)")
    if isinstance(body.get(REDACTED_FIELD), dict):
        # Redacted (oncepatch gc): bodies in the identity were replaced by their digests, so
        # call_id and args_sha256 stand as recorded; the self-digest above, the signature
        # and the ledger's ``redacted`` event (which names both digests) vouch for them.
        checked_redacted: dict[str, Any] = identity
        return checked_redacted
    if call_id != doc["call_id"]:
        raise CorruptReceipt(path, "call_id does not match identity")
    if args_sha != doc["args_sha256"]:
        raise CorruptReceipt(path, "args_sha256 does not match identity")
    checked: dict[str, Any] = identity
    return checked


def _build(doc: dict[str, Any], extra: dict[str, Any], identity: dict[str, Any], digest: str,
           signature: Any) -> Receipt:
    return Receipt(
        key=doc["key"],
        call_id=doc["call_id"],
        identity=identity,
        args_sha256=doc["args_sha256"],
        tool=doc["tool"],
        tool_version=doc["tool_version"],
        status=doc["status"],
        fencing_token=doc["fencing_token"],
        owner=doc["owner"],
        created_at=doc["created_at"],
        updated_at=doc["updated_at"],
        retryable=doc.get("retryable"),
        base=doc.get("base"),
        candidate=doc.get("candidate"),
        commit=doc.get("commit"),
        tree=doc.get("tree"),
        outputs=tuple(doc.get("outputs") or ()),
        error=doc.get("error"),
        result=doc.get("result"),
        extra=extra,
        schema=doc["schema"],
        parsed_digest=digest,
        signature=signature,
    )

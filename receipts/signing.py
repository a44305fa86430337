"""Signatures on receipts and ledger events: who wrote the store, not only that it agrees with itself.

Ed25519 through the ``cryptography`` package (docs/DECISIONS.md, "Signatures":
measured against ``ssh-keygen -Y``, a process per signature).  No crypto of
our own: this module only names what is signed and where the keys live.

Files (docs/SECURITY.md, "Signed mode")::

    <store>/allowed_signers.json   the public keys trusted for the store
                                   ($ONCEPATCH_ALLOWED_SIGNERS names another file)
    <key dir>/<key_id>.key         a private key, PEM (PKCS#8), mode 0600; the key dir is
                                   $ONCEPATCH_KEY_DIR, else $XDG_CONFIG_HOME/oncepatch/keys,
                                   else ~/.config/oncepatch/keys: the writer's, never the store's

The allowed-signers list (schema ``oncepatch.signers/1``) holds one ``active``
key, the one new signatures are made with, and the ``retired`` ones, which
still verify what they signed (rotation keeps old receipts verifiable).  A
store is **signed** when its list exists: then every receipt and every ledger
event must carry a signature by a listed key, and one without, or with one
that does not verify, is corrupt.

A signature is ``{"algorithm": "ed25519", "key_id": ..., "value": base64}`` over

* a receipt: ``oncepatch.receipt/1`` NUL its ``receipt_sha256`` (the digest
  covers every other field);
* a ledger event: ``oncepatch.event/1`` NUL the canonical JSON of the event
  without its signature (``seq`` and ``prev`` included: it seals the chain).

``cryptography`` is imported on the first signature made or checked: an
unsigned store's calls never load it (about 20 ms of start-up, measured).
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from cas.crash import pause_point
from cas.durable import NotRegularFile, make_dirs, open_regular, write_durable
from cas.errors import UsageError
from cas.hashing import sha256_hex
from receipts import jsonio
from receipts.canonical import canonical_json
from receipts.errors import TRANSIENT_ERRNOS, CorruptReceipt, ReadFailed, SigningKeyMissing
from receipts.receipt import SIGNATURE_FIELD, Receipt, now_iso

__all__ = ["SIGNERS_SCHEMA", "SIGNERS_FILE", "ALLOWED_SIGNERS_ENV", "KEY_DIR_ENV", "SignerKey", "Signers",
           "Signing", "signers_path", "key_dir", "load_signing", "init_keys", "rotate_keys", "list_keys"]

SIGNERS_SCHEMA = "oncepatch.signers/1"
SIGNERS_FILE = "allowed_signers.json"
ALLOWED_SIGNERS_ENV = "ONCEPATCH_ALLOWED_SIGNERS"
KEY_DIR_ENV = "ONCEPATCH_KEY_DIR"
ALGORITHM = "ed25519"
_RECEIPT_DOMAIN = b"oncepatch.receipt/1\0"
_EVENT_DOMAIN = b"oncepatch.event/1\0"
_MAX_SIGNERS_BYTES = 1 << 20
_MAX_KEY_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class SignerKey:
    key_id: str
    public_key: bytes  # the raw 32 bytes
    status: str  # "active" | "retired"
    created_at: str
    retired_at: str | None = None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"key_id": self.key_id, "algorithm": ALGORITHM, "status": self.status,
                               "public_key": base64.b64encode(self.public_key).decode(), "created_at": self.created_at}
        if self.retired_at is not None:
            doc["retired_at"] = self.retired_at
        if self.note:
            doc["note"] = self.note
        return doc


@dataclass(frozen=True, slots=True)
class Signers:
    """The allowed-signers list of a store: where it was read from, and its keys."""

    path: str
    keys: tuple[SignerKey, ...]

    @property
    def active(self) -> SignerKey:
        return next(k for k in self.keys if k.status == "active")

    def to_bytes(self) -> bytes:
        return jsonio.dumps_pretty({"schema": SIGNERS_SCHEMA, "keys": [k.to_json() for k in self.keys]}) + b"\n"


def signers_path(store_root: str) -> str:
    """The allowed-signers list in force for the store: ``$ONCEPATCH_ALLOWED_SIGNERS``, else the store's own."""
    return os.environ.get(ALLOWED_SIGNERS_ENV) or os.path.join(store_root, SIGNERS_FILE)


def key_dir() -> str:
    """Where this process keeps private keys (module docstring)."""
    explicit = os.environ.get(KEY_DIR_ENV)
    if explicit:
        return os.path.abspath(explicit)
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "oncepatch", "keys")


def key_id_of(public_key: bytes) -> str:
    """A key's id: the first 16 hex digits of the sha256 of its raw public key."""
    return sha256_hex(public_key)[:16]


def _bad_list(path: str, why: str) -> UsageError:
    return UsageError(f"cannot read the allowed signers '{path}': {why}", details={"allowed_signers": path})


def _parse_signers(path: str, data: bytes) -> Signers:
    """The list's keys, checked: schema, fields, ids that match their keys, exactly one active key.

    Raises:
        UsageError: anything else (the list is named; nothing is trusted from it).
    """
    try:
        doc = jsonio.loads(data)
    except jsonio.JsonError:
        raise _bad_list(path, "not JSON") from None
    if not isinstance(doc, dict) or doc.get("schema") != SIGNERS_SCHEMA or not isinstance(doc.get("keys"), list):
        raise _bad_list(path, f"not an '{SIGNERS_SCHEMA}' document")
    keys: list[SignerKey] = []
    for i, k in enumerate(doc["keys"], 1):
        try:
            if not isinstance(k, dict) or k.get("algorithm") != ALGORITHM or k.get("status") not in ("active", "retired"):
                raise ValueError
            raw = base64.b64decode(str(k["public_key"]), validate=True)
            if len(raw) != 32 or k.get("key_id") != key_id_of(raw):
                raise ValueError
            keys.append(SignerKey(str(k["key_id"]), raw, str(k["status"]), str(k.get("created_at", "")),
                                  k.get("retired_at"), k.get("note")))
        except (ValueError, KeyError, binascii.Error):
            raise _bad_list(path, f"key {i} is not an ed25519 key with its id and status") from None
    if sum(k.status == "active" for k in keys) != 1:
        raise _bad_list(path, "it must name exactly one active key")
    return Signers(path, tuple(keys))


def _refuse_open_to_all(path: str, st: os.stat_result) -> None:
    """Refuse a list any user may rewrite, or put another in place of: it would vouch for anyone's key.

    Other users' write bit on the file, or on its folder without the sticky
    bit (anyone could rename another file over it).  Group bits are left to
    the person (a group of one's own is common).
    """
    if st.st_mode & stat.S_IWOTH:
        raise _bad_list(path, f"any user may write it (mode {stat.S_IMODE(st.st_mode):04o}): anyone could add "
                              f"a key of theirs; 'chmod o-w' it, and check the keys it lists")
    try:
        folder = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        raise _bad_list(path, f"its folder cannot be read ({exc.strerror or exc})") from None
    if folder.st_mode & stat.S_IWOTH and not folder.st_mode & stat.S_ISVTX:
        raise _bad_list(path, f"any user may replace it: its folder is writable by all "
                              f"(mode {stat.S_IMODE(folder.st_mode):04o}); 'chmod o-w' the folder, and check "
                              f"the keys the list holds")


def read_signers(path: str) -> Signers | None:
    """The list at ``path`` (``None``: there is none).

    Raises:
        UsageError: it is not a regular file, cannot be read, or is not a valid list.
        ReadFailed: a read error that may pass (EIO, ...): nothing is known of the list yet.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except NotRegularFile:
        raise _bad_list(path, "not a regular file") from None
    except OSError as exc:
        if exc.errno in TRANSIENT_ERRNOS:  # a read that may pass: no verdict on the list (io_error, exit 5)
            raise ReadFailed(path, exc, effect_status="not_started") from None
        raise _bad_list(path, exc.strerror or str(exc)) from None
    with os.fdopen(fd, "rb") as fh:
        _refuse_open_to_all(path, os.fstat(fh.fileno()))
        data = fh.read(_MAX_SIGNERS_BYTES + 1)
    if len(data) > _MAX_SIGNERS_BYTES:
        raise _bad_list(path, "too large")
    return _parse_signers(path, data)


def load_signing(store_root: str) -> Signing | None:
    """The store's signing, or ``None`` for an unsigned store (no allowed-signers list).

    ``$ONCEPATCH_ALLOWED_SIGNERS`` set demands a signed store: its file must exist.

    Raises:
        UsageError: the list named by the environment is missing, or a list is unreadable or invalid.
    """
    path = signers_path(store_root)
    signers = read_signers(path)
    if signers is None:
        if os.environ.get(ALLOWED_SIGNERS_ENV):
            raise _bad_list(path, f"no such file (named by ${ALLOWED_SIGNERS_ENV})")
        return None
    return Signing(signers)


def _matching_private_key(pem: bytes, public_key: bytes, refused: Callable[[str], Exception]) -> Any:
    """The Ed25519 private key in ``pem``, whose public key must be ``public_key`` (the list's active one).

    A key file replaced by another key (or by anything else) is refused here:
    signing with it would move the branch, then write a receipt no one can verify.
    """
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        private = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise refused("is not an unencrypted PEM private key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise refused("is not an ed25519 key")
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if raw != public_key:
        raise refused(f"is another key's (its public key's id is '{key_id_of(raw)}')")
    return private


@dataclass(slots=True)
class Signing:
    """Signs with the list's active key (its private key from :func:`key_dir`) and checks against the list."""

    signers: Signers
    _private: Any = None
    _public: dict[str, Any] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "signed"

    def describe(self) -> dict[str, Any]:
        """What ``verify`` reports of the mode it proved."""
        return {"mode": "signed", "allowed_signers": self.signers.path,
                "keys": [{"key_id": k.key_id, "status": k.status} for k in self.signers.keys]}

    # -- making signatures ------------------------------------------------------

    def ready(self) -> None:
        """Load the active private key now (a call checks it before it takes its key's lock).

        Raises:
            SigningKeyMissing: it cannot be read here (lost, or another user's).
        """
        self._private_key()

    def _private_key(self) -> Any:
        if self._private is None:
            active = self.signers.active
            path = os.path.join(key_dir(), f"{active.key_id}.key")

            def refused(why: str) -> SigningKeyMissing:
                return SigningKeyMissing(
                    f"cannot sign for the store: its active key '{active.key_id}' at '{path}' {why}; a lost "
                    f"key is replaced by 'oncepatch keys rotate' (docs/SECURITY.md)",
                    details={"key_id": active.key_id, "key_path": path})

            try:
                fd = open_regular(path)
            except OSError as exc:
                raise refused(f"cannot be read ({exc.strerror or 'not a regular file'})") from None
            with os.fdopen(fd, "rb") as fh:
                st = os.fstat(fh.fileno())
                if st.st_uid != os.geteuid():
                    raise refused(f"is not this user's (owned by uid {st.st_uid})")
                if st.st_mode & 0o077:
                    raise refused(f"is open to other users (mode {stat.S_IMODE(st.st_mode):04o}, not 0600)")
                pem = fh.read(_MAX_KEY_BYTES + 1)
            self._private = _matching_private_key(pem, active.public_key, refused)
        return self._private

    def _sign(self, message: bytes) -> dict[str, Any]:
        value = self._private_key().sign(message)
        return {"algorithm": ALGORITHM, "key_id": self.signers.active.key_id,
                "value": base64.b64encode(value).decode()}

    def sign_receipt(self, digest: str) -> dict[str, Any]:
        """The signature of a receipt whose ``receipt_sha256`` is ``digest``.

        Raises:
            SigningKeyMissing: the active key's private key is not readable here (lost, or another user's).
        """
        return self._sign(_RECEIPT_DOMAIN + digest.encode())

    def sign_event(self, body: bytes) -> dict[str, Any]:
        """The signature of a ledger event whose canonical JSON, without a signature, is ``body``."""
        return self._sign(_EVENT_DOMAIN + body)

    # -- checking them ------------------------------------------------------------

    def _check(self, message: bytes, signature: object) -> str | None:
        """Why ``signature`` does not sign ``message`` for this list (``None``: it does)."""
        if signature is None:
            return "unsigned, in a signed store"
        if (not isinstance(signature, dict) or signature.get("algorithm") != ALGORITHM
                or not isinstance(signature.get("key_id"), str) or not isinstance(signature.get("value"), str)):
            return "its signature is malformed"
        key_id = signature["key_id"]
        public = self._public.get(key_id)
        if public is None:
            known = next((k for k in self.signers.keys if k.key_id == key_id), None)
            if known is None:
                return f"signed by key '{key_id}', which is not an allowed signer"
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

            public = self._public[key_id] = Ed25519PublicKey.from_public_bytes(known.public_key)
        try:
            value = base64.b64decode(signature["value"], validate=True)
        except (ValueError, binascii.Error):
            return "its signature is malformed"
        from cryptography.exceptions import InvalidSignature

        try:
            public.verify(value, message)
        except InvalidSignature:
            return f"its signature by key '{key_id}' does not verify"
        return None

    def check_receipt(self, receipt: Receipt, path: str) -> None:
        """Raises :class:`CorruptReceipt` unless ``receipt`` (as parsed) is signed by an allowed key."""
        why = self.receipt_problem(receipt.digest, receipt.signature)
        if why is not None:
            raise CorruptReceipt(path, why, key=receipt.key)

    def receipt_problem(self, digest: str, signature: object) -> str | None:
        """Why a receipt of ``digest`` with ``signature`` is not signed here (``None``: it is)."""
        return self._check(_RECEIPT_DOMAIN + digest.encode(), signature)

    def event_problem(self, event: dict[str, Any]) -> str | None:
        """Why a ledger event (as read) is not signed here (``None``: it is)."""
        body = {k: v for k, v in event.items() if k != SIGNATURE_FIELD}
        try:
            text = canonical_json(body)
        except Exception:  # noqa: BLE001 - outside the canonical profile: never one of ours
            return "not canonical JSON"
        return self._check(_EVENT_DOMAIN + text, event.get(SIGNATURE_FIELD))


# -- the keys commands --------------------------------------------------------------------------


def _new_key(note: str | None) -> tuple[SignerKey, bytes]:
    """A new Ed25519 key: its list entry and its private key's PEM."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return SignerKey(key_id_of(raw), raw, "active", now_iso(), note=note or None), pem


def _save_private(key: SignerKey, pem: bytes) -> str:
    folder = key_dir()
    make_dirs(folder, 0o700)
    path = os.path.join(folder, f"{key.key_id}.key")
    write_durable(path, pem, mode=0o600)
    return path


def _store_is_empty(store_root: str) -> bool:
    def files(folder: str) -> Iterator[str]:
        for _dirpath, _dirs, names in os.walk(folder):
            yield from (n for n in names if n.endswith(".json"))

    ledger = os.path.join(store_root, "events.jsonl")
    has_events = os.path.exists(ledger) and os.path.getsize(ledger) > 0
    return not has_events and next(files(os.path.join(store_root, "receipts")), None) is None


def init_keys(store_root: str, *, note: str | None = None) -> tuple[Signers, str]:
    """Make the store signed: a new active key, its private key in :func:`key_dir`, the list written.

    Returns the list and the private key's path.

    Raises:
        UsageError: the store already has a list, or already holds receipts or
            ledger events (written unsigned: signing them now would vouch for
            what this key never wrote; start a new store).
    """
    path = signers_path(store_root)
    if read_signers(path) is not None:
        raise UsageError(f"the store is signed already ('{path}'): 'oncepatch keys rotate' makes a new key")
    if not _store_is_empty(store_root):
        raise UsageError(f"cannot sign the store '{store_root}': it holds receipts or ledger events written "
                         f"unsigned; keys are made for a new store (--store)")
    key, pem = _new_key(note)
    private_path = _save_private(key, pem)
    signers = Signers(path, (key,))
    make_dirs(os.path.dirname(path))
    write_durable(path, signers.to_bytes(), mode=0o644)
    return signers, private_path


def rotate_keys(store_root: str, *, note: str | None = None) -> tuple[Signers, str]:
    """A new active key; the old one retired (still trusted for what it signed).  Works with the old key lost.

    Returns the new list and the new private key's path.

    Raises:
        UsageError: the store has no list (``oncepatch keys init`` first).
    """
    path = signers_path(store_root)
    old = read_signers(path)
    if old is None:
        raise UsageError(f"the store is not signed (no '{path}'): 'oncepatch keys init' first")
    pause_point("keys-listed")  # (a test seam: another rotation may run here; the caller's lock keeps it out)
    key, pem = _new_key(note)
    private_path = _save_private(key, pem)
    at = now_iso()
    kept = tuple(replace(k, status="retired", retired_at=at) if k.status == "active" else k for k in old.keys)
    signers = Signers(path, (*kept, key))
    write_durable(path, signers.to_bytes(), mode=0o644)
    return signers, private_path


def list_keys(store_root: str) -> list[dict[str, Any]]:
    """The store's keys, each saying whether this process holds its private key (empty: unsigned)."""
    signers = read_signers(signers_path(store_root))
    if signers is None:
        return []
    folder = key_dir()
    return [{**k.to_json(), "private_key": os.path.exists(os.path.join(folder, f"{k.key_id}.key"))}
            for k in signers.keys]

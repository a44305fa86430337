"""Signatures (receipts/signing.py): what is signed, and each way a signature fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cas.errors import UsageError
from receipts.signing import SIGNERS_FILE, init_keys, list_keys, load_signing, rotate_keys


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    return root


def test_an_unsigned_store_has_no_signing(store: Path) -> None:
    assert load_signing(str(store)) is None and list_keys(str(store)) == []


def test_receipt_signatures_bind_the_digest_and_the_key(store: Path) -> None:
    init_keys(str(store))
    s = load_signing(str(store))
    assert s is not None
    sig = s.sign_receipt("ab" * 32)
    assert s.receipt_problem("ab" * 32, sig) is None
    assert s.receipt_problem("cd" * 32, sig) == f"its signature by key '{sig['key_id']}' does not verify"
    assert s.receipt_problem("ab" * 32, None) == "unsigned, in a signed store"
    assert s.receipt_problem("ab" * 32, {"algorithm": "ed25519"}) == "its signature is malformed"
    assert s.receipt_problem("ab" * 32, {**sig, "key_id": "0" * 16}) == \
        "signed by key '0000000000000000', which is not an allowed signer"


def test_an_event_signature_covers_every_field_but_itself(store: Path) -> None:
    init_keys(str(store))
    s = load_signing(str(store))
    assert s is not None
    from receipts.canonical import canonical_json

    event = {"event": "committed", "seq": 3, "prev": "0" * 64}
    event["signature"] = s.sign_event(canonical_json(event))
    assert s.event_problem(event) is None
    assert s.event_problem({**event, "seq": 4}) is not None
    # A receipt's signature is no event's (each names what it signs).
    assert s.event_problem({**event, "signature": s.sign_receipt("ab" * 32)}) is not None


def test_rotation_retires_the_old_key_and_both_verify(store: Path) -> None:
    init_keys(str(store))
    old = load_signing(str(store))
    assert old is not None
    sig = old.sign_receipt("ab" * 32)
    rotate_keys(str(store), note="yearly")
    new = load_signing(str(store))
    assert new is not None and new.signers.active.key_id != sig["key_id"]
    assert new.receipt_problem("ab" * 32, sig) is None
    assert new.receipt_problem("ab" * 32, new.sign_receipt("ab" * 32)) is None
    assert [k["status"] for k in list_keys(str(store))] == ["retired", "active"]


@pytest.mark.parametrize("edit", ["two_active", "wrong_id", "not_json"])
def test_a_list_it_cannot_trust_is_refused(store: Path, edit: str) -> None:
    init_keys(str(store))
    path = store / SIGNERS_FILE
    doc = json.loads(path.read_text())
    if edit == "two_active":
        doc["keys"].append(dict(doc["keys"][0]))
    elif edit == "wrong_id":
        doc["keys"][0]["key_id"] = "f" * 16
    path.write_text("{" if edit == "not_json" else json.dumps(doc))
    with pytest.raises(UsageError, match="cannot read the allowed signers"):
        load_signing(str(store))


def test_init_twice_and_rotate_unsigned_are_refused(store: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="keys init"):
        rotate_keys(str(store))
    init_keys(str(store))
    with pytest.raises(UsageError, match="signed already"):
        init_keys(str(store))


def test_the_private_key_is_kept_outside_the_store_and_private(store: Path) -> None:
    signers, private = init_keys(str(store))
    assert not private.startswith(str(store))
    assert Path(private).stat().st_mode & 0o777 == 0o600
    assert Path(private).parent.stat().st_mode & 0o777 == 0o700
    assert list_keys(str(store))[0]["private_key"] is True

"""receipts.identity: call_id, args_sha256, key checks (pure)."""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Any

import pytest

from receipts.canonical import canonical_json
from receipts.errors import CanonicalJsonError, InvalidKey
from receipts.identity import (
    CALL_ID_TAG,
    MAX_KEY_LEN,
    check_key,
    compute_args_sha256,
    compute_call_id,
    key_hash,
    make_identity,
)

CONTRACT = "ab" * 32
ARGS: dict[str, Any] = {"repo": "/r", "branch": "refs/heads/main", "patch_sha256": "0" * 64, "paths": ["a", "b"]}


def cid(**kw: Any) -> str:
    tool = kw.pop("tool", "apply_patch")
    version = kw.pop("tool_version", "1")
    args = kw.pop("args", ARGS)
    return compute_call_id(make_identity(tool, version, args, **kw))


def test_call_id_has_versioned_tag_and_is_sha256_of_canonical_identity() -> None:
    identity = make_identity("apply_patch", "1", ARGS, contract_sha256=CONTRACT, attempt=2)
    call_id = compute_call_id(identity)
    assert call_id.startswith(CALL_ID_TAG) and CALL_ID_TAG == "opc1:"
    assert call_id == "opc1:" + hashlib.sha256(canonical_json(identity)).hexdigest()
    assert len(call_id) == len("opc1:") + 64


def test_identity_has_exactly_the_five_fields() -> None:
    identity = make_identity("t", "v", {"a": 1})
    assert identity == {"contract_sha256": None, "attempt": 1, "tool": "t", "tool_version": "v", "args": {"a": 1}}


def test_same_intent_same_call_id() -> None:
    assert cid() == cid()
    reordered = dict(reversed(list(ARGS.items())))
    assert cid(args=reordered) == cid()
    assert cid(contract_sha256=CONTRACT.upper()) == cid(contract_sha256=CONTRACT)  # hex case normalised


@pytest.mark.parametrize(
    "change",
    [
        {"args": {**ARGS, "patch_sha256": "1" * 64}},
        {"args": {**ARGS, "paths": ["b", "a"]}},  # list order is meaningful
        {"args": {**ARGS, "extra": None}},
        {"args": {k: v for k, v in ARGS.items() if k != "paths"}},
        {"tool": "apply_patch2"},
        {"tool_version": "2"},
        {"attempt": 2},
        {"contract_sha256": CONTRACT},
        {"contract_sha256": "cd" * 32},
    ],
)
def test_any_change_gives_a_new_call_id(change: dict[str, Any]) -> None:
    assert cid(**change) != cid()


def test_args_sha256_binds_tool_version_args_but_not_attempt_or_contract() -> None:
    base = compute_args_sha256("apply_patch", "1", ARGS)
    assert base == hashlib.sha256(
        canonical_json({"tool": "apply_patch", "tool_version": "1", "args": ARGS})
    ).hexdigest()
    # attempt and contract change the call_id, never args_sha256
    assert cid(attempt=3) != cid() and cid(contract_sha256=CONTRACT) != cid()
    assert compute_args_sha256("apply_patch", "1", dict(reversed(list(ARGS.items())))) == base
    assert compute_args_sha256("apply_patch2", "1", ARGS) != base
    assert compute_args_sha256("apply_patch", "2", ARGS) != base
    assert compute_args_sha256("apply_patch", "1", {**ARGS, "x": 1}) != base


@pytest.mark.parametrize("attempt", [0, -1, True, False, 1.0, "1", None])
def test_attempt_must_be_a_positive_int(attempt: Any) -> None:
    with pytest.raises(InvalidKey):
        make_identity("t", "v", {}, attempt=attempt)


@pytest.mark.parametrize("contract", ["", "ab", "g" * 64, "ab" * 33, "ab" * 31 + "a"])
def test_contract_must_be_64_hex(contract: str) -> None:
    with pytest.raises(InvalidKey):
        make_identity("t", "v", {}, contract_sha256=contract)


def test_args_outside_the_canonical_profile_are_refused() -> None:
    with pytest.raises(CanonicalJsonError):
        cid(args={"x": 1.5})
    with pytest.raises(CanonicalJsonError):
        compute_args_sha256("t", "v", {"n": 2**60})


# -- keys ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["k", "deploy/2024-01-01#3", "ключ", "a" * MAX_KEY_LEN, "opc1:" + "0" * 64, "with space", "\U0001f600"]
)
def test_good_keys_pass_unchanged(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key",
    ["", "a" * (MAX_KEY_LEN + 1), "a\nb", "a\rb", "tab\there", "nul\x00", "esc\x1b[31m", "del\x7f", "\x1f",
     "lone\ud800"],
)
def test_bad_keys_are_refused(key: str) -> None:
    with pytest.raises(InvalidKey) as ei:
        check_key(key)
    assert ei.value.exit_code == 2


@pytest.mark.parametrize("key", [None, 5, b"bytes"])
def test_non_string_keys_are_refused(key: Any) -> None:
    with pytest.raises(InvalidKey):
        check_key(key)


@pytest.mark.parametrize("ch", ["\x85", "\x9b"])
def test_c1_control_characters_are_refused(ch: str) -> None:
    assert unicodedata.category(ch) == "Cc"
    with pytest.raises(InvalidKey):
        check_key(f"key{ch}x")


def test_key_hash_is_sha256_of_utf8() -> None:
    assert key_hash("k") == hashlib.sha256(b"k").hexdigest()
    assert key_hash("ключ") == hashlib.sha256("ключ".encode()).hexdigest()
    assert key_hash("a") != key_hash("A")
    assert len(key_hash("x" * MAX_KEY_LEN)) == 64

"""receipts.receipt and receipts.states: the record, its verification on read, the state table (pure)."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from receipts.canonical import canonical_json
from receipts.errors import CorruptReceipt
from receipts.identity import compute_args_sha256, compute_call_id, key_hash, make_identity
from receipts.receipt import SCHEMA, Receipt, parse_receipt, receipt_bytes
from receipts.states import ALLOWED, STATUSES, can_move, needs_resolution

ARGS = {"repo": "/r", "branch": "refs/heads/main", "patch_sha256": "a" * 64}


def make_receipt(key: str | None = None, **kw: Any) -> Receipt:
    identity = make_identity("apply_patch", "1", dict(ARGS))
    call_id = compute_call_id(identity)
    fields: dict[str, Any] = dict(
        key=key or call_id,
        call_id=call_id,
        identity=identity,
        args_sha256=compute_args_sha256("apply_patch", "1", ARGS),
        tool="apply_patch",
        tool_version="1",
        status="committed",
        fencing_token=1,
        owner={"host": "h", "pid": 1, "start_time": "7", "since": "2024-01-01T00:00:00.000000Z"},
        created_at="2024-01-01T00:00:00.000000Z",
        updated_at="2024-01-01T00:00:01.000000Z",
        base={"ref": "refs/heads/main", "commit": "1" * 40},
        candidate="2" * 40,
        commit="2" * 40,
        tree="3" * 40,
        outputs=({"path": "a.txt", "op": "modify", "sha256": "4" * 64, "blob": "5" * 40, "mode": 0o100644},),
    )
    fields.update(kw)
    return Receipt(**fields)


def doc_of(r: Receipt) -> dict[str, Any]:
    return orjson.loads(receipt_bytes(r))


def redigest(doc: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in doc.items() if k != "receipt_sha256"}
    doc["receipt_sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    return doc


def parse(doc: dict[str, Any] | bytes, key: str | None = None) -> Receipt:
    data = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    kh = key_hash(key) if key is not None else None
    return parse_receipt(data, path="/s/receipts/xx/r.json", expected_key_hash=kh)


def reason_of(doc: dict[str, Any] | bytes, key: str | None = None) -> str:
    with pytest.raises(CorruptReceipt) as ei:
        parse(doc, key)
    assert ei.value.exit_code == 6 and ei.value.error_type == "corrupt_receipt"
    assert ei.value.details["path"] == "/s/receipts/xx/r.json"
    return ei.value.reason


# -- round trip -------------------------------------------------------------------


def test_round_trip_is_identity() -> None:
    r = make_receipt(key="biz-key", status="prepared", commit=None, tree=None)
    back = parse(receipt_bytes(r), key="biz-key")
    assert back == r
    assert receipt_bytes(back) == receipt_bytes(r)


def test_file_bytes_are_stable_sorted_indented_with_newline() -> None:
    data = receipt_bytes(make_receipt())
    assert data.endswith(b"}\n") and b'\n  "' in data
    keys = list(orjson.loads(data))
    assert keys == sorted(keys)
    doc = orjson.loads(data)
    assert doc["schema"] == SCHEMA == "oncepatch.receipt/1"
    assert doc["receipt_sha256"] == redigest(dict(doc))["receipt_sha256"]


def test_digest_covers_every_field() -> None:
    r = make_receipt()
    assert r.digest != make_receipt(status="prepared").digest
    assert r.digest != make_receipt(commit="9" * 40).digest
    assert r.digest != make_receipt(outputs=()).digest
    assert r.digest != make_receipt(extra={"note": 1}).digest


def test_evolve_refreshes_updated_at() -> None:
    r = make_receipt(status="prepared")
    r2 = r.evolve(status="committed")
    assert r2.status == "committed" and r2.updated_at != r.updated_at and r2.created_at == r.created_at


# -- tolerant of unknown keys, strict on missing ones ------------------------------


def test_unknown_keys_are_kept_and_written_back_with_recomputed_digest() -> None:
    doc = doc_of(make_receipt())
    doc["future_field"] = {"nested": [1, "two"]}
    doc["zz_note"] = "kept"
    redigest(doc)  # as a newer writer would have
    r = parse(doc)
    assert r.extra == {"future_field": {"nested": [1, "two"]}, "zz_note": "kept"}
    again = orjson.loads(receipt_bytes(r))
    assert again["future_field"] == {"nested": [1, "two"]} and again["zz_note"] == "kept"
    assert again["receipt_sha256"] == doc["receipt_sha256"]
    # and a change after reading gets a fresh digest that still verifies
    changed = r.evolve(status="prepared")
    assert parse(receipt_bytes(changed)).extra == r.extra


def test_unknown_key_added_by_hand_without_digest_is_caught() -> None:
    doc = doc_of(make_receipt())
    doc["sneaky"] = True
    assert "receipt_sha256" in reason_of(doc)


@pytest.mark.parametrize(
    "field",
    ["schema", "key", "call_id", "identity", "args_sha256", "tool", "tool_version", "status", "fencing_token",
     "owner", "created_at", "updated_at", "receipt_sha256"],
)
def test_missing_required_field_is_corrupt(field: str) -> None:
    doc = doc_of(make_receipt())
    del doc[field]
    if field != "receipt_sha256":
        redigest(doc)
    assert reason_of(doc) == f"missing field '{field}'"


def test_optional_fields_may_be_absent() -> None:
    doc = doc_of(make_receipt())
    for name in ("retryable", "base", "candidate", "commit", "tree", "outputs", "error", "result"):
        del doc[name]
    r = parse(redigest(doc))
    assert r.commit is None and r.outputs == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [("fencing_token", True), ("fencing_token", "1"), ("status", 1), ("identity", []), ("owner", None),
     ("outputs", {}), ("commit", 5), ("retryable", "yes"), ("base", [])],
)
def test_wrong_type_is_corrupt(field: str, value: Any) -> None:
    doc = doc_of(make_receipt())
    doc[field] = value
    assert reason_of(redigest(doc)) == f"field '{field}' has the wrong type"


@pytest.mark.parametrize(
    ("data", "reason"),
    [(b"", "not JSON"), (b"{", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[]", "not a JSON object"),
     (b"null", "not a JSON object")],
)
def test_unreadable_bytes_are_corrupt(data: bytes, reason: str) -> None:
    assert reason_of(data).startswith(reason)


def test_unknown_schema_and_status() -> None:
    doc = doc_of(make_receipt())
    doc["schema"] = "oncepatch.receipt/99"
    assert reason_of(redigest(doc)) == "unknown schema 'oncepatch.receipt/99'"
    doc = doc_of(make_receipt())
    doc["status"] = "done"
    assert reason_of(redigest(doc)) == "unknown status 'done'"


# -- tampering -----------------------------------------------------------------------

DIGEST_REASON = "receipt_sha256 does not match its content (edited by hand?)"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("status",), "rejected"),
        (("commit",), "f" * 40),
        (("tree",), "e" * 40),
        (("outputs",), []),
        (("outputs", 0, "sha256"), "0" * 64),
        (("identity", "args", "patch_sha256"), "b" * 64),
        (("call_id",), "opc1:" + "0" * 64),
        (("key",), "another-key"),
        (("fencing_token",), 2),
        (("base", "commit"), "0" * 40),
    ],
)
def test_hand_edit_of_any_field_is_caught_by_the_digest(path: tuple[Any, ...], value: Any) -> None:
    doc = doc_of(make_receipt())
    obj: Any = doc
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value
    assert reason_of(doc) == DIGEST_REASON


def test_tampered_identity_args_with_fixed_digest_is_caught_by_call_id() -> None:
    doc = doc_of(make_receipt())
    doc["identity"]["args"]["patch_sha256"] = "b" * 64
    assert reason_of(redigest(doc)) == "call_id does not match identity"


def test_tampered_call_id_with_fixed_digest() -> None:
    doc = doc_of(make_receipt())
    doc["call_id"] = "opc1:" + "0" * 64
    assert reason_of(redigest(doc)) == "call_id does not match identity"


def test_tampered_identity_and_call_id_is_caught_by_args_sha256() -> None:
    doc = doc_of(make_receipt())
    doc["identity"]["args"]["patch_sha256"] = "b" * 64
    doc["call_id"] = compute_call_id(doc["identity"])
    assert reason_of(redigest(doc)) == "args_sha256 does not match identity"


def test_tool_outside_identity_must_agree() -> None:
    doc = doc_of(make_receipt())
    doc["tool_version"] = "2"
    assert reason_of(redigest(doc)) == "tool or tool_version differs from identity"


def test_identity_that_cannot_be_hashed() -> None:
    doc = doc_of(make_receipt())
    doc["identity"]["args"]["f"] = 1.5
    assert reason_of(redigest_raw(doc)).startswith("cannot recompute hashes")


def redigest_raw(doc: dict[str, Any]) -> bytes:
    # a float cannot be canonicalised, so no honest digest exists: store any string
    doc["receipt_sha256"] = "0" * 64
    return orjson.dumps(doc)


def test_key_must_match_file_name() -> None:
    r = make_receipt(key="mine")
    assert parse(receipt_bytes(r), key="mine").key == "mine"
    assert reason_of(receipt_bytes(r), key="theirs") == "key does not match the file name"
    # edited key with a fixed digest: still caught through the file name
    doc = doc_of(r)
    doc["key"] = "theirs"
    assert reason_of(redigest(doc), key="mine") == "key does not match the file name"


def test_message_names_path_and_reason() -> None:
    with pytest.raises(CorruptReceipt) as ei:
        parse(b"[]")
    assert ei.value.message == "corrupt receipt '/s/receipts/xx/r.json': not a JSON object"


# -- is_final and the state table -------------------------------------------------


@pytest.mark.parametrize(
    ("status", "retryable", "final"),
    [
        ("committed", None, True),
        ("rejected", False, True),
        ("rejected", None, True),
        ("rejected", True, False),
        ("prepared", None, False),
        ("unknown", None, False),
        ("unknown", False, False),
    ],
)
def test_is_final(status: str, retryable: bool | None, final: bool) -> None:
    assert make_receipt(status=status, retryable=retryable).is_final is final


def test_statuses() -> None:
    assert STATUSES == {"prepared", "committed", "rejected", "unknown"}
    assert set(ALLOWED) == {None, *STATUSES}


CAN_MOVE = [
    # (current, retryable, new, allowed)
    (None, None, "prepared", True),
    (None, None, "rejected", True),
    (None, None, "committed", False),
    (None, None, "unknown", False),
    ("prepared", None, "prepared", True),
    ("prepared", None, "committed", True),
    ("prepared", None, "rejected", True),
    ("prepared", None, "unknown", True),
    ("unknown", None, "committed", True),
    ("unknown", None, "rejected", True),
    ("unknown", None, "unknown", True),
    ("unknown", None, "prepared", False),
    ("rejected", True, "prepared", True),
    ("rejected", True, "committed", False),
    ("rejected", True, "rejected", False),
    ("rejected", True, "unknown", False),
    ("rejected", False, "prepared", False),
    ("rejected", None, "prepared", False),
    ("committed", None, "prepared", False),
    ("committed", None, "committed", False),
    ("committed", None, "rejected", False),
    ("committed", None, "unknown", False),
    ("bogus", None, "prepared", False),
]


@pytest.mark.parametrize(("current", "retryable", "new", "allowed"), CAN_MOVE)
def test_can_move_table(current: str | None, retryable: bool | None, new: str, allowed: bool) -> None:
    assert can_move(current, new, retryable=retryable) is allowed


def test_can_move_table_is_complete() -> None:
    seen = {(c, r, n) for c, r, n, _ in CAN_MOVE}
    for current in [None, "prepared", "unknown", "committed"]:
        for new in STATUSES:
            assert (current, None, new) in seen
    for new in STATUSES:
        assert ("rejected", True, new) in seen


def test_needs_resolution() -> None:
    assert {s for s in STATUSES if needs_resolution(s)} == {"prepared", "unknown"}


def test_now_iso_is_datetimes_utc_isoformat_with_z() -> None:
    import datetime
    import re

    from receipts.receipt import now_iso

    before = datetime.datetime.now(datetime.timezone.utc)
    stamp = now_iso()
    after = datetime.datetime.now(datetime.timezone.utc)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stamp)
    assert before - datetime.timedelta(seconds=1) <= datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")) <= after


# -- the fast check (orjson's sorted dumps) and the checked walk agree -------------------------------


def sorted_digest(doc: dict[str, Any]) -> dict[str, Any]:
    """A digest made the way the fast check makes it (orjson, keys sorted): honest only inside the profile."""
    body = {k: v for k, v in doc.items() if k != "receipt_sha256"}
    doc["receipt_sha256"] = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return doc


def test_plain_receipts_take_the_fast_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import receipts.receipt as receipt_mod

    r = make_receipt()

    def no_walk(value: Any) -> Any:
        raise AssertionError("the checked walk ran")

    monkeypatch.setattr(receipt_mod, "normalise", no_walk)
    assert parse(receipt_bytes(r)) == r


def test_keys_whose_order_differs_in_utf16_go_to_the_checked_walk() -> None:
    # U+1F600 sorts before U+E000 in UTF-16 (RFC 8785) and after it by code point.
    identity = make_identity("apply_patch", "1", {**ARGS, "x": {"\U0001F600": 1, "\ue000": 2, "a": 3}})
    r = make_receipt(identity=identity, call_id=compute_call_id(identity),
                     args_sha256=compute_args_sha256("apply_patch", "1", identity["args"]))
    assert parse(receipt_bytes(r)) == r


@pytest.mark.parametrize("value", [1.5, 2**53, -(2**60), 1e16], ids=["float", "2^53", "-2^60", "1e16"])
def test_values_outside_the_profile_are_refused_even_with_a_matching_sorted_digest(value: Any) -> None:
    doc = doc_of(make_receipt())
    doc["result"] = {"n": value}
    with pytest.raises(CorruptReceipt, match="cannot recompute hashes"):
        parse(sorted_digest(doc))


def test_hand_edits_are_caught_without_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    doc = doc_of(make_receipt())
    data = orjson.dumps(doc)
    monkeypatch.delitem(sys.modules, "orjson")  # the stdlib backend, no fast check
    back = parse(data)
    assert (back.key, back.status, back.identity) == (doc["key"], "committed", doc["identity"])
    doc["status"] = "rejected"
    assert reason_of(doc) == DIGEST_REASON
    doc = doc_of(make_receipt())
    doc["identity"]["args"]["patch_sha256"] = "b" * 64
    assert reason_of(redigest(doc)) == "call_id does not match identity"


@pytest.mark.parametrize("escaped", [False, True], ids=["plain", "with-escapes"])
def test_numbers_inside_strings_are_not_floats(monkeypatch: pytest.MonkeyPatch, escaped: bool) -> None:
    import receipts.receipt as receipt_mod

    note = 'version "1.5" said 2e3\n' if escaped else "version 1.5 said 2e3"
    r = make_receipt(result={"note": note, "n": 3})

    def no_walk(value: Any) -> Any:
        raise AssertionError("the checked walk ran")

    monkeypatch.setattr(receipt_mod, "normalise", no_walk)
    assert parse(receipt_bytes(r)) == r  # the fast check accepted it
    doc = doc_of(r)
    doc["result"]["n"] = 3.5
    monkeypatch.undo()
    with pytest.raises(CorruptReceipt, match="cannot recompute hashes"):
        parse(sorted_digest(doc))


def test_a_receipt_naming_a_member_twice_is_corrupt_though_its_digest_holds() -> None:
    """orjson keeps the last "status" of two, whose digest holds; a reader keeping the first saw another receipt."""
    data = receipt_bytes(make_receipt())
    assert parse_receipt(data, path="/s/r.json").status == "committed"
    twice = data.replace(b'  "status": "committed"', b'  "status": "rejected",\n  "status": "committed"', 1)
    assert twice != data
    with pytest.raises(CorruptReceipt, match="member 'status' is given twice"):
        parse_receipt(twice, path="/s/r.json")
    # Written otherwise (compact, keys in another order) but once each: still a receipt.
    assert parse_receipt(orjson.dumps(dict(reversed(list(orjson.loads(data).items())))), path="/s/r.json")

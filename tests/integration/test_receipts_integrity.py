"""A receipt is trusted only after it verifies on read (docs/DESIGN.md section 3).

A committed receipt is edited by hand; then `oncepatch status` must report it
corrupt (exit 6, `corrupt_receipt`) and `oncepatch apply` of the same call must
refuse it the same way without replaying or re-executing anything: no new
commit, the file and the whole store unchanged.  Unknown fields are tolerated
when the self-digest `receipt_sha256` covers them; missing required fields are
not.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot
from patcher.protocol import apply
from receipts.errors import CorruptReceipt
from receipts.store import ReceiptStore

PATCH = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"
REQUIRED = ["schema", "key", "call_id", "identity", "args_sha256", "tool", "tool_version", "status",
            "fencing_token", "owner", "created_at", "updated_at"]


def digest(doc: dict[str, Any]) -> str:
    """receipt_sha256, computed independently: sha256 of the canonical JSON of every other field."""
    body = {k: v for k, v in doc.items() if k != "receipt_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode()).hexdigest()


def write_doc(path: Path, doc: dict[str, Any], *, redigest: bool) -> None:
    doc = dict(doc)
    if redigest:
        doc["receipt_sha256"] = digest(doc)
    path.write_bytes(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n")


class Applied:
    def __init__(self, repo: Repo, patch_file: Path, result: dict[str, Any]) -> None:
        self.repo = repo
        self.patch_file = patch_file
        self.result = result
        self.key: str = result["key"]
        self.path = Path(result["receipt"])
        self.doc: dict[str, Any] = json.loads(self.path.read_bytes())

    def status(self) -> Any:
        return run_cli("status", self.key, "--repo", str(self.repo.path), "--json")

    def apply(self) -> Any:
        return run_cli("apply", str(self.patch_file), "--repo", str(self.repo.path), "--json")


@pytest.fixture
def applied(tmp_path: Path) -> Applied:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n", "src/util.py": "def f():\n    return 1\n"})
    patch_file = tmp_path / "p.patch"
    patch_file.write_bytes(PATCH)
    a = Applied(repo, patch_file, apply(str(repo.path), PATCH).to_json())  # in-process: set-up only
    assert a.doc["status"] == "committed"
    assert digest(a.doc) == a.doc["receipt_sha256"], "the test's digest must match the product's"
    return a


def assert_corrupt_and_inert(a: Applied, reason: str, *, human: bool = False) -> None:
    """status and apply both report corrupt_receipt (exit 6); apply changes nothing at all."""
    r = a.status()
    assert r.code == 6, r.out + r.err
    err = r.json["error"]
    assert r.json["ok"] is False and err["type"] == "corrupt_receipt"
    assert reason in err["reason"], err["reason"]
    assert err["path"] == str(a.path)
    assert err["effect_status"] == "unknown" and err["retryable"] is False

    before = snapshot(a.repo)
    data = a.path.read_bytes()
    mtime = a.path.stat().st_mtime_ns
    r = a.apply()
    assert r.code == 6, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "corrupt_receipt" and reason in err["reason"]
    assert err["effect_status"] == "unknown"
    assert snapshot(a.repo) == before  # no commit, no ref, no ledger line, no receipt write
    assert a.path.read_bytes() == data and a.path.stat().st_mtime_ns == mtime
    assert a.repo.count() == 2
    if not human:
        return
    # Human output goes to stderr, with the same exit code.
    r = run_cli("apply", str(a.patch_file), "--repo", str(a.repo.path))
    assert r.code == 6 and "corrupt_receipt" in r.err and r.out == ""


def _set(path: tuple[Any, ...], value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node: Any = doc
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value(node[path[-1]])

    return edit


def _flip(hexstr: str) -> str:
    return hexstr[:-1] + ("0" if hexstr[-1] != "0" else "1")


TAMPERS = {
    "status": _set(("status",), lambda v: "rejected"),
    "commit": _set(("commit",), lambda v: "0" * 40),
    "outputs_sha256": _set(("outputs", 0, "sha256"), _flip),
    "patch_sha256": _set(("identity", "args", "patch_sha256"), _flip),
    "key": _set(("key",), lambda v: "someone-else"),
    "fencing_token": _set(("fencing_token",), lambda v: v + 1),
}


@pytest.mark.parametrize("field", list(TAMPERS))
def test_edited_field_is_corrupt(applied: Applied, field: str) -> None:
    doc = copy.deepcopy(applied.doc)
    TAMPERS[field](doc)
    assert doc != applied.doc
    write_doc(applied.path, doc, redigest=False)
    assert_corrupt_and_inert(applied, "receipt_sha256 does not match", human=field == "status")


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        ("patch_sha256", "call_id does not match identity"),
        ("key", "key does not match the file name"),
    ],
)
def test_edited_field_with_recomputed_digest_is_still_corrupt(applied: Applied, field: str, reason: str) -> None:
    """The self-digest is not the only check: identity and key are recomputed too."""
    doc = copy.deepcopy(applied.doc)
    TAMPERS[field](doc)
    write_doc(applied.path, doc, redigest=True)
    assert_corrupt_and_inert(applied, reason)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_set(("call_id",), lambda v: "opc1:" + "0" * 64), "call_id does not match identity"),
        (_set(("args_sha256",), _flip), "args_sha256 does not match identity"),
        (_set(("identity", "attempt"), lambda v: 2), "call_id does not match identity"),
        (_set(("schema",), lambda v: "oncepatch.receipt/999"), "unknown schema"),
        (_set(("status",), lambda v: "done"), "unknown status"),
        (_set(("fencing_token",), lambda v: "1"), "wrong type"),
    ],
    ids=["call_id", "args_sha256", "attempt", "schema", "status_value", "token_type"],
)
def test_other_checks_on_read(applied: Applied, edit: Callable[[dict[str, Any]], None], reason: str) -> None:
    doc = copy.deepcopy(applied.doc)
    edit(doc)
    write_doc(applied.path, doc, redigest=True)
    with pytest.raises(CorruptReceipt) as info:
        ReceiptStore(str(applied.repo.store)).read(applied.key)
    assert reason in info.value.reason


def test_unknown_field_with_recomputed_digest_is_tolerated(applied: Applied) -> None:
    doc = dict(applied.doc, x_future_field={"from": "a later version", "n": 3})
    write_doc(applied.path, doc, redigest=True)
    data = applied.path.read_bytes()
    mtime = applied.path.stat().st_mtime_ns

    r = applied.status()
    assert r.code == 0, r.out + r.err
    assert r.json["receipt"]["x_future_field"] == {"from": "a later version", "n": 3}
    assert r.json["receipt"]["receipt_sha256"] == json.loads(data)["receipt_sha256"]
    r = applied.apply()
    assert r.code == 0, r.out + r.err
    assert r.json["replayed"] is True and r.json["commit"] == applied.result["commit"]
    assert applied.repo.count() == 2
    assert applied.path.read_bytes() == data and applied.path.stat().st_mtime_ns == mtime


def test_unknown_field_without_recomputed_digest_is_corrupt(applied: Applied) -> None:
    doc = dict(applied.doc, x_sneaky="added by hand")
    write_doc(applied.path, doc, redigest=False)
    assert_corrupt_and_inert(applied, "receipt_sha256 does not match")


def test_missing_required_field_is_corrupt_cli(applied: Applied) -> None:
    doc = {k: v for k, v in applied.doc.items() if k != "fencing_token"}
    write_doc(applied.path, doc, redigest=True)
    assert_corrupt_and_inert(applied, "missing field 'fencing_token'")


@pytest.mark.parametrize("field", [*REQUIRED, "receipt_sha256"])
def test_missing_required_field_is_corrupt(applied: Applied, field: str) -> None:
    doc = {k: v for k, v in applied.doc.items() if k != field}
    write_doc(applied.path, doc, redigest=field != "receipt_sha256")
    with pytest.raises(CorruptReceipt) as info:
        ReceiptStore(str(applied.repo.store)).read(applied.key)
    assert f"missing field '{field}'" in info.value.reason


def test_not_json_is_corrupt(applied: Applied) -> None:
    applied.path.write_bytes(applied.path.read_bytes()[:-20])
    assert_corrupt_and_inert(applied, "not JSON")


def test_untampered_receipt_verifies(applied: Applied) -> None:
    """The control: the same checks pass on the receipt as written."""
    r = applied.status()
    assert r.code == 0, r.out + r.err
    assert r.json["receipt"] == applied.doc
    r = applied.apply()
    assert r.code == 0 and r.json["replayed"] is True


def test_a_member_given_twice_is_corrupt_though_the_last_values_digest_holds(applied: Applied) -> None:
    """orjson keeps the last of two "commit" members (the digest holds for it); a reader keeping the first
    would see another commit: neither is believed."""
    data = applied.path.read_bytes()
    twice = data.replace(b'  "commit": "', b'  "commit": "' + b"0" * 40 + b'",\n  "commit": "', 1)
    assert twice != data
    applied.path.write_bytes(twice)
    assert_corrupt_and_inert(applied, "member 'commit' is given twice")
    r = run_cli("verify", "--repo", str(applied.repo.path), "--json")
    assert r.code == 6, r.out

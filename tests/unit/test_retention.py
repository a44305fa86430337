"""gc's pure parts: the retention policy, redaction, and the ledger checkpoint's chain (no disk)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from cas.errors import UsageError
from receipts.canonical import canonical_json
from receipts.errors import CorruptReceipt
from receipts.gc import redact_receipt
from receipts.identity import compute_args_sha256, compute_call_id, key_hash, make_identity
from receipts.ledger import GENESIS, check_chain, checkpoint_event
from receipts.receipt import Receipt, parse_receipt, receipt_bytes
from receipts.retention import parse_retention

ARGS = {"repo": "/r", "branch": "refs/heads/main", "patch_sha256": "a" * 64, "message": "customer 4711"}


def receipt() -> Receipt:
    identity = make_identity("apply_patch", "1", dict(ARGS))
    return Receipt(key="k", call_id=compute_call_id(identity), identity=identity,
                   args_sha256=compute_args_sha256("apply_patch", "1", ARGS), tool="apply_patch", tool_version="1",
                   status="rejected", retryable=False, fencing_token=1, owner={"pid": 1},
                   created_at="2024-01-01T00:00:00.000000Z", updated_at="2024-01-01T00:00:01.000000Z",
                   error={"type": "conflict", "message": "secret path /home/x", "retryable": False})


def test_policy_parses_every_table() -> None:
    p = parse_retention("p.toml", """
schema = "oncepatch.retention/1"
[remove]
older_than_days = 1.5
states = ["rejected"]
key_prefixes = ["t/"]
tools = ["apply_patch"]
[keep]
key_prefixes = ["release/"]
ledger_days = 7
ledger_events = 10
[redact]
older_than_days = 0
fields = ["args.message", "error.message", "result"]
[archive]
dir = "kept/archives"
""")
    assert p.remove is not None and p.remove.older_than == 1.5 * 86400 and p.remove.states == ("rejected",)
    assert p.keep_prefixes == ("release/",) and p.ledger_seconds == 7 * 86400 and p.ledger_events == 10
    assert p.redact is not None and p.redact.fields == ("args.message", "error.message", "result")
    assert p.archive_folder("/s") == "/s/kept/archives"


@pytest.mark.parametrize("text", [
    "[remove]\nolder_then_days = 1\n", "[keep]\nledger_day = 1\n", "retain = 1\n", "[remove]\nstates = [\"unknown\"]\n",
    "[remove]\nolder_than_days = -1\n", "[remove]\nolder_than_days = inf\n", "[remove]\nolder_than_days = nan\n",
    f"[remove]\nolder_than_days = {10 ** 400}\n", "[keep]\nledger_days = inf\n", f"[keep]\nledger_days = {10 ** 30}\n",
    "[redact]\nolder_than_days = 36501\n", "[redact]\nfields = [\"body\"]\n", "[keep]\nledger_events = true\n",
    "schema = \"oncepatch.retention/2\"\n",
    # What verify, replay, drift or a compensation link read: never redacted.
    "[redact]\nfields = [\"args.repo\"]\n", "[redact]\nfields = [\"args.branch\"]\n",
    "[redact]\nfields = [\"args.patch_sha256\"]\n", "[redact]\nfields = [\"args.format\"]\n",
    "[redact]\nfields = [\"args.compensates\"]\n",
    # The archive holds whole receipts: never outside the store.
    "[archive]\ndir = \"../../../outside\"\n", "[archive]\ndir = \"/var/archives\"\n",
    "[archive]\ndir = \"archives/../../x\"\n",
])
def test_policy_refuses_what_it_does_not_know(text: str) -> None:
    with pytest.raises(UsageError) as ei:
        parse_retention("p.toml", text)
    assert ei.value.exit_code == 2 and "p.toml" in ei.value.message


def test_a_redacted_receipt_verifies_and_keeps_its_identity_hashes() -> None:
    r = receipt()
    red, fields = redact_receipt(r, ("args.message", "error.message", "result"))
    assert set(fields) == {"args.message", "error.message"}  # no result to redact
    assert fields["args.message"] == hashlib.sha256(canonical_json("customer 4711")).hexdigest()
    data = receipt_bytes(red)
    assert b"4711" not in data and b"/home/x" not in data
    back = parse_receipt(data, path="r.json", expected_key_hash=key_hash("k"))
    assert (back.call_id, back.args_sha256) == (r.call_id, r.args_sha256)
    assert back.args["message"] == "redacted:sha256:" + fields["args.message"]
    # Any other edit of a redacted receipt is still caught by its digest.
    with pytest.raises(CorruptReceipt):
        parse_receipt(data.replace(b'"rejected"', b'"committed"'), path="r.json")
    # Redacting again changes nothing more.
    assert redact_receipt(red, ("args.message",))[1] == {}


def chain(n: int) -> list[bytes]:
    lines, prev = [], GENESIS
    for seq in range(1, n + 1):
        line = canonical_json({"at": "t", "event": "committed", "key": f"k{seq}", "seq": seq, "prev": prev})
        lines.append(line)
        prev = hashlib.sha256(line).hexdigest()
    return lines


def compacted(lines: list[bytes], upto: int) -> list[bytes]:
    cp = canonical_json(checkpoint_event(lines[:upto], prev=GENESIS, first_seq=1, fields={}))
    rest = lines[upto:]
    last: dict[str, Any] = {"seq": len(lines), "prev": hashlib.sha256(rest[-1] if rest else lines[upto - 1]).hexdigest()}
    confirm = canonical_json({"at": "t", "event": "compacted", "checkpoint_sha256": hashlib.sha256(cp).hexdigest(),
                              "seq": last["seq"] + 1, "prev": last["prev"]})
    return [cp, *rest, confirm]


def problems(lines: list[bytes]) -> list[str]:
    return [p.reason for p in check_chain([line + b"\n" for line in lines])]


def test_a_checkpoint_stands_for_the_events_it_replaced() -> None:
    lines = chain(6)
    assert problems(lines) == []
    out = compacted(lines, 4)
    assert out[1:-1] == lines[4:]  # the later lines stay byte for byte
    assert problems(out) == []


def test_an_edited_or_unconfirmed_checkpoint_breaks_the_chain() -> None:
    out = compacted(chain(6), 4)
    assert problems(out[:-1]) == ["checkpoint not confirmed by a later 'compacted' event"]
    edited = out[0].replace(b'"events":4', b'"events":3')
    assert "checkpoint not confirmed" in " ".join(problems([edited, *out[1:]]))
    cp = json.loads(out[0])
    wrong_head = canonical_json({**cp, "head": "0" * 64})
    assert "hash chain broken" in " ".join(problems([wrong_head, *out[1:]]))


def test_retired_keys_follow_removed_events_and_checkpoints() -> None:
    from receipts.retired import retired_keys

    events: list[dict[str, Any]] = [
        {"event": "checkpoint", "seq": 4, "retired": {"old": {"seq": 2, "at": "2026-01-01T00:00:00Z"}}},
        {"event": "committed", "seq": 5, "key": "a"},
        {"event": "removed", "seq": 6, "key": "a", "at": "2026-02-01T00:00:00Z", "bundle_sha256": "b" * 64},
        {"event": "committed", "seq": 7, "key": "q"},
        {"event": "removed", "seq": 8, "key": "q"},
        {"event": "quarantined", "seq": 9, "key": "q"},  # a later event of a key says what it is
    ]
    got = retired_keys(events)
    assert set(got) == {"old", "a"}
    assert got["a"]["seq"] == 6 and got["a"]["bundle_sha256"] == "b" * 64
    assert got["old"] == {"seq": 2, "at": "2026-01-01T00:00:00Z"}


def test_verify_archive_caps_the_bytes_read_across_members(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip
    import io
    import tarfile

    from receipts import archive

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(4):
            info = tarfile.TarInfo(f"m{i}")
            info.size = 100
            tar.addfile(info, io.BytesIO(b"x" * 100))
    path = tmp_path / "a.tar.gz"
    path.write_bytes(gzip.compress(buf.getvalue()))
    monkeypatch.setattr(archive, "_MEMBER_MAX", 150)  # every member fits on its own ...
    monkeypatch.setattr(archive, "_TOTAL_MAX", 250)  # ... three together do not
    report = archive.verify_archive(str(path))
    assert not report.ok and "more than 250 bytes" in report.failures[0]

"""Recovery never launders a store changed by hand (issue 25, docs/RECOVERY.md).

* a ledger that lost events (truncated to nothing, to its first line), a chain
  break or a missing genesis: ``recover`` reports it corrupt, exit 6, and
  changes nothing; ``verify`` keeps failing;
* only a torn last line of the ledger's own is repaired (a whole event that
  lost its newline is kept, not cut and recorded anew);
* a key ref pointed by hand at a crashed call's candidate, which the branch
  never held: neither ``recover`` nor the next call settles it ``committed``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from conftest import Repo, make_repo, run_cli, snapshot

from receipts.store import ReceiptStore

BASE: dict[str, str | bytes] = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 11))}


def _patch(i: int) -> bytes:
    return f"--- /dev/null\n+++ b/f{i}.txt\n@@ -0,0 +1 @@\n+file {i}\n".encode()


def _apply(repo: Repo, i: int, key: str, env: dict[str, str] | None = None) -> object:
    pf = repo.path.parent / f"p{i}.diff"
    pf.write_bytes(_patch(i))
    return run_cli("apply", str(pf), "--repo", str(repo.path), "--key", key, "--json", env=env)


def _committed(tmp_path: Path, n: int) -> Repo:
    repo = make_repo(tmp_path / "repo", BASE)
    for i in range(n):
        r = _apply(repo, i, f"k{i}")
        assert r.code == 0, r.err  # type: ignore[attr-defined]
    return repo


def _verify(repo: Repo) -> object:
    return run_cli("verify", "--repo", str(repo.path), "--json")


def _recover(repo: Repo, *extra: str) -> object:
    return run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0", *extra)


def _lines(repo: Repo) -> list[bytes]:
    return (repo.store / "events.jsonl").read_bytes().splitlines(keepends=True)


@pytest.mark.parametrize("cut", ["to nothing", "to its first line", "its first line removed",
                                 "a middle line removed"])
def test_a_ledger_that_lost_events_is_reported_not_laundered(tmp_path: Path, cut: str) -> None:
    repo = _committed(tmp_path, 3)
    lines = _lines(repo)
    assert len(lines) >= 6  # prepared + committed per call
    kept = {"to nothing": [], "to its first line": lines[:1], "its first line removed": lines[1:],
            "a middle line removed": lines[:2] + lines[3:]}[cut]
    (repo.store / "events.jsonl").write_bytes(b"".join(kept))
    assert _verify(repo).code == 6  # type: ignore[attr-defined]
    before = snapshot(repo)
    for extra in ((), ("--dry-run",)):
        r = _recover(repo, *extra)
        assert r.code == 6, r.out + r.err  # type: ignore[attr-defined]
        doc = r.json  # type: ignore[attr-defined]
        assert doc["ok"] is False and doc["corrupt"] and doc["ledger_repaired"] == [] and doc["rows"] == []
        assert snapshot(repo) == before  # nothing recorded anew, nothing settled
    assert _verify(repo).code == 6  # type: ignore[attr-defined]


def test_a_last_line_without_its_newline_is_completed_not_cut(tmp_path: Path) -> None:
    """The whole event is there: recover keeps it (byte for byte) and records the repair."""
    repo = _committed(tmp_path, 2)
    ledger = repo.store / "events.jsonl"
    good = ledger.read_bytes()
    ledger.write_bytes(good[:-1])
    assert _verify(repo).code == 6  # type: ignore[attr-defined]
    r = _recover(repo)
    assert r.code == 0, r.out + r.err  # type: ignore[attr-defined]
    assert r.json["ledger_repaired"] == []  # type: ignore[attr-defined]  # no receipt recorded anew
    data = ledger.read_bytes()
    assert data.startswith(good) and b'"reason":"last_line_newline"' in data[len(good):]
    assert b"ledger_gap" not in data
    assert _verify(repo).code == 0  # type: ignore[attr-defined]


def test_a_torn_last_line_that_is_no_append_of_ours_is_reported(tmp_path: Path) -> None:
    repo = _committed(tmp_path, 1)
    ledger = repo.store / "events.jsonl"
    with open(ledger, "ab") as fh:
        fh.write(b'{"at":"2026-01-01T00:00:00Z","event":"x","prev":"' + b"1" * 64 + b'"')  # another chain
    before = snapshot(repo)
    r = _recover(repo)
    assert r.code == 6 and "torn" in r.out  # type: ignore[attr-defined]
    assert snapshot(repo) == before


def test_a_call_on_a_ledger_with_a_foreign_torn_tail_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """No call cuts, or chains onto, a torn last line it did not write; a replay answers with a warning."""
    repo = _committed(tmp_path, 1)
    ledger = repo.store / "events.jsonl"
    with open(ledger, "ab") as fh:
        fh.write(b'{"event":"forged","seq":')  # no event starts so
    before = snapshot(repo)
    r = _apply(repo, 5, "new")
    assert r.code == 6, r.out + r.err  # type: ignore[attr-defined]
    err = r.json["error"]  # type: ignore[attr-defined]
    assert (err["type"], err["effect_status"], err["next_action"]) == ("corrupt_receipt", "not_started", "recover")
    assert "oncepatch recover" in err["message"] and "torn" in err["message"]
    assert snapshot(repo) == before  # no receipt, no lock file, the tail kept
    replay = _apply(repo, 0, "k0")
    assert replay.code == 0 and replay.json["replayed"] is True  # type: ignore[attr-defined]
    assert any("not noted in the ledger" in w for w in replay.json["warnings"])  # type: ignore[attr-defined]
    assert snapshot(repo) == before
    assert _recover(repo).code == 6  # type: ignore[attr-defined]
    assert run_cli("quarantine", "--ledger", "--repo", str(repo.path), "--json").code == 0
    assert _apply(repo, 5, "new").code == 0  # type: ignore[attr-defined]
    assert _verify(repo).code == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", ["seq only", "another chain's prev", "a seq out of turn", "an array"])
def test_a_whole_last_line_that_is_no_event_of_the_chain_refuses_the_call_first(tmp_path: Path, shape: str) -> None:
    """Valid JSON with a newline but no event of the chain (`{"seq":5}`): refused before the call's first write.

    Only the last line's seq used to be read, so a call wrote its receipt and chained its events onto it.
    """
    repo = _committed(tmp_path, 2)
    ledger = repo.store / "events.jsonl"
    last = _lines(repo)[-1]
    digest = hashlib.sha256(last[:-1]).hexdigest()
    line = {"seq only": b'{"seq":5}',
            "another chain's prev": b'{"at":"2026-01-01T00:00:00Z","event":"x","prev":"' + b"1" * 64 + b'","seq":5}',
            "a seq out of turn": b'{"at":"2026-01-01T00:00:00Z","event":"x","prev":"' + digest.encode()
                                 + b'","seq":9}',
            "an array": b'[1,2]'}[shape]
    with open(ledger, "ab") as fh:
        fh.write(line + b"\n")
    before = snapshot(repo)
    r = _apply(repo, 5, "new")
    assert r.code == 6, r.out + r.err  # type: ignore[attr-defined]
    err = r.json["error"]  # type: ignore[attr-defined]
    assert (err["type"], err["effect_status"], err["next_action"]) == ("corrupt_receipt", "not_started", "recover")
    assert "last line" in err["message"] and "oncepatch quarantine --ledger" in err["message"]
    assert snapshot(repo) == before  # no receipt, no lock file, nothing chained onto the line
    assert _recover(repo).code == 6  # type: ignore[attr-defined]
    assert snapshot(repo) == before
    assert run_cli("quarantine", "--ledger", "--repo", str(repo.path), "--json").code == 0
    assert _apply(repo, 5, "new").code == 0  # type: ignore[attr-defined]
    assert _verify(repo).code == 0  # type: ignore[attr-defined]


def test_a_tail_torn_by_a_killed_append_lets_the_next_call_run_and_recover_finish(tmp_path: Path) -> None:
    """What a call killed in the middle of its last append leaves: a prefix of that event."""
    repo = _committed(tmp_path, 2)
    ledger = repo.store / "events.jsonl"
    lines = _lines(repo)
    ledger.write_bytes(b"".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])  # k1's committed event, torn
    assert _verify(repo).code == 6  # type: ignore[attr-defined]
    r = _apply(repo, 5, "new")
    assert r.code == 0, r.out + r.err  # type: ignore[attr-defined]
    assert lines[-1][:len(lines[-1]) // 2] not in ledger.read_bytes()  # the torn bytes were no event: cut
    rec = _recover(repo)
    assert rec.code == 0 and rec.json["ledger_repaired"] == ["k1"]  # type: ignore[attr-defined]
    assert _verify(repo).code == 0  # type: ignore[attr-defined]


def test_a_receipt_rewritten_after_its_ledger_events_is_still_repaired(tmp_path: Path) -> None:
    """The crash the repair is for: the receipt's latest state is missing, its history is not."""
    repo = _committed(tmp_path, 2)
    store = ReceiptStore(str(repo.store))
    r = store.read("k1")
    assert r is not None
    store.write(r.evolve(result={**(r.result or {}), "note": "rewritten"}))  # no event for this state
    rec = _recover(repo)
    assert rec.code == 0 and rec.json["ledger_repaired"] == ["k1"]  # type: ignore[attr-defined]
    assert _verify(repo).code == 0  # type: ignore[attr-defined]


# -- a key ref set by hand -----------------------------------------------------------------------


def _crashed_with_forged_key_ref(tmp_path: Path) -> tuple[Repo, str]:
    repo = make_repo(tmp_path / "repo", BASE)
    crashed = _apply(repo, 7, "forged", env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    assert crashed.code == 137, crashed.err  # type: ignore[attr-defined]
    r = ReceiptStore(str(repo.store)).read("forged")
    assert r is not None and r.status == "prepared" and r.candidate
    ref = "refs/oncepatch/keys/" + hashlib.sha256(b"forged").hexdigest()
    repo.git("update-ref", ref, r.candidate)
    return repo, r.candidate


def test_recover_does_not_settle_a_key_ref_the_branch_never_held(tmp_path: Path) -> None:
    repo, candidate = _crashed_with_forged_key_ref(tmp_path)
    head = repo.head()
    rec = _recover(repo)
    assert rec.code == 6, rec.out + rec.err  # type: ignore[attr-defined]
    doc = rec.json  # type: ignore[attr-defined]
    assert doc["rows"] == [] and "never held" in doc["corrupt"][0]["reason"]
    r = ReceiptStore(str(repo.store)).read("forged")
    assert r is not None and r.status == "prepared"  # settled as nothing
    assert repo.head() == head != candidate


def test_the_next_call_does_not_replay_a_key_ref_the_branch_never_held(tmp_path: Path) -> None:
    repo, _candidate = _crashed_with_forged_key_ref(tmp_path)
    head = repo.head()
    again = _apply(repo, 7, "forged")
    assert again.code == 6, again.out + again.err  # type: ignore[attr-defined]
    assert again.json["error"]["type"] == "corrupt_receipt"  # type: ignore[attr-defined]
    assert repo.head() == head
    r = ReceiptStore(str(repo.store)).read("forged")
    assert r is not None and r.status == "prepared"


# -- quarantine: a person moves the evidence aside ---------------------------------------------------


def _quarantine(repo: Repo, *args: str) -> object:
    return run_cli("quarantine", *args, "--repo", str(repo.path), "--json")


def test_quarantining_a_ledger_that_lost_events_keeps_it_and_verify_says_so(tmp_path: Path) -> None:
    repo = _committed(tmp_path, 3)
    ledger = repo.store / "events.jsonl"
    damaged = b"".join(_lines(repo)[:1])
    ledger.write_bytes(damaged)
    assert _recover(repo).code == 6  # type: ignore[attr-defined]
    q = _quarantine(repo, "--ledger", "--note", "cut by hand")
    assert q.code == 0, q.out + q.err  # type: ignore[attr-defined]
    record = q.json["quarantined"]  # type: ignore[attr-defined]
    assert record["what"] == "ledger" and sorted(record["adopted"]) == ["k0", "k1", "k2"]
    moved = repo.store / record["to"]
    assert moved.read_bytes() == damaged  # the evidence, byte for byte, never deleted
    assert record["file_sha256"] == hashlib.sha256(damaged).hexdigest()
    first = _lines(repo)[0]
    assert b'"event":"quarantined"' in first and record["to"].encode() in first
    v = _verify(repo)
    assert v.code == 0, v.out + v.err  # type: ignore[attr-defined]
    assert [qq["to"] for qq in v.json["quarantined"]] == [record["to"]]  # type: ignore[attr-defined]
    text = run_cli("verify", "--repo", str(repo.path))
    assert text.code == 0 and "quarantined: ledger moved to" in text.out
    assert _recover(repo).json["changed"] is False  # type: ignore[attr-defined]


def test_quarantining_a_corrupt_receipt_moves_it_aside_and_the_key_is_refused_clearly(tmp_path: Path) -> None:
    repo = _committed(tmp_path, 2)
    path = Path(ReceiptStore(str(repo.store)).receipt_path("k1"))
    path.write_bytes(b"garbage\n")
    assert _verify(repo).code == 6  # type: ignore[attr-defined]
    assert _quarantine(repo).code == 2  # type: ignore[attr-defined]  # neither a key nor --ledger
    q = _quarantine(repo, "k1")
    assert q.code == 0, q.out + q.err  # type: ignore[attr-defined]
    record = q.json["quarantined"]  # type: ignore[attr-defined]
    assert not path.exists() and (repo.store / record["to"]).read_bytes() == b"garbage\n"
    assert (repo.store / record["to"]).parent.parent.joinpath("record.json").exists()
    v = _verify(repo)
    assert v.code == 0, v.out + v.err  # type: ignore[attr-defined]
    assert [(x["what"], x["key"]) for x in v.json["quarantined"]] == [("receipt", "k1")]  # type: ignore[attr-defined]
    head = repo.head()
    again = _apply(repo, 1, "k1")  # its change is on the branch, its receipt aside: refused, not re-applied
    assert again.code == 3 and "no receipt" in again.json["error"]["message"]  # type: ignore[attr-defined]
    assert repo.head() == head
    assert _quarantine(repo, "k1").code == 2  # type: ignore[attr-defined]  # nothing left to move


def test_a_receipt_file_removed_by_hand_is_quarantined_and_verify_agrees_with_what_remains(tmp_path: Path) -> None:
    """The dead end of issue 31: a receipt file gone (or a whole store) blocked every commit for good."""
    repo = _committed(tmp_path, 3)
    Path(ReceiptStore(str(repo.store)).receipt_path("k1")).unlink()
    text = run_cli("verify", "--repo", str(repo.path))
    assert text.code == 6 and "file is missing" in text.out
    assert "oncepatch quarantine KEY" in text.err  # the failure names the way out
    rec = run_cli("recover", "--repo", str(repo.path))
    assert rec.code == 6 and "oncepatch quarantine KEY" in rec.err
    assert _quarantine(repo, "no-such-key").code == 2  # a key nothing shows is not recorded
    q = _quarantine(repo, "k1", "--note", "removed by hand")
    assert q.code == 0, q.out + q.err  # type: ignore[attr-defined]
    record = q.json["quarantined"]  # type: ignore[attr-defined]
    assert record["what"] == "missing_receipt" and record["key"] == "k1" and "refs/oncepatch/keys/" in record["evidence"]
    assert (repo.store / record["to"] / "record.json").exists()
    v = _verify(repo)
    assert v.code == 0, v.out + v.err  # type: ignore[attr-defined]
    assert [(x["what"], x["key"]) for x in v.json["quarantined"]] == [("missing_receipt", "k1")]  # type: ignore[attr-defined]
    assert v.json["receipts"] == 2  # type: ignore[attr-defined]
    assert _quarantine(repo, "k1").code == 2  # type: ignore[attr-defined]  # already quarantined


def test_a_deleted_store_fails_verify_until_each_key_ref_is_accounted_for(tmp_path: Path) -> None:
    repo = _committed(tmp_path, 2)
    import shutil

    shutil.rmtree(repo.store)
    v = _verify(repo)
    assert v.code == 6 and len(v.json["failures"]) == 2  # type: ignore[attr-defined]  # one per key ref
    assert all("oncepatch quarantine KEY" in f["reason"] for f in v.json["failures"])  # type: ignore[attr-defined]
    assert _quarantine(repo, "k0").code == 0  # type: ignore[attr-defined]  # found by its key ref
    v = _verify(repo)
    assert v.code == 6 and len(v.json["failures"]) == 1, v.out  # type: ignore[attr-defined]  # k1's ref still stray
    assert _quarantine(repo, "k1").code == 0  # type: ignore[attr-defined]
    v = _verify(repo)
    assert v.code == 0, v.out  # type: ignore[attr-defined]
    assert sorted(x["key"] for x in v.json["quarantined"]) == ["k0", "k1"]  # type: ignore[attr-defined]

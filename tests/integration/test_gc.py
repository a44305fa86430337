"""``oncepatch gc --policy``: retention on stores made by real calls (docs/LIFECYCLE.md, "gc").

What goes is archived first (a bundle ``gc --verify-archive`` proves); what a
live or unsettled call needs stays; key refs go with their receipts, git
objects never; the ledger's oldest events become a chained checkpoint and
``verify`` passes after every run.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot
from receipts.identity import key_hash

BASE = {"src/app.py": "".join(f"line {i}\n" for i in range(1, 31))}
REMOVE_ALL = "[remove]\nolder_than_days = 0\n"


def change(repo: Repo, line: int, word: str) -> bytes:
    """A unified diff replacing ``line N`` of src/app.py with ``word`` against the branch's head."""
    head = repo.head()
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace(f"line {line}\n", f"{word}\n"))
    diff = repo.git("diff", "--full-index").encode()
    repo.git("checkout", "-q", head, "--", "src/app.py")
    return diff


def apply(repo: Repo, patch: bytes, key: str, *extra: str, env: dict[str, str] | None = None) -> Any:
    return run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", key, *extra, input=patch, env=env)


def gc(repo: Repo, policy: str, *extra: str, tmp: Path) -> Any:
    pf = tmp / "policy.toml"
    pf.write_text(policy)
    return run_cli("gc", "--repo", str(repo.path), "--policy", str(pf), "--json", *extra)


def verify_ok(repo: Repo) -> dict[str, Any]:
    r = run_cli("verify", "--repo", str(repo.path), "--json", "--jobs", "1")
    assert r.code == 0, r.out + r.err
    doc: dict[str, Any] = r.json
    return doc


def key_refs(repo: Repo) -> list[str]:
    return repo.git("for-each-ref", "--format=%(refname)", "refs/oncepatch/keys/").split()


def events(repo: Repo) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (repo.store / "events.jsonl").read_bytes().splitlines()]


def three_calls(tmp_path: Path) -> Repo:
    repo = make_repo(tmp_path / "repo", BASE)
    for key, line in (("task-a/1", 3), ("task-a/2", 10), ("task-b/1", 20)):
        r = apply(repo, change(repo, line, key), key)
        assert r.code == 0, r.out + r.err
    return repo


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    before = snapshot(repo)
    r = gc(repo, REMOVE_ALL, "--dry-run", tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert sorted(x["key"] for x in r.json["remove"]) == ["task-a/1", "task-a/2", "task-b/1"]
    assert r.json["compact"] == {"first_seq": 1, "last_seq": 6}
    assert r.json["removed"] == [] and r.json["archive"] is None
    assert snapshot(repo) == before


@pytest.mark.parametrize("policy, why", [
    ("[remove]\nolder_than_day = 0\n", "unknown key 'remove.older_than_day'"),
    ("[remvoe]\nolder_than_days = 0\n", "unknown key 'remvoe'"),
    ("[remove]\nstates = [\"prepared\"]\n", "may name only committed and rejected"),
    ("[remove\n", "not TOML"),
])
def test_a_policy_with_a_misspelt_key_is_refused_and_changes_nothing(tmp_path: Path, policy: str, why: str) -> None:
    repo = three_calls(tmp_path)
    before = snapshot(repo)
    r = gc(repo, policy, tmp=tmp_path)
    assert r.code == 2, r.out + r.err
    assert why in r.json["error"]["message"]
    assert snapshot(repo) == before


def test_gc_archives_removes_with_key_refs_compacts_and_verify_passes(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    commits = {e["key"]: e["commit"] for e in events(repo) if e["event"] == "committed"}
    r = gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["task-a/"]\n', tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    doc = r.json
    assert sorted(x["key"] for x in doc["removed"]) == ["task-a/1", "task-a/2"]
    # Key refs went with their receipts; git objects never go.
    assert len(key_refs(repo)) == 1
    for key in ("task-a/1", "task-a/2"):
        repo.git("cat-file", "-e", commits[key])
        assert run_cli("status", key, "--repo", str(repo.path), "--json").code == 2
    assert run_cli("status", "task-b/1", "--repo", str(repo.path), "--json").code == 0
    # The oldest four events (task-a's) became one checkpoint, confirmed at the end.
    ev = events(repo)
    assert ev[0]["event"] == "checkpoint" and (ev[0]["first_seq"], ev[0]["seq"]) == (1, 4)
    assert ev[-1]["event"] == "compacted"
    assert ev[0]["bundle_sha256"] == doc["archive_sha256"]
    assert [e["key"] for e in ev if e["event"] == "removed"] == ["task-a/1", "task-a/2"]
    assert verify_ok(repo)["ok"]
    # The archive round-trip: it proves itself, and its head is the checkpoint's.
    v = run_cli("gc", "--verify-archive", doc["archive"], "--repo", str(repo.path), "--json")
    assert v.code == 0, v.out + v.err
    assert v.json["receipts"] == 2 and (v.json["first_seq"], v.json["last_seq"]) == (1, 4)
    assert v.json["head"] == ev[0]["head"]
    assert hashlib.sha256(Path(doc["archive"]).read_bytes()).hexdigest() == doc["archive_sha256"]
    # A second run finds nothing of task-a left, and the store still verifies.
    again = gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["task-a/"]\n', tmp=tmp_path)
    assert again.code == 0 and again.json["removed"] == [] and again.json["archive"] is None
    verify_ok(repo)


def _rewrite_member(archive: Path, out: Path, name_part: str) -> None:
    """Copy ``archive`` to ``out`` with one byte of the member whose name holds ``name_part`` changed."""
    src = tarfile.open(archive, "r:gz")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as dst:
        for info in src:
            data = src.extractfile(info).read()  # type: ignore[union-attr]
            if name_part in info.name:
                data = data.replace(b"task-a", b"task-x", 1)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    out.write_bytes(gzip.compress(buf.getvalue()))


@pytest.mark.parametrize("member", ["receipts/", "events.jsonl"])
def test_a_changed_archive_does_not_verify(tmp_path: Path, member: str) -> None:
    repo = three_calls(tmp_path)
    doc = gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["task-a/"]\n', tmp=tmp_path).json
    bad = tmp_path / "bad.tar.gz"
    _rewrite_member(Path(doc["archive"]), bad, member)
    v = run_cli("gc", "--verify-archive", str(bad), "--repo", str(repo.path), "--json")
    assert v.code == 6, v.out + v.err
    assert v.json["ok"] is False and v.json["failures"]


def test_a_removed_key_is_new_again_and_never_commits_twice(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    patch = change(repo, 30, "later")
    assert apply(repo, patch, "task-a/3").code == 0
    assert gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["task-a/3"]\n', tmp=tmp_path).code == 0
    count = repo.count()
    # Its receipt and key ref are gone: the key runs as a first call, finds its edit on the
    # branch and makes no second commit.
    r = apply(repo, patch, "task-a/3")
    assert r.code == 0, r.out + r.err
    assert r.json["replayed"] is False and r.json.get("already_applied") is True
    assert repo.count() == count
    verify_ok(repo)


@pytest.mark.parametrize("point, outcome", [("after-prepare", "rejected"), ("after-ref", "committed"),
                                            ("before-receipt-replace", "committed")])
def test_gc_never_removes_what_a_crashed_call_needs(tmp_path: Path, point: str, outcome: str) -> None:
    repo = three_calls(tmp_path)
    base = repo.count()
    patch = change(repo, 25, "crashed")
    crashed = apply(repo, patch, "crash/1", env={"ONCEPATCH_CRASH_AT": point})
    assert crashed.code == 137, crashed.out + crashed.err
    refs_before = key_refs(repo)
    # gc between the crash and its recovery: the unsettled receipt, its key ref and every
    # event of its key stay; the others go.
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert sorted(x["key"] for x in r.json["removed"]) == ["task-a/1", "task-a/2", "task-b/1"]
    assert [s["key"] for s in r.json["stays"]] == ["crash/1"] and "unsettled" in r.json["stays"][0]["reason"]
    crash_ref = "refs/oncepatch/keys/" + key_hash("crash/1")
    assert key_refs(repo) == [x for x in refs_before if x == crash_ref]
    assert (crash_ref in refs_before) is (point == "before-receipt-replace")  # made with the final receipt
    assert any(e.get("key") == "crash/1" for e in events(repo))
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    status = run_cli("status", "crash/1", "--repo", str(repo.path), "--json")
    assert status.json["receipt"]["status"] == outcome
    # The retry lands once (or replays), and the store verifies; gc again removes it cleanly.
    again = apply(repo, patch, "crash/1")
    assert again.code == 0, again.out + again.err
    assert repo.count() == base + 1
    verify_ok(repo)
    assert gc(repo, REMOVE_ALL, tmp=tmp_path).code == 0
    assert key_refs(repo) == []
    verify_ok(repo)


def test_redaction_replaces_bodies_with_digests_and_the_receipt_still_verifies(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", BASE)
    patch = change(repo, 5, "five")
    assert apply(repo, patch, "secret/1", "-m", "customer 4711 asked for this").code == 0
    r = gc(repo, '[redact]\nfields = ["args.message"]\n', tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert [x["key"] for x in r.json["redacted"]] == ["secret/1"]
    receipt = run_cli("status", "secret/1", "--repo", str(repo.path), "--json").json["receipt"]
    digest = hashlib.sha256(json.dumps("customer 4711 asked for this").encode()).hexdigest()
    assert receipt["identity"]["args"]["message"] == f"redacted:sha256:{digest}"
    assert "4711" not in json.dumps(receipt)
    red = [e for e in events(repo) if e["event"] == "redacted"]
    assert len(red) == 1 and red[0]["redacted"] == {"args.message": digest}
    verify_ok(repo)
    # The same call again replays (args_sha256 stands as recorded).
    again = apply(repo, patch, "secret/1", "-m", "customer 4711 asked for this")
    assert again.code == 0 and again.json["replayed"] is True


def test_signed_store_gc_keeps_verify_passing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", BASE)
    assert run_cli("keys", "init", "--repo", str(repo.path), "--json").code == 0
    for key, line in (("old/1", 3), ("old/2", 9), ("new/1", 15)):
        assert apply(repo, change(repo, line, key), key).code == 0
    r = gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["old/"]\n', tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert r.json["compacted"] is not None
    ev = events(repo)
    assert ev[0]["event"] == "checkpoint" and "signature" in ev[0] and "signature" in ev[-1]
    doc = verify_ok(repo)
    assert doc["signatures"]["mode"] == "signed"
    # A checkpoint edited by hand (its signature no longer matches) fails verify.
    lines = (repo.store / "events.jsonl").read_bytes().splitlines()
    first = json.loads(lines[0])
    first["events"] += 1
    lines[0] = json.dumps(first, separators=(",", ":"), sort_keys=True).encode()
    (repo.store / "events.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert run_cli("verify", "--repo", str(repo.path), "--json", "--jobs", "1").code == 6


def test_gc_keeps_a_receipt_whose_key_lock_a_live_call_holds(tmp_path: Path) -> None:
    from receipts.flock import file_lock
    from receipts.store import ReceiptStore

    repo = three_calls(tmp_path)
    # A live call holds its key's flock from before its look-up until its last write: held here
    # (another process than gc's), it is a call deciding what to do with task-a/1.
    lock = file_lock(ReceiptStore(str(repo.store)).lock_path("task-a/1"))
    lock.acquire(timeout=0)
    try:
        r = gc(repo, REMOVE_ALL, tmp=tmp_path)
        assert r.code == 0, r.out + r.err
        assert sorted(x["key"] for x in r.json["removed"]) == ["task-a/2", "task-b/1"]
        assert r.json["stays"] == [{"key": "task-a/1", "status": "committed",
                                    "reason": "a live call holds its key lock"}]
        assert key_refs(repo) == ["refs/oncepatch/keys/" + key_hash("task-a/1")]
        assert r.json["compacted"] is None  # its events are the oldest: nothing before them to compact
        verify_ok(repo)
    finally:
        lock.release()
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)
    assert [x["key"] for x in r.json["removed"]] == ["task-a/1"] and key_refs(repo) == []
    verify_ok(repo)


def test_a_later_gc_folds_the_earlier_checkpoint_into_its_own(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    first = gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["task-a/"]\n', tmp=tmp_path).json
    assert first["compacted"]["events"] == 4
    second = gc(repo, REMOVE_ALL, tmp=tmp_path).json
    # The planned range is replaced: the first checkpoint (4 events), task-b's 2, the two removed
    # events and the first run's compacted event; task-b's own removed event came after the plan.
    assert second["compacted"]["first_seq"] == 1 and second["compacted"]["events"] == 4 + 2 + 2 + 1
    ev = events(repo)
    assert [e["event"] for e in ev] == ["checkpoint", "removed", "compacted"]
    verify_ok(repo)
    v = run_cli("gc", "--verify-archive", second["archive"], "--repo", str(repo.path), "--json")
    assert v.code == 0 and v.json["head"] == ev[0]["head"], v.out


def test_gc_changes_nothing_in_a_store_whose_ledger_does_not_verify(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    ledger = repo.store / "events.jsonl"
    lines = ledger.read_bytes().splitlines()
    ledger.write_bytes(b"\n".join(lines[:2] + lines[3:]) + b"\n")  # one event deleted by hand
    before = snapshot(repo)
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)
    assert r.code == 6, r.out + r.err
    assert "gc changes nothing" in r.json["error"]["message"]
    assert snapshot(repo) == before


def test_gc_never_compacts_the_events_that_explain_a_quarantined_key(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    q = run_cli("quarantine", "task-a/1", "--note", "looked at it", "--repo", str(repo.path), "--json")
    assert q.code == 0, q.out + q.err
    verify_ok(repo)
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert sorted(x["key"] for x in r.json["removed"]) == ["task-a/2", "task-b/1"]
    # task-a/1's events come first and its key ref stays: nothing before them may be compacted.
    assert r.json["compact"] is None
    assert [e["key"] for e in events(repo)[:2]] == ["task-a/1", "task-a/1"]
    verify_ok(repo)

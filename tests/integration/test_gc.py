"""``oncepatch gc --policy``: retention on stores made by real calls (docs/LIFECYCLE.md, "gc").

What goes is archived first (a bundle ``gc --verify-archive`` proves); what a
live or unsettled call needs stays; a removed receipt's key ref stays as a
tombstone (the key is retired: a call with it is refused), git objects never
go; the ledger's oldest events become a chained checkpoint that keeps the
retired keys, and ``verify`` passes after every run.
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
    # An age past any float (a TOML integer of 400 digits) or infinite used to overflow: internal, exit 1.
    (f"[remove]\nolder_than_days = {10 ** 400}\n", "'remove.older_than_days' must be a number of days from 0"),
    ("[remove]\nolder_than_days = inf\n", "'remove.older_than_days' must be a number of days from 0"),
    (f"[keep]\nledger_days = {10 ** 400}\n[remove]\n", "'keep.ledger_days' must be a number of days from 0"),
    ("[keep]\nledger_days = inf\n[remove]\n", "'keep.ledger_days' must be a number of days from 0"),
    ("[redact]\nolder_than_days = 1e400\nfields = [\"result\"]\n", "'redact.older_than_days' must be a number"),
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
    # Key refs stay as tombstones; git objects never go.
    assert len(key_refs(repo)) == 3
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


def retired_refusal(repo: Repo, patch: bytes, key: str) -> None:
    """A call with ``key`` (retired by gc) is refused, exit 3, not started, and nothing changes."""
    before = snapshot(repo)
    count = repo.count()
    r = apply(repo, patch, key)
    assert r.code == 3, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "idempotency_conflict" and err["effect_status"] == "not_started"
    assert f"key '{key}' was retired by 'oncepatch gc' on " in err["message"] and "use a new key" in err["message"]
    assert repo.count() == count
    assert snapshot(repo) == before


def test_a_removed_key_is_retired_and_never_runs_again(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    patch = change(repo, 30, "later")
    assert apply(repo, patch, "task-a/3").code == 0
    doc = gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["task-a/3"]\n', tmp=tmp_path).json
    # Its receipt is archived and gone; its key ref stays: a tombstone.
    assert "refs/oncepatch/keys/" + key_hash("task-a/3") in key_refs(repo)
    retired_refusal(repo, patch, "task-a/3")
    st = run_cli("status", "task-a/3", "--repo", str(repo.path), "--json")
    assert st.code == 2 and "was retired by 'oncepatch gc'" in st.json["error"]["message"]
    assert f"archive sha256 {doc['archive_sha256'][:12]}" in st.json["error"]["message"]
    verify_ok(repo)


def test_revert_then_gc_then_apply_never_lands_the_key_twice(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", BASE)
    patch = change(repo, 7, "seven")
    assert apply(repo, patch, "k1").code == 0
    rv = run_cli("revert", "k1", "--key", "rk1", "--repo", str(repo.path), "--json")
    assert rv.code == 0, rv.out + rv.err
    # Both go (the compensation too, so the link does not keep k1), then their events are compacted.
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert sorted(x["key"] for x in r.json["removed"]) == ["k1", "rk1"]
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)  # the second run compacts the removed events too
    assert r.code == 0 and r.json["compacted"] is not None, r.out + r.err
    assert not [e for e in events(repo) if e.get("event") == "removed"]
    assert set(events(repo)[0]["retired"]) == {"k1", "rk1"}
    # The change is not on the branch (reverted): run as a first call it would commit again.
    retired_refusal(repo, patch, "k1")
    retired_refusal(repo, change(repo, 9, "nine"), "rk1")
    trailers = repo.git("log", "--format=%(trailers:key=Oncepatch-Key,valueonly)").split()
    assert trailers.count(key_hash("k1")) == 1
    st = run_cli("status", "k1", "--repo", str(repo.path), "--json")
    assert st.code == 2 and "was retired by 'oncepatch gc'" in st.json["error"]["message"]
    verify_ok(repo)
    for cmd in (("recover", "--dry-run"), ("doctor",), ("stats",), ("replay",), ("drift",)):
        out = run_cli(*cmd, "--repo", str(repo.path), "--json")
        assert out.code in (0, 7), (cmd, out.out, out.err)  # drift: 7 when something drifted
        assert "corrupt" not in json.dumps(out.json.get("error") or {}), (cmd, out.out)


def test_a_redacted_compensation_link_cannot_free_the_key_it_names(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", BASE)
    assert apply(repo, change(repo, 7, "seven"), "k1").code == 0
    assert run_cli("revert", "k1", "--key", "rk1", "--repo", str(repo.path), "--json").code == 0
    before = snapshot(repo)
    r = gc(repo, '[remove]\nkey_prefixes = ["k1"]\n[redact]\nfields = ["args.compensates"]\n', tmp=tmp_path)
    assert r.code == 2 and "args.compensates" in r.json["error"]["message"], r.out + r.err
    assert snapshot(repo) == before
    r = gc(repo, '[remove]\nkey_prefixes = ["k1"]\n', tmp=tmp_path)
    assert r.code == 0 and r.json["removed"] == [], r.out + r.err  # rk1 stays and compensates k1
    assert "compensates" in r.json["stays"][0]["reason"]


def test_a_crash_between_the_removed_event_and_the_file_leaves_a_store_every_command_reads(tmp_path: Path) -> None:
    repo2 = make_repo(tmp_path / "repo2", BASE)
    patch = change(repo2, 4, "four")
    assert apply(repo2, patch, "k/1").code == 0
    pf = tmp_path / "p2.toml"
    pf.write_text(REMOVE_ALL)
    r = run_cli("gc", "--repo", str(repo2.path), "--policy", str(pf), "--json",
                env={"ONCEPATCH_CRASH_AT": "gc-after-removed"})
    assert r.code == 137, r.out + r.err
    assert [e["event"] for e in events(repo2)][-1] == "removed"
    assert list((repo2.store / "receipts").rglob("*.json"))  # the file is still there
    # Every command reads the receipt as it was: no corrupt report.
    verify_ok(repo2)
    st = run_cli("status", "k/1", "--repo", str(repo2.path), "--json")
    assert st.code == 0 and st.json["receipt"]["status"] == "committed", st.out + st.err
    rec = run_cli("recover", "--repo", str(repo2.path), "--json")
    assert rec.code == 0, rec.out + rec.err
    doc = run_cli("doctor", "--repo", str(repo2.path), "--json")
    assert doc.code == 0, doc.out + doc.err
    again = apply(repo2, patch, "k/1")
    assert again.code == 0 and again.json["replayed"] is True, again.out + again.err
    # The next run finishes: the receipt goes, the key is retired, the store verifies.
    r = gc(repo2, REMOVE_ALL, tmp=tmp_path)
    assert r.code == 0 and [x["key"] for x in r.json["removed"]] == ["k/1"], r.out + r.err
    assert not list((repo2.store / "receipts").rglob("*.json"))
    verify_ok(repo2)
    assert run_cli("doctor", "--repo", str(repo2.path), "--json").code == 0
    retired_refusal(repo2, patch, "k/1")


@pytest.mark.parametrize("field", ["args.repo", "args.branch", "args.patch_sha256", "args.format"])
def test_redacting_what_a_reader_needs_is_refused(tmp_path: Path, field: str) -> None:
    repo = three_calls(tmp_path)
    before = snapshot(repo)
    r = gc(repo, f'[redact]\nfields = ["{field}"]\n', tmp=tmp_path)
    assert r.code == 2 and field in r.json["error"]["message"], r.out + r.err
    assert snapshot(repo) == before
    verify_ok(repo)


def test_the_archive_folder_stays_inside_the_store(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    before = snapshot(repo)
    outside = tmp_path / "outside"
    outside.mkdir()
    for policy in (REMOVE_ALL + '[archive]\ndir = "../../../outside"\n',
                   REMOVE_ALL + f'[archive]\ndir = "{outside}"\n'):
        r = gc(repo, policy, tmp=tmp_path)
        assert r.code == 2 and "archive.dir" in r.json["error"]["message"], r.out + r.err
    # A symlinked folder on the way is refused too, before anything is written.
    (repo.store / "linked").symlink_to(outside)
    r = gc(repo, REMOVE_ALL + '[archive]\ndir = "linked/archives"\n', tmp=tmp_path)
    assert r.code == 2, r.out + r.err
    assert list(outside.iterdir()) == []
    (repo.store / "linked").unlink()
    assert snapshot(repo) == before


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue())


@pytest.mark.parametrize("manifest", [
    b'{"schema":"oncepatch.archive/1","ledger":{"sha256":"x"},"receipts":["x"]}',
    b'{"schema":"oncepatch.archive/1","ledger":[],"receipts":[]}',
    b'[1, 2]',
    b'not json',
])
def test_verify_archive_of_a_malformed_manifest_says_so(tmp_path: Path, manifest: bytes) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(_tar_gz({"manifest.json": manifest}))
    v = run_cli("gc", "--verify-archive", str(bad), "--json")
    assert v.code == 6, v.out + v.err
    assert v.json["ok"] is False and "not an archive gc wrote" in v.json["failures"][0]


def test_verify_archive_with_a_store_checks_the_store_names_it(tmp_path: Path) -> None:
    repo = three_calls(tmp_path)
    other = three_calls(tmp_path / "other")
    doc = gc(other, '[remove]\nkey_prefixes = ["task-a/"]\n', tmp=tmp_path).json
    # Sound on its own, but not this store's archive.
    assert run_cli("gc", "--verify-archive", doc["archive"], "--json").code == 0
    v = run_cli("gc", "--verify-archive", doc["archive"], "--repo", str(repo.path), "--json")
    assert v.code == 6 and "the store names no archive" in " ".join(v.json["failures"]), v.out + v.err
    assert run_cli("gc", "--verify-archive", doc["archive"], "--repo", str(other.path), "--json").code == 0


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
    assert key_refs(repo) == refs_before  # the removed keys' refs stay: tombstones
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
    assert sorted(key_refs(repo)) == sorted(set(refs_before) | {crash_ref})
    assert not list((repo.store / "receipts").rglob("*.json"))
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
        assert len(key_refs(repo)) == 3  # every ref stays: a tombstone, or the live call's
        assert r.json["compacted"] is None  # its events are the oldest: nothing before them to compact
        verify_ok(repo)
    finally:
        lock.release()
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)
    assert [x["key"] for x in r.json["removed"]] == ["task-a/1"] and len(key_refs(repo)) == 3
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


def test_a_committed_generic_effect_stays_its_key_has_no_tombstone(tmp_path: Path) -> None:
    """A tool with no key ref outside the store (file_write) would run again were its receipt removed."""
    from receipts.adapters.file_write import write_file

    repo = three_calls(tmp_path)
    target = tmp_path / "out.txt"
    assert write_file(target, b"once\n", key="fw-1", store=repo.store).status == "committed"
    r = gc(repo, '[remove]\nolder_than_days = 0\n', tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert "fw-1" not in {row["key"] for row in r.json["removed"]}
    [stays] = [s for s in r.json["stays"] if s["key"] == "fw-1"]
    assert "no tombstone" in stays["reason"]
    target.write_bytes(b"changed by hand\n")
    again = write_file(target, b"once\n", key="fw-1", store=repo.store)
    assert again.replayed and target.read_bytes() == b"changed by hand\n"  # replayed, never run again
    verify_ok(repo)


def test_a_receipt_whose_key_ref_was_moved_stays_and_the_ref_is_left(tmp_path: Path) -> None:
    """gc asks the git adapter whether the key ref still stands for the receipt (``check_tombstone``).

    A key ref moved by hand to another commit is no tombstone of this receipt:
    the receipt stays, the ref is left as it is, and the other receipts go.
    """
    repo = three_calls(tmp_path)
    ref = "refs/oncepatch/keys/" + key_hash("task-a/1")
    elsewhere = repo.git("rev-parse", "main~3").strip()  # the initial commit: not task-a/1's
    repo.git("update-ref", ref, elsewhere)
    r = gc(repo, REMOVE_ALL, tmp=tmp_path)
    assert r.code == 0, r.out + r.err
    assert {row["key"] for row in r.json["removed"]} == {"task-a/2", "task-b/1"}
    [stays] = [s for s in r.json["stays"] if s["key"] == "task-a/1"]
    assert "its key ref does not stand for it" in stays["reason"], stays
    assert repo.git("rev-parse", ref).strip() == elsewhere
    assert len(key_refs(repo)) == 3  # every ref stays: nothing removes one

"""``stats``, ``replay`` and ``drift`` on stores that ``gc`` and ``revert`` changed (docs/LIFECYCLE.md).

The stores are made by real calls: commits, a replay, a final rejection, then
``oncepatch gc`` removing some keys (the oldest one's events compacted into a
checkpoint, a later one's left in the ledger beside its ``removed`` event) and
redacting a receipt that stays; or ``oncepatch revert`` compensating a key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from conftest import Repo, make_repo, run_cli, snapshot
from receipts.stats import count_events, to_prometheus

BASE = {"src/app.py": "".join(f"line {i}\n" for i in range(1, 31)), "README": "hello\n"}
POLICY = '[remove]\nolder_than_days = 0\nkey_prefixes = ["old/"]\n\n[redact]\nfields = ["args.message"]\n'


def change(repo: Repo, line: int, word: str) -> bytes:
    """A unified diff replacing ``line N`` of src/app.py with ``word`` against the branch's head."""
    head = repo.head()
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace(f"line {line}\n", f"{word}\n"))
    diff = repo.git("diff", "--full-index").encode()
    repo.git("checkout", "-q", head, "--", "src/app.py")
    return diff


def apply(repo: Repo, patch: bytes, key: str, *extra: str, code: int = 0) -> Any:
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", key, *extra, input=patch)
    assert r.code == code, r.out + r.err
    return r


def gc(repo: Repo, policy: str, tmp: Path) -> dict[str, Any]:
    pf = tmp / "policy.toml"
    pf.write_text(policy)
    r = run_cli("gc", "--repo", str(repo.path), "--policy", str(pf), "--json")
    assert r.code == 0, r.out + r.err
    doc: dict[str, Any] = r.json
    return doc


def collected(tmp_path: Path) -> tuple[Repo, bytes]:
    """old/1, keep/1 (and its replay), old/2, keep/2 (rejected); then gc removes old/* and redacts keep/1.

    old/1's events come first: they are compacted into a checkpoint.  old/2's
    come after keep/1's, which keeps its receipt: they stay in the ledger.
    Returns the repository and old/2's patch.
    """
    repo = make_repo(tmp_path / "repo", BASE)
    apply(repo, change(repo, 3, "three"), "old/1")
    keep = change(repo, 20, "twenty")
    apply(repo, keep, "keep/1", "-m", "customer 4711 asked for this")
    assert apply(repo, keep, "keep/1", "-m", "customer 4711 asked for this").json["replayed"] is True
    old2 = change(repo, 10, "ten")
    apply(repo, old2, "old/2")
    apply(repo, change(repo, 25, "twenty-five"), "keep/2", "--check", "false", code=4)
    doc = gc(repo, POLICY, tmp_path)
    assert sorted(r["key"] for r in doc["removed"]) == ["old/1", "old/2"]
    assert "keep/1" in [r["key"] for r in doc["redacted"]]
    assert doc["compacted"] is not None and (doc["compacted"]["first_seq"], doc["compacted"]["last_seq"]) == (1, 2)
    assert run_cli("verify", "--repo", str(repo.path), "--jobs", "1").code == 0
    return repo, old2


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families = text_string_to_metric_families(text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_stats_after_gc_counts_since_the_checkpoint_and_removed_keys_have_no_state(tmp_path: Path) -> None:
    repo, old2_patch = collected(tmp_path)
    prom = tmp_path / "oncepatch.prom"
    before = snapshot(repo)
    r = run_cli("stats", "--repo", str(repo.path), "--json", "--prometheus", str(prom))
    assert r.code == 0, r.out + r.err
    assert snapshot(repo) == before
    doc = r.json
    # The checkpoint stands for old/1's two events: named, not counted.
    assert doc["compacted"]["first_seq"] == 1 and doc["compacted"]["last_seq"] == 2
    assert doc["compacted"]["events"] == 2 and doc["compacted"]["bundle_sha256"]
    c = doc["counters"]
    # keep/1, its replay, old/2, keep/2: old/1's call is behind the checkpoint.
    assert c["calls"]["total"] == 4 and c["duplicate_requests"]["total"] == 1
    assert c["removals"]["total"] == 2
    # A removed key is in no state (its last event is 'removed': no receipt); redaction changes no state.
    assert doc["keys"] == {"apply_patch": {"committed": 1, "rejected": 1}}
    samples = _samples(prom.read_text())
    assert samples[("oncepatch_removals_total", (("tool", "apply_patch"),))] == 2
    assert samples[("oncepatch_ledger_compacted_events", ())] == 2
    assert samples[("oncepatch_keys", (("state", "committed"), ("tool", "apply_patch")))] == 1
    text = run_cli("stats", "--repo", str(repo.path)).out
    assert "compacted by gc: events 1..2 (2 event(s), in the archive), not counted" in text
    assert "removals: 2" in text


def test_replay_after_gc_finds_no_divergence_for_removed_or_redacted_keys(tmp_path: Path) -> None:
    repo, old2_patch = collected(tmp_path)
    before = snapshot(repo)
    r = run_cli("replay", "--repo", str(repo.path), "--json")
    assert snapshot(repo) == before
    assert r.code == 0, r.out + r.err
    assert r.json["divergences"] == 0 and r.json["refused_writes"] == []
    rows = {(row["key"], row["recorded"]): row for row in r.json["calls"]}
    # old/1's call was compacted away: nothing to decide.  old/2's call stays; its key is retired:
    # a call with it would be refused.
    assert {k for k, _ in rows} == {"keep/1", "old/2", "keep/2"}
    old = rows[("old/2", "execute")]
    assert old["now"] == "conflict" and old["expected"] == ["conflict", "replay"]
    assert "was retired by 'oncepatch gc'" in old["detail"]
    # keep/1's receipt was redacted: still the one its last event (redacted) names, still replayed.
    assert rows[("keep/1", "execute")]["now"] == "replay" and rows[("keep/1", "replay")]["now"] == "replay"
    status = run_cli("status", "keep/1", "--repo", str(repo.path), "--json").json["receipt"]
    assert status["identity"]["args"]["message"].startswith("redacted:sha256:")
    # The removed key, used again, is refused (nothing written); replay agrees with the ledger.
    first = apply(repo, old2_patch, "old/2", code=3)
    assert first.json["error"]["type"] == "idempotency_conflict" and "retired" in first.json["error"]["message"]
    again = run_cli("replay", "--repo", str(repo.path), "--json")
    assert again.code == 0, again.out + again.err


def test_drift_after_gc_skips_removed_keys_and_names_them_from_the_ledger(tmp_path: Path) -> None:
    repo, old2_patch = collected(tmp_path)
    old2 = repo.head()
    before = snapshot(repo)
    r = run_cli("drift", "--repo", str(repo.path), "--json")
    assert snapshot(repo) == before
    assert r.code == 7, r.out + r.err  # keep/1's file was changed later, by old/2
    assert [row["key"] for row in r.json["receipts"]] == ["keep/1"]  # removed keys: no receipt, no row
    assert r.json["skipped"] == []
    (item,) = r.json["receipts"][0]["paths"]
    assert (item["state"], item["commit"], item["by"]) == ("changed", old2, "oncepatch")
    assert item["key"] == "old/2" and item["removed_by_gc"] is True
    text = run_cli("drift", "--repo", str(repo.path)).out
    assert "by oncepatch, key 'old/2' (its receipt removed by gc)" in text


# -- compensation (oncepatch revert) ---------------------------------------------------------------


def reverted(tmp_path: Path) -> Repo:
    """'orig' changed line 5; 'undo-1' reverted it (and was retried: a replay)."""
    repo = make_repo(tmp_path / "repo", BASE)
    apply(repo, change(repo, 5, "five"), "orig")
    for replayed in (False, True):
        r = run_cli("revert", "orig", "--key", "undo-1", "--repo", str(repo.path), "--json")
        assert r.code == 0 and r.json["replayed"] is replayed, r.out + r.err
    return repo


def test_stats_counts_compensations_in_text_json_and_prometheus(tmp_path: Path) -> None:
    repo = reverted(tmp_path)
    prom = tmp_path / "oncepatch.prom"
    r = run_cli("stats", "--repo", str(repo.path), "--json", "--prometheus", str(prom))
    assert r.code == 0, r.out + r.err
    c = r.json["counters"]
    assert c["calls"]["total"] == 3
    # One compensating call; its replay is a replay, not another compensation.
    assert c["compensations"] == {"total": 1, "by": [{"tool": "apply_patch", "count": 1}]}
    assert _samples(prom.read_text())[("oncepatch_compensations_total", (("tool", "apply_patch"),))] == 1
    assert "compensations: 1" in run_cli("stats", "--repo", str(repo.path)).out


def test_drift_names_the_compensating_key_not_an_outside_revert(tmp_path: Path) -> None:
    repo = reverted(tmp_path)
    undo = repo.head()
    r = run_cli("drift", "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err  # undone on purpose, by a keyed change the store holds: not drift
    rows = {row["key"]: row for row in r.json["receipts"]}
    assert rows["orig"]["state"] == "compensated" and rows["undo-1"]["state"] == "unchanged"
    (item,) = rows["orig"]["paths"]
    assert (item["state"], item["compensated_by"], item["commit"]) == ("compensated", "undo-1", undo)
    assert r.json["drifted"] == 0
    text = run_cli("drift", "--repo", str(repo.path)).out
    assert f"src/app.py: compensated by {undo[:12]} (oncepatch revert, key 'undo-1'" in text
    # A later change outside oncepatch is drift again: the compensation is no longer the last word.
    (repo.path / "src/app.py").write_text((repo.path / "src/app.py").read_text().replace("line 5\n", "5\n"))
    repo.git("commit", "-q", "-a", "-m", "by hand")
    late = run_cli("drift", "--repo", str(repo.path), "--json")
    assert late.code == 7
    (item,) = {row["key"]: row for row in late.json["receipts"]}["orig"]["paths"]
    assert (item["state"], item["by"]) == ("changed", "outside")


def test_drift_still_names_a_compensation_whose_receipt_gc_removed(tmp_path: Path) -> None:
    repo = reverted(tmp_path)
    doc = gc(repo, '[remove]\nolder_than_days = 0\nkey_prefixes = ["undo-"]\n', tmp_path)
    assert [r["key"] for r in doc["removed"]] == ["undo-1"]
    r = run_cli("drift", "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err
    assert [row["key"] for row in r.json["receipts"]] == ["orig"]
    (item,) = r.json["receipts"][0]["paths"]
    assert (item["state"], item["compensated_by"], item["removed_by_gc"]) == ("compensated", "undo-1", True)
    stats = run_cli("stats", "--repo", str(repo.path), "--json").json
    assert stats["counters"]["compensations"]["total"] == 1 and stats["counters"]["removals"]["total"] == 1
    assert stats["keys"] == {"apply_patch": {"committed": 1}}
    assert run_cli("replay", "--repo", str(repo.path), "--json").json["divergences"] == 0
    assert os.path.exists(doc["archive"])


def test_gc_events_never_crash_the_counts_and_a_checkpoint_is_not_a_call() -> None:
    """A checkpoint with a malformed count, a 'removed' for a key whose calls it hid, a key used again."""
    def ev(seq: int, event: str, key: str | None, **extra: Any) -> dict[str, Any]:
        doc = {"seq": seq, "event": event, "tool": "t", "at": f"2026-01-01T00:00:{seq:02}Z", **extra}
        return doc if key is None else {**doc, "key": key}

    events = [ev(4, "checkpoint", None, first_seq=1, events="four", head="0" * 64, at="2026-02-01T00:00:00Z"),
              ev(5, "removed", "a", status="committed"),
              ev(6, "compacted", None, checkpoint_sha256="0" * 64),
              ev(7, "committed", "a", status="committed", fencing_token=1),
              ev(8, "prepared", "b", status="prepared", fencing_token=1, compensates="a"),
              ev(9, "committed", "b", status="committed", fencing_token=1, compensates="a"),
              ev(10, "redacted", "b", status="committed", fencing_token=1, compensates="a")]
    stats = count_events(events)
    assert stats.compacted == {"first_seq": 1, "last_seq": 4, "events": "four", "bundle_sha256": None}
    assert stats.first_at == "2026-01-01T00:00:05Z"  # the checkpoint's own time (gc's) is no call's
    assert stats.counters["calls"] == {("t",): 2} and stats.counters["duplicate_requests"] == {}
    assert stats.counters["removals"] == {("t",): 1} and stats.counters["compensations"] == {("t",): 1}
    assert stats.states == {("t", "committed"): 2}
    assert "oncepatch_ledger_compacted_events 0\n" in to_prometheus(stats)

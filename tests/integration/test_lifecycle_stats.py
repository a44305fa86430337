"""``oncepatch stats``: counts over the ledger of a store made by real calls (docs/LIFECYCLE.md, "stats").

The store: a commit and its replay, an idempotency conflict, a rejected
``--check``, a call killed after its branch moved then ``recover``, a call
killed after its prepare then ``resolve``, one more replay, and a call killed
after its prepare whose key the next call takes over.  The
Prometheus file is read back with ``prometheus_client``'s own parser.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Repo, make_repo, run_cli, snapshot

from receipts.stats import count_events


def _patch(path: str, old: str, new: str) -> bytes:
    return f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-{old}\n+{new}\n".encode()


P1, P2 = _patch("a.txt", "a", "A"), _patch("b.txt", "b", "B")
P3, P4 = _patch("c.txt", "c", "C"), _patch("d.txt", "d", "D")
P5 = _patch("e.txt", "e", "E")


def _apply(repo: Repo, patch: bytes, key: str, *extra: str, code: int = 0, env: dict[str, str] | None = None) -> None:
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", key, *extra, input=patch, env=env)
    assert r.code == code, (key, r.code, r.out, r.err)


@pytest.fixture
def busy(tmp_path: Path) -> Repo:
    """A store made by real calls (module docstring)."""
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n", "b.txt": "b\n", "c.txt": "c\n", "d.txt": "d\n", "e.txt": "e\n"})
    _apply(repo, P1, "k1")
    _apply(repo, P1, "k1")  # replayed
    _apply(repo, P2, "k1", code=3)  # idempotency conflict: nothing recorded
    _apply(repo, P2, "k5", "--check", "false", code=4)  # rejected, final
    _apply(repo, P3, "k2", code=137, env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert run_cli("recover", "--repo", str(repo.path)).code == 0  # by query
    _apply(repo, P4, "k6", code=137, env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    r = run_cli("resolve", "k6", "--as", "rejected", "--note", "looked", "--repo", str(repo.path))
    assert r.code == 0, r.out + r.err  # by person
    _apply(repo, P3, "k2")  # replayed
    _apply(repo, P5, "k7", code=137, env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    _apply(repo, P5, "k7")  # takes the key over: settles attempt 1 (by query), commits as attempt 2
    return repo


def _counter(doc: dict[str, Any], name: str, **labels: str) -> int:
    return sum(row["count"] for row in doc["counters"][name]["by"]
               if all(row.get(k) == v for k, v in labels.items()))


def test_stats_counts_what_the_calls_did(busy: Repo) -> None:
    r = run_cli("stats", "--repo", str(busy.path), "--json")
    assert r.code == 0, r.out + r.err
    doc = r.json
    assert doc["ok"] is True
    t = "apply_patch"
    assert _counter(doc, "calls", tool=t) == 8  # k1 x2, k5, k2 x2, k6, k7 x2
    assert _counter(doc, "duplicate_requests", tool=t) == 3
    assert _counter(doc, "replays", tool=t, status="committed") == 2
    assert _counter(doc, "executions", tool=t, outcome="committed") == 2
    assert _counter(doc, "rejected", tool=t, error_type="check_failed", retryable="false") == 1
    assert _counter(doc, "recoveries", tool=t, by="query", outcome="committed") == 1
    assert _counter(doc, "recoveries", tool=t, by="query", outcome="rejected") == 1  # k7's attempt 1
    assert _counter(doc, "recoveries", tool=t, by="person", outcome="rejected") == 1
    assert _counter(doc, "lease_takeovers", tool=t) == 1  # k7, not k2 (recover settled it)
    assert doc["counters"]["unknowns"]["total"] == 0
    assert doc["keys"] == {t: {"committed": 3, "rejected": 2}}
    lat = doc["latency_seconds"][t]
    assert lat["count"] == 2 and 0 <= lat["p50"] <= lat["p95"]
    assert "idempotency_conflicts" in doc["not_counted"]


def test_prometheus_file_parses_and_agrees(busy: Repo, tmp_path: Path) -> None:
    folder = tmp_path / "textfile"
    folder.mkdir()
    target = folder / "oncepatch.prom"
    target.write_text("# an older scrape\n")
    before = snapshot(busy)
    r = run_cli("stats", "--repo", str(busy.path), "--prometheus", str(target), "--json")
    assert r.code == 0, r.out + r.err
    assert snapshot(busy) == before, "stats writes nothing but its file"
    assert os.listdir(folder) == ["oncepatch.prom"], "no tmp file left beside it"
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    families = {f.name: f for f in text_string_to_metric_families(target.read_text())}
    # The parser drops a counter's _total from the family's name.
    assert {"oncepatch_calls", "oncepatch_duplicate_requests", "oncepatch_replays", "oncepatch_rejected",
            "oncepatch_unknowns", "oncepatch_lease_takeovers", "oncepatch_recoveries", "oncepatch_forbidden",
            "oncepatch_keys", "oncepatch_call_latency_seconds"} <= set(families)
    assert families["oncepatch_calls"].type == "counter"
    assert families["oncepatch_call_latency_seconds"].type == "summary"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("oncepatch_duplicate_requests_total", (("tool", "apply_patch"),))] == 3
    assert samples[("oncepatch_recoveries_total", (("by", "person"), ("outcome", "rejected"),
                                                   ("tool", "apply_patch")))] == 1
    assert samples[("oncepatch_keys", (("state", "committed"), ("tool", "apply_patch")))] == 3
    assert samples[("oncepatch_lease_takeovers_total", (("tool", "apply_patch"),))] == 1
    assert samples[("oncepatch_call_latency_seconds_count", (("tool", "apply_patch"),))] == 2
    assert ("oncepatch_call_latency_seconds", (("quantile", "0.95"), ("tool", "apply_patch"))) in samples


def test_since_counts_only_the_window(busy: Repo) -> None:
    r = run_cli("stats", "--repo", str(busy.path), "--since", "0s", "--json")
    assert r.code == 0, r.out + r.err
    assert r.json["counted_events"] == 0 and r.json["counters"]["calls"]["total"] == 0
    assert r.json["keys"]["apply_patch"] == {"committed": 3, "rejected": 2}, "states are now's, whatever the window"
    wide = run_cli("stats", "--repo", str(busy.path), "--since", "1d", "--json")
    assert wide.json["counters"]["calls"]["total"] == 8
    assert run_cli("stats", "--repo", str(busy.path), "--since", "soon").code == 2
    for huge in ("99999999999999999999d", "9" * 400, "366001d", "-1d", "nan"):  # usage errors, not internal ones
        bad = run_cli("stats", "--repo", str(busy.path), "--since", huge, "--json")
        assert bad.code == 2, (huge, bad.out, bad.err)
        assert "internal" not in bad.out + bad.err
    assert run_cli("stats", "--repo", str(busy.path), "--since", "365000d", "--json").json["counted_events"] > 0
    assert run_cli("stats", "--repo", str(busy.path), "--since", "1h", "--prometheus", "x.prom").code == 2
    missing = run_cli("stats", "--repo", str(busy.path), "--prometheus", str(busy.path / "no" / "m.prom"), "--json")
    assert missing.code == 2 and "cannot write" in missing.json["error"]["message"]


def test_a_ledger_that_fails_its_chain_is_refused(busy: Repo, tmp_path: Path) -> None:
    ledger = busy.store / "events.jsonl"
    lines = ledger.read_bytes().splitlines(keepends=True)
    ledger.write_bytes(b"".join(lines[:2] + lines[3:]))  # one event taken out
    target = tmp_path / "m.prom"
    r = run_cli("stats", "--repo", str(busy.path), "--prometheus", str(target), "--json")
    assert r.code == 6, r.out + r.err
    assert r.json["error"]["type"] == "corrupt_receipt" and "line 3" in r.json["error"]["message"]
    assert not target.exists()


def _ev(seq: int, event: str, key: str, token: int, status: str, at: str, **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "event": event, "key": key, "tool": "t", "fencing_token": token, "status": status,
            "at": f"2026-01-01T00:00:{at}Z", **extra}


def test_a_prepared_over_an_unsettled_attempt_is_a_lease_takeover() -> None:
    """Attempt 2 prepared while attempt 1 was still prepared and no settle is recorded between."""
    events = [_ev(1, "prepared", "k", 1, "prepared", "00"),
              _ev(2, "prepared", "k", 2, "prepared", "01"),
              _ev(3, "committed", "k", 2, "committed", "03"),
              # a retry after a settle is no takeover
              _ev(4, "prepared", "j", 1, "prepared", "04"),
              _ev(5, "recovered", "j", 1, "rejected", "05"),
              _ev(6, "prepared", "j", 2, "prepared", "06"),
              _ev(7, "unknown", "j", 2, "unknown", "07", error_type="internal", retryable=False)]
    stats = count_events(events)
    assert stats.counters["lease_takeovers"] == {("t",): 1}
    assert stats.counters["duplicate_requests"] == {("t",): 2}
    assert stats.counters["unknowns"] == {("t",): 1}
    assert sorted(stats.latencies["t"]) == [1.0, 2.0]  # 2 -> 3 and 6 -> 7; the crashed attempt 1 has none
    assert stats.states == {("t", "committed"): 1, ("t", "unknown"): 1}


def test_a_signed_ledger_with_an_unsigned_event_is_refused(tmp_path: Path) -> None:
    """The chain holds (seq and prev are right), the signature does not: refused as verify refuses it."""
    from receipts.ledger import Ledger
    from receipts.store import ReceiptStore

    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n"})
    assert run_cli("keys", "init", "--repo", str(repo.path)).code == 0
    _apply(repo, P1, "k1")
    assert run_cli("stats", "--repo", str(repo.path)).code == 0
    store = ReceiptStore(str(repo.store))
    Ledger(store.ledger.path, store.ledger.lock_path).append({"event": "replayed", "at": "2026-01-01T00:00:00Z",
                                                              "key": "k1", "tool": "apply_patch"})
    r = run_cli("stats", "--repo", str(repo.path), "--json")
    assert r.code == 6, r.out + r.err
    assert r.json["error"]["type"] == "corrupt_receipt" and "line 4: unsigned" in r.json["error"]["message"]


def test_forbidden_and_settled_unknowns_are_told_apart() -> None:
    events = [{"seq": 1, "event": "forbidden", "at": "2026-01-01T00:00:00Z", "request": {"tool": "apply_patch"}},
              _ev(2, "prepared", "k", 1, "prepared", "01"),
              # written by a settle whose query could not tell: no error, not the call's own end
              _ev(3, "unknown", "k", 1, "unknown", "09", reason="cannot_tell"),
              _ev(4, "resolved", "k", 1, "committed", "10")]
    stats = count_events(events)
    assert stats.counters["forbidden"] == {("apply_patch",): 1}
    assert stats.counters["unknowns"] == {("t",): 1} and not stats.counters["executions"]
    assert stats.latencies == {} and stats.counters["recoveries"] == {("t", "person", "committed"): 1}

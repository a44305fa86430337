"""The calls a ledger records, and what it says a call of each key would get now (receipts.rehearsal, pure)."""

from __future__ import annotations

from typing import Any

from receipts.rehearsal import expected, recorded_calls


def _ev(seq: int, event: str, key: str, token: int, status: str, **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "event": event, "key": key, "tool": "t", "call_id": f"c-{key}", "fencing_token": token,
            "status": status, "receipt_sha256": f"d{seq}", **extra}


def test_calls_are_cut_where_the_engine_starts_them() -> None:
    events = [_ev(1, "prepared", "a", 1, "prepared"), _ev(2, "restaged", "a", 1, "prepared"),
              _ev(3, "committed", "a", 1, "committed"), _ev(4, "replayed", "a", 1, "committed"),
              _ev(5, "rejected", "b", 1, "rejected", error_type="check_failed", retryable=False),
              _ev(6, "prepared", "c", 1, "prepared"),  # crashed
              _ev(7, "recovered", "c", 1, "rejected", retryable=True),
              _ev(8, "prepared", "c", 2, "prepared"), _ev(9, "unknown", "c", 2, "unknown", error_type="x"),
              _ev(10, "resolved", "c", 2, "committed"),
              {"seq": 11, "event": "keys_rotated", "at": "x"}]
    calls, last = recorded_calls(events)
    assert [(c.seq, c.key, c.recorded, c.outcome) for c in calls] == [
        (1, "a", "execute", "committed"), (4, "a", "replay", "committed"), (5, "b", "execute", "rejected"),
        (6, "c", "execute", None), (7, "c", "query", "rejected"), (8, "c", "execute", "unknown"),
        (10, "c", "person", "committed")]
    assert {k: e["seq"] for k, e in last.items()} == {"a": 3, "b": 5, "c": 10}


def test_what_the_last_event_says_a_call_gets_now() -> None:
    assert expected(None) == {"execute"}
    assert expected(_ev(1, "committed", "a", 1, "committed")) == {"replay"}
    assert expected(_ev(1, "rejected", "a", 1, "rejected", retryable=False)) == {"replay"}
    assert expected(_ev(1, "recovered", "a", 1, "rejected", retryable=True)) == {"execute"}
    assert expected(_ev(1, "rejected", "a", 1, "rejected")) == {"replay", "execute"}  # an event older than the field
    assert expected(_ev(1, "prepared", "a", 1, "prepared")) == {"query", "person"}
    assert expected({"event": "quarantined", "key": "a"}) == {"execute"}


def test_the_recorder_asks_queries_and_refuses_writes() -> None:
    import pytest

    from receipts.adapter import QueryResult
    from receipts.rehearsal import Recorder, WouldWrite

    class Adapter:
        tool = "t"
        wrote: list[str] = []

        def query(self, receipt: Any) -> QueryResult:
            return QueryResult("applied", "seen")

        def settle(self, receipt: Any) -> list[str]:
            self.wrote.append("settle")
            return []

    class R:
        key = "k"

    inner = Adapter()
    rec = Recorder(inner)
    assert rec.query(R()).status == "applied" and rec.confirm(R()) == []  # type: ignore[arg-type]
    with pytest.raises(WouldWrite):
        rec.settle(R())  # type: ignore[arg-type]
    with pytest.raises(WouldWrite):
        rec.execute(R())  # type: ignore[arg-type]
    assert rec.recorded == [("settle", "k"), ("execute", "k")] and inner.wrote == []

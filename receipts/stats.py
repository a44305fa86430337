"""Counts over the event ledger: what ``oncepatch stats`` reports (docs/LIFECYCLE.md, "stats").

The ledger is read as ``verify`` reads it (:meth:`Ledger.verify_chain`); a
ledger that fails is refused (:class:`~receipts.errors.CorruptLedger`, exit 6):
numbers drawn from a changed ledger would be numbers about nothing.
:func:`count_events` is pure.  What counts as a call, a duplicate, a takeover,
a latency, and how ``since``, gc's checkpoints, ``removed`` and ``redacted``
events and compensations are read: docs/LIFECYCLE.md, "stats", which this
module implements.  Idempotency conflicts leave no ledger line, so they are
never counted (:data:`NOT_COUNTED` says so in every report).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from receipts.errors import CorruptLedger
from receipts.store import ReceiptStore

__all__ = ["Stats", "NOT_COUNTED", "count_events", "read_stats", "parse_duration", "to_prometheus",
           "COUNTERS"]

#: What the ledger cannot count, and why (shown with every report).
NOT_COUNTED = {
    "idempotency_conflicts": "refused before anything is written (exit 3, not even a ledger line): "
                             "the ledger has no record of them",
}

#: counter name -> its labels and help text (the Prometheus names are ``oncepatch_<name>_total``).
COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "calls": (("tool",), "calls recorded in the ledger (executions, replays, refusals)"),
    "duplicate_requests": (("tool",), "calls for a key an earlier call already used"),
    "replays": (("tool", "status"), "final receipts answered again, nothing re-executed"),
    "executions": (("tool", "outcome"), "attempts that wrote prepared, by how they ended themselves"),
    "rejected": (("tool", "error_type", "retryable"), "rejections written by the call itself"),
    "unknowns": (("tool",), "receipts written unknown: the effect may have happened"),
    "lease_takeovers": (("tool",), "calls that took a key over from an attempt left unsettled (next fencing token)"),
    "recoveries": (("tool", "by", "outcome"), "dead owners' calls settled: by query (recover, watch, the "
                                              "next call) or by person (resolve)"),
    "forbidden": (("tool",), "calls the store's policy refused"),
    "compensations": (("tool",), "compensating calls (oncepatch revert): a new keyed effect undoing a key's, "
                                 "replays not counted"),
    "removals": (("tool",), "receipts oncepatch gc removed (their keys retired)"),
}

_FINAL_OF_EXECUTION = ("committed", "rejected", "unknown")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``24h``, ``7d``, ``2w`` as seconds.

    Raises:
        ValueError: anything else.
    """
    m = _DURATION.match(text.strip())
    if m is None:
        raise ValueError(f"not a duration: {text!r} (a number with s, m, h, d or w)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def _at(event: dict[str, Any]) -> datetime | None:
    at = event.get("at")
    if not isinstance(at, str):
        return None
    try:
        when = datetime.fromisoformat(at)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values`` (not empty)."""
    rank = max(1, math.ceil(q * len(values)))
    return values[rank - 1]


@dataclass
class Stats:
    """The counts: ``counters[name][labels]`` (labels in :data:`COUNTERS` order), states, latencies."""

    events: int = 0
    counted_events: int = 0
    first_at: str | None = None
    last_at: str | None = None
    since: str | None = None
    #: the range an ``oncepatch gc`` checkpoint stands for, not counted: first_seq, last_seq, events, bundle_sha256
    compacted: dict[str, Any] | None = None
    counters: dict[str, Counter[tuple[str, ...]]] = field(default_factory=lambda: defaultdict(Counter))
    #: (tool, state) -> keys in that state now
    states: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: tool -> seconds of each execution, prepared to its own final event
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def total(self, name: str) -> int:
        return sum(self.counters[name].values())

    def latency(self) -> dict[str, dict[str, float | int]]:
        out: dict[str, dict[str, float | int]] = {}
        for tool, values in sorted(self.latencies.items()):
            ordered = sorted(values)
            out[tool] = {"count": len(ordered), "sum": round(sum(ordered), 6),
                         "p50": round(_percentile(ordered, 0.5), 6), "p95": round(_percentile(ordered, 0.95), 6)}
        return out

    def to_json(self) -> dict[str, Any]:
        counters: dict[str, Any] = {}
        for name, (labels, _help) in COUNTERS.items():
            rows = [{**dict(zip(labels, key)), "count": n} for key, n in sorted(self.counters[name].items())]
            counters[name] = {"total": sum(r["count"] for r in rows), "by": rows}
        states: dict[str, dict[str, int]] = defaultdict(dict)
        for (tool, state), n in sorted(self.states.items()):
            states[tool][state] = n
        return {"events": self.events, "counted_events": self.counted_events, "since": self.since,
                "compacted": self.compacted,
                "first_at": self.first_at, "last_at": self.last_at, "counters": counters,
                "keys": dict(states), "latency_seconds": self.latency(), "not_counted": dict(NOT_COUNTED)}


@dataclass
class _Key:
    seen: bool = False  # a call used this key before
    open_token: int | None = None  # an attempt's prepared not settled yet
    open_at: datetime | None = None
    status: str | None = None
    tool: str = "?"


def count_events(events: Iterable[dict[str, Any]], *, since: datetime | None = None) -> Stats:
    """The counts over ``events`` (ledger order); only those at or after ``since`` are counted."""
    stats = Stats(since=since.isoformat().replace("+00:00", "Z") if since is not None else None)
    keys: dict[str, _Key] = defaultdict(_Key)
    c = stats.counters
    for event in events:
        stats.events += 1
        kind = str(event.get("event"))
        if kind == "checkpoint":
            # gc's compaction: the events it stands for are not here to count (module docstring).
            stats.compacted = {"first_seq": event.get("first_seq"), "last_seq": event.get("seq"),
                               "events": event.get("events"), "bundle_sha256": event.get("bundle_sha256")}
            continue
        when = _at(event)
        counted = since is None or (when is not None and when >= since)
        if counted:
            stats.counted_events += 1
            if stats.first_at is None:
                stats.first_at = event.get("at")
            stats.last_at = event.get("at")
        if kind == "forbidden":
            request = event.get("request")
            if counted:
                c["forbidden"][(str(request.get("tool", "?")) if isinstance(request, dict) else "?",)] += 1
            continue
        key = event.get("key")
        if not isinstance(key, str):
            continue  # the store's own events (keys, ledger repairs)
        k = keys[key]
        tool = str(event.get("tool") or k.tool)
        k.tool = tool
        if kind in ("quarantined", "removed"):
            # The key has no receipt now: in no state; gc's removal is counted.
            if kind == "removed" and counted:
                c["removals"][(tool,)] += 1
            k.status, k.open_token = None, None
            continue
        token = event.get("fencing_token")
        status = event.get("status")
        starts = (kind in ("prepared", "replayed")
                  or (kind in ("committed", "rejected") and k.open_token != token))
        if starts and counted:
            c["calls"][(tool,)] += 1
            if k.seen:
                c["duplicate_requests"][(tool,)] += 1
        if starts:
            k.seen = True
            if counted and kind != "replayed" and isinstance(event.get("compensates"), str):
                c["compensations"][(tool,)] += 1
        if kind == "prepared":
            if k.open_token is not None and isinstance(token, int) and token > k.open_token and counted:
                c["lease_takeovers"][(tool,)] += 1
            k.open_token, k.open_at = (token if isinstance(token, int) else None), when
        elif kind == "replayed":
            if counted:
                c["replays"][(tool, str(status))] += 1
        elif kind in _FINAL_OF_EXECUTION:
            # An unknown written by a settle (a query that could not tell) carries no error: not the call's own end.
            own = (k.open_token is not None and k.open_token == token
                   and (kind != "unknown" or event.get("error_type") is not None))
            if counted:
                if own:
                    c["executions"][(tool, kind)] += 1
                    if when is not None and k.open_at is not None:
                        stats.latencies[tool].append(max(0.0, (when - k.open_at).total_seconds()))
                if kind == "rejected":
                    c["rejected"][(tool, str(event.get("error_type") or "unrecorded"),
                                   "true" if event.get("retryable") else "false")] += 1
                elif kind == "unknown":
                    c["unknowns"][(tool,)] += 1
                    if event.get("takeover"):
                        c["lease_takeovers"][(tool,)] += 1
            k.open_token, k.open_at = None, None
        elif kind in ("recovered", "resolved"):
            if counted:
                c["recoveries"][(tool, "query" if kind == "recovered" else "person", str(status))] += 1
                if event.get("takeover"):
                    c["lease_takeovers"][(tool,)] += 1
            k.open_token, k.open_at = None, None
        if isinstance(status, str) and kind != "replayed":
            k.status = status
    for k in keys.values():
        if k.status is not None:
            stats.states[(k.tool, k.status)] += 1
    return stats


def read_stats(store: ReceiptStore, *, since: datetime | None = None) -> Stats:
    """The counts over ``store``'s ledger, read and checked in one pass.

    Raises:
        CorruptLedger: the chain (or a signature) does not verify.
    """
    events: list[dict[str, Any]] = []
    problems = store.ledger.verify_chain(events.append)
    if problems:
        first = problems[0]
        raise CorruptLedger(f"ledger '{store.ledger.path}' line {first.line}: {first.reason}: its events are "
                            "not counted ('oncepatch verify' reports it)", effect_status="not_started",
                            details={"path": store.ledger.path,
                                     "problems": [{"line": p.line, "reason": p.reason} for p in problems]})
    return count_events(events, since=since)


# -- Prometheus text exposition format ----------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{name}="{_escape(value)}"' for name, value in pairs)
    return "{" + inner + "}" if inner else ""


def _compacted_events(stats: Stats) -> int:
    events = (stats.compacted or {}).get("events")
    return events if isinstance(events, int) and not isinstance(events, bool) else 0


def to_prometheus(stats: Stats) -> str:
    """``stats`` in the Prometheus text format (version 0.0.4): counters, a gauge of the keys, a summary."""
    out: list[str] = []
    for name, (labels, help_) in COUNTERS.items():
        metric = f"oncepatch_{name}_total"
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} counter"]
        for key, n in sorted(stats.counters[name].items()):
            out.append(f"{metric}{_labels(zip(labels, key))} {n}")
    out += ["# HELP oncepatch_keys keys in each state now (their receipts' last recorded state)",
            "# TYPE oncepatch_keys gauge"]
    for (tool, state), n in sorted(stats.states.items()):
        out.append(f"oncepatch_keys{_labels([('tool', tool), ('state', state)])} {n}")
    metric = "oncepatch_call_latency_seconds"
    out += [f"# HELP {metric} executions from prepared to their own final event",
            f"# TYPE {metric} summary"]
    for tool, row in stats.latency().items():
        for q in ("0.5", "0.95"):
            out.append(f"{metric}{_labels([('tool', tool), ('quantile', q)])} "
                       f"{row['p50' if q == '0.5' else 'p95']}")
        out.append(f"{metric}_sum{_labels([('tool', tool)])} {row['sum']}")
        out.append(f"{metric}_count{_labels([('tool', tool)])} {row['count']}")
    out += ["# HELP oncepatch_ledger_events ledger events read", "# TYPE oncepatch_ledger_events gauge",
            f"oncepatch_ledger_events {stats.events}",
            "# HELP oncepatch_ledger_compacted_events events oncepatch gc compacted into a checkpoint: not counted",
            "# TYPE oncepatch_ledger_compacted_events gauge",
            f"oncepatch_ledger_compacted_events {_compacted_events(stats)}"]
    return "\n".join(out) + "\n"

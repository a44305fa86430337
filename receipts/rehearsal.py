"""Every recorded call decided again, without side effects: what ``oncepatch replay`` reports.

Not the engine's replay of a final receipt (:meth:`receipts.engine.Call.replay`,
which answers a call): a *rehearsal* asks, for each call the ledger recorded,
what the engine would decide for it today, with the engine's own pieces,
read-only, and compares that with what the key's last ledger event implies.
The decisions and what counts as a divergence: docs/LIFECYCLE.md, "replay".

No lock is taken (a lock file is a write), nothing is settled and no ledger
event is appended.  Every adapter is wrapped in a :class:`Recorder`: its
``query`` and ``confirm`` are asked, and ``execute`` and ``settle`` are
recorded and refused (:class:`WouldWrite`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from receipts.adapter import EffectAdapter, QueryResult
from receipts.engine import check_same_intent
from receipts.errors import CorruptLedger, CorruptReceipt, IdempotencyConflict
from receipts.receipt import Receipt
from receipts.retired import retired_entry, retired_message
from receipts.states import needs_resolution
from receipts.store import ReceiptStore

__all__ = ["Recorder", "WouldWrite", "RecordedCall", "Rehearsal", "recorded_calls", "decide", "rehearse"]


class WouldWrite(RuntimeError):
    """A rehearsal reached a step that writes (an adapter's ``execute`` or ``settle``): recorded, refused."""


class Recorder:
    """An adapter whose queries are asked and whose writes are recorded, never done."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.tool: str = getattr(adapter, "tool", "?")
        self.recorded: list[tuple[str, str]] = []  # (what, key)

    def query(self, receipt: Receipt) -> QueryResult:
        result: QueryResult = self.adapter.query(receipt)
        return result

    def confirm(self, receipt: Receipt) -> list[str]:
        confirm: Callable[[Receipt], list[str]] | None = getattr(self.adapter, "confirm", None)
        return confirm(receipt) if confirm is not None else []

    def execute(self, receipt: Receipt, *_args: Any, **_kw: Any) -> Any:
        self.recorded.append(("execute", receipt.key))
        raise WouldWrite(f"execute of key '{receipt.key}' refused: a rehearsal writes nothing")

    def settle(self, receipt: Receipt) -> list[str]:
        self.recorded.append(("settle", receipt.key))
        raise WouldWrite(f"settle of key '{receipt.key}' refused: a rehearsal writes nothing")


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """One call as the ledger recorded it: where it starts, its key, what was decided and how it ended."""

    seq: int
    key: str
    call_id: str
    tool: str
    recorded: str  # execute | replay | query | person
    outcome: str | None  # the status its events end with (None: none recorded, a crash)


def recorded_calls(events: Iterable[Mapping[str, Any]]) -> tuple[list[RecordedCall], dict[str, Mapping[str, Any]]]:
    """The calls the ``events`` record, in order, and each key's last event with a status.

    A call starts at ``prepared`` (an execution, ended by its own token's
    ``committed``/``rejected``/``unknown``), ``replayed``, a ``committed`` or
    ``rejected`` without its ``prepared``, or a ``recovered``/``resolved``
    (a dead owner's call settled by a query or a person).
    """
    calls: list[dict[str, Any]] = []
    open_exec: dict[str, tuple[int, int]] = {}  # key -> (index in calls, token)
    last: dict[str, Mapping[str, Any]] = {}
    for e in events:
        key, kind = e.get("key"), str(e.get("event"))
        if not isinstance(key, str):
            continue
        if kind in ("quarantined", "removed"):
            last[key] = e
            open_exec.pop(key, None)
            continue
        token, status = e.get("fencing_token"), e.get("status")
        base = {"seq": int(e.get("seq") or 0), "key": key, "call_id": str(e.get("call_id") or ""),
                "tool": str(e.get("tool") or "?")}
        if kind == "prepared":
            open_exec[key] = (len(calls), token if isinstance(token, int) else -1)
            calls.append({**base, "recorded": "execute", "outcome": None})
        elif kind in ("committed", "rejected", "unknown"):
            at = open_exec.get(key)
            if at is not None and at[1] == token:
                calls[at[0]]["outcome"] = status
                if kind != "unknown":
                    open_exec.pop(key, None)
            elif kind != "unknown":
                calls.append({**base, "recorded": "execute", "outcome": status})
        elif kind == "replayed":
            calls.append({**base, "recorded": "replay", "outcome": status})
        elif kind in ("recovered", "resolved"):
            open_exec.pop(key, None)
            calls.append({**base, "recorded": "query" if kind == "recovered" else "person", "outcome": status})
        if isinstance(status, str) and kind != "replayed":
            last[key] = e
    return [RecordedCall(**c) for c in calls], last


def expected(last: Mapping[str, Any] | None) -> frozenset[str]:
    """What the ledger says a call of the key would get now (module docstring)."""
    if last is not None and last.get("event") == "removed":
        return frozenset({"conflict", "replay"})  # retired; replay: gc stopped before removing the file
    if last is None or last.get("event") == "quarantined":
        return frozenset({"execute"})
    status = last.get("status")
    if status == "committed":
        return frozenset({"replay"})
    if status == "rejected":
        # An event written before error_type/retryable were recorded says neither: either is right.
        if "retryable" not in last:
            return frozenset({"replay", "execute"})
        return frozenset({"execute" if last.get("retryable") else "replay"})
    return frozenset({"query", "person"})


@dataclass(frozen=True, slots=True)
class Decision:
    decision: str
    detail: str
    receipt_sha256: str | None


def decide(store: ReceiptStore, key: str, adapters: Mapping[str, Recorder]) -> Decision:
    """The engine's decision for a call of ``key`` today (module docstring), read-only."""
    try:
        receipt = store.read(key)
    except CorruptReceipt as exc:
        return Decision("corrupt", exc.message, None)
    if receipt is None:
        return Decision("execute", "no receipt: the call would run its effect again", None)
    try:
        # The call re-driven is the key's own (a recorded call passed this check when it ran).
        check_same_intent(receipt, receipt.args_sha256, key, receipt.identity)
    except IdempotencyConflict as exc:
        return Decision("conflict", exc.message, receipt.digest)
    adapter = adapters.get(receipt.tool)
    if receipt.is_final:
        if receipt.status == "committed" and adapter is not None:
            problems = adapter.confirm(receipt)
            if problems:
                return Decision("corrupt", "; ".join(problems), receipt.digest)
        return Decision("replay", f"{receipt.status} receipt answered again", receipt.digest)
    if not needs_resolution(receipt.status):
        return Decision("execute", "rejected, retryable: the next fencing token would run it", receipt.digest)
    if adapter is None:
        return Decision("person", f"no adapter for tool '{receipt.tool}' to query", receipt.digest)
    try:
        result = adapter.query(receipt)
    except CorruptReceipt as exc:
        return Decision("corrupt", exc.message, receipt.digest)
    if result.status == "unknown":
        return Decision("person", f"the adapter cannot tell ({result.reason}): 'oncepatch resolve'", receipt.digest)
    then = "replay committed" if result.status == "applied" else "execute (rejected, retryable)"
    return Decision("query", f"{receipt.status}: query says {result.status} ({result.reason}), then {then}",
                    receipt.digest)


@dataclass
class Rehearsal:
    rows: list[dict[str, Any]] = field(default_factory=list)
    refused_writes: list[tuple[str, str]] = field(default_factory=list)

    @property
    def divergent(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["divergence"]]

    def to_json(self) -> dict[str, Any]:
        return {"calls": self.rows, "divergences": len(self.divergent),
                "refused_writes": [{"what": w, "key": k} for w, k in self.refused_writes]}


def rehearse(store: ReceiptStore, adapters: Mapping[str, EffectAdapter], *, from_seq: int = 1) -> Rehearsal:
    """Decide every call the ledger recorded from ``from_seq`` on again (module docstring).

    ``adapters``: read-only ones (a query only reports a stale lock); each is
    wrapped in a :class:`Recorder`.

    Raises:
        CorruptLedger: the ledger's chain (or a signature) does not verify.
    """
    events: list[dict[str, Any]] = []
    problems = store.ledger.verify_chain(events.append)
    if problems:
        first = problems[0]
        raise CorruptLedger(f"ledger '{store.ledger.path}' line {first.line}: {first.reason}: its calls are not "
                            "replayed ('oncepatch verify' reports it)", effect_status="not_started",
                            details={"path": store.ledger.path})
    recorders = {tool: Recorder(a) for tool, a in adapters.items()}
    calls, last = recorded_calls(events)
    out = Rehearsal()
    decided: dict[str, Decision] = {}
    for call in calls:
        if call.seq < from_seq:
            continue
        now = decided.get(call.key)
        if now is None:
            now = decided[call.key] = decide(store, call.key, recorders)
            final_event = last.get(call.key) or {}
            if final_event.get("event") == "removed" and now.receipt_sha256 is None:
                # The key is retired: its key ref stays, and the apply path refuses it.
                now = decided[call.key] = Decision(
                    "conflict", f"no receipt: {retired_message(call.key, retired_entry(dict(final_event)))}; "
                                "a call with it is refused", None)
        want = expected(last.get(call.key))
        reasons: list[str] = []
        if now.decision not in want:
            reasons.append(f"the ledger says {' or '.join(sorted(want))}, today's store says {now.decision}")
        final = last.get(call.key) or {}
        named = final.get("receipt_sha256")
        if (now.receipt_sha256 is not None and isinstance(named, str) and named != now.receipt_sha256
                and final.get("event") not in ("quarantined", "removed")):
            reasons.append("the receipt on disk is not the one the ledger's last event names")
        detail = now.detail
        out.rows.append({"seq": call.seq, "key": call.key, "call_id": call.call_id, "tool": call.tool,
                         "recorded": call.recorded, "recorded_outcome": call.outcome, "now": now.decision,
                         "detail": detail, "expected": sorted(want), "divergence": bool(reasons),
                         "why": "; ".join(reasons) or None})
    for r in recorders.values():
        out.refused_writes += r.recorded
    return out

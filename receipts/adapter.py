"""The adapter protocol: how a tool with side effects plugs into receipts (docs/EFFECTS.md, "Adapters").

``receipts`` is generic: it knows keys, receipts, locks and the ledger, not
git; what it needs of a tool is :class:`EffectAdapter`.  An adapter that
cannot query returns ``unknown``, and recovery leaves the receipt for a person.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from receipts.receipt import Receipt

__all__ = ["QueryStatus", "QueryResult", "EffectAdapter"]

QueryStatus = Literal["applied", "not_applied", "unknown"]


@dataclass(frozen=True, slots=True)
class QueryResult:
    status: QueryStatus
    reason: str
    fields: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EffectAdapter(Protocol):
    """What the engine (:mod:`receipts.engine`) needs of a tool's adapter.

    ``query(receipt)`` must answer from the world, not from the receipt:
    ``applied`` (with ``fields={"result": ...}`` when it can rebuild the
    result, or the commit and outputs), ``not_applied``, or ``unknown``.
    Optional: ``prepare(args) -> dict`` (validate before anything is sent,
    fields for the receipt), ``verify_committed(receipt) -> list[str]``
    (``verify``, ``status``, ``recover``: why the world contradicts a
    ``committed`` receipt) and ``confirm(receipt) -> list[str]`` (the same
    question in the cheap form a replay can afford; a replay answers from the
    receipt only when it returns ``[]``).  A tool whose effect leaves nothing
    to check against returns ``[]`` from both.

    Optional, for the receipts' lifecycle (docs/LIFECYCLE.md):
    ``compensation(receipt, **inputs) -> (args, run)`` (the action that undoes
    a committed effect, run as a new keyed effect by
    :func:`receipts.effects.compensate`); ``check_tombstone(receipt) -> None``
    (raises unless what the world holds for a receipt ``oncepatch gc``
    removes still stands for it: git's key ref, kept as a tombstone); ``collect_unneeded(kept, *, dry_run) ->
    list[str]`` (state of the tool's own that none of the receipts that stay,
    ``kept``, needs any more: gc's extension point).
    """

    tool: str

    def query(self, receipt: Receipt) -> QueryResult: ...

    def settle(self, receipt: Receipt) -> list[str]:
        """Repair follow-up state for an applied receipt; return what was done (for the report)."""
        ...

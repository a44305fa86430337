"""Receipt states and their allowed transitions (pure; the diagram: docs/DESIGN.md section 3).

The seven-state vocabulary maps onto these: NEW = no receipt, ACCEPTED/RUNNING
= ``prepared`` (with a live owner holding the key lock), SUCCEEDED =
``committed``, FAILED_RETRYABLE / FAILED_FINAL = ``rejected`` with
``retryable`` true / false, UNKNOWN = ``unknown``.  ``unknown`` is never read
as failed.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Status", "STATUSES", "ALLOWED", "can_move", "needs_resolution"]

Status = Literal["prepared", "committed", "rejected", "unknown"]

STATUSES: frozenset[str] = frozenset({"prepared", "committed", "rejected", "unknown"})

ALLOWED: dict[str | None, frozenset[str]] = {
    None: frozenset({"prepared", "rejected"}),
    "prepared": frozenset({"prepared", "committed", "rejected", "unknown"}),
    "unknown": frozenset({"committed", "rejected", "unknown"}),
    "rejected": frozenset({"prepared"}),  # only when retryable
    "committed": frozenset(),
}


def can_move(current: str | None, new: str, *, retryable: bool | None = None) -> bool:
    """Whether a receipt in ``current`` state may be rewritten as ``new``."""
    if current == "rejected" and not retryable:
        return False
    return new in ALLOWED.get(current, frozenset())


def needs_resolution(status: str) -> bool:
    """States that ``recover`` must settle."""
    return status in ("prepared", "unknown")

"""The work one call may spend matching patches (pure: no I/O; docs/FORMATS.md, "work budget").

Matching is linear in the file and the patch (:mod:`patcher.matching`), but
every edit block of a file reads the whole file again
(:func:`patcher.formats.editblocks.apply_sequential`).  So each call gets one
:class:`WorkBudget` of *line steps*, :data:`MAX_MATCH_WORK` plus
:data:`LINEAR_ALLOWANCE` per line matched, and a call that would spend more is
refused with :class:`patcher.errors.TooLarge` before anything is written.
:func:`work_budget` opens one budget for everything matched inside it (one
call's files); outside any, :func:`current_budget` gives a fresh budget (one
per file).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from receipts.environ import env_int
from patcher.errors import TooLarge

__all__ = ["MAX_MATCH_WORK", "LINEAR_ALLOWANCE", "WorkBudget", "work_budget", "current_budget"]

#: The line steps one call may spend matching beyond :data:`LINEAR_ALLOWANCE` (module docstring).
MAX_MATCH_WORK = env_int("ONCEPATCH_MAX_MATCH_WORK", 16_000_000)

#: Steps allowed per line of each file matched and of its hunks, on top of :data:`MAX_MATCH_WORK`:
#: splitting, keying at every grade, one search.
LINEAR_ALLOWANCE = 24


class WorkBudget:
    """Line steps spent so far, against a limit."""

    __slots__ = ("limit", "spent")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = MAX_MATCH_WORK if limit is None else limit
        self.spent = 0

    def allow(self, lines: int) -> None:
        """Raise the limit by what linear matching of ``lines`` more lines may take.

        Called once per file a call matches, with the lines of the file and of
        its hunks: work that grows with the input is always allowed; only work
        that grows faster (every edit reading the whole file again) meets the limit.
        """
        self.limit += lines * LINEAR_ALLOWANCE

    def spend(self, steps: int, path: str) -> None:
        """Count ``steps`` more.

        Raises:
            TooLarge: the call has now spent more than its limit.
        """
        self.spent += steps
        if self.spent > self.limit:
            raise TooLarge(
                f"matching the patch against '{path}' needs more than {self.limit} steps of work "
                "(ONCEPATCH_MAX_MATCH_WORK): send fewer or smaller edits per call",
                details={"path": path, "limit": self.limit, "reason": "work"},
            )


_CURRENT: ContextVar[WorkBudget | None] = ContextVar("oncepatch_work_budget", default=None)


@contextmanager
def work_budget(limit: int | None = None) -> Iterator[WorkBudget]:
    """One budget for everything matched inside the ``with`` block."""
    budget = WorkBudget(limit)
    token = _CURRENT.set(budget)
    try:
        yield budget
    finally:
        _CURRENT.reset(token)


def current_budget() -> WorkBudget:
    """The budget of the enclosing :func:`work_budget`, or a fresh one."""
    budget = _CURRENT.get()
    return budget if budget is not None else WorkBudget()

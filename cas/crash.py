"""Named crash points for fault-injection tests (stdlib only).

``ONCEPATCH_CRASH_AT=<point>`` makes the process exit with status 137 (a
SIGKILL's) at that point, through ``os._exit``: no ``finally``, no atexit, no
flush, as if the machine had killed it there.  Unset, a point costs one dict
lookup.  The points are :data:`POINTS`; where each one is: docs/DESIGN.md
section 4, "Crash points" (gc's ``gc-after-removed``: docs/LIFECYCLE.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["POINTS", "CRASH_ENV", "PAUSE_ENV", "crash_point", "crash_hook", "pause_point"]

CRASH_ENV = "ONCEPATCH_CRASH_AT"
POINTS = frozenset({"after-stage", "after-prepare", "after-worktree-ahead", "after-index-ahead", "after-ref", "after-push",
                    "after-materialise", "after-generation", "before-receipt-replace", "recover-after-resolve",
                    "recover-before-receipt-replace", "check-running", "effect-after-execute",
                    "gc-after-removed"})
_environ = os.environ


def crash_point(name: str) -> None:
    """Exit with status 137 here if ``ONCEPATCH_CRASH_AT`` names this point."""
    if _environ.get(CRASH_ENV) == name:
        os._exit(137)


def crash_hook(name: str) -> Callable[[], None] | None:
    """A ``before_replace`` callback for :func:`cas.durable.write_durable`, or ``None`` when unarmed."""
    return (lambda: crash_point(name)) if _environ.get(CRASH_ENV) == name else None


#: Test seam (like ``ONCEPATCH_CRASH_AT``): ``ONCEPATCH_PAUSE_AT=<point>`` makes the process
#: stop itself with SIGSTOP at that point (docs/DESIGN.md, "Pause points").
PAUSE_ENV = "ONCEPATCH_PAUSE_AT"


def pause_point(name: str) -> None:
    """Stop this process (SIGSTOP) here if ``ONCEPATCH_PAUSE_AT`` names this point, until it is continued."""
    if _environ.get(PAUSE_ENV) == name:
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)

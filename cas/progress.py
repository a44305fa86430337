"""What the process is doing now, for a progress line (stdlib only; nothing here prints).

Long steps announce themselves (``with phase("creating the check worktree"):``;
a scan calls :func:`count` as it goes); the CLI, and only the CLI, reads
:func:`current` from a timer thread and shows it on stderr when a step has
taken more than a couple of seconds (docs/DECISIONS.md, issue 31).  With no
reader the cost is one lock and one assignment per call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["phase", "count", "current"]

_lock = threading.Lock()
_stack: list[tuple[str, float]] = []  # (what, since): the innermost step last
_counted: list[int] = [0]


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Mark ``what`` as the step under way until the block ends."""
    with _lock:
        _stack.append((what, time.monotonic()))
        _counted[0] = 0
    try:
        yield
    finally:
        with _lock:
            if _stack and _stack[-1][0] == what:
                _stack.pop()
            _counted[0] = 0


def count(n: int) -> None:
    """How many items the current step has done so far (shown beside it)."""
    _counted[0] = n


def current() -> tuple[str, float, int] | None:
    """``(what, seconds, items)``: the innermost step, the seconds since the outermost began, its count; or ``None``."""
    with _lock:
        if not _stack:
            return None
        return _stack[-1][0], time.monotonic() - _stack[0][1], _counted[0]

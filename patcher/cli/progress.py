"""Progress on stderr for work that takes more than :data:`AFTER` seconds (issue 31).

Shown when stderr is a terminal (one line, redrawn in place, cleared at the
end), or when asked with ``ONCEPATCH_PROGRESS=1`` (then a plain line every
:data:`EVERY_PLAIN` seconds, for logs).  Otherwise nothing: scripts reading
stderr see only errors.  What is shown is :func:`cas.progress.current`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from cas.progress import current, phase

__all__ = ["AFTER", "shown", "wanted"]

#: Seconds a step runs before its progress shows.
AFTER = 2.0
#: Seconds between plain lines when stderr is not a terminal but progress was asked for.
EVERY_PLAIN = 10.0


def wanted() -> bool:
    """Whether progress is shown: stderr is a terminal, or ``ONCEPATCH_PROGRESS=1``."""
    asked = os.environ.get("ONCEPATCH_PROGRESS")
    if asked is not None:
        return asked == "1"
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _line(what: str, seconds: float, n: int) -> str:
    return f"oncepatch: {what}{f' ({n})' if n else ''}, {seconds:.0f}s"


@contextlib.contextmanager
def shown(what: str) -> Iterator[None]:
    """Run the block as the step ``what``; show the innermost step's progress while it runs long."""
    if not wanted():
        with phase(what):
            yield
        return
    tty = sys.stderr.isatty()
    stop = threading.Event()
    drawn = [False]

    def tick() -> None:
        last_plain = 0.0
        while not stop.wait(0.5 if tty else 1.0):
            now = current()
            if now is None or now[1] < AFTER:
                continue
            text = _line(*now)
            if tty:
                sys.stderr.write(f"\r\033[K{text}")
                drawn[0] = True
            elif now[1] - last_plain >= EVERY_PLAIN or not last_plain:
                sys.stderr.write(text + "\n")
                last_plain = now[1]
            sys.stderr.flush()

    ticker = threading.Thread(target=tick, name="oncepatch-progress", daemon=True)
    with phase(what):
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            if drawn[0]:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()

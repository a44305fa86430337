"""Whether a process of this host is gone (stdlib only).

A zombie (exited, not yet reaped by its parent) still has its pid, so
``kill(pid, 0)`` succeeds, but its files are closed and its flocks dropped:
for a lock it left behind it is gone.  An agent's harness that reaps its
children one at a time leaves such zombies, and a later call used to wait for
a dead call's ``index.lock`` until its timeout.
"""

from __future__ import annotations

import os

__all__ = ["gone"]


def gone(pid: int) -> bool:
    """``True`` when no process ``pid`` runs here: none has that pid, or it is a zombie.

    A pid this process may not signal (another user's) counts as running: waiting is the safe side.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    # A process whose main thread has ended while others run shows its leader as a zombie
    # too: it is gone only when every thread is (those of an exit_group may linger a moment,
    # as zombies themselves).
    try:
        return all(_state(f"/proc/{pid}/task/{tid}/stat") in (b"Z", b"X") for tid in os.listdir(f"/proc/{pid}/task"))
    except (OSError, IndexError):
        return False  # no /proc (not Linux), or it went meanwhile: the next look decides


def _state(stat_path: str) -> bytes:
    """The state letter of a ``/proc/.../stat`` file (after the command name, which may hold ')'); ``X`` once gone."""
    try:
        with open(stat_path, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return b"X"  # a thread released between the listing and the read

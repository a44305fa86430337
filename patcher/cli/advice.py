"""What a text-mode error shows besides its message: the details ``--json`` carries, and the next step.

:func:`details` turns an error envelope into the lines printed on stderr
after ``oncepatch: <type>: <message>``: the closest match's diff of a hunk
that did not apply, the tail of a failed ``--check``'s output, the way out
of a corrupt receipt.  Nothing here changes the envelope.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["details", "CHECK_TAIL_LINES"]

#: How many of a failed check's last output lines text mode shows (all of it is in the file it names).
CHECK_TAIL_LINES = 30


def _closest(err: dict[str, Any]) -> list[str]:
    closest = err.get("closest")
    if not isinstance(closest, dict) or not isinstance(closest.get("diff"), list):
        return []
    line = closest.get("line")
    out = [f"closest match{' at line ' + str(line) if line is not None else ''} of "
           f"'{err.get('path', '?')}' ('-' the patch expects, '+' the file has):"]
    out += [f"  {row}" for row in closest["diff"] if isinstance(row, str)]
    return out


def _check_output(err: dict[str, Any]) -> list[str]:
    path = err.get("output_path")
    if not isinstance(path, str):
        return []
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return [f"check output: in {path}"]
    lines = text.splitlines()
    shown = lines[-CHECK_TAIL_LINES:]
    head = (f"check output (last {len(shown)} of {len(lines)} lines; all of it in {path}):"
            if len(shown) < len(lines) else f"check output (also in {path}):")
    return [head, *(f"  {row}" for row in shown)] if lines else [f"check output: none ({path})"]


def details(err: dict[str, Any]) -> str:
    """The lines (each ending in a newline) a text-mode error prints after its message, maybe none."""
    lines = _closest(err) + _check_output(err)
    etype = err.get("type")
    if etype == "corrupt_receipt":
        key = err.get("key")
        lines.append("next: if a crash left it, 'oncepatch recover'; otherwise look at it, then "
                     f"'oncepatch quarantine {key if isinstance(key, str) else 'KEY'}' moves it aside, kept as "
                     "evidence ('oncepatch doctor' shows what else is wrong)")
    elif etype == "idempotency_conflict" and err.get("next_action") == "new_key":
        lines.append("next: this key already stands for another change: give this one a new --key")
    return "".join(f"{line}\n" for line in lines)

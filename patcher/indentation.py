"""Indentation of a hunk matched ignoring leading whitespace (pure: no I/O).

At the grades that ignore leading whitespace (:data:`LOOSE_INDENT_GRADES`)
every non-blank matched line must be off by one same delta -- the file's
indentation is the patch's plus (or minus) one same whitespace string; tabs
against spaces is no delta -- and the hunk's added lines move by it
(:func:`indent_shift`, :func:`shifted`).  Otherwise
:class:`patcher.errors.IndentationMismatch`, before anything is written:
kept lines taking the file's indentation and added ones the patch's is how a
loose match used to commit Python that no longer parsed.
"""

from __future__ import annotations

from patcher.errors import IndentationMismatch
from patcher.lines import Lines, chomp, line_text
from patcher.model import Hunk

__all__ = ["LOOSE_INDENT_GRADES", "indent_shift", "shifted"]

_SHOWN = 20  # matched lines an error lists


_INDENT = b" \t"
LOOSE_INDENT_GRADES = ("strip", "punct")  # the grades that ignore leading whitespace


def _indent(line: bytes) -> bytes:
    return line[: len(line) - len(line.lstrip(_INDENT))]


def _show_delta(sign: int, ws: bytes) -> str:
    if not sign:
        return "0"
    what = f"{len(ws)} space(s)" if ws.strip(b" ") == b"" else f"{ws.decode()!r}"
    return ("+" if sign > 0 else "-") + what


def indent_shift(f: Lines, hunk: Hunk, pos: int, index: int) -> tuple[int, bytes]:
    """The one indentation delta between the hunk's old lines and the file's (``(sign, whitespace)``).

    Every non-blank matched line must be off by the same delta: the file's
    indentation is the patch's plus (sign 1) or minus (sign -1) the same
    whitespace.  Tabs against spaces (neither indentation a prefix of the
    other) is no delta.

    Raises:
        IndentationMismatch: the lines are off by different deltas, or by none.
    """
    seen: dict[tuple[int, bytes] | None, list[int]] = {}
    for k, pline in enumerate(hunk.old_lines):
        fline = f.lines[pos + k]
        if not pline.strip() or not fline.strip():
            continue
        pi, fi = _indent(chomp(pline)), _indent(chomp(fline))
        delta: tuple[int, bytes] | None
        if fi == pi:
            delta = (0, b"")
        elif fi.startswith(pi):
            delta = (1, fi[len(pi):])
        elif pi.startswith(fi):
            delta = (-1, pi[len(fi):])
        else:
            delta = None
        seen.setdefault(delta, []).append(pos + k + 1)
    only = next(iter(seen), (0, b""))
    if only is not None and len(seen) <= 1:
        return only
    parts = [f"line(s) {', '.join(map(str, lines[:5]))}: "
             + ("tabs against spaces" if d is None else f"off by {_show_delta(*d)}")
             for d, lines in seen.items()]
    raise IndentationMismatch(
        f"hunk {index + 1} of '{f.path}' matches only ignoring indentation, and its lines are not all "
        f"off by the same indentation ({'; '.join(parts)}): nothing was changed; send the lines as "
        "they are in the file",
        details={"path": f.path, "hunk": index + 1, "hunk_header": hunk.header,
                 "lines": [{"line": line, "delta": None if d is None else _show_delta(*d)}
                           for d, lines in seen.items() for line in lines[:_SHOWN]]},
    )


def shifted(line: bytes, sign: int, ws: bytes, f: Lines, hunk: Hunk, index: int) -> bytes:
    """An added line moved by the hunk's indentation delta (blank lines stay as they are)."""
    if not sign or not line.strip():
        return line
    if sign > 0:
        return ws + line
    if line.startswith(ws):
        return line[len(ws):]
    raise IndentationMismatch(
        f"hunk {index + 1} of '{f.path}' matches only with {len(ws)} fewer indentation character(s), and "
        f"its added line '{line_text(line).strip()[:60]}' has fewer than that to remove: nothing was changed",
        details={"path": f.path, "hunk": index + 1, "hunk_header": hunk.header, "line": line_text(line)},
    )

"""What a result says about how loosely its hunks matched, and ``strict`` calls (pure: no I/O).

The grades are :mod:`patcher.matching`'s (``exact``, ``rstrip``, ``strip``,
``punct``) plus ``substring`` (an edit's exact partial-line text,
:mod:`patcher.formats.editblocks`).  A result carries the grade of every
hunk and, per hunk below ``exact``, a warning (:func:`grade_warnings`); a
strict call refuses such a hunk (:func:`refuse_inexact`).  Kept apart from
the matcher so that a replay, which only reports a receipt's grades, does
not import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar

from patcher.errors import InexactMatch

__all__ = ["STRICT", "refuse_inexact", "grade_warnings"]

#: ``strict`` calls (``--strict``): a hunk that applies below ``exact`` is refused
#: (:class:`patcher.errors.InexactMatch`) instead of applied; set by :func:`patcher.protocol.apply`.
STRICT: ContextVar[bool] = ContextVar("oncepatch_strict", default=False)

#: Grades a result warns about: every one below ``exact`` (``substring``: exact text, in place).
_WARN_FREE = ("exact", "substring")
_GRADE_WORDS = {"rstrip": "ignoring trailing whitespace", "strip": "ignoring indentation and trailing whitespace",
                "punct": "ignoring whitespace and Unicode punctuation"}


def refuse_inexact(path: str, grades: Sequence[str], applied: Sequence[int]) -> None:
    """Under :data:`STRICT`, refuse the first applied hunk (0-based in ``applied``) matched below ``exact``.

    Raises:
        InexactMatch: such a hunk.
    """
    if not STRICT.get():
        return
    for i in applied:
        if grades[i] not in _WARN_FREE:
            raise InexactMatch(
                f"hunk {i + 1} of '{path}' matches only at grade {grades[i]} ({_GRADE_WORDS.get(grades[i], '')}), "
                "and the call is strict: nothing was changed; send the lines exactly as they are in the file",
                details={"path": path, "hunk": i + 1, "grade": grades[i], "grades": list(grades)},
            )


def grade_warnings(grades: Mapping[str, Sequence[str]]) -> list[str]:
    """One warning per hunk matched below ``exact`` (a result's ``warnings``)."""
    out = []
    for path, per_hunk in grades.items():
        for i, grade in enumerate(per_hunk):
            if grade not in _WARN_FREE:
                out.append(f"'{path}' hunk {i + 1} matched at grade {grade} "
                           f"({_GRADE_WORDS.get(grade, 'loosely')}): check the result")
    return out

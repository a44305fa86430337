"""The one internal model every patch format parses into (pure data, no I/O).

A patch is an ordered tuple of :class:`FileEdit`.  Paths are POSIX, relative to
the repository root, already checked by :mod:`patcher.paths`.

Lines are ``bytes`` *including* their terminator (``b"\\n"`` or ``b"\\r\\n"``);
only the last line of a file may lack one.  Formats whose lines carry no
terminator (agent formats) set ``Hunk.eol_agnostic``: the matcher then compares
lines without their terminators and writes new lines with the file's own line
ending, so a CRLF file stays CRLF.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "MODE_FILE",
    "MODE_EXEC",
    "MODE_LINK",
    "Op",
    "Hunk",
    "FileEdit",
    "Patch",
    "AppliedFile",
]

MODE_FILE = 0o100644
MODE_EXEC = 0o100755
MODE_LINK = 0o120000

Op = Literal["add", "modify", "delete", "rename", "copy"]


@dataclass(frozen=True, slots=True)
class Hunk:
    """One hunk: the old lines (context + removed) become the new lines (context + added).

    ``old_start`` is the 1-based line the patch claims the old lines start at
    (``None`` for formats without line numbers; ``0`` for an empty old side).
    ``scopes`` are ``@@ <scope line>`` anchors (apply_patch) that must be found, in
    order, before the hunk.  ``at_eof`` anchors the hunk to the end of the file.
    ``prefer_start`` / ``prefer_eof``: where git anchors a unified hunk (old side
    from line 1; context before the change and none after it), tried first:
    the hunk applies, or is found present, there before anywhere else.
    ``kept``: when the format says which lines are context (apply_patch), the
    ``(new index, old index)`` of each; ``None``: paired by content.
    """

    old_lines: tuple[bytes, ...]
    new_lines: tuple[bytes, ...]
    old_start: int | None = None
    scopes: tuple[bytes, ...] = ()
    at_eof: bool = False
    eol_agnostic: bool = False
    prefer_start: bool = False
    prefer_eof: bool = False
    header: str = ""
    kept: tuple[tuple[int, int], ...] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class FileEdit:
    """An edit of one path.

    * ``add``: ``path`` must not exist; ``content`` is the whole new file.
    * ``delete``: ``path`` must exist; if ``hunks``/``content`` are given they must
      describe the whole current content (git diffs do), else the delete is blind.
    * ``modify``: ``hunks`` applied to ``path`` (or ``content`` replaces it whole
      when ``hunks`` is empty and ``content`` is not ``None``); a mode change
      alone has neither.
    * ``rename``: as ``modify``, and the result lands at ``new_path`` (which must
      not exist); ``path`` disappears.
    * ``copy``: as ``rename``, but ``path`` stays as it is (it is read, not
      touched); the copy's content is ``path``'s content in the base commit.

    ``binary`` marks a git binary patch: ``"literal"`` (``content`` is the whole
    new file), ``"delta"`` (``delta`` is git's delta against the old content) or
    ``"blob"`` (no data: the new content is the object ``new_blob``, which must
    be in the repository).  Binary edits are checked against ``old_blob`` and
    ``new_blob`` as ``git apply`` checks them.

    ``new_mode`` is the git file mode after the edit (``None``: keep the old one;
    for ``add``, ``None`` means :data:`MODE_FILE`).  ``old_mode`` is what the
    patch claims the mode was (checked when given).
    """

    op: Op
    path: str
    new_path: str | None = None
    hunks: tuple[Hunk, ...] = ()
    content: bytes | None = None
    old_mode: int | None = None
    new_mode: int | None = None
    old_blob: str | None = None  # git 'index' line: abbreviated or full old blob oid
    new_blob: str | None = None
    binary: str | None = None
    delta: bytes | None = None

    @property
    def target(self) -> str:
        """The path the edit's result lives at (``new_path`` for a rename)."""
        return self.new_path if self.new_path is not None else self.path

    @property
    def touched(self) -> tuple[str, ...]:
        """Every path this edit changes in the tree (a copy's source is only read)."""
        if self.op == "copy" and self.new_path is not None:
            return (self.new_path,)
        if self.new_path is not None and self.new_path != self.path:
            return (self.path, self.new_path)
        return (self.path,)


@dataclass(frozen=True, slots=True)
class Patch:
    format: str
    edits: tuple[FileEdit, ...]


@dataclass(frozen=True, slots=True)
class AppliedFile:
    """Result of applying hunks to one file's bytes; ``grades`` names, per hunk, the grade that matched."""

    content: bytes
    grades: tuple[str, ...] = field(default=())
    already_applied: bool = False

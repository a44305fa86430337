"""Parser of the ``apply_patch`` envelope (``*** Begin Patch`` ... ``*** End Patch``) (pure).

The grammar, what is tolerated because agents send it, and what is refused:
docs/FORMATS.md, "`apply_patch`".  Update hunks are line-ending agnostic
(``Hunk.eol_agnostic``, ``Hunk.kept`` naming the context lines by position);
a ``\\ No newline`` line makes a hunk exact about line endings instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from patcher.formats.detection import looks_envelope
from patcher.errors import ParseError
from patcher.formats import Format
from patcher.model import FileEdit, Hunk, Patch

__all__ = ["FORMAT_NAME", "looks_envelope", "parse_envelope", "FORMATS"]

FORMAT_NAME = "apply_patch"

BEGIN = b"*** Begin Patch"
END = b"*** End Patch"
ADD = b"*** Add File:"
DELETE = b"*** Delete File:"
UPDATE = b"*** Update File:"
MOVE = b"*** Move to:"
END_OF_FILE = b"*** End of File"

_KNOWN = (ADD, DELETE, UPDATE, MOVE, END_OF_FILE, BEGIN, END)
_HEREDOC = re.compile(rb"(?:(?:apply_patch|applypatch)\s+)?<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_UNIFIED_HEADER = re.compile(rb"@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@.*")


@dataclass(slots=True)
class _Line:
    no: int  # 1-based line number in the patch as sent
    raw: bytes  # without its "\n" (a "\r" before it is kept)

    @property
    def text(self) -> bytes:
        """The line without its terminator (``\\r\\n`` or ``\\n``)."""
        return self.raw[:-1] if self.raw.endswith(b"\r") else self.raw

    @property
    def marker(self) -> bytes:
        return self.raw.strip()


def _error(message: str, line: int | None = None, **extra: object) -> ParseError:
    details: dict[str, object] = dict(extra)
    if line is not None:
        details["line"] = line
        message = f"{message} (line {line})"
    return ParseError(f"invalid apply_patch envelope: {message}", details=details)


def _lines(data: bytes) -> list[_Line]:
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    return [_Line(i + 1, raw) for i, raw in enumerate(parts)]


def _trimmed(lines: list[_Line]) -> list[_Line]:
    """``lines`` without the blank lines at either end."""
    lo, hi = 0, len(lines)
    while lo < hi and not lines[lo].marker:
        lo += 1
    while hi > lo and not lines[hi - 1].marker:
        hi -= 1
    return lines[lo:hi]


def _unwrap(lines: list[_Line]) -> list[_Line]:
    """The lines between ``*** Begin Patch`` and ``*** End Patch`` (heredoc and blanks removed)."""
    body = _trimmed(lines)
    if not body:
        raise _error("the patch is empty")
    heredoc = _HEREDOC.fullmatch(body[0].marker)
    if heredoc is not None:
        tag = heredoc[2]
        if len(body) < 2 or body[-1].marker != tag:
            raise _error(f"heredoc '{tag.decode()}' is not closed by a last line '{tag.decode()}'",
                         body[-1].no)
        body = _trimmed(body[1:-1])
    if not body or body[0].marker != BEGIN:
        first = body[0] if body else lines[0]
        raise _error("the first line must be '*** Begin Patch'", first.no)
    if body[-1].marker != END or len(body) < 2:
        ends = [ln.no for ln in body[1:] if ln.marker == END]
        if ends:
            raise _error("text after '*** End Patch'", ends[0] + 1)
        raise _error("the last line must be '*** End Patch' (is the patch cut short?)", body[-1].no)
    inner = body[1:-1]
    for ln in inner:
        if ln.marker == BEGIN or ln.marker == END:
            raise _error(f"unexpected '{ln.marker.decode()}' inside the patch", ln.no)
    return inner


def _path(line: _Line, marker: bytes) -> str:
    raw = line.marker[len(marker):].strip()
    if not raw:
        raise _error(f"'{marker.decode()}' without a path", line.no)
    return raw.decode("utf-8", "surrogateescape")  # (valid UTF-8 decodes as with "strict")


@dataclass(slots=True)
class _HunkBuf:
    line: int
    header: str
    scopes: list[bytes] = field(default_factory=list)
    body: list[tuple[str, _Line]] = field(default_factory=list)  # (' ' | '-' | '+', line)
    no_newline: set[int] = field(default_factory=set)  # indexes into body
    at_eof: bool = False


def _hunk(buf: _HunkBuf, path: str, index: int) -> Hunk:
    body = list(buf.body)
    while not buf.at_eof and body and body[-1][1].raw == b"" and len(body) - 1 not in buf.no_newline:
        body.pop()  # trailing bare blank lines: a separator, not context (see module docstring)
    if not body:
        raise _error(f"hunk {index} of '{path}' has no lines", buf.line, path=path, hunk=index)
    if all(kind == " " for kind, _ in body):
        raise _error(f"hunk {index} of '{path}' changes nothing (no '+' or '-' line)", buf.line,
                     path=path, hunk=index)
    exact = bool(buf.no_newline)
    old: list[bytes] = []
    new: list[bytes] = []
    kept: list[tuple[int, int]] = []
    for k, (kind, ln) in enumerate(body):
        content = ln.raw[1:] if ln.raw[:1] in (b" ", b"-", b"+") else b""
        if exact:
            line = content if k in buf.no_newline else content + b"\n"
        else:
            line = content[:-1] if content.endswith(b"\r") else content
        if kind == " ":
            kept.append((len(new), len(old)))
        if kind in (" ", "-"):
            old.append(line)
        if kind in (" ", "+"):
            new.append(line)
    for side in (old, new):
        for line in side[:-1]:
            if exact and not line.endswith(b"\n"):
                raise _error(f"hunk {index} of '{path}': '\\ No newline' marks a line that is not "
                             "the last of its side", buf.line, path=path, hunk=index)
    return Hunk(old_lines=tuple(old), new_lines=tuple(new), scopes=tuple(buf.scopes), at_eof=buf.at_eof or exact,
                eol_agnostic=not exact, header=buf.header, kept=tuple(kept))


def _parse_update(lines: list[_Line], i: int, path: str) -> tuple[list[Hunk], int]:
    """Hunks of one ``Update File`` section starting at ``lines[i]``; returns them and the next index."""
    hunks: list[Hunk] = []
    buf: _HunkBuf | None = None

    def flush() -> None:
        nonlocal buf
        if buf is not None:
            hunks.append(_hunk(buf, path, len(hunks) + 1))
            buf = None

    while i < len(lines):
        ln = lines[i]
        marker = ln.marker
        if marker == END_OF_FILE:
            if buf is None or not buf.body:
                raise _error("'*** End of File' outside a hunk", ln.no)
            buf.at_eof = True
            flush()
            i += 1
            continue
        if _is_marker(ln):
            break
        if ln.raw.startswith(b"@@"):
            # '@@' lines stack until the hunk's first body line.
            if buf is not None and buf.body:
                flush()
            if buf is None:
                buf = _HunkBuf(ln.no, ln.text.decode("utf-8", "replace"))
            else:
                buf.header += "\n" + ln.text.decode("utf-8", "replace")
            scope = _scope_of(ln)
            if scope is not None:
                buf.scopes.append(scope)
            i += 1
            continue
        if buf is None:
            if not marker:
                i += 1  # blank lines between sections and hunks
                continue
            buf = _HunkBuf(ln.no, "")
        first = ln.raw[:1]
        if first in (b" ", b"-", b"+"):
            buf.body.append((first.decode(), ln))
        elif first == b"\\":
            if not buf.body:
                raise _error("'\\ No newline at end of file' with no line before it", ln.no)
            buf.no_newline.add(len(buf.body) - 1)
        elif not marker:
            buf.body.append((" ", _Line(ln.no, b"")))  # a bare empty line: empty context
        else:
            raise _error(
                f"unexpected line in hunk of '{path}': '{ln.text.decode('utf-8', 'replace')[:60]}'; "
                "every hunk line starts with ' ' (context), '-' (removed) or '+' (added)",
                ln.no, path=path,
            )
        i += 1
    flush()
    return hunks, i


def _is_marker(ln: _Line) -> bool:
    """A ``***`` line: at column 0, or indented but naming a known marker (else it is context)."""
    return ln.raw.startswith(b"***") or ln.marker.startswith(_KNOWN)


def _scope_of(ln: _Line) -> bytes | None:
    """The scope text of an ``@@`` line, ``None`` for a bare ``@@`` or a unified hunk header."""
    text = ln.text.lstrip()
    if _UNIFIED_HEADER.fullmatch(text.rstrip()):
        return None
    rest = text[3:] if text[2:3] == b" " else text[2:]
    return rest if rest.strip() else None


def parse_envelope(data: bytes) -> Patch:
    """Parse an ``apply_patch`` envelope into ``Patch(format="apply_patch", ...)``.

    Raises:
        ParseError: the envelope is malformed (module docstring), with ``details["line"]``.
    """
    lines = _unwrap(_lines(data))
    edits: list[FileEdit] = []
    seen: dict[str, int] = {}

    def claim(path: str, line: int) -> None:
        if path in seen:
            raise _error(f"'{path}' appears in two file sections (lines {seen[path]} and {line}); "
                         "put all of its hunks in one section", line, path=path)
        seen[path] = line

    i = 0
    while i < len(lines):
        ln = lines[i]
        marker = ln.marker
        if not marker:
            i += 1
            continue
        if marker.startswith(ADD):
            path = _path(ln, ADD)
            claim(path, ln.no)
            content: list[bytes] = []
            i += 1
            while i < len(lines):
                nxt = lines[i]
                if nxt.raw.startswith(b"+"):
                    content.append(nxt.raw[1:] + b"\n")
                elif nxt.raw.startswith(b"\\") and content and content[-1].endswith(b"\n"):
                    content[-1] = content[-1][:-1]
                elif not nxt.marker:
                    j = i
                    while j < len(lines) and not lines[j].marker:
                        j += 1
                    if j < len(lines) and lines[j].raw.startswith(b"+"):
                        raise _error(f"blank line inside Add File '{path}': write an empty line as '+'",
                                     nxt.no, path=path)
                    i = j
                    break
                else:
                    break
                i += 1
            if any(not line.endswith(b"\n") for line in content[:-1]):
                raise _error(f"'\\ No newline' in Add File '{path}' is not after its last line", ln.no,
                             path=path)
            edits.append(FileEdit(op="add", path=path, content=b"".join(content)))
            continue
        if marker.startswith(DELETE):
            path = _path(ln, DELETE)
            claim(path, ln.no)
            i += 1
            while i < len(lines) and not lines[i].marker:
                i += 1
            if i < len(lines) and not _is_marker(lines[i]):
                raise _error(f"Delete File '{path}' takes no lines", lines[i].no, path=path)
            edits.append(FileEdit(op="delete", path=path))
            continue
        if marker.startswith(UPDATE):
            path = _path(ln, UPDATE)
            claim(path, ln.no)
            i += 1
            new_path: str | None = None
            if i < len(lines) and lines[i].marker.startswith(MOVE):
                new_path = _path(lines[i], MOVE)
                if new_path == path:
                    raise _error(f"'{path}' is moved onto itself", lines[i].no, path=path)
                claim(new_path, lines[i].no)
                i += 1
            hunks, i = _parse_update(lines, i, path)
            if not hunks and new_path is None:
                raise _error(f"Update File '{path}' has no hunks", ln.no, path=path)
            edits.append(FileEdit(op="modify" if new_path is None else "rename", path=path, new_path=new_path,
                                  hunks=tuple(hunks)))
            continue
        if marker.startswith(MOVE):
            raise _error("'*** Move to:' must directly follow '*** Update File:'", ln.no)
        raise _error(f"'{ln.text.decode('utf-8', 'replace')[:60]}' is not a file header; expected "
                     "'*** Add File: <path>', '*** Delete File: <path>' or '*** Update File: <path>'", ln.no)
    if not edits:
        raise _error("the patch changes no file")
    return Patch(format=FORMAT_NAME, edits=tuple(edits))


FORMATS: list[Format] = [Format(FORMAT_NAME, looks_envelope, parse_envelope)]

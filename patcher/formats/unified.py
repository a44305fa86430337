"""Parser of unified diffs (``git diff``, ``format-patch``, ``diff -u``, agents) into a ``Patch`` (pure).

Content stays bytes (non-UTF-8 and CRLF survive byte for byte); paths are
decoded as UTF-8 with ``surrogateescape`` and checked by
:func:`patcher.paths.check_path`.  What is read, what each block becomes and
what is refused: docs/FORMATS.md, "`unified`".  Size limits are the caller's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from cas.hashing import git_blob_oid
from patcher.formats.binary import BinaryHunk, InflateBudget, read_binary_hunks
from patcher.formats.detection import looks_unified
from patcher.errors import ParseError, UnsupportedPatch
from patcher.matching import chomp, split_lines
from patcher.model import FileEdit, Hunk, MODE_EXEC, MODE_FILE, MODE_LINK, Patch
from patcher.paths import check_path

__all__ = ["looks_unified", "parse_unified"]

_DEV_NULL = b"/dev/null"
_FULL_OID = (40, 64)  # hex digits of a full SHA-1 / SHA-256 object id
_MODE_GITLINK = 0o160000
# A hunk line's first byte, and the sides a line goes to (patcher.formats.unified._read_hunk).
_SPACE, _MINUS, _PLUS, _BACKSLASH = b" -+\\"
_OLD, _NEW, _BOTH = 1, 2, 3
_HUNK = re.compile(rb"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)", re.DOTALL)
_INDEX = re.compile(rb"([0-9a-fA-F]+)\.\.([0-9a-fA-F]+)(?: +([0-7]+))? *")
_STAMP = rb"\s*(\d{4}-\d\d-\d\d[ T]\d\d:\d\d(?::\d\d(?:\.\d+)?)?)(?:\s*([+-]\d{4}))?\s*"
_DATED_NAME = re.compile(rb"(.*?)\s" + _STAMP)  # 'name 2024-01-01 10:00:00 +0000' without a tab
_TIMESTAMP = re.compile(_STAMP)
_BINARY = re.compile(rb"Binary files (.*) and (.*) differ")
_MAIL_START = re.compile(rb"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$", re.MULTILINE)  # format-patch
_PREFIX_PAIRS = ((b"a/", b"b/"), (b"c/", b"w/"), (b"c/", b"i/"), (b"i/", b"w/"), (b"o/", b"w/"), (b"1/", b"2/"))
_ESCAPES = {ord(c): v for c, v in zip('abtnvfr"\\', (7, 8, 9, 10, 11, 12, 13, 34, 92))}


# ---------------------------------------------------------------------------
# names


def _show(name: bytes) -> str:
    return name.decode("utf-8", "backslashreplace")


def _fail(message: str, lineno: int, **extra: object) -> ParseError:
    return ParseError(message, details={"line": lineno, **extra})


def _unquote(text: bytes, start: int, lineno: int) -> tuple[bytes, int]:
    """Unquote the C-style string starting at ``text[start] == '"'``.

    Returns the bytes and the index just after the closing quote.
    """
    out = bytearray()
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == ord('"'):
            return bytes(out), i + 1
        if c == ord("\\"):
            i += 1
            if i >= len(text):
                break
            e = text[i]
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
                i += 1
                continue
            octal = text[i : i + 3]
            if len(octal) == 3 and all(0x30 <= d <= 0x37 for d in octal) and int(octal, 8) < 256:
                out.append(int(octal, 8))
                i += 3
                continue
            raise _fail(f"bad escape in quoted name at line {lineno}: '{_show(text)}'", lineno)
        out.append(c)
        i += 1
    raise _fail(f"unterminated quoted name at line {lineno}: '{_show(text)}'", lineno)


def _is_epoch(date: bytes, zone: bytes | None) -> bool:
    try:
        stamp = datetime.fromisoformat(date.decode("ascii").replace(" ", "T")[:19])
    except ValueError:
        return False
    offset = 0
    if zone:
        sign = -1 if zone[:1] == b"-" else 1
        offset = sign * (int(zone[1:3]) * 3600 + int(zone[3:5]) * 60)
    seconds = (stamp - datetime(1970, 1, 1)).total_seconds() - offset
    return seconds == 0


def _name_field(raw: bytes, lineno: int) -> tuple[bytes, bool]:
    """The name on a ``---``/``+++`` line (after the marker); whether its timestamp is the epoch."""
    raw = chomp(raw)
    if raw.startswith(b'"'):
        # GNU diff quotes a name with spaces and still dates it: '"a/x y"<TAB>1970-01-01 ...'.
        name, end = _unquote(raw, 0, lineno)
        dated = _TIMESTAMP.fullmatch(raw[end + 1:]) if raw[end:end + 1] == b"\t" else None
        return name, dated is not None and _is_epoch(dated[1], dated[2])
    name, tab, stamp = raw.partition(b"\t")
    if tab:
        dated = _TIMESTAMP.fullmatch(stamp)
        return name, dated is not None and _is_epoch(dated[1], dated[2])
    # No tab (git adds one after names with spaces): trailing blanks are junk, a date is a stamp.
    name = name.rstrip(b" ")
    dated = _DATED_NAME.fullmatch(name)
    if dated is None:
        return name, False
    return dated[1], _is_epoch(dated[2], dated[3])


def _header_names(rest: bytes, lineno: int) -> tuple[bytes, bytes] | None:
    """The two names of a ``diff --git`` line, or ``None`` when spaces make them ambiguous."""
    if rest.startswith(b'"'):
        first, end = _unquote(rest, 0, lineno)
        tail = rest[end:]
        if not tail.startswith(b" "):
            return None
        tail = tail[1:]
        if tail.startswith(b'"'):
            second, end = _unquote(tail, 0, lineno)
            return (first, second) if end == len(tail) else None
        return first, tail
    k = rest.find(b' "')
    while k != -1:
        try:
            second, end = _unquote(rest, k + 1, lineno)
        except ParseError:
            second, end = b"", -1
        if end == len(rest):
            return rest[:k], second
        k = rest.find(b' "', k + 1)
    splits: list[int] = []
    for k in (m.start() for m in re.finditer(rb" ", rest)):
        old, new = rest[:k], rest[k + 1 :]
        if old == new or (b"/" in old and old.partition(b"/")[2] == new.partition(b"/")[2]):
            splits.append(k)
    if len(splits) != 1 and rest.count(b" ") == 1:
        splits = [rest.index(b" ")]
    if len(splits) != 1:
        return None
    k = splits[0]
    return rest[:k], rest[k + 1 :]


def _prefix_pair(old: bytes, new: bytes) -> tuple[bytes, bytes]:
    """The prefixes a ``diff --git`` line uses (``(b"", b"")`` for ``--no-prefix``)."""
    if old == new:
        return b"", b""
    for pair in _PREFIX_PAIRS:
        if old.startswith(pair[0]) and new.startswith(pair[1]):
            return pair
    old_first, old_sep, old_rest = old.partition(b"/")
    new_first, new_sep, new_rest = new.partition(b"/")
    if old_sep and new_sep and old_rest == new_rest:
        return old_first + b"/", new_first + b"/"
    return b"", b""


def _strip(name: bytes, prefix: bytes) -> bytes:
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


# ---------------------------------------------------------------------------
# blocks


@dataclass(slots=True)
class _Block:
    """One file's section of the patch while it is being read."""

    line: int
    git: bool
    header: tuple[bytes, bytes] | None = None
    prefix: tuple[bytes, bytes] | None = None
    minus: bytes | None = None
    plus: bytes | None = None
    minus_epoch: bool = False
    plus_epoch: bool = False
    rename_from: bytes | None = None
    rename_to: bytes | None = None
    copy: tuple[bytes | None, bytes | None] | None = None
    old_mode: int | None = None
    new_mode: int | None = None
    new_file_mode: int | None = None
    deleted_mode: int | None = None
    index_mode: int | None = None
    old_blob: str | None = None
    new_blob: str | None = None
    index_full: bool = False  # an index line with full object ids on both sides
    binary: str | None = None  # "patch" (GIT binary patch) or "differ" (no data)
    binary_data: BinaryHunk | None = None
    hunks: list[Hunk] = field(default_factory=list)

    def display(self) -> str:
        """The block's path as far as it is known yet, for messages."""
        old, new = _names(self)
        name = new if new is not None else old
        return "?" if name is None else _show(name)


def _mode(raw: bytes, lineno: int) -> int:
    try:
        mode = int(raw.strip(), 8)
    except ValueError:
        mode = -1
    kind = mode & 0o170000 if mode >= 0 else -1
    if mode == _MODE_GITLINK:
        return mode
    if kind == 0o120000:
        return MODE_LINK
    if kind == 0o100000:
        return MODE_EXEC if mode & 0o100 else MODE_FILE
    raise _fail(f"invalid file mode '{_show(raw)}' at line {lineno}", lineno)


def _blob(oid: bytes) -> str | None:
    text = oid.decode("ascii").lower()
    return None if set(text) == {"0"} else text


def _path_field(raw: bytes, lineno: int) -> bytes:
    return _unquote(raw, 0, lineno)[0] if raw.startswith(b'"') else raw


def _extended(block: _Block, line: bytes, lineno: int) -> bool:
    """Consume one extended header line of a git block; ``False`` when ``line`` is not one."""
    head, _, value = line.partition(b" ")
    if line.startswith(b"old mode "):
        block.old_mode = _mode(line[9:], lineno)
    elif line.startswith(b"new mode "):
        block.new_mode = _mode(line[9:], lineno)
    elif line.startswith(b"new file mode "):
        block.new_file_mode = _mode(line[14:], lineno)
    elif line.startswith(b"deleted file mode "):
        block.deleted_mode = _mode(line[18:], lineno)
    elif line.startswith((b"rename from ", b"rename old ")):
        block.rename_from = _path_field(line[12:], lineno)
    elif line.startswith((b"rename to ", b"rename new ")):
        block.rename_to = _path_field(line[line.index(b" ", 7) + 1 :], lineno)
    elif line.startswith(b"copy from "):
        block.copy = (_path_field(line[10:], lineno), (block.copy or (None, None))[1])
    elif line.startswith(b"copy to "):
        block.copy = ((block.copy or (None, None))[0], _path_field(line[8:], lineno))
    elif line.startswith((b"similarity index ", b"dissimilarity index ")):
        pass
    elif head == b"index":
        index = _INDEX.fullmatch(value)
        if index is None:
            raise _fail(f"malformed index line at line {lineno}", lineno)
        block.old_blob, block.new_blob = _blob(index[1]), _blob(index[2])
        block.index_full = len(index[1]) in _FULL_OID and len(index[2]) in _FULL_OID
        if index[3] is not None:
            block.index_mode = _mode(index[3], lineno)
    elif line == b"GIT binary patch":
        block.binary = "patch"
    elif _BINARY.fullmatch(line):
        block.binary = "differ"
    else:
        return False
    return True


def _excess(lines: list[bytes], j: int) -> bool:
    """Whether ``lines[j]``, just after a complete hunk, is a diff line its header left out."""
    line = lines[j]
    if line[:1] in (b" ", b"+"):
        return True
    if line[:1] != b"-":
        return False
    if chomp(line) in (b"-- ", b"--"):  # format-patch signature
        return False
    return not (
        line.startswith(b"--- ") and j + 1 < len(lines) and lines[j + 1].startswith(b"+++ ")
    )


def _read_hunks(lines: list[bytes], i: int, block: _Block) -> int:
    """Read the hunks starting at ``lines[i]`` into ``block``; return the index after them."""
    while i < len(lines) and lines[i].startswith(b"@@ -"):
        i = _read_hunk(lines, i, block)
    return i


def _read_hunk(lines: list[bytes], i: int, block: _Block) -> int:
    """Read the hunk whose header is ``lines[i]`` into ``block``; return the index after it."""
    n = len(lines)
    head = _HUNK.fullmatch(chomp(lines[i]))
    if head is None:
        raise _fail(f"malformed hunk header at line {i + 1}: '{_show(chomp(lines[i]))}'", i + 1,
                    path=block.display())
    old_count = 1 if head[2] is None else int(head[2])
    new_count = 1 if head[4] is None else int(head[4])
    old: list[bytes] = []
    new: list[bytes] = []
    to_old, to_new = old.append, new.append
    # The side(s) the previous line went to: _BOTH (context), _OLD ('-'), _NEW ('+'), 0 (none yet, or a marker).
    sides = 0
    want_old, want_new = old_count, new_count
    leading = trailing = 0  # context lines before the first change, after the last
    changed = False

    def fail(what: str, at: int) -> ParseError:
        return ParseError(f"hunk at line {i + 1} of '{block.display()}' {what} at line {at}: header says "
                          f"{old_count} old and {new_count} new lines",
                          details={"line": at, "hunk_line": i + 1, "path": block.display()})

    def no_newline(at: int, sides: int) -> None:
        if not sides:
            raise fail("has a '\\ No newline' marker before any line", at)
        # A patch converted to CRLF as a whole ends the marker in CRLF too: then the
        # line before it lost a CRLF, not a bare LF (else a stray '\r' would be left).
        cut = b"\r\n" if lines[at - 1].endswith(b"\r\n") else b"\n"
        if sides & _OLD and old[-1].endswith(cut):
            old[-1] = old[-1][: -len(cut)]
        if sides & _NEW and new[-1].endswith(cut):
            new[-1] = new[-1][: -len(cut)]

    # One pass over the hunk's lines, the first byte of each compared as a number: this
    # loop is most of the time a large patch takes to parse (a line of work per diff line).
    j = i + 1
    while want_old > 0 or want_new > 0:
        if j >= n:
            raise fail("ends early", j)
        line = lines[j]
        kind = line[0]
        if kind == _SPACE or (want_old > 0 and want_new > 0 and (line == b"\n" or line == b"\r\n")):
            if want_old == 0 or want_new == 0:
                raise fail("is longer than its header says", j + 1)
            body = line[1:] if kind == _SPACE else line
            to_old(body)
            to_new(body)
            want_old -= 1
            want_new -= 1
            sides = _BOTH
            trailing += 1
            if not changed:
                leading += 1
        elif kind == _MINUS:
            if want_old == 0:
                raise fail("is longer than its header says", j + 1)
            to_old(line[1:])
            want_old -= 1
            sides, changed, trailing = _OLD, True, 0
        elif kind == _PLUS:
            if want_new == 0:
                raise fail("is longer than its header says", j + 1)
            to_new(line[1:])
            want_new -= 1
            sides, changed, trailing = _NEW, True, 0
        elif kind == _BACKSLASH:
            no_newline(j + 1, sides)
            sides = 0
        else:
            raise fail("ends early", j + 1)
        j += 1
    if j < n and lines[j].startswith(b"\\"):
        no_newline(j + 1, sides)
        j += 1
    if j < n and not lines[j].startswith(b"@@ -") and _excess(lines, j):
        raise fail("is longer than its header says", j + 1)
    # git apply's anchors (apply.c, match_beginning / match_end): a hunk from line 1 starts
    # the file; one with no context after its change ends it.  A hunk with no context at all
    # (-U0) is read by its line numbers, as 'git apply --unidiff-zero' reads it.
    block.hunks.append(Hunk(
        old_lines=tuple(old), new_lines=tuple(new), old_start=int(head[1]),
        header=chomp(lines[i]).decode("utf-8", "replace"), prefer_start=bool(old) and int(head[1]) == 1,
        prefer_eof=bool(old) and changed and trailing == 0 and leading > 0,
        # A side whose last line has no terminator ends the file there (only a file's
        # last line can lack one): such a hunk is never placed mid-file.
        at_eof=bool(old) and (not old[-1].endswith(b"\n") or bool(new) and not new[-1].endswith(b"\n"))))
    return j


def _read_git_block(lines: list[bytes], i: int, budget: InflateBudget) -> tuple[_Block, int]:
    block = _Block(line=i + 1, git=True)
    block.header = _header_names(chomp(lines[i])[len(b"diff --git ") :], i + 1)
    if block.header is not None:
        block.prefix = _prefix_pair(*block.header)
    i += 1
    while i < len(lines) and _extended(block, chomp(lines[i]), i + 1):
        i += 1
        if block.binary == "patch":
            for name in _names(block):  # an unsafe path is refused before its data is inflated
                if name is not None:
                    _decode(name)
            block.binary_data, _reverse, i = read_binary_hunks(lines, i, block.display(), budget)
            return block, _read_hunks(lines, i, block)  # hunks here are an error (_to_edit)
    if i + 1 < len(lines) and lines[i].startswith(b"--- ") and lines[i + 1].startswith(b"+++ "):
        i = _read_names(block, lines, i)
    return block, _read_hunks(lines, i, block)


def _read_names(block: _Block, lines: list[bytes], i: int) -> int:
    """Read the ``---``/``+++`` lines at ``lines[i]`` into ``block``; return the index after them."""
    block.minus, block.minus_epoch = _name_field(lines[i][4:], i + 1)
    block.plus, block.plus_epoch = _name_field(lines[i + 1][4:], i + 2)
    return i + 2


# ---------------------------------------------------------------------------
# edits


def _decode(name: bytes) -> str:
    return check_path(name.decode("utf-8", "surrogateescape"))


def _plain_names(minus: bytes | None, plus: bytes | None) -> tuple[bytes | None, bytes | None]:
    """Names from ``---``/``+++`` (``None``: absent); ``a/``, ``b/`` stripped if both use them."""
    if (minus is None or minus.startswith(b"a/")) and (plus is None or plus.startswith(b"b/")):
        minus = None if minus is None else minus[2:]
        plus = None if plus is None else plus[2:]
    return minus, plus


def _names(block: _Block) -> tuple[bytes | None, bytes | None]:
    """The old and new path of a block; ``None`` for the absent side of an add or a delete."""
    # 'diff -N' dates the absent side of an add or a delete at the epoch; a file that is
    # really dated so (a reproducible tarball's: pip's own sdists) has lines on that side
    # of its hunks, and is there (as GNU patch reads it; git apply refuses the patch).
    minus_absent = block.minus_epoch and not any(h.old_lines for h in block.hunks)
    plus_absent = block.plus_epoch and not any(h.new_lines for h in block.hunks)
    minus = None if block.minus == _DEV_NULL or minus_absent else block.minus
    plus = None if block.plus == _DEV_NULL or plus_absent else block.plus
    absent_old = block.minus is not None and minus is None
    absent_new = block.plus is not None and plus is None
    if not block.git:
        if block.minus not in (None, _DEV_NULL) and block.plus not in (None, _DEV_NULL):
            # 'diff -ruN old-tree new-tree': the names differ only in their first
            # component (the two folders compared); git apply's -p1 strips it.
            assert block.minus is not None and block.plus is not None
            top_old, _, rest_old = block.minus.partition(b"/")
            top_new, _, rest_new = block.plus.partition(b"/")
            if rest_old and rest_old == rest_new and top_old != top_new:
                minus = None if minus is None else rest_old
                plus = None if plus is None else rest_new
        old, new = _plain_names(minus, plus)
        if old is not None and new is not None and old != new:
            old = new = old if len(old) < len(new) and new.startswith(old) else new
        return old, new
    if block.prefix is not None and block.header is not None:
        old_prefix, new_prefix = block.prefix
        old = None if minus is None else _strip(minus, old_prefix)
        new = None if plus is None else _strip(plus, new_prefix)
        if old is None and not absent_old:
            old = _strip(block.header[0], old_prefix)
        if new is None and not absent_new:
            new = _strip(block.header[1], new_prefix)
    else:
        old, new = _plain_names(minus, plus)
    if block.rename_from is not None:
        old = block.rename_from
    if block.rename_to is not None:
        new = block.rename_to
    if block.copy is not None:
        old = block.copy[0] if block.copy[0] is not None else old
        new = block.copy[1] if block.copy[1] is not None else new
    if block.new_file_mode is not None:
        old = None
    if block.deleted_mode is not None:
        new = None
    return old, new


def _to_edit(block: _Block) -> FileEdit:
    lineno, shown = block.line, block.display()
    if _MODE_GITLINK in (block.old_mode, block.new_mode, block.new_file_mode, block.deleted_mode, block.index_mode):
        raise UnsupportedPatch(f"submodule changes are not supported: '{shown}'",
                               details={"path": shown, "line": lineno})
    old, new = _names(block)
    if old is None and new is None:
        raise _fail(f"cannot tell which file the patch at line {lineno} changes", lineno)
    renamed = block.rename_from is not None or block.rename_to is not None
    if block.copy is not None and (None in block.copy or renamed):
        raise _fail(f"copy at line {lineno} needs one 'copy from' and one 'copy to' line", lineno)
    op = "copy" if block.copy is not None else "rename" if renamed else "modify"
    if op != "modify" and old == new:
        raise _fail(f"{op} of '{_show(old or b'')}' onto itself at line {lineno}", lineno, path=_show(old or b""))
    hunks = tuple(block.hunks)
    kind: str | None = None
    data = b""
    if block.binary is not None:
        if hunks:
            raise _fail(f"binary patch for '{shown}' at line {lineno} also has text hunks", lineno, path=shown)
        if not block.index_full:
            # git apply's rule: without both full object ids, what the patch applies to
            # (and what it must give) cannot be checked.
            why = ("changed, but the patch carries no data" if block.binary_data is None
                   else "has no index line with full object ids (git apply refuses it too)")
            raise UnsupportedPatch(f"binary file '{shown}' {why}: make the patch with 'git diff --binary'",
                                   details={"path": shown, "line": lineno, "reason": "binary"})
        # No data: a delete needs none; else the new blob must be in the repository.
        kind, data = block.binary_data if block.binary_data is not None else ("blob", b"")
    content = data if kind == "literal" else None
    old_mode = block.old_mode if block.old_mode is not None else block.index_mode
    if old is None:
        assert new is not None
        if kind == "delta":
            raise _fail(f"new binary file '{_show(new)}' at line {lineno} is a delta, not a literal", lineno,
                        path=_show(new))
        if any(h.old_lines for h in hunks):
            raise _fail(f"new file '{_show(new)}' at line {lineno} has hunks with old lines", lineno, path=_show(new))
        if kind is None:
            content = b"".join(line for h in hunks for line in h.new_lines)
        return FileEdit(op="add", path=_decode(new), content=content, new_mode=block.new_file_mode,
                        new_blob=block.new_blob, binary=kind)
    if new is None:
        if any(h.new_lines for h in hunks):
            raise _fail(f"deleted file '{_show(old)}' at line {lineno} has hunks with new lines", lineno,
                        path=_show(old))
        return FileEdit(op="delete", path=_decode(old), hunks=hunks, old_blob=block.old_blob, binary=kind,
                        old_mode=block.deleted_mode if block.deleted_mode is not None else old_mode)
    if not hunks and kind is None and op == "modify" and block.new_mode is None:
        raise _fail(f"patch for '{_show(new)}' at line {lineno} changes nothing", lineno, path=_show(new))
    return FileEdit(
        op=op,  # type: ignore[arg-type]
        path=_decode(old), new_path=_decode(new) if op != "modify" else None, hunks=hunks, content=content,
        delta=data if kind == "delta" else None, old_mode=old_mode, new_mode=block.new_mode,
        old_blob=block.old_blob, new_blob=block.new_blob, binary=kind,
    )


def _sides(edit: FileEdit) -> list[tuple[str, int]]:
    """The paths ``edit`` takes old content away from (0) and writes new content to (1).

    A path may be on both sides in one patch only through different edits of
    the kinds git writes together: moved or deleted away and written anew (a
    rename away and a copy onto it, a delete and an add).  Twice on one side is
    the same content changed twice.
    """
    if edit.op == "add":
        return [(edit.path, 1)]
    if edit.op == "delete":
        return [(edit.path, 0)]
    if edit.op == "copy":
        return [(edit.target, 1)]
    if edit.op == "rename":
        return [(edit.path, 0), (edit.target, 1)]
    return [(edit.path, 0), (edit.path, 1)]


def _old_blob(gone: FileEdit) -> str | None:
    """The old blob a deleted path must be: a git delete's hunks hold its whole content."""
    if gone.binary is None and gone.hunks:
        full = b"".join(line for h in gone.hunks for line in h.old_lines)
        return git_blob_oid(full)
    return gone.old_blob


def parse_unified(data: bytes) -> Patch:
    """Parse a unified diff into ``Patch(format="unified", ...)`` as the module docstring describes.

    Raises:
        ParseError: malformed hunk or header, a path changed twice, or no file change found.
        UnsupportedPatch: a binary change without data, submodule or combined-diff content.
        UnsafePath: a path that :func:`patcher.paths.check_path` refuses (a binary
            block's before its data is inflated).
        TooLarge: binary data over :data:`patcher.formats.binary.MAX_BINARY_BYTES`
            (one hunk, or the patch's hunks together: :class:`InflateBudget`).
    """
    if data and not data.endswith(b"\n"):
        # Only a '\\ No newline' marker says a line has no terminator; a patch whose own
        # last line was cut (agents often drop it) must not drop the file's last newline.
        last = data.rfind(b"\n")
        data += b"\r\n" if last > 0 and data[last - 1] == 0x0D else b"\n"
    lines = split_lines(data)
    inflate = InflateBudget()  # one for the whole patch: its binary hunks together are bounded
    edits: list[FileEdit] = []
    removed: set[str] = set()  # paths whose old content the patch takes away (changed, deleted, moved)
    written: set[str] = set()  # paths the patch writes new content to
    side_sets = (removed, written)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"diff --git "):
            block, i = _read_git_block(lines, i, inflate)
        elif i + 2 < len(lines) and lines[i].startswith(b"--- ") and lines[i + 1].startswith(b"+++ ") \
                and lines[i + 2].startswith(b"@@ -"):
            block = _Block(line=i + 1, git=False)
            i = _read_hunks(lines, _read_names(block, lines, i), block)
        elif line.startswith((b"diff --cc ", b"diff --combined ")):
            raise UnsupportedPatch(f"combined diffs are not supported at line {i + 1}", details={"line": i + 1})
        elif (binary := _BINARY.fullmatch(chomp(line))) is not None:
            target = binary[2] if binary[2] != _DEV_NULL else binary[1]
            shown = _show(target[2:] if target.startswith((b"a/", b"b/")) else target)
            raise UnsupportedPatch(f"binary file '{shown}' changed, but the patch carries no data: make it with "
                                   "'git diff --binary'", details={"path": shown, "line": i + 1, "reason": "binary"})
        else:
            i += 1
            continue
        edit = _to_edit(block)
        if (edit.op == "add" and edits and edits[-1].op == "delete" and edits[-1].path == edit.path
                and (edits[-1].old_mode == MODE_LINK) != (edit.new_mode == MODE_LINK)):
            # A type change (symlink <-> file): git writes a delete and an add of one
            # path; it is one whole-content replacement with a new mode.
            gone = edits.pop()
            edit = FileEdit(op="modify", path=edit.path, content=edit.content,
                            old_mode=gone.old_mode, new_mode=edit.new_mode or MODE_FILE,
                            binary=edit.binary, old_blob=_old_blob(gone), new_blob=edit.new_blob)
            removed.discard(edit.path)
        for path, side in _sides(edit):
            if path in side_sets[side]:
                mails = len(_MAIL_START.findall(data))
                series = (f": the input is a series of {mails} patches (git format-patch); "
                          "apply them one call each") if mails > 1 else ""
                raise ParseError(f"'{path}' is changed more than once in the patch (line {block.line}){series}",
                                 details={"line": block.line, "path": path, **({"patches": mails} if series else {})})
            side_sets[side].add(path)
        edits.append(edit)
    if not edits:
        raise ParseError("no file changes found in patch")
    return Patch(format="unified", edits=tuple(edits))

"""Converting unified diffs to the ``apply_patch`` envelope, and contents to unified diffs (pure).

Test code: the cross-format tests' oracle (no command, API or tool of
oncepatch converts, so it is not part of the installed package).

:func:`unified_to_envelope` (docs/FORMATS.md, "The unified → envelope
converter") grows each hunk's context until it matches exactly once and
checks its output by parsing it back and applying it; it writes the
``\\ No newline at end of file`` extension where a final newline is absent
or changes.  :func:`make_unified` writes a git-style unified diff of one file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

from patcher.formats.envelope import parse_envelope
from patcher.errors import AmbiguousMatch, ContextNotFound, ParseError, PartiallyApplied, UnsupportedPatch
from patcher.lines import dominant_eol
from patcher.matching import apply_hunks, chomp, eol_of, split_lines
from patcher.model import MODE_FILE, MODE_LINK, FileEdit, Hunk
from patcher.formats.unified import parse_unified

__all__ = ["Conversion", "unified_to_envelope", "make_unified", "edit_to_envelope"]

_NO_NEWLINE = b"\\ No newline at end of file\n"
_MAX_ROUNDS = 10_000


@dataclass(frozen=True, slots=True)
class Conversion:
    """The envelope (``text``), the unified blocks it was made from (``unified``), and what was skipped."""

    text: bytes
    unified: bytes
    skipped: tuple[tuple[str, str], ...]
    files: int


def _blocks(diff: bytes) -> list[bytes]:
    """The diff cut at each ``diff --git`` line (the whole diff if it has none)."""
    lines = split_lines(diff)
    starts = [i for i, line in enumerate(lines) if line.startswith(b"diff --git ")]
    if not starts:
        return [diff]
    starts.append(len(lines))
    return [b"".join(lines[a:b]) for a, b in zip(starts, starts[1:])]


def _path_bytes(path: str) -> bytes:
    raw = path.encode("utf-8", "surrogateescape")
    if raw != raw.strip():
        raise UnsupportedPatch(f"the envelope cannot name '{path}': it has surrounding whitespace",
                               details={"path": path, "reason": "path"})
    return raw


def _exact_needed(old: Sequence[bytes], new: Sequence[bytes]) -> bool:
    """True when an eol-agnostic hunk would lose bytes: an unterminated line, or a content ending in CR."""
    return any(not line.endswith(b"\n") or chomp(line).endswith(b"\r") for line in (*old, *new))


def _hunk_body(old: Sequence[bytes], new: Sequence[bytes]) -> list[bytes]:
    """The `` ``/``-``/``+`` lines of one envelope hunk (old and new lines carry their terminators)."""
    exact = _exact_needed(old, new)
    keys_old = list(old) if exact else [chomp(x) for x in old]
    keys_new = list(new) if exact else [chomp(x) for x in new]
    return _diff_lines(SequenceMatcher(None, keys_old, keys_new, autojunk=False).get_opcodes(), old, new, exact)


def _emit(prefix: bytes, line: bytes, exact: bool = True) -> list[bytes]:
    """One diff line (``exact``: its terminator kept, a missing one marked; else the line's own dropped)."""
    if not exact:
        return [prefix + chomp(line) + b"\n"]
    return [prefix + line] if line.endswith(b"\n") else [prefix + line + b"\n", _NO_NEWLINE]


def _diff_lines(opcodes: Sequence[tuple[str, int, int, int, int]], old: Sequence[bytes], new: Sequence[bytes],
                exact: bool = True) -> list[bytes]:
    """The `` ``/``-``/``+`` lines of ``opcodes`` (:meth:`difflib.SequenceMatcher.get_opcodes`)."""
    body: list[bytes] = []
    for tag, a0, a1, b0, b1 in opcodes:
        for line in old[a0:a1]:
            body += _emit(b" " if tag == "equal" else b"-", line, exact)
        if tag != "equal":
            for line in new[b0:b1]:
                body += _emit(b"+", line, exact)
    return body


def _section(edit: FileEdit, hunks: Sequence[tuple[Sequence[bytes], Sequence[bytes], bool]]) -> list[bytes]:
    out = [b"*** Update File: " + _path_bytes(edit.path) + b"\n"]
    if edit.op == "rename":
        assert edit.new_path is not None
        out.append(b"*** Move to: " + _path_bytes(edit.new_path) + b"\n")
    for old, new, at_eof in hunks:
        out.append(b"@@\n")
        out += _hunk_body(old, new)
        if at_eof and not _exact_needed(old, new):
            out.append(b"*** End of File\n")
    return out


@dataclass(slots=True)
class _Region:
    """A change of ``file[start:end]`` into ``new``, shown with ``before``/``after`` lines of context."""

    start: int
    end: int
    new: list[bytes]
    before: int = 0
    after: int = 0


def _grown(file: list[bytes], r: _Region) -> tuple[list[bytes], list[bytes], bool, int, int]:
    lo = max(0, r.start - r.before)
    hi = min(len(file), r.end + r.after)
    old = file[lo:hi]
    new = file[lo:r.start] + r.new + file[r.end:hi]
    return old, new, hi == len(file), lo, hi


def _merge(file: list[bytes], regions: list[_Region]) -> list[_Region]:
    """Merge neighbours whose grown ranges overlap (envelope hunks may not overlap)."""
    out: list[_Region] = []
    for r in regions:
        if out:
            prev = out[-1]
            _, _, _, _, prev_hi = _grown(file, prev)
            _, _, _, lo, _ = _grown(file, r)
            if lo < prev_hi or (prev.end == prev.start and r.start == prev.end):
                out[-1] = _Region(prev.start, r.end, prev.new + file[prev.end:r.start] + r.new,
                                  prev.before, r.after)
                continue
        out.append(r)
    return out


def _render_check(edit: FileEdit, file: list[bytes], regions: list[_Region]) -> tuple[list[bytes], list[Hunk]]:
    hunks = [_grown(file, r) for r in regions]
    section = _section(edit, [(old, new, eof) for old, new, eof, _, _ in hunks])
    try:
        parsed = parse_envelope(b"*** Begin Patch\n" + b"".join(section) + b"*** End Patch\n")
    except ParseError as exc:
        # A kept line such as ' *** End Patch' (a patch file's own content): the envelope
        # reads markers with blanks around them, so it cannot carry that line as context.
        raise UnsupportedPatch(f"'{edit.path}' has a line the envelope would read as a marker: {exc.message}",
                               details={"path": edit.path, "reason": "marker line"}) from None
    return section, list(parsed.edits[0].hunks)


def _widened(file: list[bytes], regions: list[_Region], which: list[_Region]) -> list[_Region]:
    """``regions`` with each of ``which`` shown with twice the context (one line at first), merged where they meet."""
    for r in which:
        step = max(1, max(r.before, r.after))
        r.before += step
        r.after += step
    return _merge(file, regions)


def _fit(edit: FileEdit, old_content: bytes) -> list[bytes]:
    """The file section for ``edit`` whose hunks each match ``old_content`` exactly once."""
    file = split_lines(old_content)
    target = apply_hunks(old_content, edit.hunks, path=edit.path).content
    eol = dominant_eol(old_content)
    regions: list[_Region] = []
    for h in edit.hunks:
        assert h.old_start is not None
        start = h.old_start - 1 if h.old_lines else h.old_start
        if tuple(file[start:start + len(h.old_lines)]) != h.old_lines:
            raise UnsupportedPatch(f"hunk of '{edit.path}' does not match the old content at line {h.old_start}",
                                   details={"path": edit.path, "reason": "offset"})
        old_set = list(h.old_lines)
        for line in h.new_lines:
            if line in old_set:
                old_set.remove(line)
            elif file and eol_of(line) not in (b"", eol):
                raise UnsupportedPatch(
                    f"'{edit.path}' has mixed line endings: an added line ends differently from the file",
                    details={"path": edit.path, "reason": "mixed line endings"})
        r = _Region(start, start + len(h.old_lines), list(h.new_lines))
        if r.start == r.end and r.start < len(file):
            r.after = 1  # a bare insertion inside the file needs an anchor
        regions.append(r)
    regions = _merge(file, regions)
    for _ in range(_MAX_ROUNDS):
        section, hunks = _render_check(edit, file, regions)
        try:
            got = apply_hunks(old_content, hunks, path=edit.path)
        except AmbiguousMatch as exc:
            regions = _widened(file, regions, [regions[int(exc.details["hunk"]) - 1]])
            continue
        except (PartiallyApplied, ContextNotFound):
            got = None  # a hunk judged present used up the lines the next one needed: as below
        if got is None or got.content != target or got.already_applied:
            # Judged present (or placed) elsewhere: repetitive lines ('a' / 'a' / 'a') can look
            # like the change already made.  More context tells them apart; the whole file at most.
            if all(r.start - r.before <= 0 and r.end + r.after >= len(file) for r in regions):
                raise UnsupportedPatch(f"the envelope cannot reproduce the change of '{edit.path}'",
                                       details={"path": edit.path, "reason": "mismatch"})
            regions = _widened(file, regions, regions)
            continue
        return section
    raise UnsupportedPatch(f"cannot make the hunks of '{edit.path}' unique", details={"path": edit.path,
                                                                                     "reason": "ambiguous"})


def edit_to_envelope(edit: FileEdit, old_content: bytes | None = None) -> bytes:
    """One file section of an envelope for ``edit`` (a unified diff's edit).

    Raises:
        UnsupportedPatch: the envelope cannot express it (module docstring).
    """
    if edit.binary is not None:
        raise UnsupportedPatch(f"'{edit.target}' is a binary file", details={"path": edit.target, "reason": "binary"})
    if edit.op == "copy":
        raise UnsupportedPatch(f"'{edit.target}' is a copy of '{edit.path}'",
                               details={"path": edit.target, "reason": "copy"})
    if edit.op == "add":
        if edit.new_mode == MODE_LINK:
            raise UnsupportedPatch(f"'{edit.path}' is a symlink", details={"path": edit.path, "reason": "symlink"})
        if edit.new_mode not in (None, MODE_FILE):
            raise UnsupportedPatch(f"'{edit.path}': new file with mode {edit.new_mode:o}",
                                   details={"path": edit.path, "reason": "mode"})
        out = [b"*** Add File: " + _path_bytes(edit.path) + b"\n"]
        for line in split_lines(edit.content or b""):
            if line.endswith(b"\n"):
                out.append(b"+" + line)
            else:
                out += [b"+" + line + b"\n", _NO_NEWLINE]
        return b"".join(out)
    if edit.op == "delete":
        return b"*** Delete File: " + _path_bytes(edit.path) + b"\n"
    if MODE_LINK in (edit.old_mode, edit.new_mode):
        raise UnsupportedPatch(f"'{edit.path}' is a symlink", details={"path": edit.path, "reason": "symlink"})
    if edit.new_mode is not None and edit.new_mode != edit.old_mode:
        raise UnsupportedPatch(f"'{edit.path}': mode change", details={"path": edit.path, "reason": "mode"})
    if old_content is not None and edit.hunks:
        return b"".join(_fit(edit, old_content))
    return b"".join(_section(edit, [(h.old_lines, h.new_lines, False) for h in edit.hunks]))


def _reason(exc: UnsupportedPatch) -> str:
    """A short word for what could not be converted: mode, symlink, binary, copy, submodule, ..."""
    if "reason" in exc.details:
        return str(exc.details["reason"])
    text = exc.message.lower()
    for word in ("binary", "copies", "submodule", "combined"):
        if word in text:
            return {"copies": "copy"}.get(word, word)
    return "unsupported"


def unified_to_envelope(
    diff: bytes,
    *,
    read_old: Callable[[str], bytes | None] | None = None,
    skip_unsupported: bool = False,
) -> Conversion:
    """Convert a unified diff into an ``apply_patch`` envelope (module docstring).

    ``read_old(path)`` gives the old content of a changed file (``None``: unknown).

    Raises:
        UnsupportedPatch: something the envelope cannot say (unless ``skip_unsupported``).
        ParseError: the diff does not parse.
    """
    sections: list[bytes] = []
    kept: list[bytes] = []
    skipped: list[tuple[str, str]] = []
    if not diff.strip():
        return Conversion(b"", b"", (), 0)
    for block in _blocks(diff):
        try:
            edits = parse_unified(block).edits
            texts = [edit_to_envelope(e, read_old(e.path) if read_old is not None and e.op != "add" else None)
                     for e in edits]
        except UnsupportedPatch as exc:
            if not skip_unsupported:
                raise
            skipped.append((str(exc.details.get("path", "?")), _reason(exc)))
            continue
        sections += texts
        kept.append(block)
    text = b"*** Begin Patch\n" + b"".join(sections) + b"*** End Patch\n" if sections else b""
    return Conversion(text, b"".join(kept), tuple(skipped), len(sections))


# --------------------------------------------------------------------------- contents → unified


def _range(start: int, length: int) -> bytes:
    first = start + 1 if length else start
    return b"%d" % first if length == 1 else b"%d,%d" % (first, length)


def make_unified(path: str, old: bytes | None, new: bytes | None, *, context: int = 3) -> bytes:
    """A git-style unified diff of one file (``old``/``new`` ``None``: the file is added/deleted)."""
    name = path.encode("utf-8", "surrogateescape")
    a, b = split_lines(old or b""), split_lines(new or b"")
    head = [b"diff --git a/" + name + b" b/" + name + b"\n"]
    if old is None:
        head += [b"new file mode 100644\n", b"--- /dev/null\n", b"+++ b/" + name + b"\n"]
    elif new is None:
        head += [b"deleted file mode 100644\n", b"--- a/" + name + b"\n", b"+++ /dev/null\n"]
    else:
        if old == new:
            return b""
        head += [b"--- a/" + name + b"\n", b"+++ b/" + name + b"\n"]
    if not a and not b:
        return b"".join(head[:2]) if old is None or new is None else b""
    body: list[bytes] = []
    for group in SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        body.append(b"@@ -" + _range(i1, i2 - i1) + b" +" + _range(j1, j2 - j1) + b" @@\n")
        body += _diff_lines(group, a, b)
    return b"".join(head + body)

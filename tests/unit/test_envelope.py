"""The apply_patch envelope parser (pure) and the unified → envelope converter."""

from __future__ import annotations

import pytest

from tests.convert import make_unified, unified_to_envelope
from patcher.formats.envelope import looks_envelope, parse_envelope
from patcher.errors import AmbiguousMatch, ContextNotFound, ParseError, UnsupportedPatch
from patcher.matching import apply_hunks
from patcher.model import FileEdit, Hunk
from patcher.formats.unified import parse_unified


def env(body: str) -> bytes:
    return ("*** Begin Patch\n" + body + "*** End Patch\n").encode()


def only(data: bytes) -> FileEdit:
    edits = parse_envelope(data).edits
    assert len(edits) == 1
    return edits[0]


def parse_error(data: bytes) -> ParseError:
    with pytest.raises(ParseError) as info:
        parse_envelope(data)
    return info.value


# --------------------------------------------------------------------------- the grammar


def test_every_operation_maps_to_the_model() -> None:
    patch = parse_envelope(env(
        "*** Add File: a.txt\n+one\n+two\n"
        "*** Delete File: b.txt\n"
        "*** Update File: c.py\n*** Move to: d/c.py\n@@ def f():\n-    return 1\n+    return 2\n"
        "*** Update File: e.txt\n@@\n x\n-y\n+z\n"
    ))
    assert patch.format == "apply_patch"
    add, delete, move, update = patch.edits
    assert add == FileEdit(op="add", path="a.txt", content=b"one\ntwo\n")
    assert delete == FileEdit(op="delete", path="b.txt")
    assert move.op == "rename" and move.path == "c.py" and move.new_path == "d/c.py"
    assert move.hunks == (Hunk((b"    return 1",), (b"    return 2",), scopes=(b"def f():",), eol_agnostic=True,
                               header="@@ def f():"),)
    assert update.op == "modify"
    assert update.hunks[0].old_lines == (b"x", b"y") and update.hunks[0].new_lines == (b"x", b"z")
    assert update.hunks[0].scopes == () and update.hunks[0].old_start is None


def test_stacked_scopes_narrow_one_hunk_and_bare_at_adds_none() -> None:
    edit = only(env("*** Update File: c.py\n@@ class B:\n@@\n@@     def run(self):\n-        a\n+        b\n"
                    "@@ class C:\n-x\n+y\n"))
    first, second = edit.hunks
    assert first.scopes == (b"class B:", b"    def run(self):")
    assert second.scopes == (b"class C:",)


def test_unified_hunk_header_is_a_bare_at() -> None:
    edit = only(env("*** Update File: f\n@@ -10,3 +10,3 @@ def g():\n-a\n+b\n"))
    assert edit.hunks[0].scopes == () and edit.hunks[0].old_start is None


def test_end_of_file_anchors_and_closes_the_hunk() -> None:
    edit = only(env("*** Update File: f\n@@\n-a\n+b\n*** End of File\n@@\n-c\n+d\n"))
    assert [h.at_eof for h in edit.hunks] == [True, False]


def test_first_hunk_may_come_without_at() -> None:
    assert only(env("*** Update File: f\n x\n-y\n+z\n")).hunks[0].old_lines == (b"x", b"y")


def test_context_line_that_starts_with_stars_is_context_when_indented() -> None:
    edit = only(env("*** Update File: notes.md\n@@\n *** not a marker\n-a\n+b\n"))
    assert edit.hunks[0].old_lines == (b"*** not a marker", b"a")


# --------------------------------------------------------------------------- tolerance


@pytest.mark.parametrize("opening", ["<<EOF", "<<'EOF'", '<<"EOF"', "apply_patch <<'EOF'", "applypatch <<EOF",
                                     "  apply_patch  << 'EOF'  ", "<<-PATCH"])
def test_heredoc_wrappers(opening: str) -> None:
    tag = "PATCH" if "PATCH" in opening else "EOF"
    data = f"{opening}\n*** Begin Patch\n*** Add File: x\n+1\n*** End Patch\n{tag}\n".encode()
    assert looks_envelope(data)
    assert only(data).content == b"1\n"


def test_unclosed_heredoc_is_an_error() -> None:
    err = parse_error(b"<<'EOF'\n*** Begin Patch\n*** Add File: x\n+1\n*** End Patch\n")
    assert "heredoc" in err.message


def test_whitespace_around_markers_crlf_and_missing_final_newline() -> None:
    data = (b"\r\n  *** Begin Patch  \r\n   *** Update File:   f.txt  \r\n@@\r\n a\r\n-b\r\n+c\r\n"
            b"*** Add File: g\r\n+x\r\n *** End Patch")
    upd, add = parse_envelope(data).edits
    assert upd.path == "f.txt" and upd.hunks[0].old_lines == (b"a", b"b") and upd.hunks[0].new_lines == (b"a", b"c")
    assert add.content == b"x\r\n"  # an added file keeps the bytes sent


def test_blank_lines_inside_between_and_at_the_end_of_hunks() -> None:
    edit = only(env("*** Update File: f\n\n@@\n a\n\n-b\n+c\n\n\n@@\n x\n-y\n+z\n \n"))
    first, second = edit.hunks
    assert first.old_lines == (b"a", b"", b"b")  # inner bare line: empty context
    assert first.new_lines == (b"a", b"", b"c")  # trailing bare lines dropped
    assert second.old_lines == (b"x", b"y", b"")  # a ' ' line is always context


def test_blank_lines_before_end_of_file_are_context() -> None:
    edit = only(env("*** Update File: f\n@@\n-a\n+b\n\n*** End of File\n"))
    assert edit.hunks[0].old_lines == (b"a", b"") and edit.hunks[0].at_eof


def test_no_newline_marker_in_add_and_update() -> None:
    add = only(env("*** Add File: f\n+a\n+b\n\\ No newline at end of file\n"))
    assert add.content == b"a\nb"
    upd = only(env("*** Update File: f\n@@\n x\r\n-last\n\\ No newline at end of file\n+last\n"))
    hunk = upd.hunks[0]
    assert not hunk.eol_agnostic and hunk.at_eof
    assert hunk.old_lines == (b"x\r\n", b"last") and hunk.new_lines == (b"x\r\n", b"last\n")
    assert apply_hunks(b"x\r\nlast", [hunk], path="f").content == b"x\r\nlast\n"


# --------------------------------------------------------------------------- refusals, with line numbers


@pytest.mark.parametrize(
    ("data", "words", "line"),
    [
        (b"", "empty", None),
        (b"*** Add File: x\n+1\n*** End Patch\n", "first line must be '*** Begin Patch'", 1),
        (b"*** Begin Patch\n*** Add File: x\n+1\n", "cut short", 3),
        (b"*** Begin Patch\n*** Add File: x\n+1\n*** End Patch\ntrailing\n", "text after", 5),
        (env("*** Update File: f\n@@\n x\nbad line\n"), "every hunk line starts with", 5),
        (env("*** Add File: f\n+a\n\n+b\n"), "blank line inside Add File", 4),
        (env("*** Delete File: f\n-a\n"), "takes no lines", 3),
        (env("*** Update File: f\n"), "has no hunks", 2),
        (env("*** Update File: f\n@@\n a\n"), "changes nothing", 3),
        (env("*** Update File: f\n@@\n"), "has no lines", 3),
        (env("*** Update File: f\n@@\n-a\n+b\n*** Update File: f\n@@\n-c\n+d\n"), "two file sections", 6),
        (env("*** Update File: f\n*** Move to: f\n"), "moved onto itself", 3),
        (env("*** Move to: g\n"), "must directly follow", 2),
        (env("*** Copy File: f\n"), "not a file header", 2),
        (env("*** Update File: f\n*** End of File\n"), "outside a hunk", 3),
        (env("*** Update File: f\n@@\n-a\n\\ No newline\n-b\n+c\n"), "not the last of its side", 3),
        (env("*** Begin Patch\n"), "inside the patch", 2),
        (env("*** Add File:\n+x\n"), "without a path", 2),
        (b"*** Begin Patch\n*** End Patch\n", "changes no file", None),
    ],
)
def test_malformed_envelopes_are_refused(data: bytes, words: str, line: int | None) -> None:
    err = parse_error(data)
    assert words in err.message
    assert err.type == "parse_error"
    if line is not None:
        assert err.details["line"] == line


# --------------------------------------------------------------------------- with the matcher


CLASSES = (b"class A:\n    def run(self):\n        return 1\n\nclass B:\n    def run(self):\n        return 1\n")


def test_envelope_hunks_never_take_the_first_of_two_matches() -> None:
    edit = only(env("*** Update File: c.py\n@@\n-        return 1\n+        return 2\n"))
    with pytest.raises(AmbiguousMatch) as info:
        apply_hunks(CLASSES, edit.hunks, path="c.py")
    assert info.value.details["candidates"] == [3, 7]
    scoped = only(env("*** Update File: c.py\n@@ class B:\n-        return 1\n+        return 2\n"))
    assert apply_hunks(CLASSES, scoped.hunks, path="c.py").content.endswith(b"return 2\n")


def test_rejection_details_name_the_hunk_and_closest_region() -> None:
    edit = only(env("*** Update File: c.py\n@@ class A:\n     def run(self):\n-        return 7\n+        return 8\n"))
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(CLASSES, edit.hunks, path="c.py")
    details = info.value.details
    assert details["path"] == "c.py" and details["hunk"] == 1 and details["hunk_header"] == "@@ class A:"
    assert details["expected"].startswith("    def run(self):")
    assert details["closest"]["line"] == 2 and "-        return 7" in details["closest"]["diff"]


# --------------------------------------------------------------------------- the converter


PERIODIC = b"".join(b"def f%d():\n    x = 1\n\n" % (i % 2) for i in range(8))


def test_converter_grows_context_until_unique_and_checks_itself() -> None:
    new = PERIODIC.replace(b"    x = 1\n", b"    x = 2\n", 5).replace(b"    x = 2\n", b"    x = 1\n", 4)
    diff = make_unified("p.py", PERIODIC, new)
    plain = unified_to_envelope(diff)  # without the old content: the diff's own context
    hunks = parse_envelope(plain.text).edits[0].hunks
    with pytest.raises(AmbiguousMatch):
        apply_hunks(PERIODIC, hunks, path="p.py")
    fitted = unified_to_envelope(diff, read_old=lambda path: PERIODIC)
    hunks = parse_envelope(fitted.text).edits[0].hunks
    assert len(hunks[0].old_lines) > 7
    assert apply_hunks(PERIODIC, hunks, path="p.py").content == new


def test_converter_merges_hunks_whose_context_would_overlap() -> None:
    old = b"same\n" * 30
    lines = old.splitlines(keepends=True)
    lines[7], lines[15] = b"eight\n", b"sixteen\n"
    new = b"".join(lines)
    diff = make_unified("s", old, new)
    assert diff.count(b"\n@@ ") == 2  # two separate hunks in the unified diff
    fitted = unified_to_envelope(diff, read_old=lambda path: old)
    hunks = parse_envelope(fitted.text).edits[0].hunks
    assert len(hunks) == 1  # grown until they touched, then merged
    assert apply_hunks(old, hunks, path="s").content == new


def test_converter_marks_end_of_file_and_final_newline_changes() -> None:
    old = b"a\nb\nc"
    new = b"a\nb\nc\n"
    text = unified_to_envelope(make_unified("f", old, new), read_old=lambda path: old).text
    assert b"\\ No newline at end of file" in text
    assert apply_hunks(old, parse_envelope(text).edits[0].hunks, path="f").content == new
    crlf_old, crlf_new = b"x\r\ny\r\nx\r\ny\r\n", b"x\r\ny\r\nx\r\nY\r\n"
    text = unified_to_envelope(make_unified("w", crlf_old, crlf_new), read_old=lambda path: crlf_old).text
    assert text.endswith(b"*** End of File\n*** End Patch\n")
    assert b"\r" not in text  # eol-agnostic lines: the file's CRLF is kept by the matcher
    assert apply_hunks(crlf_old, parse_envelope(text).edits[0].hunks, path="w").content == crlf_new


def test_converter_refuses_or_skips_what_the_envelope_cannot_say() -> None:
    mode = b"diff --git a/x b/x\nold mode 100644\nnew mode 100755\n"
    binary = b"diff --git a/b b/b\nnew file mode 100644\nBinary files /dev/null and b/b differ\n"
    link = b"diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+x\n\\ No newline at end of file\n"
    text = make_unified("t.txt", b"1\n", b"2\n")
    with pytest.raises(UnsupportedPatch):
        unified_to_envelope(mode + text)
    conv = unified_to_envelope(mode + binary + link + text, skip_unsupported=True)
    assert conv.skipped == (("x", "mode"), ("b", "binary"), ("l", "symlink"))
    assert conv.files == 1 and conv.unified == text
    mixed_old = b"a\r\nb\nc\n"
    with pytest.raises(UnsupportedPatch) as info:
        unified_to_envelope(make_unified("m", mixed_old, b"a\r\nB\r\nc\n"), read_old=lambda path: mixed_old)
    assert info.value.details["reason"] == "mixed line endings"


def test_make_unified_round_trips_through_the_unified_parser() -> None:
    cases = [(b"a\nb\n", b"a\nc\n"), (b"a\nb", b"a\nb\n"), (b"a\nb\n", b"a\nb"), (b"", b"x\n"), (b"x\r\n", b"")]
    for old, new in cases:
        edit = parse_unified(make_unified("f", old, new)).edits[0]
        assert apply_hunks(old, edit.hunks, path="f").content == new
    assert parse_unified(make_unified("n", None, b"new\n")).edits[0].content == b"new\n"
    assert parse_unified(make_unified("n", b"gone\n", None)).edits[0].op == "delete"
    assert make_unified("same", b"x\n", b"x\n") == b""


@pytest.mark.parametrize("old,new,context", [
    (b"a\na\na\na\n", b"a\na\na\na\na\n", 3),  # once judged already applied: nothing changed
    (b"a\n\na\n", b"a\n\n\na\na", 0),  # once a hunk judged present used up the next one's lines
])
def test_the_converter_reproduces_edits_of_repeated_lines(old: bytes, new: bytes, context: int) -> None:
    text = unified_to_envelope(make_unified("f", old, new, context=context), read_old=lambda path: old).text
    got = apply_hunks(old, parse_envelope(text).edits[0].hunks, path="f")
    assert got.content == new and not got.already_applied

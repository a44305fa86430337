"""Parsing unified diffs into the edit model (pure; two tests ask a real git for diff text)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from patcher.errors import ContextNotFound, ParseError, UnsafePath, UnsupportedPatch
from patcher.matching import apply_hunks
from patcher.model import MODE_EXEC, MODE_FILE, MODE_LINK, FileEdit, Hunk
from patcher.formats.unified import looks_unified, parse_unified


def _p(*lines: str | bytes) -> bytes:
    """Patch text from lines, each given without its '\\n'."""
    return b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines)


def _one(data: bytes) -> FileEdit:
    patch = parse_unified(data)
    assert patch.format == "unified"
    assert len(patch.edits) == 1
    return patch.edits[0]


MODIFY = _p(
    "diff --git a/src/x.py b/src/x.py",
    "index 83db48f..bf269f4 100644",
    "--- a/src/x.py",
    "+++ b/src/x.py",
    "@@ -1,3 +1,3 @@ def f():",
    " one",
    "-two",
    "+TWO",
    " three",
)


# --------------------------------------------------------------------------- headers


def test_git_modify_with_index_line() -> None:
    edit = _one(MODIFY)
    assert edit.op == "modify"
    assert edit.path == "src/x.py" and edit.new_path is None
    assert edit.old_blob == "83db48f" and edit.new_blob == "bf269f4"
    assert edit.old_mode == MODE_FILE and edit.new_mode is None
    (hunk,) = edit.hunks
    assert hunk.old_lines == (b"one\n", b"two\n", b"three\n")
    assert hunk.new_lines == (b"one\n", b"TWO\n", b"three\n")
    assert hunk.old_start == 1
    assert hunk.header == "@@ -1,3 +1,3 @@ def f():"
    assert not hunk.eol_agnostic


def test_index_line_mode_is_the_unchanged_mode() -> None:
    edit = _one(MODIFY.replace(b"100644", b"100755"))
    assert edit.old_mode == MODE_EXEC and edit.new_mode is None


def test_full_index_oids_are_recorded() -> None:
    old, new = "a" * 40, "b" * 40
    edit = _one(MODIFY.replace(b"83db48f..bf269f4", f"{old}..{new}".encode()))
    assert (edit.old_blob, edit.new_blob) == (old, new)


def test_new_file() -> None:
    edit = _one(
        _p(
            "diff --git a/new.txt b/new.txt",
            "new file mode 100755",
            "index 0000000..3b18e51",
            "--- /dev/null",
            "+++ b/new.txt",
            "@@ -0,0 +1,2 @@",
            "+hello",
            "+world",
        )
    )
    assert edit.op == "add" and edit.path == "new.txt"
    assert edit.content == b"hello\nworld\n"
    assert edit.hunks == ()
    assert edit.new_mode == MODE_EXEC
    assert edit.old_blob is None and edit.new_blob == "3b18e51"


def test_deleted_file_keeps_removed_lines() -> None:
    edit = _one(
        _p(
            "diff --git a/gone.txt b/gone.txt",
            "deleted file mode 100644",
            "index 3b18e51..0000000",
            "--- a/gone.txt",
            "+++ /dev/null",
            "@@ -1,2 +0,0 @@",
            "-hello",
            "-world",
        )
    )
    assert edit.op == "delete" and edit.path == "gone.txt"
    assert edit.old_mode == MODE_FILE
    assert edit.hunks[0].old_lines == (b"hello\n", b"world\n")
    assert edit.hunks[0].new_lines == ()
    assert edit.new_blob is None


def test_empty_new_file_and_empty_deleted_file() -> None:
    patch = parse_unified(
        _p(
            "diff --git a/empty b/empty",
            "new file mode 100644",
            "index 0000000..e69de29",
            "diff --git a/was-empty b/was-empty",
            "deleted file mode 100755",
            "index e69de29..0000000",
        )
    )
    add, delete = patch.edits
    assert (add.op, add.path, add.content, add.new_mode) == ("add", "empty", b"", MODE_FILE)
    assert (delete.op, delete.path, delete.hunks, delete.old_mode) == (
        "delete",
        "was-empty",
        (),
        MODE_EXEC,
    )


def test_mode_only_change() -> None:
    edit = _one(_p("diff --git a/run.sh b/run.sh", "old mode 100644", "new mode 100755"))
    assert edit.op == "modify" and edit.path == "run.sh"
    assert (edit.old_mode, edit.new_mode) == (MODE_FILE, MODE_EXEC)
    assert edit.hunks == () and edit.content is None


def test_odd_regular_mode_is_canonicalised() -> None:
    edit = _one(_p("diff --git a/f b/f", "old mode 100664", "new mode 100775"))
    assert (edit.old_mode, edit.new_mode) == (MODE_FILE, MODE_EXEC)


def test_pure_rename() -> None:
    edit = _one(
        _p(
            "diff --git a/old name.txt b/new name.txt",
            "similarity index 100%",
            "rename from old name.txt",
            "rename to new name.txt",
        )
    )
    assert (edit.op, edit.path, edit.new_path, edit.hunks) == (
        "rename",
        "old name.txt",
        "new name.txt",
        (),
    )


def test_rename_with_edit() -> None:
    edit = _one(
        _p(
            "diff --git a/a.py b/lib/b.py",
            "similarity index 80%",
            "rename from a.py",
            "rename to lib/b.py",
            "index 1111111..2222222 100644",
            "--- a/a.py",
            "+++ b/lib/b.py",
            "@@ -2 +2 @@",
            "-x",
            "+y",
        )
    )
    assert (edit.op, edit.path, edit.new_path) == ("rename", "a.py", "lib/b.py")
    assert edit.hunks[0].old_lines == (b"x\n",) and edit.hunks[0].old_start == 2
    assert edit.old_mode == MODE_FILE


def test_dissimilarity_index_with_rewrite_is_read() -> None:
    edit = _one(
        _p(
            "diff --git a/f b/f",
            "dissimilarity index 90%",
            "index 1111111..2222222 100644",
            "--- a/f",
            "+++ b/f",
            "@@ -1 +1 @@",
            "-a",
            "+b",
        )
    )
    assert edit.op == "modify" and edit.hunks[0].new_lines == (b"b\n",)


def test_symlink_is_a_file_whose_content_is_the_target() -> None:
    edit = _one(
        _p(
            "diff --git a/link b/link",
            "new file mode 120000",
            "index 0000000..b1ed2a4",
            "--- /dev/null",
            "+++ b/link",
            "@@ -0,0 +1 @@",
            "+target/file",
            "\\ No newline at end of file",
        )
    )
    assert (edit.op, edit.new_mode, edit.content) == ("add", MODE_LINK, b"target/file")


def test_copy_is_an_edit_that_reads_its_source() -> None:
    edit = _one(_p("diff --git a/a b/b", "similarity index 100%", "copy from a", "copy to b"))
    assert (edit.op, edit.path, edit.new_path, edit.hunks) == ("copy", "a", "b", ())
    assert edit.touched == ("b",), "the source is read, not changed"
    edited = _one(_p("diff --git a/src/a b/src/c", "similarity index 80%", "copy from src/a", "copy to src/c",
                     "--- a/src/a", "+++ b/src/c", "@@ -1 +1 @@", "-x", "+y"))
    assert (edited.op, edited.target, len(edited.hunks)) == ("copy", "src/c", 1)


def test_a_copy_and_an_edit_of_its_source_are_two_edits() -> None:
    patch = parse_unified(_p("diff --git a/a b/a", "--- a/a", "+++ b/a", "@@ -1 +1 @@", "-x", "+y",
                             "diff --git a/a b/b", "similarity index 100%", "copy from a", "copy to b"))
    assert [(e.op, e.target) for e in patch.edits] == [("modify", "a"), ("copy", "b")]


@pytest.mark.parametrize("header", [["copy from a"], ["copy from a", "copy to a"],
                                    ["copy from a", "copy to b", "rename from a", "rename to c"]])
def test_malformed_copies_are_refused(header: list[str]) -> None:
    with pytest.raises(ParseError):
        parse_unified(_p("diff --git a/a b/b", *header))


# git diff --binary of: a 10,240-byte file with 10 bytes changed (a delta), a new 7-byte file
# b"new\0bin" (a literal), and a deleted 3-byte file b"x\0y" (a literal 0 and its reverse).
GIT_BINARY = _p(
    "diff --git a/b.dat b/b.dat",
    "index c24b5240932db6bddd91a9aecd36e95ffb2e8f0e..b3dd4fc8734314a5ae59012d8c6c475f45af0a97 100644",
    "GIT binary patch",
    "delta 21",
    "ccmZn&Xb6~)!sX%W<KrLhALQe*F>jJO08#J<a{vGU",
    "",
    "delta 10",
    "RcmZn&Xb4!usJ@7i5daim0}lWI",
    "",
    "diff --git a/n.bin b/n.bin",
    "new file mode 100644",
    "index 0000000000000000000000000000000000000000..0ae8040411865fbc997e77a0a3ccce72e6e91cd8",
    "GIT binary patch",
    "literal 7",
    "Ocmc~xEoVr|%mV-lAOeH{",
    "",
    "literal 0",
    "HcmV?d00001",
    "",
    "diff --git a/small.bin b/small.bin",
    "deleted file mode 100644",
    "index d5d0b8b4c4c9e936890870f6799cfbb5ba984470..0000000000000000000000000000000000000000",
    "GIT binary patch",
    "literal 0",
    "HcmV?d00001",
    "",
    "literal 3",
    "Kcmb<ms0083<N)#j",
    "",
)


def test_git_binary_patch_is_read() -> None:
    delta, add, delete = parse_unified(GIT_BINARY).edits
    assert (delta.op, delta.path, delta.binary, len(delta.delta or b""), delta.content) == (
        "modify", "b.dat", "delta", 21, None)
    assert (delta.old_blob, delta.new_blob) == ("c24b5240932db6bddd91a9aecd36e95ffb2e8f0e",
                                                "b3dd4fc8734314a5ae59012d8c6c475f45af0a97")
    assert (add.op, add.path, add.binary, add.content, add.new_mode) == ("add", "n.bin", "literal", b"new\0bin",
                                                                          MODE_FILE)
    assert (delete.op, delete.path, delete.old_blob) == ("delete", "small.bin",
                                                          "d5d0b8b4c4c9e936890870f6799cfbb5ba984470")


def test_binary_patch_without_its_trailing_blank_line_is_read() -> None:
    cut = GIT_BINARY.rstrip(b"\n") + b"\n"
    assert parse_unified(cut).edits[2].op == "delete"


def test_binary_files_differ_with_a_full_new_oid_names_the_blob() -> None:
    edit = _one(_p("diff --git a/img.png b/img.png",
                   "index 1111111111111111111111111111111111111111..2222222222222222222222222222222222222222 100644",
                   "Binary files a/img.png and b/img.png differ"))
    assert (edit.op, edit.binary, edit.new_blob, edit.content, edit.delta) == (
        "modify", "blob", "2" * 40, None, None)


def test_binary_files_differ_with_abbreviated_oids_is_refused() -> None:
    data = _p("diff --git a/img.png b/img.png", "index 1111111..2222222 100644",
              "Binary files a/img.png and b/img.png differ")
    with pytest.raises(UnsupportedPatch) as info:
        parse_unified(data)
    assert "carries no data" in info.value.message and "git diff --binary" in info.value.message
    assert info.value.error_type == "parse_error" and info.value.details["path"] == "img.png"


@pytest.mark.parametrize("body, why", [
    (["GIT binary patch"], "has no 'literal' or 'delta' hunk"),
    (["GIT binary patch", "literal 7", "Ocmc~xEoVr|%mV-lAOeH"], "not a base-85 data line"),
    (["GIT binary patch", "literal 7", "0cmc~xEoVr|%mV-lAOeH{"], "not a base-85 data line"),
    (["GIT binary patch", "literal 7", "Acmc~xEoVr|%mV-lAOeH{"], "length byte does not fit"),
    (["GIT binary patch", "literal 8", "Ocmc~xEoVr|%mV-lAOeH{"], "inflates to 7 bytes, not 8"),
    (["GIT binary patch", "literal 6", "Ocmc~xEoVr|%mV-lAOeH{"], "does not inflate to 6 bytes"),
    (["GIT binary patch", "literal 7", "Ocmc~xEoVr|%mV-lAOeH "], "bad base-85 data"),
])
def test_corrupt_binary_patches_are_refused(body: list[str], why: str) -> None:
    data = _p("diff --git a/n.bin b/n.bin", "new file mode 100644", *body)
    with pytest.raises(ParseError, match="corrupt binary patch for 'n.bin'|no 'literal'") as info:
        parse_unified(data)
    assert why in info.value.message
    assert info.value.error_type == "parse_error"


def test_binary_block_with_text_hunks_is_refused() -> None:
    with pytest.raises(ParseError, match="also has text hunks"):
        parse_unified(_p("diff --git a/x b/x", "Binary files a/x and b/x differ", "--- a/x", "+++ b/x",
                         "@@ -1 +1 @@", "-a", "+b"))


def test_plain_binary_line_is_refused() -> None:
    with pytest.raises(UnsupportedPatch, match=r"'img\.png'"):
        parse_unified(_p("Binary files a/img.png and b/img.png differ"))


def test_submodule_and_combined_diff_are_refused() -> None:
    with pytest.raises(UnsupportedPatch, match="submodule"):
        parse_unified(
            _p(
                "diff --git a/sub b/sub",
                "index 1111111..2222222 160000",
                "--- a/sub",
                "+++ b/sub",
                "@@ -1 +1 @@",
                "-Subproject commit 1111111",
                "+Subproject commit 2222222",
            )
        )
    with pytest.raises(UnsupportedPatch, match="combined"):
        parse_unified(_p("diff --cc f", "@@@ -1,1 -1,1 +1,1 @@@", "- a", " -b", "++c"))


# --------------------------------------------------------------------------- names


def test_quoted_paths_are_unquoted() -> None:
    edit = _one(
        _p(
            r'diff --git "a/sp\303\251cial \"x\"" "b/sp\303\251cial \"x\""',
            r'--- "a/sp\303\251cial \"x\""' + "\t",
            r'+++ "b/sp\303\251cial \"x\""' + "\t",
            "@@ -1 +1 @@",
            "-a",
            "+b",
        )
    )
    assert edit.path == 'spécial "x"'


def test_quoted_rename_paths_with_escapes() -> None:
    edit = _one(
        _p(
            r'diff --git "a/say \"hi\"" "b/\303\251t\303\251"',
            "similarity index 100%",
            r'rename from "say \"hi\""',
            r'rename to "\303\251t\303\251"',
        )
    )
    assert (edit.path, edit.new_path) == ('say "hi"', "été")


def test_quoted_escape_of_a_control_character_is_decoded_then_refused() -> None:
    with pytest.raises(UnsafePath) as info:
        parse_unified(
            _p(r'diff --git "a/tab\there" "b/tab\there"', "old mode 100644", "new mode 100755")
        )
    assert info.value.details["path"] == "tab\there"


def test_non_utf8_path_is_refused_and_shown_escaped() -> None:
    with pytest.raises(UnsafePath) as info:
        _one(_p(r'diff --git "a/caf\351" "b/caf\351"', "old mode 100644", "new mode 100755"))
    assert info.value.details == {"path": "caf\\xe9", "reason": "not UTF-8"}


def test_header_names_with_spaces_are_split_where_they_agree() -> None:
    edit = _one(_p("diff --git a/my b/file b/my b/file", "old mode 100644", "new mode 100755"))
    assert edit.path == "my b/file"


def test_no_prefix_git_diff() -> None:
    edit = _one(
        _p(
            "diff --git a/x a/x",
            "index 1..2 100644",
            "--- a/x",
            "+++ a/x",
            "@@ -1 +1 @@",
            "-p",
            "+q",
        )
    )
    assert edit.path == "a/x"


def test_mnemonic_prefixes() -> None:
    edit = _one(_p("diff --git i/f.c w/f.c", "--- i/f.c", "+++ w/f.c", "@@ -1 +1 @@", "-p", "+q"))
    assert edit.path == "f.c"


def test_plain_diff_with_prefixes_and_timestamps() -> None:
    edit = _one(
        _p(
            "--- a/lib/x.c\t2024-01-02 10:00:00.000000000 +0100",
            "+++ b/lib/x.c\t2024-01-02 11:00:00.000000000 +0100",
            "@@ -1 +1 @@",
            "-p",
            "+q",
        )
    )
    assert (edit.op, edit.path) == ("modify", "lib/x.c")


def test_plain_diff_without_prefixes_keeps_the_name() -> None:
    edit = _one(_p("--- a/x.py", "+++ a/x.py", "@@ -1 +1 @@", "-p", "+q"))
    assert edit.path == "a/x.py"
    edit = _one(_p("--- x.py", "+++ x.py", "@@ -1 +1 @@", "-p", "+q"))
    assert edit.path == "x.py"


def test_plain_diff_with_differing_names_takes_gits_choice() -> None:
    assert _one(_p("--- x.py.orig", "+++ x.py", "@@ -1 +1 @@", "-p", "+q")).path == "x.py"
    assert _one(_p("--- x.py", "+++ x.py.new", "@@ -1 +1 @@", "-p", "+q")).path == "x.py"


def test_plain_add_and_delete_via_dev_null() -> None:
    patch = parse_unified(
        _p(
            "--- /dev/null",
            "+++ b/new.txt",
            "@@ -0,0 +1 @@",
            "+n",
            "--- a/old.txt",
            "+++ /dev/null",
            "@@ -1 +0,0 @@",
            "-o",
        )
    )
    add, delete = patch.edits
    assert (add.op, add.path, add.content, add.new_mode) == ("add", "new.txt", b"n\n", None)
    assert (delete.op, delete.path, delete.hunks[0].old_lines) == ("delete", "old.txt", (b"o\n",))


def test_epoch_timestamp_means_absent_side() -> None:
    edit = _one(
        _p(
            "--- x.txt\t1970-01-01 00:00:00.000000000 +0000",
            "+++ x.txt\t2024-01-01 00:00:00.000000000 +0000",
            "@@ -0,0 +1 @@",
            "+n",
        )
    )
    assert (edit.op, edit.content) == ("add", b"n\n")


def test_epoch_timestamp_after_a_quoted_name_means_absent_side() -> None:
    """GNU diff quotes a name with spaces and still dates it (diff -ruN of an added / deleted file)."""
    add = _one(_p('--- "a/sub/new  two.txt"\t1970-01-01 00:00:00.000000000 +0000',
                  '+++ "b/sub/new  two.txt"\t2026-11-30 03:48:45.145901275 +0000', "@@ -0,0 +1 @@", "+y"))
    assert (add.op, add.path, add.content) == ("add", "sub/new  two.txt", b"y\n")
    gone = _one(_p('--- "a/old one.txt"\t2026-11-30 03:48:45.145901275 +0000',
                   '+++ "b/old one.txt"\t1970-01-01 00:00:00.000000000 +0000', "@@ -1 +0,0 @@", "-x"))
    assert (gone.op, gone.path) == ("delete", "old one.txt")
    kept = _one(_p('--- "a/x y.txt"\t2026-11-30 03:48:45 +0000', '+++ "b/x y.txt"\t2026-11-30 03:48:46 +0000',
                   "@@ -1 +1 @@", "-x", "+z"))
    assert (kept.op, kept.path) == ("modify", "x y.txt")


def test_epoch_dated_file_with_lines_on_both_sides_is_there() -> None:
    """A file really dated at the epoch (a reproducible tarball's, as in pip's sdists) changed by 'diff -ruN'.

    Its hunks hold lines on the epoch side, so the file is there: a change, as GNU
    patch reads it (git apply refuses "deleted file still has contents").
    """
    changed = _one(_p("--- old/PKG-INFO\t2023-07-22 09:17:02.010808000 +0000",
                      "+++ new/PKG-INFO\t1970-01-01 00:00:00.000000000 +0000",
                      "@@ -1,2 +1,2 @@", "-Version: 1", "+Version: 2", " Name: x"))
    assert (changed.op, changed.path) == ("modify", "PKG-INFO")
    assert changed.hunks[0].old_lines == (b"Version: 1\n", b"Name: x\n")
    older = _one(_p("--- old/a.txt\t1970-01-01 00:00:00.000000000 +0000",
                    "+++ new/a.txt\t2024-01-01 00:00:00.000000000 +0000", "@@ -1 +1 @@", "-x", "+y"))
    assert (older.op, older.path) == ("modify", "a.txt")
    emptied = _one(_p("--- old/e.txt\t2024-01-01 00:00:00 +0000", "+++ new/e.txt\t1970-01-01 00:00:00 +0000",
                      "@@ -1 +0,0 @@", "-x"))
    assert (emptied.op, emptied.path) == ("delete", "e.txt")  # no lines on the epoch side: diff -N's absent file


def test_unsafe_path_in_patch_is_refused() -> None:
    with pytest.raises(UnsafePath):
        parse_unified(
            _p("--- a/../../etc/passwd", "+++ b/../../etc/passwd", "@@ -1 +1 @@", "-p", "+q")
        )
    with pytest.raises(UnsafePath):
        parse_unified(
            _p("diff --git a/.git/config b/.git/config", "old mode 100644", "new mode 100755")
        )


# --------------------------------------------------------------------------- hunks


def test_counts_default_to_one() -> None:
    (hunk,) = _one(_p("--- a/f", "+++ b/f", "@@ -3 +3 @@", "-p", "+q")).hunks
    assert (hunk.old_lines, hunk.new_lines, hunk.old_start) == ((b"p\n",), (b"q\n",), 3)


def test_several_hunks_keep_their_order_and_starts() -> None:
    edit = _one(
        _p(
            "--- a/f",
            "+++ b/f",
            "@@ -1,2 +1,2 @@",
            " a",
            "-b",
            "+B",
            "@@ -10,2 +10,1 @@",
            " j",
            "-k",
        )
    )
    assert [h.old_start for h in edit.hunks] == [1, 10]
    assert edit.hunks[1].new_lines == (b"j\n",)


def test_empty_old_side_keeps_the_insert_after_line() -> None:
    (hunk,) = _one(_p("--- a/f", "+++ b/f", "@@ -5,0 +6,2 @@", "+x", "+y")).hunks
    assert hunk.old_lines == () and hunk.old_start == 5


def test_crlf_lines_are_kept_byte_for_byte() -> None:
    data = b"--- a/f\r\n+++ b/f\r\n@@ -1,2 +1,2 @@\r\n x\r\n-y\r\n+Y\r\n"
    (hunk,) = _one(data).hunks
    assert hunk.old_lines == (b"x\r\n", b"y\r\n") and hunk.new_lines == (b"x\r\n", b"Y\r\n")


def test_lone_cr_is_not_a_line_break() -> None:
    (hunk,) = _one(_p("--- a/f", "+++ b/f", "@@ -1 +1 @@", "-a\rb", "+c\rd")).hunks
    assert hunk.old_lines == (b"a\rb\n",) and hunk.new_lines == (b"c\rd\n",)


def test_non_utf8_content_survives() -> None:
    (hunk,) = _one(_p("--- a/f", "+++ b/f", "@@ -1 +1 @@", b"-caf\xe9", b"+\xff\xfe")).hunks
    assert hunk.old_lines == (b"caf\xe9\n",) and hunk.new_lines == (b"\xff\xfe\n",)


def test_no_newline_on_old_side() -> None:
    (hunk,) = _one(
        _p("--- a/f", "+++ b/f", "@@ -1 +1 @@", "-last", "\\ No newline at end of file", "+last")
    ).hunks
    assert hunk.old_lines == (b"last",) and hunk.new_lines == (b"last\n",)


def test_no_newline_on_new_side() -> None:
    (hunk,) = _one(
        _p("--- a/f", "+++ b/f", "@@ -1 +1 @@", "-last", "+last", "\\ No newline at end of file")
    ).hunks
    assert hunk.old_lines == (b"last\n",) and hunk.new_lines == (b"last",)


def test_no_newline_on_both_sides() -> None:
    (hunk,) = _one(
        _p(
            "--- a/f",
            "+++ b/f",
            "@@ -1,2 +1,2 @@",
            "-a",
            "+A",
            " end",
            "\\ No newline at end of file",
        )
    ).hunks
    assert hunk.old_lines == (b"a\n", b"end") and hunk.new_lines == (b"A\n", b"end")


def test_no_newline_keeps_cr_of_crlf_line() -> None:
    data = b"--- a/f\n+++ b/f\n@@ -1 +1 @@\n-x\r\n\\ No newline at end of file\n+y\r\n"
    (hunk,) = _one(data).hunks
    assert hunk.old_lines == (b"x\r",) and hunk.new_lines == (b"y\r\n",)


def test_patch_text_cut_before_its_last_newline_keeps_the_files_newline() -> None:
    (hunk,) = _one(b"--- a/f\n+++ b/f\n@@ -1 +1,2 @@\n x\n+y").hunks
    assert hunk.new_lines == (b"x\n", b"y\n")
    (crlf,) = _one(b"--- a/f\r\n+++ b/f\r\n@@ -1 +1 @@\r\n-x\r\n+y").hunks
    assert crlf.new_lines == (b"y\r\n",)


def test_stripped_empty_context_line_is_accepted_inside_a_hunk() -> None:
    (hunk,) = _one(_p("--- a/f", "+++ b/f", "@@ -1,3 +1,3 @@", " a", "", "-b", "+B")).hunks
    assert hunk.old_lines == (b"a\n", b"\n", b"b\n")
    assert hunk.new_lines == (b"a\n", b"\n", b"B\n")


def test_empty_line_after_a_complete_hunk_ends_it() -> None:
    patch = parse_unified(_p("--- a/f", "+++ b/f", "@@ -1 +1 @@", "-a", "+b", "", "trailing words"))
    assert patch.edits[0].hunks[0].new_lines == (b"b\n",)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (["-a"], "ends early"),
        (["-a", "+b", " c"], "is longer than its header says"),
        (["-a", "+b", "+c"], "is longer than its header says"),
        (["-a", "-b"], "is longer than its header says"),
        (["-a", "garbage"], "ends early"),
    ],
)
def test_bad_counts_are_parse_errors_with_line_number(body: list[str], where: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_unified(_p("--- a/f", "+++ b/f", "@@ -1 +1 @@", *body))
    assert where in info.value.message
    assert "hunk at line 3 of 'f'" in info.value.message
    assert isinstance(info.value.details["line"], int) and info.value.details["line"] >= 4


def test_malformed_hunk_header_is_a_parse_error() -> None:
    with pytest.raises(ParseError, match="malformed hunk header at line 3"):
        parse_unified(_p("--- a/f", "+++ b/f", "@@ -x +1 @@", "-a", "+b"))


# --------------------------------------------------------------------------- framing


FORMAT_PATCH = _p(
    "From 1234567890abcdef1234567890abcdef12345678 Mon Sep 17 00:00:00 2001",
    "From: A U Thor <author@example.com>",
    "Date: Tue, 2 Jan 2024 10:00:00 +0100",
    "Subject: [PATCH] change f",
    "",
    "A message that mentions --- and +++ in passing.",
    "--- a/not/a/header",
    "",
    "---",
    " f | 2 +-",
    " 1 file changed, 1 insertion(+), 1 deletion(-)",
    "",
    "diff --git a/f b/f",
    "index 1111111..2222222 100644",
    "--- a/f",
    "+++ b/f",
    "@@ -1,2 +1,2 @@",
    " keep",
    "-old",
    "+new",
    "-- ",
    "2.39.5",
    "",
)


def test_format_patch_preamble_and_signature_are_ignored() -> None:
    edit = _one(FORMAT_PATCH)
    assert edit.path == "f"
    assert edit.hunks[0].new_lines == (b"keep\n", b"new\n")


def test_garbage_between_files_is_skipped() -> None:
    patch = parse_unified(
        _p(
            "Index: f",
            "===================================================================",
            "--- f",
            "+++ f",
            "@@ -1 +1 @@",
            "-a",
            "+b",
            "Some explanation an agent wrote.",
            "--- g",
            "+++ g",
            "@@ -1 +1 @@",
            "-c",
            "+d",
        )
    )
    assert [e.path for e in patch.edits] == ["f", "g"]


def test_nothing_recognisable_is_a_parse_error() -> None:
    with pytest.raises(ParseError, match="no file changes found in patch"):
        parse_unified(b"just some words\n--- not\nalone\n")
    with pytest.raises(ParseError, match="no file changes found in patch"):
        parse_unified(b"")


def test_same_path_twice_is_a_parse_error() -> None:
    one = _p("--- a/f", "+++ b/f", "@@ -1 +1 @@", "-a", "+b")
    with pytest.raises(ParseError, match="'f' is changed more than once"):
        parse_unified(one + one)


def test_rename_target_counts_as_touched() -> None:
    with pytest.raises(ParseError, match="'b' is changed more than once"):
        parse_unified(
            _p(
                "diff --git a/a b/b",
                "rename from a",
                "rename to b",
                "diff --git a/b b/b",
                "old mode 100644",
                "new mode 100755",
            )
        )


def test_block_without_change_is_a_parse_error() -> None:
    with pytest.raises(ParseError, match="changes nothing"):
        parse_unified(_p("diff --git a/f b/f", "index 1111111..2222222 100644"))


def test_looks_unified() -> None:
    assert looks_unified(MODIFY)
    assert looks_unified(_p("intro", "--- f", "+++ f", "@@ -1 +1 @@", "-a", "+b"))
    assert looks_unified(b"--- f\r\n+++ f\r\n@@ -1 +1 @@\r\n-a\r\n+b\r\n")
    assert not looks_unified(_p("*** Begin Patch", "*** Update File: f", "@@", "-a", "+b"))
    assert not looks_unified(_p("--- f", "+++ f", "no hunk"))
    assert not looks_unified(b"")


# --------------------------------------------------------------------------- real git output


def _git(cwd: Path, *args: str) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(cwd), GIT_CONFIG_NOSYSTEM="1", LC_ALL="C")
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
    ).stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_real_git_diff_round_trips_through_apply(tmp_path: Path) -> None:
    before = {
        "a.txt": b"one\ntwo\nthree\n" + b"".join(b"line %d\n" % i for i in range(30)) + b"tail\n",
        "crlf.txt": b"x\r\ny\r\nz\r\n",
        "nonl.txt": b"no newline",
        'caf\xc3\xa9 "q".txt': b"keep\n",
        "old.txt": b"".join(b"row %d\n" % i for i in range(20)),
        "gone.txt": b"bye\n",
        "bytes.bin.txt": b"caf\xe9\n",
    }
    after = {
        "a.txt": b"one\nTWO\nthree\n"
        + b"".join(b"line %d\n" % i for i in range(30))
        + b"tail\nnew\n",
        "crlf.txt": b"x\r\nY\r\nz\r\n",
        "nonl.txt": b"no newline either",
        'caf\xc3\xa9 "q".txt': b"keep\nmore\n",
        "new.txt": b"".join(b"row %d\n" % i for i in range(20)) + b"row 20\n",
        "added.txt": b"fresh\n",
        "bytes.bin.txt": b"caf\xe9\n\xff\n",
    }
    _git(tmp_path, "init", "-q", ".")
    _git(tmp_path, "config", "core.autocrlf", "false")
    for name, data in before.items():
        (tmp_path / os.fsdecode(name.encode() if isinstance(name, str) else name)).write_bytes(data)
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "base")
    for name in before:
        (tmp_path / name).unlink()
    for name, data in after.items():
        (tmp_path / name).write_bytes(data)
    _git(tmp_path, "add", "-A")
    diff = _git(tmp_path, "diff", "--cached", "-M", "--full-index")
    edits = {e.target: e for e in parse_unified(diff).edits}
    assert edits["new.txt"].op == "rename" and edits["new.txt"].path == "old.txt"
    assert edits["gone.txt"].op == "delete"
    assert edits["added.txt"].content == b"fresh\n"
    for target, edit in edits.items():
        if edit.op in ("modify", "rename"):
            result = apply_hunks(before[edit.path], edit.hunks, path=edit.path)
            assert result.content == after[target], target
            assert set(result.grades) == {"exact"}
        elif edit.op == "delete":
            result = apply_hunks(before[edit.path], edit.hunks, path=edit.path)
            assert result.content == b""


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_real_git_format_patch_parses(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q", ".")
    (tmp_path / "f").write_bytes(b"a\nb\n")
    _git(tmp_path, "add", "f")
    _git(tmp_path, "commit", "-qm", "base")
    (tmp_path / "f").write_bytes(b"a\nB\n")
    (tmp_path / "run.sh").write_bytes(b"#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "subject\n\nbody --- with\n+++ markers\n")
    text = _git(tmp_path, "format-patch", "--stdout", "-1")
    assert text.rstrip().splitlines()[-2] == b"-- "
    edits = {e.path: e for e in parse_unified(text).edits}
    assert edits["f"].hunks[0].new_lines == (b"a\n", b"B\n")
    assert (edits["run.sh"].op, edits["run.sh"].new_mode) == ("add", MODE_EXEC)
    assert isinstance(edits["f"].hunks[0], Hunk)


def test_a_format_patch_series_that_changes_a_file_twice_is_refused_with_a_hint() -> None:
    def mail(sha: str, old: str, new: str) -> bytes:
        return _p(f"From {sha} Mon Sep 17 00:00:00 2001", "Subject: [PATCH] step", "", "---",
                  "diff --git a/f b/f", "--- a/f", "+++ b/f", "@@ -1 +1 @@", f"-{old}", f"+{new}", "-- ", "2.39.5", "")

    with pytest.raises(ParseError) as info:
        parse_unified(mail("1" * 40, "a", "b") + mail("2" * 40, "b", "c"))
    assert "series of 2 patches" in info.value.message and info.value.details["patches"] == 2
    with pytest.raises(ParseError) as one:
        parse_unified(_p("diff --git a/f b/f", "--- a/f", "+++ b/f", "@@ -1 +1 @@", "-a", "+b") * 2)
    assert "series" not in one.value.message


def test_a_path_may_be_taken_away_and_written_anew_but_not_changed_twice_on_one_side() -> None:
    rename_and_copy = parse_unified(_p(
        "diff --git a/f b/g", "similarity index 100%", "copy from f", "copy to g",
        "diff --git a/g b/k", "similarity index 100%", "rename from g", "rename to k"))
    assert [(e.op, e.path, e.target) for e in rename_and_copy.edits] == [("copy", "f", "g"), ("rename", "g", "k")]
    delete_then_add = parse_unified(_p(
        "diff --git a/x b/x", "deleted file mode 100644", "--- a/x", "+++ /dev/null", "@@ -1 +0,0 @@", "-a",
        "diff --git a/x b/x", "new file mode 100644", "--- /dev/null", "+++ b/x", "@@ -0,0 +1 @@", "+b"))
    assert [e.op for e in delete_then_add.edits] == ["delete", "add"]
    for twice in [
        _p("diff --git a/x b/y", "rename from x", "rename to y", "diff --git a/x b/z", "rename from x", "rename to z"),
        _p("diff --git a/a b/x", "copy from a", "copy to x", "diff --git a/b b/x", "copy from b", "copy to x"),
        _p("diff --git a/x b/x", "--- a/x", "+++ b/x", "@@ -1 +1 @@", "-a", "+b",
           "diff --git a/x b/y", "rename from x", "rename to y"),
    ]:
        with pytest.raises(ParseError, match="changed more than once"):
            parse_unified(twice)


# -- git's anchors: a hunk from line 1 starts the file, one without trailing context ends it --------


def _apply_twice_like_git(tmp_path: Path, original: bytes, patch: bytes) -> tuple[bytes, bool, bytes | None]:
    """Ours applied once, then again on its result (already applied?), and git's result of the first."""
    edit = parse_unified(patch).edits[0]
    once = apply_hunks(original, edit.hunks, path="f").content
    again = apply_hunks(once, edit.hunks, path="f")
    (tmp_path / "f").write_bytes(original)
    (tmp_path / "p.diff").write_bytes(patch)
    res = subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, capture_output=True, check=False)
    theirs = (tmp_path / "f").read_bytes() if res.returncode == 0 else None
    return once, again.already_applied and again.content == once, theirs


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
@pytest.mark.parametrize("original,patch", [
    # lines appended after the last lines (git diff's context before, none after)
    (b"x\ny\nz\n", b"--- a/f\n+++ b/f\n@@ -1,3 +1,4 @@\n x\n y\n z\n+new\n"),
    (b"1\n2\n3\n4\n5\n6\nx\ny\nz\n", b"--- a/f\n+++ b/f\n@@ -7,3 +7,5 @@\n x\n y\n z\n+n1\n+n2\n"),
    # the last line replaced
    (b"a\nb\nc\nd\n", b"--- a/f\n+++ b/f\n@@ -2,3 +2,3 @@\n b\n c\n-d\n+D\n"),
    # lines prepended before the first lines
    (b"x\ny\nz\nw\n", b"--- a/f\n+++ b/f\n@@ -1,3 +1,4 @@\n+new\n x\n y\n z\n"),
    # the first line replaced, in a file that repeats it
    (b"a\nb\nc\na\nb\nc\n", b"--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n-a\n+A\n b\n c\n"),
], ids=["append", "append_longer_file", "replace_last", "prepend", "replace_first"])
def test_a_hunk_git_anchors_is_already_applied_the_second_time(tmp_path: Path, original: bytes,
                                                              patch: bytes) -> None:
    """Applied again to its own result, such a hunk is already there (it used to apply a second time)."""
    once, already, theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert once == theirs
    assert already


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_a_hunk_without_trailing_context_ends_the_file_where_its_context_is_also_earlier(tmp_path: Path) -> None:
    """git's reading: the context repeats at the stated position and at the end; the end wins."""
    original = b"mid\nx\ny\nz\nmid\nx\ny\nz\n"
    patch = b"--- a/f\n+++ b/f\n@@ -2,3 +2,4 @@\n x\n y\n z\n+new\n"
    once, _already, theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert theirs == once == b"mid\nx\ny\nz\nmid\nx\ny\nz\nnew\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_a_hunk_without_trailing_context_in_mid_file_still_applies_where_git_refuses(tmp_path: Path) -> None:
    """Leniency kept: an agent's hunk that stops after its change applies at its context (git wants the end)."""
    original = b"def f():\n    x = 1\n    return x\n"
    patch = b"--- a/f\n+++ b/f\n@@ -1,2 +1,3 @@\n def f():\n     x = 1\n+    y = 2\n"
    once, _already, theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert theirs is None
    assert once == b"def f():\n    x = 1\n    y = 2\n    return x\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_a_hunk_with_no_context_is_read_by_its_line_numbers(tmp_path: Path) -> None:
    """-U0: no anchor (git needs --unidiff-zero); the stated line is changed, not the same line at the end."""
    original = b"a\n}\nb\n}\n"
    patch = b"--- a/f\n+++ b/f\n@@ -2 +2 @@\n-}\n+};\n"
    once, _already, _theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert once == b"a\n};\nb\n}\n"
    edit = parse_unified(patch).edits[0]
    assert not edit.hunks[0].prefer_eof and not edit.hunks[0].prefer_start


def test_anchor_flags_follow_the_hunk_lines() -> None:
    def flags(body: bytes, start: int = 5) -> tuple[bool, bool]:
        old = sum(1 for line in body.splitlines() if line[:1] in (b" ", b"-"))
        new = sum(1 for line in body.splitlines() if line[:1] in (b" ", b"+"))
        h = parse_unified(b"--- a/f\n+++ b/f\n@@ -%d,%d +%d,%d @@\n" % (start, old, start, new) + body).edits[0].hunks[0]
        return h.prefer_start, h.prefer_eof

    assert flags(b" a\n-b\n+B\n c\n") == (False, False)
    assert flags(b" a\n-b\n+B\n") == (False, True)
    assert flags(b"-b\n+B\n c\n") == (False, False)
    assert flags(b"-b\n+B\n c\n", start=1) == (True, False)
    assert flags(b" a\n b\n-c\n", start=1) == (True, True)
    assert flags(b"-b\n+B\n") == (False, False)


def test_no_newline_marker_in_a_patch_converted_to_crlf_leaves_no_stray_cr() -> None:
    """unix2dos over a whole git diff: the marker line ends in CRLF, so the line before it lost CRLF."""
    lf = (b"--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n line1\n line2\n-line3\n\\ No newline at end of file\n"
          b"+line3 too\n\\ No newline at end of file\n")
    original = b"line1\nline2\nline3"
    for patch in (lf, lf.replace(b"\n", b"\r\n")):
        edit = parse_unified(patch).edits[0]
        assert apply_hunks(original, edit.hunks, path="f").content == b"line1\nline2\nline3 too"
    # A file whose last line ends in a lone CR keeps it (the marker ends in LF).
    cr = b"--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\r\n\\ No newline at end of file\n+b\r\n\\ No newline at end of file\n"
    edit = parse_unified(cr).edits[0]
    assert apply_hunks(b"a\r", edit.hunks, path="f").content == b"b\r"


def test_diff_ruN_of_two_folders_strips_the_folder_names() -> None:
    """'diff -ruN orig new': the first components differ, the rest is the path (git apply's -p1)."""
    patch = parse_unified(_p(
        "diff -ruN orig/x/only_new.txt n2/x/only_new.txt",
        "--- orig/x/only_new.txt\t1970-01-01 00:00:00.000000000 +0000",
        "+++ n2/x/only_new.txt\t2026-11-30 03:48:45.145901275 +0000",
        "@@ -0,0 +1 @@", "+new",
        "diff -ruN orig/x/kept.txt n2/x/kept.txt",
        "--- orig/x/kept.txt\t2026-11-30 03:48:45 +0000",
        "+++ n2/x/kept.txt\t2026-11-30 03:48:46 +0000",
        "@@ -1 +1 @@", "-a", "+b",
        "--- orig/gone.txt\t2026-11-30 03:48:45 +0000",
        "+++ n2/gone.txt\t1970-01-01 00:00:00.000000000 +0000",
        "@@ -1 +0,0 @@", "-g",
    ))
    assert [(e.op, e.path) for e in patch.edits] == [("add", "x/only_new.txt"), ("modify", "x/kept.txt"),
                                                     ("delete", "gone.txt")]
    same = _one(_p("--- src/x.py.orig", "+++ src/x.py", "@@ -1 +1 @@", "-a", "+b"))
    assert same.path == "src/x.py"


def test_an_anchor_does_not_beat_a_stricter_match_elsewhere() -> None:
    """The end of the file matches only with trailing blanks ignored; the stated line matches exactly."""
    patch = b"--- a/f\n+++ b/f\n@@ -4,2 +4,3 @@\n [b]\n x = 1\n+y = 2\n"
    content = b"[a]\nx = 1\n\n[b]\nx = 1\n\n[b]\nx = 1   \n"
    edit = parse_unified(patch).edits[0]
    got = apply_hunks(content, edit.hunks, path="f")
    assert got.content == b"[a]\nx = 1\n\n[b]\nx = 1\ny = 2\n\n[b]\nx = 1   \n" and got.grades == ("exact",)


def test_an_insertion_ending_with_a_copy_of_its_context_is_already_applied_the_second_time(tmp_path: Path) -> None:
    """'' / +'x = 1' / +'' / 'class C:': once applied, the old lines ('' / 'class C:') occur once, inside the
    inserted block; they used to be taken for the place to insert again (a second 'x = 1')."""
    original = b"a\nb\n\nclass C:\n    pass\n"
    patch = b"--- a/f\n+++ b/f\n@@ -3,2 +3,4 @@\n \n+x = 1\n+\n class C:\n"
    once, already, theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert once == theirs == b"a\nb\n\nx = 1\n\nclass C:\n    pass\n"
    assert already


@pytest.mark.parametrize("original,patch", [
    # 'a' x4 -> 'a' x5, with its stated line and one off (no line says which 'a' is new)
    (b"a\na\na\na\n", b"--- a/f\n+++ b/f\n@@ -2,3 +2,4 @@\n a\n a\n a\n+a\n"),
    (b"a\na\na\na\n", b"--- a/f\n+++ b/f\n@@ -3,3 +3,4 @@\n a\n a\n a\n+a\n"),
    # a blank line added before a blank line
    (b"\n\n}", b"--- a/f\n+++ b/f\n@@ -1 +1,2 @@\n+\n \n"),
    (b"x\nq\n\n\ny\n", b"--- a/f\n+++ b/f\n@@ -2,2 +2,3 @@\n q\n+\n \n"),
])
def test_added_lines_that_only_repeat_the_old_ones_are_applied_not_taken_as_applied(
        tmp_path: Path, original: bytes, patch: bytes) -> None:
    """Lines added that are all copies of the hunk's old lines: a copy of the new lines stands around the old
    ones before any application too, so it proves nothing; the hunk is applied, as git applies it. (Was judged
    already applied: a success with nothing changed.) Sent again, it applies again, as git does."""
    once, _already, theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert once == theirs and once != original


def test_lines_appended_mid_file_after_their_context_are_already_applied_the_second_time(tmp_path: Path) -> None:
    """Context before the change and none after, mid-file: sent again, the old lines still stand at their
    stated line, followed by the lines the first application added: present, not a second copy."""
    original = b"a\nb\nc\nd\ne\n"
    patch = b"--- a/f\n+++ b/f\n@@ -2,2 +2,3 @@\n b\n c\n+new\n"
    once, already, theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert once == b"a\nb\nc\nnew\nd\ne\n" and theirs in (once, None)
    assert already


def test_a_change_sent_again_whose_old_lines_now_match_loosely_elsewhere_is_already_applied(tmp_path: Path) -> None:
    """'  }' added after '}': sent again, ' }' / '' matches only with whitespace ignored one line on, while the
    new lines stand exactly at the stated line (was a second '  }'; git refuses)."""
    original = b"\n}\n\n"
    patch = b"--- a/f\n+++ b/f\n@@ -2,2 +2,3 @@\n }\n+  }\n \n"
    once, already, _theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert once == b"\n}\n  }\n\n" and already


def test_a_hunk_ending_without_a_newline_is_never_placed_mid_file() -> None:
    """Only a file's last line can lack its terminator: such a hunk ends the file (was written mid-file, and a
    line was given a newline it never had)."""
    patch = b"--- a/f\n+++ b/f\n@@ -1,2 +1,3 @@\n x\n x\n+a\n\\ No newline at end of file\n"
    (edit,) = parse_unified(patch).edits
    assert edit.hunks[0].at_eof
    assert apply_hunks(b"x\nx\nx\n", edit.hunks, path="f").content == b"x\nx\nx\na"
    with pytest.raises(ContextNotFound):
        apply_hunks(b"x\nx\ny\n", edit.hunks, path="f")


def test_an_exact_match_at_the_stated_line_beats_the_end_of_file_anchor_elsewhere(tmp_path: Path) -> None:
    """No context after the change: git anchors it at the end, where '}' alone looked like the change made;
    the old lines stand exactly at the stated line (was judged already applied, nothing changed)."""
    original = b"x\n}\n\ny\n}\n"
    patch = b"--- a/f\n+++ b/f\n@@ -2,2 +2 @@\n }\n-\n"
    once, already, _theirs = _apply_twice_like_git(tmp_path, original, patch)
    assert once == b"x\n}\ny\n}\n" and already

"""Search/replace blocks, str_replace JSON, and their sequential, unique-match application (pure)."""

from __future__ import annotations

import json

import pytest

from patcher.formats.editblocks import apply_sequential, parse_search_replace, parse_str_replace
from patcher.errors import AmbiguousMatch, ContextNotFound, ParseError, PartiallyApplied
from patcher.model import FileEdit, Hunk


def block(search: str, replace: str, path: str | None = "f.py") -> str:
    head = f"{path}\n" if path is not None else ""
    return f"{head}<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


def sr(text: str) -> tuple[FileEdit, ...]:
    return parse_search_replace(text.encode()).edits


def strs(items: object) -> tuple[FileEdit, ...]:
    return parse_str_replace(json.dumps(items).encode()).edits


def hunk(old: bytes, new: bytes) -> Hunk:
    return Hunk(tuple(old.split(b"\n")), tuple(new.split(b"\n")), eol_agnostic=True)


# --------------------------------------------------------------------------- search/replace parsing


def test_one_block_is_one_eol_agnostic_hunk() -> None:
    (edit,) = sr(block("a\nb\n", "c\n"))
    assert edit.op == "modify" and edit.path == "f.py" and edit.hunks[0].header == "block 1 (line 2)"
    assert edit.hunks[0].old_lines == (b"a", b"b") and edit.hunks[0].new_lines == (b"c",)
    assert edit.hunks[0].eol_agnostic and edit.hunks[0].old_start is None and not edit.hunks[0].scopes


@pytest.mark.parametrize("name_line", ["f.py", "`f.py`", "**f.py**", "### f.py", "f.py:", "  f.py  "])
def test_file_name_decorations(name_line: str) -> None:
    text = f"Some prose.\n\n{name_line}\n```python\n<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n```\n"
    assert sr(text)[0].path == "f.py"


def test_blocks_group_per_file_in_order_and_reuse_the_previous_name() -> None:
    text = block("1\n", "one\n", "a.txt") + block("2\n", "two\n", None) + "```\n" + block("x\n", "y\n", "b.txt")
    a, b = sr(text)
    assert a.path == "a.txt" and [h.old_lines for h in a.hunks] == [(b"1",), (b"2",)]
    assert b.path == "b.txt"


def test_marker_lengths_and_crlf() -> None:
    text = "f\r\n<<<<< SEARCH\r\nold\r\n=========\r\nnew\r\n>>>>>>>>> REPLACE\r\n"
    (edit,) = parse_search_replace(text.encode()).edits
    assert edit.hunks[0].old_lines == (b"old",) and edit.hunks[0].new_lines == (b"new",)


def test_empty_search_creates_the_file() -> None:
    (edit,) = sr(block("", "hello\nworld\n", "new.md"))
    assert edit == FileEdit(op="add", path="new.md", content=b"hello\nworld\n")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n", "no file name"),
        ("f\n<<<<<<< SEARCH\nx\n=======\ny\n", "not closed"),
        ("f\n<<<<<<< SEARCH\nx\ny\n>>>>>>> REPLACE\n", "no '=======' line"),
        ("f\n<<<<<<< SEARCH\nx\n=======\n=======\ny\n>>>>>>> REPLACE\n", "cannot tell where SEARCH ends"),
        (block("", "new\n") + block("a\n", "b\n", None), "empty SEARCH"),
        (block("same\n", "same\n"), "changes nothing"),
        ("no blocks here\n", "no search/replace block"),
    ],
)
def test_search_replace_refusals(text: str, words: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_search_replace(text.encode())
    assert words in info.value.message


# --------------------------------------------------------------------------- str_replace parsing


def test_str_replace_list_object_and_aliases() -> None:
    (edit,) = strs({"path": "a", "old_str": "x", "new_str": "y"})
    assert edit.hunks[0].old_lines == (b"x",) and edit.hunks[0].header == "edit 1"
    a, b = strs([{"path": "a", "old": "1\n2\n", "new": ""}, {"path": "b", "old": "3", "new": "4"},
                 {"path": "a", "old": "5", "new": "6"}])
    assert a.path == "a" and [h.old_lines for h in a.hunks] == [(b"1", b"2"), (b"5",)]
    assert a.hunks[0].new_lines == () and b.path == "b"


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ([{"path": "a", "old": "x", "new": "y", "extra": 1}], "unknown key"),
        ([{"path": "a", "old": "x", "old_str": "x", "new": "y"}], "both 'old' and 'old_str'"),
        ([{"path": "a", "old": 3, "new": "y"}], "'old' must be a string"),
        ([{"path": "a", "old": "x"}], "'new' must be a string"),
        ([{"path": "a", "old": "", "new": "y"}], "'old' is empty"),
        ([{"path": "a", "old": "x", "new": "x"}], "changes nothing"),
        ("not a list", "JSON list"),
    ],
)
def test_str_replace_refusals(items: object, words: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_str_replace(json.dumps(items).encode())
    assert words in info.value.message


# --------------------------------------------------------------------------- applying


def test_edits_apply_in_sequence_in_any_order() -> None:
    original = b"a\nb\nc\n"
    hunks = [hunk(b"c", b"C"), hunk(b"a", b"A"), hunk(b"A\nb", b"AB")]
    result = apply_sequential(original, hunks, path="f")
    assert result.content == b"AB\nC\n" and result.grades == ("exact", "exact", "exact")


def test_two_matches_are_ambiguous_never_the_first() -> None:
    with pytest.raises(AmbiguousMatch) as info:
        apply_sequential(b"x = 1\ny\nx = 1\n", [hunk(b"y", b"Y"), hunk(b"x = 1", b"x = 2")], path="f")
    details = info.value.details
    assert details["hunk"] == 2 and details["sequential"] and details["candidates"] == [1, 3]
    assert info.value.message.startswith("hunk 2 of 'f'")


def test_partial_line_text_is_replaced_in_place() -> None:
    result = apply_sequential(b"    total = price * qty\n", [hunk(b"price * qty", b"price * qty * 2")], path="f")
    assert result.content == b"    total = price * qty * 2\n" and result.grades == ("substring",)


def test_ambiguous_substring_is_refused_but_a_unique_whole_line_wins() -> None:
    with pytest.raises(AmbiguousMatch) as info:
        apply_sequential(b"f(1)\ng(f(1))\n", [hunk(b"(1)", b"(2)")], path="f")
    assert info.value.details["candidates"] == [1, 2]
    # 'foo = 1' is a substring twice, but a whole line (ignoring indentation) once
    result = apply_sequential(b"  foo = 1\n  foo = 12\n", [hunk(b"foo = 1", b"foo = 3")], path="f")
    # (issue 24: the new line takes the matched line's indentation; it used to land at column 0)
    assert result.content == b"  foo = 3\n  foo = 12\n" and result.grades == ("strip",)


def test_substring_reads_lf_as_the_files_crlf() -> None:
    result = apply_sequential(b"a = 1\r\nb = 2\r\n", [hunk(b"1\nb", b"10\nb")], path="f")
    assert result.content == b"a = 10\r\nb = 2\r\n"


def test_whole_line_fuzzy_grades_are_recorded() -> None:
    result = apply_sequential("x \u2013 y  \n".encode(), [hunk(b"x - y", b"x + y")], path="f")
    assert result.content == b"x + y\n" and result.grades == ("punct",)


def test_already_applied_and_partially_applied() -> None:
    """Present: the old text occurs once, inside the new text (an edit that extended a line, sent again)."""
    original = b"import os, sys\nvalue = f(x)\n"
    done = apply_sequential(original, [hunk(b"import os", b"import os, sys"), hunk(b"f(x)", b"value = f(x)")],
                            path="f")
    assert done.already_applied and done.content == original
    with pytest.raises(PartiallyApplied) as info:
        apply_sequential(original, [hunk(b"import os", b"import os, sys"), hunk(b"f(x)", b"g(x)")], path="f")
    assert info.value.details["applied_hunks"] == [1] and info.value.details["missing_hunks"] == [2]


def test_new_text_elsewhere_is_no_proof_of_an_edit_applied() -> None:
    """'foo(a, b)' -> 'foo(a)' where the file has 'x = foo(a)' and no 'foo(a, b)': not already applied
    (that would be a success with nothing changed), but not found, with a hint where the new text is."""
    with pytest.raises(ContextNotFound) as info:
        apply_sequential(b"x = foo(a)\ny = foo(a, c)\n", [hunk(b"foo(a, b)", b"foo(a)")], path="m.py")
    assert info.value.details["new_text_at"] == 1 and "already at line 1" in info.value.message


def test_not_found_keeps_the_matchers_details_renumbered() -> None:
    with pytest.raises(ContextNotFound) as info:
        apply_sequential(b"alpha\nbeta\n", [hunk(b"alpha", b"ALPHA"), hunk(b"betta", b"BETA")], path="f")
    details = info.value.details
    assert details["hunk"] == 2 and details["sequential"] and details["path"] == "f"
    assert details["grade_tried"] == ["exact", "rstrip", "strip", "punct"]


def test_a_replace_marker_inside_replace_text_is_refused_not_cut_short() -> None:
    """'>>>>>>> REPLACE' as a line of the REPLACE text ended the block there; the rest was dropped unseen."""
    data = b"t.txt\n<<<<<<< SEARCH\nb\n=======\nB1\n>>>>>>> REPLACE\nB2\n>>>>>>> REPLACE\n"
    with pytest.raises(ParseError, match="outside any block") as info:
        parse_search_replace(data)
    assert info.value.details["line"] == 8


# --------------------------------------------------------------------------- bounded work


@pytest.mark.timeout(60)
def test_a_one_character_str_replace_in_512_kib_lists_twenty_candidates_and_a_count() -> None:
    """It took 40 s and its error listed 524,288 line numbers."""
    with pytest.raises(AmbiguousMatch) as info:
        apply_sequential(b"a" * (512 << 10), [hunk(b"a", b"b")], path="f")
    details = info.value.details
    assert details["candidates"] == [1] * 20 and details["candidate_count"] == 512 << 10
    assert len(info.value.message) < 400 and "and 524268 more" in info.value.message


def test_candidate_lines_are_counted_from_the_one_before() -> None:
    data = b"".join(b"x%d = 1\n" % i for i in range(30))
    with pytest.raises(AmbiguousMatch) as info:
        apply_sequential(data, [hunk(b" = 1", b" = 2")], path="f")
    assert info.value.details["candidates"] == list(range(1, 21))
    assert info.value.details["candidate_count"] == 30


@pytest.mark.timeout(60)
def test_twenty_thousand_blocks_on_one_file_are_refused_within_the_budget() -> None:
    """Each block reads the whole file again: 124 s before; now refused as too large."""
    from patcher.budget import WorkBudget, work_budget
    from patcher.errors import TooLarge

    data = b"".join(b"line %d\n" % i for i in range(20_000))
    blocks = [hunk(b"line %d" % i, b"LINE %d" % i) for i in range(20_000)]
    with work_budget() as budget, pytest.raises(TooLarge) as info:
        apply_sequential(data, blocks, path="f")
    assert isinstance(budget, WorkBudget) and info.value.details["reason"] == "work"
    # A hundred of them fit.
    out = apply_sequential(data, blocks[:100], path="f")
    assert out.content.count(b"LINE") == 100

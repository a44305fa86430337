"""Applying hunks to bytes (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patcher.errors import AmbiguousMatch, ContextNotFound, IndentationMismatch, PartiallyApplied
from patcher.matching import apply_hunks, split_lines
from patcher.model import Hunk


def _lines(*xs: str, eol: str = "\n") -> tuple[bytes, ...]:
    return tuple((x + eol).encode() for x in xs)


def _text(*xs: str, eol: str = "\n") -> bytes:
    return b"".join(_lines(*xs, eol=eol))


def _hunk(old: tuple[bytes, ...], new: tuple[bytes, ...], **kw: object) -> Hunk:
    return Hunk(old_lines=old, new_lines=new, **kw)  # type: ignore[arg-type]


NUMBERS = [f"line {i}" for i in range(1, 21)]


# --------------------------------------------------------------------------- split_lines


def test_split_lines_keeps_terminators_and_ignores_lone_cr() -> None:
    assert split_lines(b"") == []
    assert split_lines(b"a\nb\r\nc\rd\ne") == [b"a\n", b"b\r\n", b"c\rd\n", b"e"]
    assert split_lines(b"\n\n") == [b"\n", b"\n"]
    assert b"".join(split_lines(b"x\r\ny")) == b"x\r\ny"


# --------------------------------------------------------------------------- grades


def test_exact_at_stated_position() -> None:
    original = _text(*NUMBERS)
    hunk = _hunk(
        _lines("line 4", "line 5", "line 6"), _lines("line 4", "five", "line 6"), old_start=4
    )
    result = apply_hunks(original, [hunk], path="f")
    assert result.content == original.replace(b"line 5\n", b"five\n")
    assert result.grades == ("exact",) and not result.already_applied


def test_rstrip_grade_keeps_the_files_context_bytes() -> None:
    original = b"a  \nb\t\nc\n"
    hunk = _hunk(_lines("a", "b", "c"), _lines("a", "B", "c"), old_start=1)
    result = apply_hunks(original, [hunk], path="f")
    assert result.grades == ("rstrip",)
    assert result.content == b"a  \nB\nc\n"


def test_stricter_grade_anywhere_beats_looser_grade_at_stated_position() -> None:
    original = _text("x  ", *NUMBERS, "x")
    hunk = _hunk(_lines("x"), _lines("y"), old_start=1)
    result = apply_hunks(original, [hunk], path="f")
    assert result.grades == ("exact",)
    assert result.content == _text("x  ", *NUMBERS, "y")


def test_strip_grade_with_unlike_indentation_deltas_is_refused() -> None:
    # Issue 24: this used to commit 'def f():\n  a = 2\n    return a\n' (an IndentationError):
    # the kept lines took the file's indentation, the added one kept the patch's.  'def' is
    # off by 0, the body by +2: no one delta moves the added line right, so nothing is written.
    original = b"def f():\n    a = 1\n    return a\n"
    hunk = _hunk(
        _lines("def f():", "  a = 1", "  return a"),
        _lines("def f():", "  a = 2", "  return a"),
        old_start=1,
    )
    with pytest.raises(IndentationMismatch) as err:
        apply_hunks(original, [hunk], path="f.py")
    assert err.value.error_type == "indentation_mismatch"
    assert [x["line"] for x in err.value.details["lines"]] == [1, 2, 3]
    assert "off by 0" in err.value.message and "off by +2 space(s)" in err.value.message


def test_strip_grade_shifts_added_lines_by_the_one_delta() -> None:
    original = b"def f():\n    a = 1\n    return a\n"
    hunk = _hunk(_lines("  a = 1", "  return a"), _lines("  a = 1", "  if a:", "    a += 1", "  return a"))
    result = apply_hunks(original, [hunk], path="f.py")
    assert result.grades == ("strip",)
    # one delta (+2), Aider's rule: the nested line keeps its depth relative to the patch's lines
    assert result.content == b"def f():\n    a = 1\n    if a:\n      a += 1\n    return a\n"


def test_strip_grade_shifts_left_when_the_patch_is_indented_more() -> None:
    original = b"if x:\n  a = 1\n  b = 2\n"
    hunk = _hunk(_lines("\ta = 1", "\tb = 2"), _lines("\ta = 1", "\tc = 3", "\tb = 2"))
    with pytest.raises(IndentationMismatch, match="tabs against spaces"):
        apply_hunks(original, [hunk], path="f.py")
    hunk = _hunk(_lines("      a = 1", "      b = 2"), _lines("      a = 1", "      c = 3", "      b = 2"))
    result = apply_hunks(original, [hunk], path="f.py")
    assert result.content == b"if x:\n  a = 1\n  c = 3\n  b = 2\n"


def test_a_shift_left_past_an_added_line_s_indentation_is_refused() -> None:
    original = b"a = 1\nb = 2\n"
    hunk = _hunk(_lines("    a = 1", "    b = 2"), _lines("    a = 1", "c = 3", "    b = 2"))
    with pytest.raises(IndentationMismatch, match="fewer"):
        apply_hunks(original, [hunk], path="f.py")


def test_punct_grade_folds_unicode_punctuation() -> None:
    original = "say \u201chi\u201d \u2014 it\u2019s\u00a0ok\nnext\n".encode()
    hunk = _hunk(_lines('say "hi" - it\'s ok', "next"), _lines('say "hi" - it\'s ok', "NEXT"))
    result = apply_hunks(original, [hunk], path="f")
    assert result.grades == ("punct",)
    assert result.content == "say \u201chi\u201d \u2014 it\u2019s\u00a0ok\nNEXT\n".encode()


def test_punct_grade_survives_invalid_utf8() -> None:
    original = b"\xff\xfe \xe2\x80\x93 x\nend\n"
    hunk = _hunk((b"\xff\xfe - x\n", b"end\n"), (b"\xff\xfe - x\n", b"END\n"))
    assert apply_hunks(original, [hunk], path="f").content == b"\xff\xfe \xe2\x80\x93 x\nEND\n"


def test_nothing_matches_at_any_grade() -> None:
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(_text(*NUMBERS), [_hunk(_lines("absent"), _lines("x"))], path="f")
    assert info.value.details["grade_tried"] == ["exact", "rstrip", "strip", "punct"]


# --------------------------------------------------------------------------- positions


def test_offset_is_found_and_carried_to_the_next_hunk() -> None:
    # Five new lines at the top: hunk 1 is found 5 lines late.  Hunk 2's context occurs
    # both at its stated line (10) and 5 lines later; the carried offset picks the later.
    body = ["a", "b", "c", "k", "x", "k", "d", "e", "f", "k", "x", "k", "g", "h", "k", "x", "k"]
    original = _text("new1", "new2", "new3", "new4", "new5", *body)
    h1 = _hunk(_lines("a", "b", "c"), _lines("a", "B", "c"), old_start=1)
    h2 = _hunk(_lines("k", "x", "k"), _lines("k", "X", "k"), old_start=10)
    result = apply_hunks(original, [h1, h2], path="f")
    out = split_lines(result.content)
    assert out[5:8] == list(_lines("a", "B", "c"))
    assert out.index(b"X\n") == 5 + 10  # stated 10 (1-based) + offset 5, 0-based index 15
    assert result.grades == ("exact", "exact")


def test_nearest_candidate_wins() -> None:
    original = _text("m", "p", "q", "p", "r", "s", "t", "u", "p", "v")
    # stated line 5 ('r'); 'p' is at lines 2, 4 and 9: 4 is nearest.
    result = apply_hunks(original, [_hunk(_lines("p"), _lines("P"), old_start=5)], path="f")
    assert result.content == _text("m", "p", "q", "P", "r", "s", "t", "u", "p", "v")


def test_equal_distance_is_ambiguous() -> None:
    original = _text("p", "x", "p")
    with pytest.raises(AmbiguousMatch) as info:
        apply_hunks(original, [_hunk(_lines("p"), _lines("P"), old_start=2)], path="src/x.py")
    assert info.value.details["candidates"] == [1, 3]
    assert info.value.message.startswith("hunk 1 of 'src/x.py' does not apply: ")


def test_without_line_numbers_two_candidates_are_ambiguous() -> None:
    original = _text("p", "x", "p")
    with pytest.raises(AmbiguousMatch) as info:
        apply_hunks(original, [_hunk(_lines("p"), _lines("P"))], path="f")
    assert info.value.details["candidates"] == [1, 3]
    assert info.value.details["grade_tried"] == ["exact"]
    one = apply_hunks(_text("p", "x"), [_hunk(_lines("p"), _lines("P"))], path="f")
    assert one.content == _text("P", "x")


def test_hunks_match_in_order_without_overlap() -> None:
    original = _text("a", "b", "c", "d")
    h1 = _hunk(_lines("c"), _lines("C"))
    h2 = _hunk(_lines("a"), _lines("A"))
    # Issue 24: a hunk without line numbers found once before the previous one's match is
    # taken there, as codex takes it (this used to be refused: hunks in file order).
    assert apply_hunks(original, [h1, h2], path="f").content == _text("A", "b", "C", "d")
    # ... but never over a line an earlier hunk changes.
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(original, [_hunk(_lines("b", "c"), _lines("B", "c")), _hunk(_lines("c"), _lines("X"))],
                    path="f")
    assert info.value.details["hunk"] == 2
    # ... nor where it is ambiguous
    with pytest.raises(ContextNotFound):
        apply_hunks(_text("a", "b", "a", "c"), [_hunk(_lines("c"), _lines("C")), h2], path="f")
    # with line numbers (unified diffs), the file order is still the rule
    with pytest.raises(ContextNotFound):
        apply_hunks(original, [_hunk(_lines("c"), _lines("C"), old_start=3), _hunk(_lines("a"), _lines("A"), old_start=1)],
                    path="f")
    # 'a' alone would be ambiguous; after hunk 1's match only one 'a' is left to find.
    first = _hunk(_lines("a", "b"), _lines("A", "b"))
    both = apply_hunks(_text("a", "b", "a"), [first, h2], path="f")
    assert both.content == _text("A", "b", "A")


# --------------------------------------------------------------------------- scopes and at_eof


CLASSES = _text(
    "class A:",
    "    def __init__(self):",
    "        self.x = 1",
    "    def run(self):",
    "        return 1",
    "class B:",
    "    def __init__(self):",
    "        self.y = 2",
    "    def run(self):",
    "        return 1",
)


def test_scope_selects_among_repeated_contexts() -> None:
    hunk = _hunk(_lines("        return 1"), _lines("        return 2"), eol_agnostic=False)
    with pytest.raises(AmbiguousMatch):
        apply_hunks(CLASSES, [hunk], path="c.py")
    scoped = _hunk(hunk.old_lines, hunk.new_lines, scopes=(b"class B:",))
    result = apply_hunks(CLASSES, [scoped], path="c.py")
    assert result.content == b"return 2".join(CLASSES.rsplit(b"return 1", 1))


def test_nested_scopes_and_first_match_after_scope() -> None:
    hunk = _hunk(
        (b"        return 1",),
        (b"        return 3",),
        scopes=(b"class A:", b"    def run(self):"),
        eol_agnostic=True,
    )
    result = apply_hunks(CLASSES, [hunk], path="c.py")
    lines = split_lines(result.content)
    assert lines[4] == b"        return 3\n" and lines[9] == b"        return 1\n"


def test_ambiguous_scope_is_fine_when_the_hunk_resolves_it() -> None:
    hunk = _hunk(
        (b"self.y = 2",), (b"self.y = 3",), scopes=(b"def __init__(self):",), eol_agnostic=True
    )
    result = apply_hunks(CLASSES, [hunk], path="c.py")
    # only class B's __init__ leads to 'self.y = 2'; the added line takes the matched
    # line's indentation (issue 24: it used to keep the patch's, at column 0)
    assert result.content == CLASSES.replace(b"        self.y = 2\n", b"        self.y = 3\n")
    assert result.grades == ("strip",)


def test_ambiguous_scope_leading_to_different_places_is_ambiguous() -> None:
    hunk = _hunk(
        (b"    def run(self):",),
        (b"    def go(self):",),
        scopes=(b"def __init__(self):",),
        eol_agnostic=True,
    )
    with pytest.raises(AmbiguousMatch) as info:
        apply_hunks(CLASSES, [hunk], path="c.py")
    assert info.value.details["candidates"] == [4, 9]


def test_missing_scope_is_reported() -> None:
    hunk = _hunk((b"return 1",), (b"return 2",), scopes=(b"class C:",), eol_agnostic=True)
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(CLASSES, [hunk], path="c.py")
    assert "scope 'class C:' not found" in info.value.message
    assert info.value.details["scope"] == "class C:"


def test_at_eof_anchors_to_the_last_lines() -> None:
    original = _text("end", "middle", "end")
    with pytest.raises(AmbiguousMatch):
        apply_hunks(original, [_hunk(_lines("end"), _lines("END"))], path="f")
    result = apply_hunks(original, [_hunk(_lines("end"), _lines("END"), at_eof=True)], path="f")
    assert result.content == _text("end", "middle", "END")
    with pytest.raises(ContextNotFound, match="at end of file"):
        apply_hunks(original, [_hunk(_lines("middle"), _lines("M"), at_eof=True)], path="f")


# --------------------------------------------------------------------------- insertion


def test_pure_insertion_with_line_numbers() -> None:
    original = _text("a", "b")
    top = apply_hunks(original, [_hunk((), _lines("x"), old_start=0)], path="f")
    assert top.content == _text("x", "a", "b")
    after_one = apply_hunks(original, [_hunk((), _lines("x"), old_start=1)], path="f")
    assert after_one.content == _text("a", "x", "b")
    with pytest.raises(ContextNotFound, match="outside the file"):
        apply_hunks(original, [_hunk((), _lines("x"), old_start=7)], path="f")


def test_pure_insertion_without_line_numbers_goes_to_the_end_or_after_scope() -> None:
    original = _text("a", "def f():", "b")
    assert apply_hunks(
        original, [_hunk((), (b"x",), eol_agnostic=True)], path="f"
    ).content == _text("a", "def f():", "b", "x")
    scoped = _hunk((), (b"x",), scopes=(b"def f():",), eol_agnostic=True)
    assert apply_hunks(original, [scoped], path="f").content == _text("a", "def f():", "x", "b")


def test_insertion_after_unterminated_last_line_does_not_glue_lines() -> None:
    result = apply_hunks(b"a\nb", [_hunk((), (b"c\n",), old_start=2)], path="f")
    assert result.content == b"a\nb\nc\n"
    agnostic = apply_hunks(b"a\r\nb", [_hunk((), (b"c",), eol_agnostic=True)], path="f")
    assert agnostic.content == b"a\r\nb\r\nc"


# --------------------------------------------------------------------------- line endings


def test_eol_agnostic_hunk_on_crlf_file_stays_crlf() -> None:
    original = _text("one", "two", "three", eol="\r\n")
    hunk = _hunk((b"one", b"two", b"three"), (b"one", b"2", b"2.5", b"three"), eol_agnostic=True)
    result = apply_hunks(original, [hunk], path="f")
    assert result.grades == ("exact",)
    assert result.content == _text("one", "2", "2.5", "three", eol="\r\n")


def test_eol_agnostic_context_keeps_file_bytes_in_mixed_file() -> None:
    original = b"a\nb\r\nc\r\n"
    hunk = _hunk((b"a", b"b"), (b"a", b"B"), eol_agnostic=True)
    assert apply_hunks(original, [hunk], path="f").content == b"a\nB\r\nc\r\n"


def test_eol_agnostic_keeps_missing_final_newline() -> None:
    hunk = _hunk((b"a", b"last"), (b"a", b"LAST"), eol_agnostic=True)
    assert apply_hunks(b"a\nlast", [hunk], path="f").content == b"a\nLAST"
    assert apply_hunks(b"a\nlast\n", [hunk], path="f").content == b"a\nLAST\n"


def test_no_newline_hunk_from_unified_diff_preserved() -> None:
    hunk = _hunk((b"x\n", b"end"), (b"x\n", b"END"), old_start=1)
    assert apply_hunks(b"x\nend", [hunk], path="f").content == b"x\nEND"
    # the same hunk does not claim a final newline the file has
    add_newline = _hunk((b"end",), (b"end\n",), old_start=2)
    assert apply_hunks(b"x\nend", [add_newline], path="f").content == b"x\nend\n"


def test_lf_patch_on_crlf_file_writes_crlf() -> None:
    original = _text("a", "b", "c", eol="\r\n")
    hunk = _hunk(_lines("a", "b", "c"), _lines("a", "B", "c"), old_start=1)
    result = apply_hunks(original, [hunk], path="f")
    assert result.grades == ("rstrip",)
    assert result.content == _text("a", "B", "c", eol="\r\n")


def test_crlf_patch_bytes_are_kept_exactly() -> None:
    original = b"a\r\nb\r\n"
    hunk = _hunk((b"a\r\n", b"b\r\n"), (b"a\r\n", b"b\n"), old_start=1)
    assert apply_hunks(original, [hunk], path="f").content == b"a\r\nb\n"


# --------------------------------------------------------------------------- already applied


TWO_HUNKS = [
    _hunk(_lines("line 1", "line 2", "line 3"), _lines("line 1", "TWO", "line 3"), old_start=1),
    _hunk(
        _lines("line 14", "line 15", "line 16"),
        _lines("line 14", "FIFTEEN", "line 16"),
        old_start=14,
    ),
]


def test_reapplying_is_detected_as_already_applied() -> None:
    first = apply_hunks(_text(*NUMBERS), TWO_HUNKS, path="f")
    again = apply_hunks(first.content, TWO_HUNKS, path="f")
    assert again.already_applied and again.content == first.content
    assert again.grades == ("exact", "exact")


def test_whitespace_change_reapplied_is_already_applied() -> None:
    hunk = _hunk((b"a\n", b"  x\n", b"b\n"), (b"a\n", b"    x\n", b"b\n"), old_start=1)
    first = apply_hunks(b"a\n  x\nb\n", [hunk], path="f")
    assert first.content == b"a\n    x\nb\n"
    again = apply_hunks(first.content, [hunk], path="f")
    assert again.already_applied


def test_partially_applied_names_the_hunks() -> None:
    half = apply_hunks(_text(*NUMBERS), TWO_HUNKS[:1], path="f").content
    with pytest.raises(PartiallyApplied) as info:
        apply_hunks(half, TWO_HUNKS, path="f")
    assert info.value.details == {"path": "f", "applied_hunks": [1], "missing_hunks": [2]}
    assert info.value.error_type == "partially_applied"


def test_context_free_insertion_is_never_judged_present() -> None:
    insert = _hunk((), _lines("x"), old_start=0)
    once = apply_hunks(_text("a"), [insert], path="f").content
    assert apply_hunks(once, [insert], path="f").content == _text("x", "x", "a")
    change = _hunk(_lines("a"), _lines("A"), old_start=1)
    done = apply_hunks(_text("a"), [insert, change], path="f").content
    with pytest.raises(PartiallyApplied) as info:
        apply_hunks(done, [insert, change], path="f")
    assert info.value.details["applied_hunks"] == [2]
    assert info.value.details["missing_hunks"] == [1]


# --------------------------------------------------------------------------- error details


def test_context_not_found_details() -> None:
    original = _text(*NUMBERS)
    hunks = [
        TWO_HUNKS[0],
        _hunk(
            _lines("line 10", "line eleven", "line 12", "line 13"),
            _lines("line 10", "line 11b", "line 12", "line 13"),
            old_start=10,
            header="@@ -10,4 +10,4 @@ section",
        ),
    ]
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(original, hunks, path="src/x.py")
    err = info.value
    assert err.message == (
        "hunk 2 of 'src/x.py' does not apply: context not found (tried exact, rstrip, strip, punct)"
    )
    d = err.details
    assert d["path"] == "src/x.py" and d["hunk"] == 2
    assert d["hunk_header"] == "@@ -10,4 +10,4 @@ section"
    assert d["expected"] == "line 10\nline eleven\nline 12"
    assert d["grade_tried"] == ["exact", "rstrip", "strip", "punct"]
    closest = d["closest"]
    assert closest["line"] == 10
    assert closest["lines"] == [f"line {i}" for i in range(10, 16)]
    assert closest["diff"] == [" line 10", "-line eleven", "+line 11", " line 12", " line 13"]
    assert err.envelope()["type"] == "context_not_found"


def test_closest_tie_goes_to_the_stated_position() -> None:
    original = _text("k", "a", "k", "b", "k", "c", "k")
    hunk = _hunk(_lines("k", "zz"), _lines("k", "yy"), old_start=5)
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(original, [hunk], path="f")
    assert info.value.details["closest"]["line"] == 5


def test_closest_is_none_when_nothing_is_shared() -> None:
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(_text("a"), [_hunk(_lines("q"), _lines("r"))], path="f")
    assert info.value.details["closest"] is None


# --------------------------------------------------------------------------- property


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.sampled_from(["a", "b", "c", "", "  a", "x y"]), min_size=0, max_size=30),
    data=st.data(),
)
def test_single_region_replacement_applies_back(lines: list[str], data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(lines)))
    end = data.draw(st.integers(start, len(lines)))
    replacement = data.draw(st.lists(st.sampled_from(["a", "b", "new", ""]), max_size=5))
    before, old_mid, after = lines[:start], lines[start:end], lines[end:]
    ctx_before, ctx_after = before[-3:], after[:3]
    old = _lines(*ctx_before, *old_mid, *ctx_after)
    new = _lines(*ctx_before, *replacement, *ctx_after)
    old_start = len(before) - len(ctx_before) + 1 if old else len(before)
    hunk = _hunk(old, new, old_start=old_start)
    result = apply_hunks(_text(*lines), [hunk], path="f")
    assert result.content == _text(*before, *replacement, *after)


def test_a_hunk_out_of_file_order_is_named_as_such() -> None:
    """Hunks are matched in order: one whose context lies before the previous match says so."""
    late = _hunk(_lines("line 15", "line 16"), _lines("line 15", "sixteen"), old_start=15)
    early = _hunk(_lines("line 3", "line 4"), _lines("line 3", "four"), old_start=3)
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(_text(*NUMBERS), [late, early], path="f")
    assert info.value.details["found_before_previous_hunk"] == 3
    assert "file order" in info.value.message


# --------------------------------------------------------------------------- bounded work
# Each was quadratic before (95-150 s for the first): they must finish, and spend a number of
# steps that grows with the input, not with its square.

_A_FILE = b"a\n" * 50_000
_NEAR_MISS = (b"a\n",) * 19_999 + (b"b\n",)  # 20k lines, only the last differs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("old_start", [None, 7])
def test_a_near_miss_of_repeated_lines_is_searched_in_linear_work(old_start: int | None) -> None:
    from patcher.budget import WorkBudget

    budget = WorkBudget()
    with pytest.raises(ContextNotFound) as info:
        apply_hunks(_A_FILE, [_hunk(_NEAR_MISS, (b"c\n",), old_start=old_start)], path="f", budget=budget)
    assert budget.spent < 200 * (50_000 + 20_000), budget.spent
    assert info.value.details["closest"] is not None  # a hint still, from the rarer lines or the stated one


@pytest.mark.timeout(60)
def test_a_match_at_every_position_is_found_in_linear_work() -> None:
    """At ``rstrip`` every start matches: all 30,001 of them, listed in the error as 20 and a count."""
    from patcher.budget import WorkBudget

    budget = WorkBudget()
    hunk = _hunk((b"a \n",) * 20_000, (b"c\n",))
    with pytest.raises(AmbiguousMatch) as info:
        apply_hunks(_A_FILE, [hunk], path="f", budget=budget)
    details = info.value.details
    assert details["candidates"] == list(range(1, 21)) and details["candidate_count"] == 30_001
    assert len(info.value.message) < 400
    assert budget.spent < 200 * (50_000 + 20_000), budget.spent


@pytest.mark.timeout(60)
def test_scopes_found_everywhere_are_resolved_in_linear_work() -> None:
    """A first scope line on 30,000 lines, each followed by the second one only at the end."""
    from patcher.budget import WorkBudget

    budget = WorkBudget()
    data = b"def f():\n" * 30_000 + b"class C:\n" + b"x = 1\n"
    hunk = _hunk((b"x = 1\n",), (b"x = 2\n",), scopes=(b"def f():\n", b"class C:\n"))
    out = apply_hunks(data, [hunk], path="f", budget=budget)  # every 'def f():' leads to one place
    assert out.content.endswith(b"class C:\nx = 2\n")
    assert budget.spent < 200 * 30_000, budget.spent


@pytest.mark.timeout(60)
def test_many_hunks_without_line_numbers_cost_what_the_file_does() -> None:
    from patcher.budget import WorkBudget

    lines = [f"line {i}\n".encode() for i in range(50_000)]
    hunks = [_hunk((lines[i],), (lines[i].upper(),)) for i in range(0, 50_000, 10)]
    budget = WorkBudget()
    out = apply_hunks(b"".join(lines), hunks, path="f", budget=budget)
    assert out.content.count(b"LINE") == 5000
    assert budget.spent < 100 * 50_000, budget.spent


def test_work_over_the_budget_is_too_large() -> None:
    from patcher.budget import WorkBudget
    from patcher.errors import TooLarge

    data = _text(*NUMBERS)
    hunk = _hunk(_lines("line 5 "), _lines("five"))  # found at rstrip: every grade's keys made
    assert apply_hunks(data, [hunk], path="f", budget=WorkBudget(10_000)).content.count(b"five") == 1
    with pytest.raises(TooLarge) as info:
        apply_hunks(data, [hunk], path="f", budget=WorkBudget(50))
    assert info.value.details == {"path": "f", "limit": 50, "reason": "work"}


@pytest.mark.timeout(60)
def test_an_ambiguous_old_side_is_checked_for_its_new_side_in_linear_work() -> None:
    """Found at every line at ``rstrip``, its new side is looked for at each place: one search, not 30,000."""
    from patcher.budget import WorkBudget

    budget = WorkBudget()
    hunk = _hunk((b"a \n",) * 19_999 + (b"a \n",), (b"a \n",) * 19_999 + (b"c\n",))
    with pytest.raises(AmbiguousMatch) as info:
        apply_hunks(_A_FILE, [hunk], path="f", budget=budget)
    assert info.value.details["candidate_count"] == 30_001
    assert budget.spent < 200 * (50_000 + 20_000), budget.spent

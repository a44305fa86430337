"""Line endings by position, and envelope chunks out of file order (issue 24; docs/FORMATS.md).

A kept line keeps its own bytes; a line that replaces a removed line takes
that line's ending; an inserted line takes the ending of the line before it
(after it at the start of a file).
"""

from __future__ import annotations

import pytest

from patcher.errors import ContextNotFound
from patcher.formats.envelope import parse_envelope
from patcher.matching import apply_hunks


def run(original: bytes, body: str) -> bytes:
    patch = parse_envelope(f"*** Begin Patch\n*** Update File: f.txt\n{body}*** End Patch\n".encode())
    return apply_hunks(original, patch.edits[0].hunks, path="f.txt").content


def test_a_kept_line_is_the_one_at_its_position() -> None:
    # '-same' then ' same': the kept line is the second one, with its LF (paired by content,
    # the first 'same' and its CRLF were kept).
    assert run(b"same\r\nsame\n", "@@\n-same\n same\n") == b"same\n"
    assert run(b"same\r\nsame\n", "@@\n same\n-same\n") == b"same\r\n"


def test_a_replacing_line_takes_the_ending_of_the_line_it_replaces() -> None:
    mixed = b"one\r\ntwo\nthree\r\nfour\n"
    assert run(mixed, "@@\n one\n two\n-three\n+THREE\n four\n") == b"one\r\ntwo\nTHREE\r\nfour\n"
    assert run(mixed, "@@\n-two\n+TWO\n three\n") == b"one\r\nTWO\nthree\r\nfour\n"


def test_an_inserted_line_takes_the_ending_of_the_line_before_it() -> None:
    mixed = b"one\r\ntwo\nthree\r\n"
    assert run(mixed, "@@\n two\n+after two\n three\n") == b"one\r\ntwo\nafter two\nthree\r\n"
    assert run(mixed, "@@\n one\n+after one\n two\n") == b"one\r\nafter one\r\ntwo\nthree\r\n"
    # two replacing one: the first takes the removed line's ending, the second the one before it
    assert run(mixed, "@@\n-two\n+2a\n+2b\n three\n") == b"one\r\n2a\n2b\nthree\r\n"


def test_at_the_start_of_a_file_an_inserted_line_takes_the_ending_after_it() -> None:
    assert run(b"one\r\ntwo\n", "@@\n+zero\n one\n") == b"zero\r\none\r\ntwo\n"


def test_a_pure_addition_chunk_before_a_chunk_of_earlier_lines() -> None:
    # codex's test_pure_addition_chunk_followed_by_removal: the addition goes to the end of
    # the file; the next chunk's lines are before it.
    got = run(b"line1\nline2\nline3\n",
              "@@\n+after-context\n+second-line\n@@\n line1\n-line2\n-line3\n+line2-replacement\n")
    assert got == b"line1\nline2-replacement\nafter-context\nsecond-line\n"


def test_out_of_order_chunks_that_overlap_are_refused() -> None:
    with pytest.raises(ContextNotFound):
        run(b"a\nb\nc\nd\n", "@@\n b\n-c\n+C\n@@\n-b\n+B\n")


def test_a_lone_cr_is_a_line_break_where_the_file_uses_one() -> None:
    # codex's fixture 024: 'two\rthree' is two lines for it; the lines as git reads them
    # (split at LF) hold no line 'two', so they are read again, split at the lone CR too.
    got = run(b"one\r\ntwo\rthree\nfour\r\n", "@@\n one\n two\n-three\n+THREE\n four\n")
    assert got == b"one\r\ntwo\rTHREE\nfour\r\n"  # THREE takes the ending of 'three' it replaces
    # an inserted line after a line ended by a lone CR takes that CR
    assert run(b"a\rb\n", "@@\n a\n+x\n b\n") == b"a\rx\rb\n"
    # a file whose lone CR is no line break of the hunk: matched as git reads it
    assert run(b"progress 10%\r20%\nnext\n", "@@\n-next\n+NEXT\n") == b"progress 10%\r20%\nNEXT\n"


def test_a_lone_cr_does_not_make_a_missing_context_found() -> None:
    with pytest.raises(ContextNotFound):
        run(b"a\rb\n", "@@\n-c\n+C\n")

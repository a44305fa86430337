"""Property tests (hypothesis) across formats.

1. Random file, random edits → the change written in every format → applying
   it reproduces the edited file byte for byte (CRLF, missing final newline,
   repeated lines included).
2. A block of lines placed among shuffled unrelated lines (which may repeat
   it): an edit of that block either lands exactly there, or -- when the
   block's lines occur more than once -- is refused as ambiguous.  Never a
   match at another place.
"""

from __future__ import annotations

import base64
import json

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.convert import make_unified, unified_to_envelope
from patcher.formats.editblocks import apply_sequential, parse_search_replace, parse_str_replace
from patcher.formats.envelope import parse_envelope
from patcher.errors import AmbiguousMatch
from patcher.matching import apply_hunks
from patcher.model import Hunk
from patcher.formats.unified import parse_unified
from patcher.formats.wholefile import parse_whole_file

ALPHABET = ["a", "b", "c", "", "  a", "a  ", "x = 1", "}", "caf\u00e9", "\u201cq\u201d"]
line = st.sampled_from(ALPHABET)
settings.register_profile("formats", max_examples=150, deadline=None)


@st.composite
def file_and_edit(draw: st.DrawFn, *, same_final_newline: bool = False) -> tuple[bytes, bytes]:
    old = draw(st.lists(line, min_size=1, max_size=30))
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    final = draw(st.booleans())
    new = list(old)
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(new)))
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        if op == "insert" or i == len(new):
            new.insert(i, draw(line) + draw(st.sampled_from(["", "!", " new"])))
        elif op == "replace":
            new[i] = draw(line) + "!"
        elif len(new) > 1:
            del new[i]
    new_final = final if same_final_newline else draw(st.booleans())
    if len(old) == 1 and not final:
        eol = "\n"  # a file with no line ending at all is LF to the matcher
    old_b = (eol.join(old) + (eol if final else "")).encode()
    new_b = (eol.join(new) + (eol if new_final else "")).encode()
    assume(old_b != new_b)
    if same_final_newline:  # (a last "" line makes a final newline of its own)
        assume(old_b.endswith(b"\n") == new_b.endswith(b"\n"))
    return old_b, new_b


def _blocks_of(old: bytes, new: bytes) -> list[tuple[tuple[bytes, ...], tuple[bytes, ...]]] | None:
    """Edit blocks for old → new: the unified hunks with as little context as keeps them unique in turn."""
    for context in (3, 8, 20, 10**6):
        hunks = parse_unified(make_unified("f", old, new, context=context)).edits[0].hunks
        pairs = [(tuple(x.rstrip(b"\r\n") for x in h.old_lines), tuple(x.rstrip(b"\r\n") for x in h.new_lines))
                 for h in hunks]
        try:
            result = apply_sequential(old, [Hunk(o, n, eol_agnostic=True) for o, n in pairs], path="f")
        except AmbiguousMatch:
            continue
        assert result.content == new
        return pairs
    return None


@settings(settings.get_profile("formats"))
@given(file_and_edit())
def test_unified_and_envelope_reproduce_the_edit(case: tuple[bytes, bytes]) -> None:
    old, new = case
    diff = make_unified("f.txt", old, new)
    assert apply_hunks(old, parse_unified(diff).edits[0].hunks, path="f.txt").content == new
    envelope = unified_to_envelope(diff, read_old=lambda path: old).text
    edit = parse_envelope(envelope).edits[0]
    assert apply_hunks(old, edit.hunks, path="f.txt").content == new


@settings(settings.get_profile("formats"))
@given(file_and_edit(same_final_newline=True))
def test_edit_blocks_and_str_replace_reproduce_the_edit(case: tuple[bytes, bytes]) -> None:
    old, new = case
    assume(any(x.strip() for x in old.split(b"\n")))
    pairs = _blocks_of(old, new)
    assert pairs is not None
    text = b"".join(b"f.txt\n<<<<<<< SEARCH\n" + b"".join(x + b"\n" for x in o) + b"=======\n"
                    + b"".join(x + b"\n" for x in n) + b">>>>>>> REPLACE\n" for o, n in pairs)
    edit = parse_search_replace(text).edits[0]
    assert apply_sequential(old, edit.hunks, path="f.txt").content == new
    items = [{"path": "f.txt", "old": b"".join(x + b"\n" for x in o).decode(),
              "new": b"".join(x + b"\n" for x in n).decode()} for o, n in pairs]
    if all(item["old"] for item in items):
        edit = parse_str_replace(json.dumps(items).encode()).edits[0]
        assert apply_sequential(old, edit.hunks, path="f.txt").content == new


@settings(settings.get_profile("formats"))
@given(file_and_edit())
def test_whole_file_reproduces_the_edit(case: tuple[bytes, bytes]) -> None:
    _, new = case
    doc = json.dumps([{"path": "f.txt", "content_b64": base64.b64encode(new).decode()}]).encode()
    assert parse_whole_file(doc).edits[0].content == new


# --------------------------------------------------------------------------- never a wrong place


CLEAN = [x for x in ALPHABET if x == x.rstrip()]  # drift below is the only trailing whitespace


@st.composite
def block_among_noise(draw: st.DrawFn) -> tuple[list[str], int, list[str], list[str], str]:
    block = draw(st.lists(st.sampled_from(CLEAN), min_size=1, max_size=3))
    replacement = draw(st.lists(st.sampled_from(["NEW", "NEWER", ""]), min_size=0, max_size=3))
    assume(block != replacement)
    noise = draw(st.lists(st.sampled_from(CLEAN[:5]), max_size=25))
    noise = draw(st.permutations(noise))
    at = draw(st.integers(0, len(noise)))
    lines = noise[:at] + block + noise[at:]
    drift = draw(st.sampled_from(["", "  ", "\t"]))  # the same trailing whitespace on every file line
    return lines, at, block, replacement, drift


def _occurrences(lines: list[str], block: list[str]) -> int:
    keys = [x.rstrip() for x in lines]
    want = [x.rstrip() for x in block]
    return sum(keys[i:i + len(want)] == want for i in range(len(keys) - len(want) + 1))


def _check_placement(apply: object, lines: list[str], at: int, block: list[str], replacement: list[str],
                     drift: str) -> None:
    original = "".join(x + drift + "\n" for x in lines).encode()
    expected_lines = lines[:at] + replacement + lines[at + len(block):]
    count = _occurrences(lines, block)
    try:
        result = apply(original)  # type: ignore[operator]
    except AmbiguousMatch:
        assert count > 1, "refused as ambiguous although the block occurs once"
        return
    assert count == 1, f"block occurs {count} times but was applied"
    got = [x.rstrip(" \t") for x in result.content.decode().split("\n")[:-1]]
    assert got == [x.rstrip(" \t") for x in expected_lines]


@settings(settings.get_profile("formats"))
@given(block_among_noise())
def test_envelope_hunk_lands_at_its_block_or_is_ambiguous(case: tuple[list[str], int, list[str], list[str], str]) -> None:
    lines, at, block, replacement, drift = case
    text = ("*** Begin Patch\n*** Update File: f\n@@\n" + "".join(f"-{x}\n" for x in block)
            + "".join(f"+{x}\n" for x in replacement) + "*** End Patch\n").encode()
    hunks = parse_envelope(text).edits[0].hunks
    _check_placement(lambda data: apply_hunks(data, hunks, path="f"), lines, at, block, replacement, drift)


@settings(settings.get_profile("formats"))
@given(block_among_noise())
def test_edit_block_lands_at_its_block_or_is_ambiguous(case: tuple[list[str], int, list[str], list[str], str]) -> None:
    lines, at, block, replacement, drift = case
    text = ("f\n<<<<<<< SEARCH\n" + "".join(f"{x}\n" for x in block) + "=======\n"
            + "".join(f"{x}\n" for x in replacement) + ">>>>>>> REPLACE\n").encode()
    hunks = parse_search_replace(text).edits[0].hunks
    assume(any(x.strip() for x in block))  # an all-blank SEARCH is a different question (substring rules)
    _check_placement(lambda data: apply_sequential(data, hunks, path="f"), lines, at, block, replacement, drift)

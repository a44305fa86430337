"""Whole-file JSON writes and deletes (pure parsing; staging rules are in the conformance suite)."""

from __future__ import annotations

import base64
import json

import pytest

from patcher.errors import ParseError
from patcher.formats import get_format
from patcher.model import MODE_EXEC, MODE_FILE, FileEdit
from patcher.formats.wholefile import looks_whole_file, parse_whole_file


def parse(items: object) -> tuple[FileEdit, ...]:
    return parse_whole_file(json.dumps(items).encode()).edits


def test_writes_deletes_and_modes() -> None:
    edits = parse([
        {"path": "a.txt", "content": "caf\u00e9\r\n"},
        {"path": "bin", "content_b64": base64.b64encode(b"\x00\xff").decode(), "mode": "100755"},
        {"path": "c", "content": "", "mode": 0o644},
        {"path": "gone", "delete": True},
    ])
    assert edits == (
        FileEdit(op="modify", path="a.txt", content="caf\u00e9\r\n".encode()),
        FileEdit(op="modify", path="bin", content=b"\x00\xff", new_mode=MODE_EXEC),
        FileEdit(op="modify", path="c", content=b"", new_mode=MODE_FILE),
        FileEdit(op="delete", path="gone"),
    )
    assert parse({"path": "one", "content": "x"})[0].content == b"x"


def test_the_format_creates_missing_files_and_matches_nothing() -> None:
    fmt = get_format("whole_file")
    assert fmt is not None and fmt.writes_create and fmt.apply_file is None


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ([{"path": "a", "contents": "x"}], "unknown key"),
        ([{"path": "a"}], "exactly one of"),
        ([{"path": "a", "content": "x", "delete": True}], "exactly one of"),
        ([{"path": "a", "delete": False}], "'delete' must be true"),
        ([{"path": "a", "delete": True, "mode": "100644"}], "'mode' makes no sense"),
        ([{"path": "a", "content": 1}], "'content' must be a string"),
        ([{"path": "a", "content_b64": "not base64!"}], "not valid base64"),
        ([{"path": "a", "content": "x", "mode": "120000"}], "'mode' must be"),
        ([{"path": "a", "content": "x", "mode": True}], "'mode' must be"),
        ([{"path": 3, "content": "x"}], "'path' must be a string"),
        ([{"path": "a", "content": "x"}, {"path": "a", "delete": True}], "also item 1"),
        ([], "expected a JSON list"),
    ],
)
def test_refusals_name_the_item(items: object, words: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_whole_file(json.dumps(items).encode())
    assert words in info.value.message


def test_looks_needs_path_and_a_whole_file_key_and_no_edit_key() -> None:
    assert looks_whole_file(b' [{"path": "a", "delete": true}]')
    assert not looks_whole_file(b'[{"path": "a", "content": "x", "old": "y"}]')
    assert not looks_whole_file(b'[{"path": "a"}]')
    assert not looks_whole_file(b'{"path": "a", "content": ')  # not JSON
    assert not looks_whole_file(b"[1, 2]")

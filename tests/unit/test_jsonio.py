"""receipts.jsonio: orjson's bytes are the ones json.dumps gives for receipt values, so receipts keep their bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from receipts import jsonio
from receipts.canonical import MAX_SAFE_INT, canonical_json

text = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-MAX_SAFE_INT, MAX_SAFE_INT) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_compact_bytes_are_json_dumps_bytes(value: object) -> None:
    expected = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    assert jsonio.dumps(value) == expected
    assert jsonio.loads(expected) == json.loads(expected)


@settings(max_examples=300, deadline=None)
@given(values)
def test_indented_bytes_are_json_dumps_bytes(value: object) -> None:
    expected = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False).encode("utf-8")
    assert jsonio.dumps_pretty(value) == expected  # a receipt file, without its newline


def test_control_characters_escape_as_rfc8785_does() -> None:
    s = "".join(chr(c) for c in range(0x20)) + '"\\\x7f\u2028\ue000\U0001f600'
    assert jsonio.dumps(s) == json.dumps(s, ensure_ascii=False).encode("utf-8")
    assert canonical_json({"k": s}) == b'{"k":' + json.dumps(s, ensure_ascii=False).encode("utf-8") + b"}"


def test_what_json_cannot_carry_is_refused() -> None:  # NaN is refused earlier, by canonical.normalise
    with pytest.raises(jsonio.JsonError):
        jsonio.dumps("\ud800")
    with pytest.raises(jsonio.JsonError):
        jsonio.dumps({"x": object()})
    with pytest.raises(jsonio.JsonError):
        jsonio.loads(b'{"x": NaN}')
    with pytest.raises(jsonio.JsonError):
        jsonio.loads(b"{not json")
    assert jsonio.loads(' [1, {"a": null}] ') == [1, {"a": None}]

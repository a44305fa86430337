"""Both JSON backends give the same bytes for receipt values (so a replay may skip orjson)."""

from __future__ import annotations

import sys

import orjson
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
def test_stdlib_backend_gives_orjsons_bytes(value: object) -> None:
    expected = orjson.dumps(value)
    saved = sys.modules.pop("orjson")
    try:
        assert jsonio.dumps(value) == expected
        assert jsonio.loads(expected) == orjson.loads(expected)
    finally:
        sys.modules["orjson"] = saved


@settings(max_examples=300, deadline=None)
@given(values)
def test_stdlib_backend_gives_orjsons_indented_bytes(value: object) -> None:
    expected = orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    assert jsonio.dumps_pretty(value) == expected
    saved = sys.modules.pop("orjson")
    try:
        assert jsonio.dumps_pretty(value) == expected  # a receipt file is the same bytes without orjson
    finally:
        sys.modules["orjson"] = saved


def test_control_characters_escape_the_same() -> None:
    s = "".join(chr(c) for c in range(0x20)) + '"\\\x7f\u2028\ue000\U0001f600'
    saved = sys.modules.pop("orjson")
    try:
        slow = jsonio.dumps(s)
        slow_canonical = canonical_json({"k": s})
    finally:
        sys.modules["orjson"] = saved
    assert slow == orjson.dumps(s)
    assert slow_canonical == canonical_json({"k": s})


@pytest.mark.parametrize("with_orjson", [True, False])
def test_both_refuse_what_json_cannot_carry(  # NaN is refused earlier, by canonical.normalise
    with_orjson: bool) -> None:
    saved = None if with_orjson else sys.modules.pop("orjson")
    try:
        with pytest.raises(jsonio.JsonError):
            jsonio.dumps("\ud800")
        with pytest.raises(jsonio.JsonError):
            jsonio.loads(b'{"x": NaN}')
        with pytest.raises(jsonio.JsonError):
            jsonio.loads(b"{not json")
    finally:
        if saved is not None:
            sys.modules["orjson"] = saved


# -- without orjson, loads reads through _json exactly as json.loads does -------------------------

_JSON_PIECES = ["{", "}", "[", "]", ",", ":", '"', '"a"', '"\\u00e9"', '"\\ud800"', "\\", "1", "-0", "1.5e3", "NaN",
                "Infinity", "-Infinity", "true", "null", " ", "\t", "\n", "\r", "\x0b", "\ufeff", "é", "\x00", "x"]
_json_texts = st.lists(st.sampled_from(_JSON_PIECES), max_size=10).map("".join)


def _stdlib(data: bytes | str) -> tuple[str, object]:
    import json

    def refuse(name: str) -> object:
        raise ValueError(name)

    try:
        return "value", json.loads(data, parse_constant=refuse)
    except ValueError:  # (UnicodeDecodeError and JSONDecodeError too)
        return "error", None


def _ours(data: bytes | str) -> tuple[str, object]:
    saved = sys.modules.pop("orjson")
    try:
        return "value", jsonio.loads(data)
    except jsonio.JsonError:
        return "error", None
    finally:
        sys.modules["orjson"] = saved


@settings(max_examples=2000, deadline=None)
@given(_json_texts, st.sampled_from(["str", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32"]))
def test_loads_without_orjson_is_json_loads(text: str, encoding: str) -> None:
    data: bytes | str = text
    if encoding != "str":
        try:
            data = text.encode(encoding)
        except UnicodeEncodeError:
            data = text.encode(encoding, "surrogatepass")
    assert _ours(data) == _stdlib(data)


def test_loads_without_orjson_or_json_loaded_reports_the_scanners_error() -> None:
    """The C scanner raises json's error class, which it finds only once json.decoder is loaded."""
    import subprocess

    probe = ("import sys\nfrom receipts import jsonio\n"
             "print(jsonio.loads(b' [1, {\"a\": null}] '), jsonio.dumps({'b': [True]}).decode())\n"
             "print(sorted(m for m in ('orjson', 'json', 're') if m in sys.modules))\n"
             "try:\n    jsonio.loads(b'{not json')\nexcept jsonio.JsonError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[1, {'a': None}] {\"b\":[true]}", "[]",
                                "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"]

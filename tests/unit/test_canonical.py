"""receipts.canonical: RFC 8785 on a restricted profile (pure, no disk)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from receipts.canonical import MAX_SAFE_INT, canonical_json, normalise
from receipts.errors import CanonicalJsonError

# -- RFC 8785 examples that fit the profile (no floats) ---------------------------


def test_rfc8785_section_3_2_2_example_without_numbers() -> None:
    # RFC 8785 3.2.2 input, minus the "numbers" member (floats are outside the profile).
    source = r'''{
      "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
      "literals": [null, true, false]
    }'''
    expected = '{"literals":[null,true,false],"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    assert canonical_json(json.loads(source)) == expected.encode("utf-8")


def test_rfc8785_section_3_2_3_sorting_example() -> None:
    # RFC 8785 3.2.3: keys sort by UTF-16 code units, so the emoji (a surrogate
    # pair, 0xD83D...) sorts *before* U+FB33 although its code point is larger.
    source = r'''{
      "\u20ac": "Euro Sign",
      "\r": "Carriage Return",
      "\ufb33": "Hebrew Letter Dalet With Dagesh",
      "1": "One",
      "\ud83d\ude00": "Emoji: Grinning Face",
      "\u0080": "Control",
      "\u00f6": "Latin Small Letter O With Diaeresis"
    }'''
    out = canonical_json(json.loads(source)).decode("utf-8")
    keys = list(json.loads(out))
    assert keys == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]
    assert out.startswith('{"\\r":"Carriage Return","1":"One","\u0080":"Control"')


@pytest.mark.parametrize("bmp", ["\ue000", "\uf8ff", "\ufb33", "\uffef", "\uffff"])
def test_non_bmp_key_sorts_before_high_bmp_keys(bmp: str) -> None:
    astral = "\U00010000"  # code point above, UTF-16 0xD800 0xDC00 below U+E000..U+FFFF
    out = canonical_json({bmp: 1, astral: 2})
    assert list(json.loads(out)) == [astral, bmp]
    # Python's own code-point order would be the reverse: the profile is not sorted()
    assert sorted([bmp, astral]) == [bmp, astral]


def test_literals_and_integers() -> None:
    assert canonical_json([None, True, False, 0, -1, 10**15]) == b"[null,true,false,0,-1,1000000000000000]"


# -- shape -------------------------------------------------------------------------


def test_keys_sorted_recursively_and_no_whitespace() -> None:
    value = {"b": {"z": 1, "a": [3, {"y": None, "x": "s p"}]}, "a": [], "c": {}}
    assert canonical_json(value) == b'{"a":[],"b":{"a":[3,{"x":"s p","y":null}],"z":1},"c":{}}'


def test_insertion_order_does_not_matter() -> None:
    a = {"x": 1, "y": 2, "nested": {"p": 1, "q": 2}}
    b = {"nested": {"q": 2, "p": 1}, "y": 2, "x": 1}
    assert canonical_json(a) == canonical_json(b)


def test_tuples_are_arrays() -> None:
    assert canonical_json({"t": (1, "a", (True,))}) == b'{"t":[1,"a",[true]]}'


def test_utf8_output_without_escaping_non_ascii() -> None:
    assert canonical_json("café ✓ \U0001f600") == '"café ✓ \U0001f600"'.encode("utf-8")


def test_normalise_returns_sorted_plain_structure() -> None:
    got = normalise({"b": (1, 2), "a": {"d": 1, "c": 2}})
    assert list(got) == ["a", "b"] and list(got["a"]) == ["c", "d"] and got["b"] == [1, 2]


# -- string escapes (RFC 8785 3.2.2.2) ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "encoded"),
    [
        ("\x1f", '"\\u001f"'),
        ("\x00", '"\\u0000"'),
        ("\x0f", '"\\u000f"'),  # lower-case hex
        ("\x0b", '"\\u000b"'),
        ("\n", '"\\n"'),
        ("\r", '"\\r"'),
        ("\t", '"\\t"'),
        ("\b", '"\\b"'),
        ("\f", '"\\f"'),
        ('"', '"\\""'),
        ("\\", '"\\\\"'),
        ("/", '"/"'),  # not escaped
        ("\x7f", '"\x7f"'),  # DEL is not a JSON control: as is
        ("\u2028", '"\u2028"'),  # as is
        ("\u00e9", '"\u00e9"'),
    ],
)
def test_escapes_match_rfc8785(text: str, encoded: str) -> None:
    assert canonical_json(text) == encoded.encode("utf-8")


# -- refused values -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [1.0, 0.5, -0.0, 1e30, float("nan"), float("inf"), float("-inf")])
def test_floats_nan_and_infinities_are_refused(bad: float) -> None:
    with pytest.raises(CanonicalJsonError) as ei:
        canonical_json({"a": [1, {"b": bad}]})
    assert "$.a[1].b" in ei.value.message
    if math.isnan(bad):
        assert "NaN" in ei.value.message


def test_integer_bounds() -> None:
    assert canonical_json(MAX_SAFE_INT) == b"9007199254740991"
    assert canonical_json(-MAX_SAFE_INT) == b"-9007199254740991"
    for bad in (MAX_SAFE_INT + 1, -MAX_SAFE_INT - 1, 2**64, -(2**70)):
        with pytest.raises(CanonicalJsonError) as ei:
            canonical_json({"n": bad})
        assert "$.n" in ei.value.message


def test_bool_is_not_an_int() -> None:
    assert canonical_json({"t": True, "f": False}) == b'{"f":false,"t":true}'


@pytest.mark.parametrize("key", [1, None, True, (1, 2), b"bytes"])
def test_non_string_keys_are_refused(key: Any) -> None:
    with pytest.raises(CanonicalJsonError):
        canonical_json({"ok": 1, key: 2})


@pytest.mark.parametrize("value", [b"bytes", {1, 2}, object(), 1j, bytearray(b"x")])
def test_other_types_are_refused(value: Any) -> None:
    with pytest.raises(CanonicalJsonError):
        canonical_json({"v": value})


@pytest.mark.parametrize("s", ["\ud800", "a\udfffb", "\ud83d", "\ude00x"])
def test_lone_surrogates_in_values_are_refused(s: str) -> None:
    with pytest.raises(CanonicalJsonError) as ei:
        canonical_json({"v": [s]})
    assert "$.v[0]" in ei.value.message


def test_lone_surrogate_in_a_key_is_refused_as_canonical_json_error() -> None:
    with pytest.raises(CanonicalJsonError):
        canonical_json({"\ud800": 1})


def test_lone_surrogate_in_a_key_is_refused_somehow() -> None:
    with pytest.raises(Exception):  # never written
        canonical_json({"\ud800": 1})


def test_error_is_usage_class() -> None:
    err = CanonicalJsonError("x")
    assert err.exit_code == 2 and err.error_type == "invalid_args"

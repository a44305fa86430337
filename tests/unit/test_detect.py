"""`--format auto`: each format's `looks` is specific, and two that accept the input is an error."""

from __future__ import annotations

import pytest

from patcher.errors import ParseError, UnsupportedPatch
from patcher.formats import FORMATS, detect, format_names, parse_patch

SAMPLES: dict[str, bytes] = {
    "unified": b"diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n",
    "apply_patch": b"*** Begin Patch\n*** Update File: f\n@@\n-a\n+b\n*** End Patch\n",
    "search_replace": b"f\n<<<<<<< SEARCH\na\n=======\nb\n>>>>>>> REPLACE\n",
    "str_replace": b'[{"path": "f", "old": "a", "new": "b"}]',
    "whole_file": b'[{"path": "f", "content": "b\\n"}]',
}

# Inputs that carry another format's markers *inside their content*: still only one format.
NESTED: dict[str, bytes] = {
    "apply_patch": b"*** Begin Patch\n*** Add File: notes.md\n+<<<<<<< SEARCH\n+diff --git a/x b/x\n"
                   b"+>>>>>>> REPLACE\n*** End Patch\n",
    "unified": b"--- a/f\n+++ b/f\n@@ -1 +1,3 @@\n-a\n+<<<<<<< SEARCH\n+*** Begin Patch\n+>>>>>>> REPLACE\n",
    "whole_file": b'[{"path": "f", "content": "<<<<<<< SEARCH\\n=======\\n>>>>>>> REPLACE\\n*** Begin Patch\\n"}]',
    "str_replace": b'{"path": "f", "old": "diff --git a/f b/f\\n", "new": "x"}',
    "apply_patch_heredoc": b"apply_patch <<'EOF'\n*** Begin Patch\n*** Delete File: f\n*** End Patch\nEOF\n",
}


def test_every_builtin_format_is_registered() -> None:
    assert format_names() == ["apply_patch", "search_replace", "str_replace", "unified", "whole_file"]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_sample_is_accepted_by_exactly_its_format(name: str) -> None:
    accepted = [f.name for f in FORMATS.values() if f.looks(SAMPLES[name])]
    assert accepted == [name]
    assert detect(SAMPLES[name]) == name
    assert parse_patch(SAMPLES[name], name).format == name


@pytest.mark.parametrize("name", sorted(NESTED))
def test_markers_inside_content_do_not_confuse_detection(name: str) -> None:
    expected = name.removesuffix("_heredoc")
    assert detect(NESTED[name]) == expected
    parse_patch(NESTED[name], expected)


def test_two_formats_accepting_is_an_error_not_a_guess() -> None:
    both = SAMPLES["unified"] + SAMPLES["search_replace"]
    with pytest.raises(ParseError) as info:
        detect(both)
    assert info.value.details["formats"] == ["search_replace", "unified"]
    assert "--format" in info.value.message


@pytest.mark.parametrize(
    "data",
    [
        b"please change f\n",
        b'[{"path": "f", "old": "a", "content": "b"}]',  # a mix of two JSON formats
        b'{"path": "f"}',
        b"  *** Update File: f\n@@\n-a\n+b\n*** End Patch\n",  # no Begin Patch
        b"f\n<<<<<<< SEARCH\na\n=======\nb\n",  # no REPLACE line
    ],
)
def test_nothing_matches_is_an_error(data: bytes) -> None:
    with pytest.raises(ParseError) as info:
        detect(data)
    assert "cannot tell the patch format" in info.value.message


def test_detected_format_is_part_of_the_identity(tmp_path: object) -> None:
    from patcher.args import normalise_args
    from conftest import make_repo
    from pathlib import Path

    repo = make_repo(Path(str(tmp_path)) / "r")
    auto = normalise_args(str(repo.path), SAMPLES["apply_patch"], branch=None, format="auto", check=None,
                          message=None, detect=detect)
    named = normalise_args(str(repo.path), SAMPLES["apply_patch"], branch=None, format="apply_patch",
                           check=None, message=None, detect=detect)
    assert auto.as_dict() == named.as_dict() and auto.format == "apply_patch"


def test_a_combined_diff_is_detected_as_unified_and_refused_by_name() -> None:
    cc = b"diff --cc f.txt\nindex 1,2..3\n--- a/f.txt\n+++ b/f.txt\n@@@ -1,1 -1,1 +1,1 @@@\n- a\n -b\n++c\n"
    assert detect(cc) == "unified"
    with pytest.raises(UnsupportedPatch, match="combined diffs are not supported"):
        parse_patch(cc, detect(cc))


# -- the cheap checks decide exactly as the full patterns do ---------------------------------------

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from patcher.formats import detection  # noqa: E402

# Pieces the patterns look for, and what sits near them, joined in any order: the generated
# inputs reach every branch of the cheap checks (and the patterns' corners: \s, \r, heredocs).
_PIECES = [b"diff --git ", b"diff --cc ", b"diff --combined ", b"diff --", b"--- ", b"+++ ", b"@@ -", b"@@",
           b"*** Begin Patch", b"apply_patch", b"applypatch", b"<<", b"<<-", b"'EOF'", b"\"EOF", b"EOF", b"_x9",
           b"<<<<< SEARCH", b"<<<<<<< SEARCH", b"<<<<<<<<<<< SEARCH", b">>>>>>> REPLACE", b">>>>> REPLACE>",
           b"SEARCH>", b"\n", b"\r\n", b"\r", b" ", b"\t", b"\x0b", b"\x0c", b"a", b"-", b"+", b"*", b"<", b">"]
_inputs = st.lists(st.sampled_from(_PIECES), max_size=12).map(b"".join) | st.binary(max_size=40)


def _full(name: str, data: bytes) -> bool:
    import re

    source, flags = detection._PATTERNS[name]
    pattern = re.compile(source, flags)
    return (pattern.match(data) if name == "envelope" else pattern.search(data)) is not None


@settings(max_examples=3000, deadline=None)
@given(_inputs)
@example(b"x\n--- a\n+++ b\n@@ -1 +1 @@\n")
@example(b"--- a\n+++ b\n@@ -")
@example(b"--- a\n+++ b\n@@ +")
@example(b" \x0b*** Begin Patch \t\r\n")
@example(b"*** Begin Patch\r")
@example(b"apply_patch <<'EOF'\n*** Begin Patch\n")
@example(b"<<-EOF \r\n \n*** Begin Patch")
@example(b"x\n<<<<<<< SEARCH>\r\n>>>>>>> REPLACE \r\n")
def test_the_cheap_checks_decide_as_the_patterns_do(data: bytes) -> None:
    assert detection.looks_unified(data) == _full("unified", data)
    assert detection.looks_envelope(data) == _full("envelope", data)
    assert detection.looks_search_replace(data) == (_full("search", data) and _full("replace", data))

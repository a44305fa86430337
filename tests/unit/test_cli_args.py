"""A plain ``apply`` line read without argparse gives argparse's answer, and anything else goes to argparse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cas.errors import UsageError
from patcher import cli
from patcher.cli.parser import untranslated


def parsed(argv: list[str]) -> dict[str, object] | None:
    """argparse's reading of ``argv`` (``None``: it refuses the line)."""
    try:
        with untranslated():
            return vars(cli.build_parser("apply").parse_args(argv))
    except (UsageError, SystemExit):
        return None


PLAIN = [
    ["apply", "p.diff"],
    ["apply", "-"],
    ["apply", "p.diff", "--json"],
    ["apply", "--json", "p.diff", "--repo", "/r", "--store", "s"],
    ["apply", "p.diff", "--key", "k", "--branch", "main", "--attempt", "2", "--format", "unified"],
    ["apply", "p.diff", "--key=k", "--branch=feature/x", "--attempt=3", "--contract-sha256=ab"],
    ["apply", "p.diff", "--check", "make test", "--check-timeout", "1.5", "--lock-timeout", "0"],
    ["apply", "p.diff", "-m", "fix: a thing", "--message", "again"],
    ["apply", "p.diff", "--key", "a", "--key", "b"],
    ["apply", "p.diff", "--key="],
    ["apply", "p.diff", "--key", ""],
    ["apply", "p.diff", "--lock-timeout", "1e3", "--check-timeout", "inf"],
    ["apply", "p.diff", "--attempt", " 7 "],
]

ARGPARSE_ONLY = [
    ["apply"],
    ["apply", "a", "b"],
    ["apply", "p.diff", "--help"],
    ["apply", "p.diff", "--key", "-x"],
    ["apply", "p.diff", "--key"],
    ["apply", "p.diff", "--attempt", "0"],
    ["apply", "p.diff", "--attempt", "-1"],
    ["apply", "p.diff", "--attempt", "x"],
    ["apply", "p.diff", "--attempt", "x", "--attempt", "2"],
    ["apply", "p.diff", "--lock-timeout", "nan"],
    ["apply", "p.diff", "--check-timeout", "0"],
    ["apply", "p.diff", "--repo", ""],
    ["apply", "p.diff", "--repo="],
    ["apply", "p.diff", "--js"],
    ["apply", "p.diff", "--json=1"],
    ["apply", "p.diff", "-mfix"],
    ["apply", "p.diff", "-m=fix"],
    ["apply", "--", "p.diff"],
    ["apply", "-x"],
    ["status", "k"],
    ["--json", "apply", "p.diff"],
]


@pytest.mark.parametrize("argv", PLAIN, ids=" ".join)
def test_a_plain_line_is_read_as_argparse_reads_it(argv: list[str]) -> None:
    quick = cli._plain_apply(argv)
    assert quick is not None
    assert vars(quick) == parsed(argv)


@pytest.mark.parametrize("argv", ARGPARSE_ONLY, ids=" ".join)
def test_anything_else_is_left_to_argparse(argv: list[str]) -> None:
    assert cli._plain_apply(argv) is None


_TOKENS = ["apply", "p.diff", "-", "--json", "--key", "--key=k", "k", "--branch", "main", "--attempt", "2", "0",
           "-1", "--format", "unified", "--check", "--check-timeout", "1", "--lock-timeout", "-m", "msg",
           "--message", "--repo", "--store", "/s", "", "--help", "--", "--js", "x=y", "--attempt=1", "--repo="]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(_TOKENS), max_size=7))
def test_whenever_the_quick_reading_answers_argparse_agrees(tail: list[str]) -> None:
    argv = ["apply", *tail]
    quick = cli._plain_apply(argv)
    if quick is not None:
        assert vars(quick) == parsed(argv)

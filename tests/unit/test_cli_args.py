"""patcher.cli_parser: what the apply command line means, and what it refuses (exit 2, usage)."""

from __future__ import annotations

import pytest

from cas.errors import UsageError
from patcher.cli import build_parser

DEFAULTS = {"command": "apply", "patch": "p.diff", "json": False, "repo": ".", "store": None, "branch": None,
            "key": None, "contract_sha256": None, "attempt": 1, "format": "auto", "check": None,
            "check_timeout": 600.0, "message": None, "lock_timeout": 30.0, "strict": False, "no_server": False,
            "common_dir": None, "dir": None, "remote": None}


@pytest.mark.parametrize(("argv", "changed"), [
    (["apply", "p.diff"], {}),
    (["apply", "-"], {"patch": "-"}),
    (["apply", "--json", "p.diff", "--repo", "/r", "--store", "s"], {"json": True, "repo": "/r", "store": "s"}),
    (["apply", "p.diff", "--key=k", "--branch=feature/x", "--attempt=3", "--contract-sha256=ab"],
     {"key": "k", "branch": "feature/x", "attempt": 3, "contract_sha256": "ab"}),
    (["apply", "p.diff", "--check", "make test", "--check-timeout", "1.5", "--lock-timeout", "0"],
     {"check": "make test", "check_timeout": 1.5, "lock_timeout": 0.0}),
    (["apply", "p.diff", "-m", "fix: a thing", "--message", "again"], {"message": "again"}),
    (["apply", "p.diff", "--key", "a", "--key", "b"], {"key": "b"}),
    (["apply", "p.diff", "--key", ""], {"key": ""}),
    (["apply", "p.diff", "--attempt", " 7 "], {"attempt": 7}),
    (["apply", "--", "-p.diff"], {"patch": "-p.diff"}),
    (["apply", "p.diff", "--remote", "origin"], {"remote": "origin"}),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_apply_lines(argv: list[str], changed: dict[str, object]) -> None:
    assert vars(build_parser().parse_args(argv)) == {**DEFAULTS, **changed}


@pytest.mark.parametrize("argv", [
    ["apply"],
    ["apply", "a", "b"],
    ["apply", "p.diff", "--key"],
    ["apply", "p.diff", "--attempt", "0"],
    ["apply", "p.diff", "--attempt", "x"],
    ["apply", "p.diff", "--lock-timeout", "nan"],
    ["apply", "p.diff", "--check-timeout", "0"],
    ["apply", "p.diff", "--repo", ""],
    ["apply", "p.diff", "--dir", ""],
    ["apply", "p.diff", "--dir", "/nonexistent/never-adopted"],  # not a directory target
    ["apply", "p.diff", "--js"],  # no abbreviations: main() chose the output by '--json' alone
    ["apply", "p.diff", "--json=1"],
    ["frobnicate"],
], ids=" ".join)
def test_refused_lines_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        build_parser().parse_args(argv)


def test_every_command_is_known() -> None:
    for argv in (["status", "k"], ["log"], ["recover", "--dry-run"], ["verify"], ["watch"], ["install-hook"],
                 ["mcp"], ["init", "--dir", "d"], ["rollback", "--to", "abcd", "--key", "k"], ["gc"]):
        assert build_parser().parse_args(argv).command == argv[0]

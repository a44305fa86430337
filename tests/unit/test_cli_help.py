"""What ``--help`` and ``--version`` tell a new user (issue 31): every format, the exit codes, the defaults."""

from __future__ import annotations

import re

import pytest

from patcher.cli import build_parser, main
from patcher.formats import BUILTIN_NAMES
from patcher.version import version


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare word by word


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"oncepatch {version()}\n" and version()


def test_apply_help_lists_every_format_every_exit_code_and_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "apply")
    assert all(name in text for name in BUILTIN_NAMES) and "..." not in text
    assert [int(c) for c in re.findall(r"(?:^|\s)([0-6]) (?=[a-z])", text.split("exit codes:")[1])] == list(range(7))
    assert "stopped (default 600)" in text and "(default 30)" in text


@pytest.mark.parametrize(("argv", "wanted"), [
    (("watch",), ["flagged (default 30)", "rescans (default 30)"]),
    (("verify",), ["or 300)"]),
    (("status",), ["KEY the idempotency key"]),
    (("resolve",), ["--as {committed,rejected} what happened"]),
    (("doctor",), ["say what to do next; changes nothing", "6: a receipt is corrupt"]),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_each_option_says_what_it_is_and_its_default(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                                     wanted: list[str]) -> None:
    text = _help(capsys, *argv)
    assert all(w in text for w in wanted), text


def test_json_before_the_command_counts() -> None:
    args = build_parser().parse_args(["--json", "status", "x"])
    assert args.json is True and args.command == "status" and not hasattr(args, "json_first")
    assert build_parser().parse_args(["status", "x"]).json is False

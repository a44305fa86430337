"""Commit messages an agent may give (pure): no control characters but newline and tab, no trailers of ours."""

from __future__ import annotations

import pytest

from cas.errors import EXIT_USAGE, UsageError
from patcher.args import check_message


@pytest.mark.parametrize("message", [
    None,
    "",
    "fix the null check",
    "subject\n\nbody line\n\tindented with a tab\n",
    "Signed-off-by: A <a@example.com>",
    "mentions Oncepatch-Call in a sentence",
    "Oncepatch: the tool's name alone",
    "caf\u00e9 \u2014 \u6f22\u5b57",
])
def test_messages_git_keeps_as_written_are_accepted(message: str | None) -> None:
    assert check_message(message) == message


@pytest.mark.parametrize(("message", "at"), [
    ("fix\x00", 3),
    ("\x00", 0),
    ("windows\r\nline", 7),
    ("clear \x1b[2J screen", 6),
    ("bell\x07", 4),
    ("del\x7f", 3),
    ("c1 \x85 next line", 3),
    ("form\x0cfeed", 4),
    ("vertical\x0btab", 8),
])
def test_control_characters_are_refused(message: str, at: int) -> None:
    with pytest.raises(UsageError) as info:
        check_message(message)
    assert info.value.exit_code == EXIT_USAGE
    assert info.value.details == {"reason": "control_character", "at": at}
    assert "\x00" not in info.value.message and "\x1b" not in info.value.message


@pytest.mark.parametrize(("message", "line"), [
    ("Oncepatch-Call: opc1:" + "0" * 64, 1),
    ("fix\n\nOncepatch-Call: opc1:" + "0" * 64, 3),
    ("fix\n\noncepatch-key: deadbeef", 3),
    ("fix\n\nONCEPATCH-KEY: x", 3),
    ("fix\n  Oncepatch-Call: x", 2),  # a folded trailer line
    ("fix\n\tOncepatch-Anything", 2),
])
def test_trailers_of_our_own_are_refused(message: str, line: int) -> None:
    with pytest.raises(UsageError) as info:
        check_message(message)
    assert info.value.details == {"reason": "own_trailer", "line": line}
    assert "Oncepatch-" in info.value.message


def test_a_message_that_is_not_text_is_refused() -> None:
    with pytest.raises(UsageError):
        check_message(b"fix")


@pytest.mark.parametrize("message", ["   ", "\t", "\n", " \nbody", "\n\nsubject after blank lines"])
def test_a_blank_subject_is_refused(message: str) -> None:
    # git refuses an empty message after stripping blank lines; libgit2 would write an empty subject line.
    with pytest.raises(UsageError) as info:
        check_message(message)
    assert info.value.details == {"reason": "blank_subject"}

"""The CLI's argparse parser, built only when a command line needs it (:mod:`patcher.cli`).

A plain ``oncepatch apply`` line is read without it (``patcher.cli``'s quick
reading): importing argparse brings ``re`` and ``gettext``, a few
milliseconds of a cold replay.  Everything else — other commands, ``--help``,
a value that looks like an option, anything the quick reading does not
know — comes here, and so does every refusal of a value.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from cas.errors import UsageError
from patcher.cli.common import add_common, add_options

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from typing import Any, NoReturn
    from patcher.cli.common import Option

__all__ = ["build_parser", "untranslated"]


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter with the terminal width found without importing shutil.

    argparse makes a formatter for every ``add_argument`` (to check it), and the
    stock one imports shutil for the width: 1.5 ms of every short command.
    """

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        if width is None:
            try:
                width = int(os.environ["COLUMNS"])
            except (KeyError, ValueError):
                try:
                    width = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__ else 80
                except (AttributeError, ValueError, OSError):
                    width = 80
            width -= 2
        super().__init__(prog, indent_increment, max_help_position, width)


@contextlib.contextmanager
def untranslated() -> Iterator[None]:
    """argparse's own words in English, without gettext.

    Every ``_()`` of argparse looks for message catalogues (importing
    ``locale`` and trying a file per language): about 3 ms of a 40 ms replay.
    oncepatch's own messages are English, so argparse's ("usage:", "the
    following arguments are required") are kept in English with them.
    """
    saved = argparse._, argparse.ngettext  # type: ignore[attr-defined]
    argparse._ = lambda message: message  # type: ignore[attr-defined]
    argparse.ngettext = lambda singular, plural, n: singular if n == 1 else plural  # type: ignore[attr-defined]
    try:
        yield
    finally:
        argparse._, argparse.ngettext = saved  # type: ignore[attr-defined]


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        # No abbreviations: '--js' would set --json for argparse while main() (which
        # chooses the output before parsing) saw no '--json'.
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser(apply_options: tuple[Option, ...], extra_commands: list[Callable[[Any], None]],
                 only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, just that command's subparser is filled in.

    argparse spends most of a short command's start-up building help text for
    every subcommand, so a known command builds only its own.
    """
    parser = _Parser(prog="oncepatch", description="apply patches to git effectively once")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    if only is not None:
        sub = _OnlySubparsers(sub, only)  # type: ignore[assignment]

    p = sub.add_parser("apply", help="apply a patch as one atomic commit, once per key")
    add_common(p)
    p.add_argument("patch", help="patch file, or - for standard input")
    add_options(p, apply_options)
    p.add_argument("--strict", action="store_true",
                   help="refuse a hunk that matches only loosely (below the exact grade)")

    p = sub.add_parser("status", help="the verified receipt of a key or call_id")
    add_common(p)
    p.add_argument("key")

    p = sub.add_parser("log", help="the event ledger")
    add_common(p)
    p.add_argument("--limit", type=int, default=None, help="only the last N events")

    for register in extra_commands:
        register(sub)
    return parser


class _NullParser:
    """Stands in for the subparsers of commands not invoked: every call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self


class _OnlySubparsers:
    """Wraps argparse's subparsers action: ``add_parser`` builds the named command only."""

    def __init__(self, sub: Any, only: str) -> None:
        self._sub = sub
        self._only = only

    def add_parser(self, name: str, **kw: Any) -> argparse.ArgumentParser:
        if name == self._only:
            return self._sub.add_parser(name, **kw)  # type: ignore[no-any-return]
        return _NullParser()  # type: ignore[return-value]  # filled in, then dropped

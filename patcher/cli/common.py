"""Pieces shared by the CLI's command modules (no pygit2)."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from receipts import lookup

__all__ = ["add_common", "store_root", "seconds", "positive_seconds", "at_least_one", "path_given", "text"]


def _refuse(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message)


def seconds(text: str, *, zero: bool = True) -> float:
    """An argparse type: a number of seconds, 0 or more (more than 0 with ``zero=False``)."""
    try:
        value = float(text)
    except ValueError:
        _refuse(f"not a number of seconds: {text!r}")
    if not (value >= 0 if zero else value > 0):  # (NaN neither)
        _refuse(f"must be {'0 or more' if zero else 'more than 0'} seconds: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds, more than 0."""
    return seconds(text, zero=False)


def at_least_one(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        _refuse(f"not an integer: {text!r}")
    if value < 1:
        _refuse(f"must be at least 1: {text!r}")
    return value


def path_given(text: str) -> str:
    """An argparse type: a path that is not empty."""
    if not text:
        _refuse("must be a path, not empty (leave the option out for the default)")
    return text


def text(value: str) -> str:
    """An argparse type: text that is UTF-8 (a key, a note), unlike a path, which may be any bytes.

    Bytes that are not UTF-8 reach ``sys.argv`` as lone surrogates, which no receipt, ledger or
    envelope can hold: refused here, before anything is read or written.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        _refuse("not valid UTF-8")
    return value


class _DirOption(argparse.Action):
    """``--dir PATH``: a directory target (docs/DIRECTORIES.md); its object database is the repository."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from patcher.dirs import objects_of  # (pygit2: loaded only for a directory target)

        namespace.dir = values
        namespace.repo = objects_of(str(values))


def add_common(p: argparse.ArgumentParser) -> None:
    """The options every command takes."""
    p.add_argument("--repo", default=".", type=path_given, help="repository (default: the current folder)")
    p.add_argument("--store", type=path_given,
                   help="receipt store (default: $ONCEPATCH_STORE or <git-common-dir>/oncepatch)")
    p.add_argument("--dir", action=_DirOption, default=None, type=path_given, metavar="PATH",
                   help="a directory target instead of a repository (docs/DIRECTORIES.md)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    # Read by the thin client (patcher.connect) before any parsing; accepted here so both agree.
    p.add_argument("--no-server", action="store_true",
                   help="run in this process, not through a running 'oncepatch serve' ($ONCEPATCH_SERVER)")


def store_root(args: argparse.Namespace) -> str:
    """The store of the command: ``--store``, ``$ONCEPATCH_STORE``, or the repository's default."""
    return lookup.store_root(args.store, args.repo)

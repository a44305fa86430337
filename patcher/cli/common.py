"""Pieces shared by the CLI's command modules (no pygit2)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, NoReturn

from cas.gitdir import discover
from patcher.protocol import store_root_for

__all__ = ["Option", "COMMON_OPTIONS", "add_common", "add_options", "store_root", "seconds", "positive_seconds",
           "at_least_one", "path_given", "text"]


#: (flags, dest, default, type, metavar, help) of one option that takes a value
Option = tuple[tuple[str, ...], str, Any, Callable[[str], Any] | None, str | None, str]


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


#: The options every command takes that have a value (``--json`` is the common flag).
COMMON_OPTIONS: tuple[Option, ...] = (
    (("--repo",), "repo", ".", path_given, None, "repository (default: the current folder)"),
    (("--store",), "store", None, path_given, None,
     "receipt store (default: $ONCEPATCH_STORE or <git-common-dir>/oncepatch)"),
)


def add_options(p: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    for flags, dest, default, kind, metavar, help_ in options:
        extra: dict[str, Any] = {"type": kind} if kind is not None else {}
        if metavar is not None:
            extra["metavar"] = metavar
        p.add_argument(*flags, dest=dest, default=default, help=help_, **extra)


class _DirOption(argparse.Action):
    """``--dir PATH``: a directory target (docs/DIRECTORIES.md); its object database is the repository."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from patcher.dirs import objects_of  # (pygit2: loaded only for a directory target)

        namespace.dir = values
        namespace.repo = objects_of(str(values))


def add_common(p: argparse.ArgumentParser) -> None:
    add_options(p, COMMON_OPTIONS)
    p.add_argument("--dir", action=_DirOption, default=None, type=path_given, metavar="PATH",
                   help="a directory target instead of a repository (docs/DIRECTORIES.md)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    # Read by the thin client (patcher.connect) before any parsing; accepted here so both agree.
    p.add_argument("--no-server", action="store_true",
                   help="run in this process, not through a running 'oncepatch serve' ($ONCEPATCH_SERVER)")


def store_root(args: argparse.Namespace) -> str:
    if args.store:
        return os.path.abspath(str(args.store))
    if os.environ.get("ONCEPATCH_STORE"):
        return os.path.abspath(os.environ["ONCEPATCH_STORE"])
    return store_root_for(discover(str(args.repo)).common_dir)

"""Pieces shared by the CLI's command modules (no pygit2)."""

from __future__ import annotations

import argparse
import os

__all__ = ["add_common", "store_root", "seconds", "positive_seconds", "at_least_one", "path_given"]


def seconds(text: str, *, zero: bool = True) -> float:
    """An argparse type: a number of seconds, 0 or more (more than 0 with ``zero=False``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value >= 0 if zero else value > 0):  # (NaN neither)
        raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero else 'more than 0'} seconds: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds, more than 0."""
    return seconds(text, zero=False)


def at_least_one(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def path_given(text: str) -> str:
    """An argparse type: a path that is not empty."""
    if not text:
        raise argparse.ArgumentTypeError("must be a path, not empty (leave the option out for the default)")
    return text


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", default=".", type=path_given, help="repository (default: the current folder)")
    p.add_argument("--store", default=None, type=path_given,
                   help="receipt store (default: $ONCEPATCH_STORE or <git-common-dir>/oncepatch)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def store_root(args: argparse.Namespace) -> str:
    from cas.gitdir import discover
    from patcher.protocol import store_root_for

    if args.store:
        return os.path.abspath(str(args.store))
    if os.environ.get("ONCEPATCH_STORE"):
        return os.path.abspath(os.environ["ONCEPATCH_STORE"])
    return store_root_for(discover(str(args.repo)).common_dir)



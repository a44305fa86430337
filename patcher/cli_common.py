"""Pieces shared by the CLI's command modules (no pygit2)."""

from __future__ import annotations

import argparse
import os

__all__ = ["add_common", "store_root"]


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", default=".", help="repository (default: the current folder)")
    p.add_argument("--store", default=None, help="receipt store (default: $ONCEPATCH_STORE or <git-common-dir>/oncepatch)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def store_root(args: argparse.Namespace) -> str:
    from cas.gitdir import discover
    from patcher.protocol import store_root_for

    if args.store:
        return os.path.abspath(str(args.store))
    if os.environ.get("ONCEPATCH_STORE"):
        return os.path.abspath(os.environ["ONCEPATCH_STORE"])
    return store_root_for(discover(str(args.repo)).common_dir)



"""The CLI's argparse parser (:mod:`patcher.cli` reads every command line with it)."""

from __future__ import annotations

import argparse
import functools
from typing import Any, NoReturn

from cas.errors import UsageError
from patcher.cli import mcp as cli_mcp, recovery as cli_recovery, server as cli_server
from patcher.cli.common import Option, add_common, add_options, at_least_one, positive_seconds, seconds

__all__ = ["APPLY_OPTIONS", "build_parser", "the_parser"]

#: ``apply``'s own options (besides ``--repo``, ``--store``, ``--json`` and the patch).
APPLY_OPTIONS: tuple[Option, ...] = (
    (("--branch",), "branch", None, None, None, "target branch (default: the checked-out branch)"),
    (("--key",), "key", None, None, None, "idempotency key (default: the call_id)"),
    (("--contract-sha256",), "contract_sha256", None, None, None, "sha256 of the contract the call was made under"),
    (("--attempt",), "attempt", 1, at_least_one, None, "attempt number: a new intent with the same patch"),
    (("--format",), "format", "auto", None, None, "auto, unified, apply_patch, ..."),
    (("--check",), "check", None, None, "CMD", "run CMD in a temporary worktree of the candidate"),
    (("--check-timeout",), "check_timeout", 600.0, positive_seconds, None, "seconds before --check is stopped"),
    (("--message", "-m"), "message", None, None, None, "commit subject (default: names the touched files)"),
    (("--lock-timeout",), "lock_timeout", 30.0, seconds, None,
     "seconds to wait for each lock of the call (key, index.lock, branch)"),
)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        # No abbreviations: '--js' would set --json for argparse while main() (which
        # chooses the output before parsing) saw no '--json'.
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = _Parser(prog="oncepatch", description="apply patches to git effectively once")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("apply", help="apply a patch as one atomic commit, once per key")
    add_common(p)
    p.add_argument("patch", help="patch file, or - for standard input")
    add_options(p, APPLY_OPTIONS)
    p.add_argument("--strict", action="store_true",
                   help="refuse a hunk that matches only loosely (below the exact grade)")

    p = sub.add_parser("status", help="the verified receipt of a key or call_id")
    add_common(p)
    p.add_argument("key")

    p = sub.add_parser("log", help="the event ledger")
    add_common(p)
    p.add_argument("--limit", type=int, default=None, help="only the last N events")

    cli_recovery.register(sub)
    cli_mcp.register(sub)
    cli_server.register(sub)
    return parser


@functools.cache
def the_parser() -> argparse.ArgumentParser:
    """The parser, built once per process: building it is most of a short call's own time
    (argparse looks up its translations and the terminal's size for every option).  A
    server builds it before forking its call processes, which share it.
    """
    return build_parser()


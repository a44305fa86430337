"""The CLI's argparse parser (:mod:`patcher.cli` reads every command line with it)."""

from __future__ import annotations

import argparse
import functools
from typing import Any, NoReturn

from cas.errors import SHOWN_CHARS, UsageError, clip
from patcher.formats import BUILTIN_NAMES
from patcher.cli import gc as cli_gc, revert as cli_revert
from patcher.cli import dirs as cli_dirs, doctor as cli_doctor, keys as cli_keys, mcp as cli_mcp, recovery as cli_recovery, server as cli_server
from patcher.cli import drift as cli_drift, replay as cli_replay, stats as cli_stats
from patcher.version import version
from patcher.cli.common import add_common, at_least_one, positive_seconds, seconds, text

__all__ = ["build_parser", "the_parser"]


#: Exit codes, as docs/DESIGN.md section 6 has them (shown by ``oncepatch apply --help``).
EXIT_CODES = """exit codes:
  0  done (a replay included)
  1  internal error
  2  usage or unreadable input
  3  idempotency conflict (the key stands for another change: use a new key)
  4  rejected: does not apply, unsafe or dirty path, check failed (nothing changed)
  5  in progress (a lock stayed held) or unknown: ask 'oncepatch status KEY' before retrying
  6  verification failed or a receipt is corrupt: 'oncepatch doctor' says what next"""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        # No abbreviations: '--js' would set --json for argparse while main() (which
        # chooses the output before parsing) saw no '--json'.
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        given = [a for a in (args or []) if isinstance(a, str)]
        given += [a.split("=", 1)[1] for a in given if a.startswith("-") and "=" in a]  # --key=VALUE
        self._given = [a for a in given if len(a) > SHOWN_CHARS]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        # argparse quotes what it could not read, whole ('unrecognized arguments: ...', 'invalid
        # choice: ...', a type's refusal): an argument of megabytes was a message of megabytes.
        for given in sorted(getattr(self, "_given", []), key=len, reverse=True):
            message = message.replace(repr(given), repr(clip(given))).replace(given, clip(given))
        raise UsageError(message)


class _TopParser(_Parser):
    """The top-level parser: ``--json`` before the command counts as the command's (``oncepatch --json status K``)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "json_first", False):
            ns.json = True
        if hasattr(ns, "json_first"):
            delattr(ns, "json_first")
        return ns, rest


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = _TopParser(prog="oncepatch", description="apply patches to git effectively once: every intended "
                        "change becomes exactly one atomic commit (or none), with a durable receipt",
                        epilog="after a crash: 'oncepatch doctor' says what to run next (docs/RECOVERY.md)")
    parser.add_argument("--version", action="version", version=f"oncepatch {version()}")
    parser.add_argument("--json", dest="json_first", action="store_true",
                        help="print exactly one JSON object (also accepted after the command)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("apply", help="apply a patch as one atomic commit, once per key",
                       description="Apply a patch as one atomic commit, at most once per idempotency key.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("patch", help="patch file, or - for standard input")
    p.add_argument("--branch", help="target branch (default: the checked-out branch)")
    p.add_argument("--key", help="idempotency key (default: the call_id)")
    p.add_argument("--contract-sha256", help="sha256 of the contract the call was made under")
    p.add_argument("--attempt", type=at_least_one, default=1, help="attempt number: a new intent with the same patch")
    p.add_argument("--format", default="auto", help="patch format: auto (detected, the default), or one of "
                   f"{', '.join(BUILTIN_NAMES)} (docs/FORMATS.md)")
    p.add_argument("--check", metavar="CMD", help="run CMD in a temporary worktree of the candidate")
    p.add_argument("--check-timeout", type=positive_seconds, default=600.0,
                   help="seconds before --check is stopped (default 600)")
    p.add_argument("--message", "-m", help="commit subject (default: names the touched files)")
    p.add_argument("--lock-timeout", type=seconds, default=30.0,
                   help="seconds to wait for each lock of the call (key, index.lock, branch) (default 30)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a hunk that matches only loosely (below the exact grade)")
    # The common git dir the caller resolved the repository to (patcher.remote): refused if it differs.
    p.add_argument("--common-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--remote", default=None, metavar="NAME", help="claim the key on this git remote: one atomic push "
                   "(default: oncepatch.remote of the repository's config; docs/REMOTE.md)")

    p = sub.add_parser("status", help="the verified receipt of a key or call_id")
    add_common(p)
    p.add_argument("key", metavar="KEY", type=text, help="the idempotency key (--key of apply), or a call_id (opc1:...)")

    p = sub.add_parser("log", help="the event ledger")
    add_common(p)
    p.add_argument("--limit", type=int, default=None, help="only the last N events (default: all)")

    cli_recovery.register(sub)
    cli_doctor.register(sub)
    cli_mcp.register(sub)
    cli_keys.register(sub)
    cli_server.register(sub)
    for lifecycle in (cli_stats, cli_replay, cli_drift, cli_gc, cli_revert):
        lifecycle.register(sub)
    cli_dirs.register(sub)
    return parser


@functools.cache
def the_parser() -> argparse.ArgumentParser:
    """The parser, built once per process: building it is most of a short call's own time
    (argparse looks up its translations and the terminal's size for every option).  A
    server builds it before forking its call processes, which share it.
    """
    return build_parser()


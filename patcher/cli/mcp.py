"""CLI command ``oncepatch mcp``: serve the MCP tools over stdio (needs ``oncepatch[mcp]``).

Registered into :mod:`patcher.cli` on import.  It speaks the protocol on
stdout until the client closes stdin, then exits 0; errors before serving
(no ``mcp`` package, not a repository) follow the usual envelope and exit code.
"""

from __future__ import annotations

import argparse
from typing import Any

from cas.errors import EXIT_OK
from receipts.store import DEFAULT_LOCK_TIMEOUT
from patcher.cli.common import path_given, seconds
from patcher.mcp_server import serve

__all__ = ["register", "HANDLERS"]


def register(sub: Any) -> None:
    p = sub.add_parser("mcp", help="serve apply_patch, receipt_status, recover, verify over MCP (stdio)")
    p.add_argument("--repo", default=".", help="default repository of the tools (default: the current folder)")
    p.add_argument("--store", default=None, type=path_given,
                   help="receipt store (default: $ONCEPATCH_STORE or <git-common-dir>/oncepatch)")
    p.add_argument("--any-repo", action="store_true",
                   help="let tool calls name other repositories than --repo")
    p.add_argument("--lock-timeout", type=seconds, default=DEFAULT_LOCK_TIMEOUT,
                   help=f"seconds each tool call waits for each lock (default {DEFAULT_LOCK_TIMEOUT:g})")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level on stderr (default WARNING)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def _cmd_mcp(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    serve(args.repo, store=args.store, allow_other_repos=args.any_repo, log_level=args.log_level,
          lock_timeout=args.lock_timeout)
    return EXIT_OK, {}, ""


HANDLERS = {"mcp": _cmd_mcp}

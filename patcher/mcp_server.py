"""``oncepatch mcp``: the Model Context Protocol server over stdio (optional extra ``oncepatch[mcp]``).

Built on the official ``mcp`` SDK: ``mcp.server.mcpserver.MCPServer`` (SDK 2.x;
``mcp.server.fastmcp.FastMCP`` of SDK 1.x is used when that is what is
installed: the same ``add_tool`` call, the same wire result).  Each tool is a
thin layer over one :class:`patcher.api.Client` per server (repositories and
stores stay open between calls, which run on worker threads).  The tools,
their hints and why ``apply_patch`` is not destructive nor open-world:
docs/AGENTS.md, "The MCP server".

Errors come back as tool errors (``isError: true``) carrying the CLI's
envelope.  Nothing but the protocol goes to stdout: logs go to stderr (and
the SDK points fd 1 at stderr while serving, so a child process cannot write
to the wire either).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Literal

import orjson

from cas.errors import SHOWN_PATH_CHARS, OncepatchError, UsageError, clip
from cas.gitdir import discover
from receipts.store import DEFAULT_LOCK_TIMEOUT
from patcher.api import Client
from patcher.version import version

__all__ = ["build_server", "serve", "SERVER_NAME", "INSTRUCTIONS", "FormatName"]

#: The ``format`` argument of ``apply_patch`` (its schema's enum): auto, or a built-in format
#: (:data:`patcher.formats.BUILTIN_NAMES`; a test holds the two equal).
FormatName = Literal["auto", "apply_patch", "search_replace", "str_replace", "unified", "whole_file"]

SERVER_NAME = "oncepatch"
log = logging.getLogger("oncepatch.mcp")

#: How many unknown argument names a refusal names.
_UNKNOWN_SHOWN = 10

INSTRUCTIONS = """\
oncepatch applies a patch to a git branch effectively once: one atomic commit per \
idempotency key, with a durable receipt. Choose the key per intended change (e.g. \
"issue-123/fix-null-check"), not per attempt: when a call times out or its result is \
lost, call again with the SAME key and the SAME patch — it replays the stored outcome \
instead of committing twice. A different patch needs a different key. On an error, \
read error.retryable and error.next_action before trying again."""


def _import_sdk() -> tuple[Any, Any]:
    """(server class, mcp.types) of the installed SDK.

    Raises:
        UsageError: the ``mcp`` package is not installed.
    """
    try:
        import mcp.types as mcp_types
    except ImportError as exc:
        raise UsageError("the MCP server needs the 'mcp' package: pip install 'oncepatch[mcp]'") from exc
    server_cls: Any
    try:
        from mcp.server.mcpserver import MCPServer

        server_cls = MCPServer
    except ImportError:  # SDK 1.x
        import importlib

        server_cls = importlib.import_module("mcp.server.fastmcp").FastMCP
    return server_cls, mcp_types


def _validator(types: Any) -> Callable[[bytes], Any]:
    """The SDK's own reader of one JSON-RPC message (what its stdio transport accepts, the wire accepts)."""
    adapter = getattr(types, "jsonrpc_message_adapter", None)
    if adapter is not None:  # SDK 2.x
        return functools.partial(adapter.validate_json, by_name=False)
    model: Callable[[bytes], Any] = types.JSONRPCMessage.model_validate_json  # SDK 1.x
    return model


class _Tools:
    """The tool bodies: plain functions over one :class:`Client`, returning ``CallToolResult``."""

    def __init__(self, client: Any, types: Any, *, allow_other_repos: bool) -> None:
        from cas.gitdir import discover

        self.client = client
        self.types = types
        self.allow_other_repos = allow_other_repos
        # The served repository, resolved once: what every 'repo' argument is checked against.
        self.served = discover(str(client.repo)).common_dir

    def _resolve(self, repo: str | None) -> tuple[str, str | None]:
        """The repository a call's ``repo`` names, resolved once: (its root, as a real path; its common git dir).

        Race guarded: the check and the apply used to resolve ``repo`` each on
        its own; a symlink on the path flipped in between (by hand, or by the
        client's own ``apply_patch`` calls committing a symlink into the served
        worktree) landed the commit in another repository.  Now the path is made
        real once, its repository found once, and the call is given that
        repository's root (no symlink on it, nothing a patch can change) and
        its common git dir, which the apply checks again on the repository it
        opens (:func:`patcher.protocol.apply`'s ``common_dir``).

        Raises:
            UsageError: not the served repository (unless the server serves any).
        """
        from cas.gitdir import discover

        if repo is None or repo == "":
            return str(self.client.repo), self.served
        real = os.path.realpath(repo)
        try:
            layout = discover(real)
        except UsageError:
            if self.allow_other_repos:
                return real, None  # the apply names what is wrong with it
            raise self._not_served(repo) from None
        if not self.allow_other_repos and layout.common_dir != self.served:
            raise self._not_served(repo)
        return layout.workdir or layout.git_dir, layout.common_dir

    def _not_served(self, repo: str) -> UsageError:
        return UsageError(f"this server serves '{self.client.repo}' only, not '{clip(repo, SHOWN_PATH_CHARS)}' "
                          "(start it with --any-repo to allow others)")

    def _result(self, doc: dict[str, Any], *, error: bool = False) -> Any:
        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
        return self.types.CallToolResult(content=[self.types.TextContent(type="text", text=text)],
                                         structuredContent=doc, isError=error)

    def _err(self, exc: OncepatchError) -> Any:
        return self._result({"ok": False, "error": exc.envelope()}, error=True)

    def unknown_arguments(self, tool: str, taken: frozenset[str], arguments: dict[str, Any]) -> dict[str, Any] | None:
        """The tool error (a ``tools/call`` result) for arguments ``tool`` does not take, or None.

        The SDK would drop them unread: a misspelt ``branch`` would commit to the
        default branch, a misspelt ``dry_run`` would recover for real.
        """
        unknown = sorted(set(arguments) - taken)
        if not unknown:
            return None
        key = arguments.get("idempotency_key")
        # Names as an error quotes any value (cas.errors.clip), and at most _UNKNOWN_SHOWN of them:
        # a call may send megabytes of them.
        named = [clip(u) for u in unknown[:_UNKNOWN_SHOWN]]
        more = f" (and {len(unknown) - len(named)} more)" if len(unknown) > len(named) else ""
        err = UsageError(f"unknown argument{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(u) for u in named)}{more} for '{tool}': it takes {', '.join(sorted(taken))}")
        err.details["unknown"] = named
        if isinstance(key, str):
            err.with_key(key)
        doc: dict[str, Any] = self._err(err).model_dump(mode="json", by_alias=True, exclude_none=True)
        return doc

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> Any:
        try:
            doc = fn()
        except OncepatchError as exc:
            log.info("%s: %s: %s", name, exc.error_type, exc.message)
            return self._err(exc)
        except Exception as exc:  # noqa: BLE001 - one envelope for the unexpected, as the CLI does
            log.exception("%s failed", name)
            err = OncepatchError(f"{type(exc).__name__}: {exc}", effect_status="unknown",
                                 next_action="query_before_retry")
            return self._err(err)
        return self._result(doc)

    # -- bodies ----------------------------------------------------------------

    def apply_patch(self, patch: str, idempotency_key: str, repo: str | None, branch: str | None,
                    format: str, message: str | None, strict: bool = False, dir: str | None = None,
                    remote: str | None = None) -> dict[str, Any]:
        if dir:  # a directory target: its object database is the repository (docs/DIRECTORIES.md)
            from patcher.dirs import objects_of

            repo = objects_of(dir)
        where, common_dir = self._resolve(repo)
        res = self.client.apply(patch, key=idempotency_key, repo=where, branch=branch or None,
                                format=format or "auto", message=message or None, common_dir=common_dir,
                                strict=bool(strict), remote=remote or None)
        doc: dict[str, Any] = res.to_json()
        return doc

    def receipt_status(self, key: str, repo: str | None) -> dict[str, Any]:
        where, _common = self._resolve(repo)
        receipt = self.client.status(key, repo=where)
        return {"ok": True, "receipt": receipt.to_doc(),
                "path": self.client.receipt_store(where).receipt_path(receipt.key)}

    def recover(self, repo: str | None, dry_run: bool) -> dict[str, Any]:
        doc: dict[str, Any] = self.client.recover(repo=self._resolve(repo)[0], dry_run=dry_run).to_json()
        return doc

    def verify(self, repo: str | None) -> dict[str, Any]:
        doc: dict[str, Any] = self.client.verify(repo=self._resolve(repo)[0]).to_json()
        return doc


def build_server(repo: str = ".", *, store: str | None = None, allow_other_repos: bool = False,
                 lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> Any:
    """The MCP server object (not yet running), with the four tools registered.

    ``lock_timeout``: how long each tool call waits for each lock (the CLI's ``--lock-timeout``).
    """
    import anyio  # deferred: it comes with the optional mcp package

    server_cls, types = _import_sdk()
    client = Client(repo, store=store, lock_timeout=lock_timeout)
    tools = _Tools(client, types, allow_other_repos=allow_other_repos)
    try:
        server = server_cls(SERVER_NAME, instructions=INSTRUCTIONS, version=version())
    except TypeError:  # an SDK 1.x FastMCP without 'version': server_info.version stays its default
        server = server_cls(SERVER_NAME, instructions=INSTRUCTIONS)
    server._oncepatch_client = client  # closed by serve()

    def offload(name: str, fn: Callable[[], dict[str, Any]]) -> Any:
        # pygit2 and fsync block: run on a worker thread, keep the event loop free.
        return anyio.to_thread.run_sync(functools.partial(tools.run, name, fn))

    async def apply_patch(patch: str, idempotency_key: str, repo: str | None = None, branch: str | None = None,
                          format: FormatName = "auto", message: str | None = None, strict: bool = False,
                          dir: str | None = None, remote: str | None = None) -> Any:
        return await offload("apply_patch", lambda: tools.apply_patch(patch, idempotency_key, repo, branch,
                                                                      format, message, strict, dir, remote))

    async def receipt_status(key: str, repo: str | None = None) -> Any:
        return await offload("receipt_status", lambda: tools.receipt_status(key, repo))

    async def recover(repo: str | None = None, dry_run: bool = False) -> Any:
        return await offload("recover", lambda: tools.recover(repo, dry_run))

    async def verify(repo: str | None = None) -> Any:
        return await offload("verify", lambda: tools.verify(repo))

    taken = {fn.__name__: frozenset(inspect.signature(fn).parameters)
             for fn in (apply_patch, receipt_status, recover, verify)}

    def check_call(name: str, arguments: dict[str, Any]) -> dict[str, Any] | None:
        return tools.unknown_arguments(name, taken[name], arguments) if name in taken else None

    server._oncepatch_check_call = check_call  # read by serve(): the wire answers such a call itself
    server._oncepatch_validate = _validator(types)

    A = types.ToolAnnotations
    server.add_tool(
        apply_patch, name="apply_patch", title="Apply a patch once",
        description=(
            "Apply a patch (a unified diff as git diff writes it, codex's apply_patch envelope, "
            "search/replace blocks, str_replace edits as JSON, or whole files as JSON) to a git branch as ONE "
            "atomic commit, at most once per idempotency_key. Returns the commit and a receipt. "
            "idempotency_key: stable per intended change (e.g. 'issue-42/rename-helper'), never per "
            "attempt — repeating a call with the same key and patch replays the first result "
            "(replayed: true) and commits nothing. repo: path of the repository (default: the "
            "server's); branch: target branch (default: the checked-out one); format: auto (detected), "
            "unified, apply_patch, search_replace, str_replace or whole_file; strict: refuse a hunk that matches only loosely (the result's "
            "grades and warnings say when one did); remote: a git remote of the repository (its name, e.g. 'origin') "
            "to claim the key on, so that every machine sending the same key lands it once on that remote's branch "
            "(default: the repository's oncepatch.remote config, else none: a local commit). Errors carry error.type, error.retryable and "
            "error.next_action (retry, fix_input, new_key, query_before_retry, recover, none)."
        ),
        annotations=A(title="Apply a patch once", readOnlyHint=False, destructiveHint=False,
                      idempotentHint=True, openWorldHint=False),
        structured_output=False,
    )
    server.add_tool(
        receipt_status, name="receipt_status", title="Receipt of a key",
        description=("The verified receipt of an idempotency key (or call_id): status prepared, "
                     "committed, rejected or unknown, the commit, and the output digests."),
        annotations=A(title="Receipt of a key", readOnlyHint=True, idempotentHint=True, openWorldHint=False),
        structured_output=False,
    )
    server.add_tool(
        recover, name="recover", title="Recover after a crash",
        description=("Settle every receipt left prepared or unknown by a crashed call: asks git whether "
                     "the commit landed and records committed or rejected (retryable). A second run "
                     "changes nothing. dry_run: only report the plan."),
        annotations=A(title="Recover after a crash", readOnlyHint=False, destructiveHint=False,
                      idempotentHint=True, openWorldHint=False),
        structured_output=False,
    )
    server.add_tool(
        verify, name="verify", title="Verify receipts",
        description=("Prove every receipt matches what it claims: receipts verify, committed ones "
                     "match their commits, nothing is left prepared or unknown, the ledger chain "
                     "holds. ok: false lists each failure."),
        annotations=A(title="Verify receipts", readOnlyHint=True, idempotentHint=True, openWorldHint=False),
        structured_output=False,
    )
    return server


def serve(repo: str = ".", *, store: str | None = None, allow_other_repos: bool = False,
          log_level: str = "WARNING", lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
    """Run the server on stdin/stdout until the client closes it.

    Raises:
        UsageError: the ``mcp`` package is missing, or ``repo`` is not a repository.
    """
    discover(repo)  # fail fast, before the client waits on a silent server
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="oncepatch mcp: %(levelname)s %(message)s")
    server = build_server(repo, store=store, allow_other_repos=allow_other_repos, lock_timeout=lock_timeout)
    logging.getLogger().setLevel(getattr(logging, log_level.upper(), logging.WARNING))
    from patcher.mcp_wire import claim_stdio

    try:
        with claim_stdio(validate=server._oncepatch_validate, check_call=server._oncepatch_check_call):
            server.run("stdio")
    finally:
        server._oncepatch_client.close()

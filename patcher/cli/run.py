"""``oncepatch`` command line, in process: a thin layer over the Python API (docs/DESIGN.md section 6).

:mod:`patcher.cli` tries a running server first (:mod:`patcher.connect`)
and comes here when there is none; the server runs every call through this
same :func:`main`, so the answers are the same either way.  Only this module prints.  With ``--json`` stdout is exactly one
JSON object (one per line for ``watch``); human text otherwise; logs and
progress go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from cas.crash import CRASH_ENV, POINTS
from cas.errors import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, SHOWN_PATH_CHARS, OncepatchError, UsageError, clip
from receipts import jsonio
from receipts.lookup import status
from receipts.policy import Caller, may_read
from receipts.store import ReceiptStore
from patcher.cli import gc as cli_gc, revert as cli_revert
from patcher.cli import advice as cli_advice, dirs as cli_dirs, doctor as cli_doctor, keys as cli_keys, mcp as cli_mcp, recovery as cli_recovery, server as cli_server
from patcher.cli import drift as cli_drift, replay as cli_replay, stats as cli_stats
from patcher.cli.common import store_root
from patcher.cli.parser import build_parser, the_parser
from patcher.cli.progress import shown
from patcher.protocol import apply

__all__ = ["main", "build_parser"]


def _read_patch(name: str) -> bytes:
    try:
        if name == "-":
            if sys.stdin is None:  # started with file descriptor 0 closed
                raise UsageError("cannot read patch '-': standard input is closed")
            return sys.stdin.buffer.read()
        with open(name, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read patch '{clip(name, SHOWN_PATH_CHARS)}': {exc.strerror}") from exc


def _cmd_apply(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    try:
        data = _read_patch(args.patch)
    except UsageError as exc:  # the envelope names the call's key, as every other refusal of the call does
        raise exc.with_key(args.key) if args.key is not None else exc
    with shown("applying the patch"):
        res = apply(
            args.repo, data, key=args.key, branch=args.branch, contract_sha256=args.contract_sha256,
            attempt=args.attempt, format=args.format, check=args.check, message=args.message,
            store=args.store, lock_timeout=args.lock_timeout, check_timeout=args.check_timeout, strict=args.strict,
            caller=args.caller, common_dir=args.common_dir, remote=args.remote, _stores=args.stores,
        )
    doc = res.to_json()
    if res.already_applied:  # the commit is the branch's, made before this call: never this key's own
        text = (f"{'replayed: ' if res.replayed else ''}already applied: the branch already had every edit "
                f"at {(res.commit or '')[:12]} (an earlier commit, not this key's); no commit made for this key\n")
    elif res.replayed:
        text = f"replayed: {res.status} {(res.commit or '')[:12]} (nothing re-executed)\n"
    else:
        text = f"committed {(res.commit or '')[:12]}: {len(res.outputs)} file(s)\n"
    if res.remote is not None:
        text += f"remote {res.remote['name']}: {res.remote.get('restages', 0)} re-stage(s)\n"
    text += f"key {res.key}\nreceipt {res.receipt}\n"
    for path, grades in (res.grades or {}).items():
        if any(g != "exact" for g in grades):
            text += f"grades {path}: {' '.join(grades)}\n"
    for w in res.warnings:
        text += f"warning: {w}\n"
    return EXIT_OK, doc, text


def _cmd_status(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    rstore = ReceiptStore(store_root(args))
    receipt = status(args.key, store=rstore, adapters=_status_adapters)
    doc = {"ok": True, "receipt": receipt.to_doc(), "path": rstore.receipt_path(receipt.key)}
    text = (f"{receipt.status}{' (retryable)' if receipt.retryable else ''}  key {receipt.key}\n"
            f"call_id {receipt.call_id}\ncommit {receipt.commit or '-'}\n"
            f"fencing token {receipt.fencing_token}, updated {receipt.updated_at}\n")
    if isinstance(receipt.args.get("compensates"), str):
        text += f"compensates {receipt.args['compensates']}\n"
    return EXIT_OK, doc, text


def _status_adapters(rstore: Any) -> dict[str, Any]:
    """The adapters ``status`` asks of a committed receipt (read-only: nothing is settled)."""
    from patcher.git_adapter import adapters

    return adapters(rstore, {}, read_only=True)


def _cmd_log(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    if args.limit is not None and args.limit < 0:
        raise UsageError(f"--limit must be 0 or more, not {args.limit}")
    events = list(ReceiptStore(store_root(args)).ledger.events())
    if args.limit is not None:
        events = events[-args.limit:] if args.limit > 0 else []
    if args.json:
        return EXIT_OK, {"ok": True, "events": events}, ""

    def field(e: dict[str, Any], name: str) -> str:
        value = e.get(name)
        return "" if value is None else str(value)  # whatever a hand-edited line holds (verify judges it)

    # A key whose call found its edits already on the branch records that commit, which is
    # another's: its rows say so instead of reading as the key's own commit.
    found: dict[str, str] = {}
    lines = [f"{'seq':>5} {'at':<27} {'event':<10} {'status':<10} {'commit':<12} key"] if events else []
    for e in events:
        key, commit = field(e, "key"), field(e, "commit")
        if e.get("already_applied") and commit:
            found[key] = commit
        note = "  (already on the branch: an earlier commit, not this key's)" if commit and found.get(key) == commit else ""
        if e.get("compensates") is not None:
            note += f"  (compensates {field(e, 'compensates')})"
        lines.append(f"{field(e, 'seq'):>5} {field(e, 'at'):<27} {field(e, 'event'):<10} {field(e, 'status'):<10} "
                     f"{(commit or '-')[:12]:<12} {key}{note}")
    return EXIT_OK, {"ok": True, "events": events}, "\n".join(lines) + ("\n" if lines else "")


_HANDLERS: dict[str, Callable[[argparse.Namespace], tuple[int, dict[str, Any], str]]] = {
    "apply": _cmd_apply, "status": _cmd_status, "log": _cmd_log, **cli_recovery.HANDLERS, **cli_doctor.HANDLERS,
    **cli_mcp.HANDLERS, **cli_keys.HANDLERS, **cli_gc.HANDLERS, **cli_revert.HANDLERS, **cli_dirs.HANDLERS,
    **cli_stats.HANDLERS, **cli_replay.HANDLERS, **cli_drift.HANDLERS,
}


def _cmd_serve(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    return cli_server.serve(args, main), {}, ""


_HANDLERS["serve"] = _cmd_serve


def _printable(value: Any) -> Any:
    """``value`` as JSON can hold it: each string's undecodable bytes (lone surrogates from ``sys.argv``)
    shown as ``\\xNN``, an integer past 64 bits (a size a patch claims) as its decimal string."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
        return str(value)
    if isinstance(value, str):
        try:
            return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate no byte escapes to (one from JSON input): shown as \\udNNN
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable(v) for v in value]
    return value


def _emit(doc: dict[str, Any], text: str, as_json: bool) -> None:
    if sys.stdout is None:  # started with file descriptor 1 closed: the exit status is all there is to say
        return
    if as_json:
        try:
            data = jsonio.dumps(doc)
        except jsonio.JsonError:  # a message quoting bytes that are not UTF-8, a size past 64 bits
            data = jsonio.dumps(_printable(doc))
    try:
        if as_json:
            sys.stdout.buffer.write(data + b"\n")
        else:
            sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        # Standard output that takes no more bytes (a full disk: ENOSPC, EIO, a reader
        # gone: EPIPE) once the call ran: as with it closed, the exit status is the
        # call's, not a traceback's exit 1 (which says "unknown" of a call that landed).
        _drop_stdout()
        if sys.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"oncepatch: cannot write to standard output: {exc.strerror or exc}\n")


def _drop_stdout() -> None:
    """Point file descriptor 1 at /dev/null: what is left in its buffer is flushed there at exit
    (a second failure then would make Python exit with status 120)."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)


def _confine(args: argparse.Namespace) -> None:
    """What a broker refuses its callers: another store, a command run as the broker, a file read as it,
    a store the caller could not read itself (:func:`receipts.policy.may_read`)."""
    if getattr(args, "store", None):
        raise UsageError("the broker writes its own store: leave out --store")
    if args.caller is not None and getattr(args, "repo", None) is not None:
        # Resolved once: a symlink of the caller's, flipped after the check, is not followed again.
        try:
            args.repo = os.path.realpath(str(args.repo), strict=False)
            root = store_root(args)
        except OncepatchError:
            root = None  # no repository there: the call says so itself
        except OSError as exc:  # unchecked is refused, never let through
            raise UsageError(f"the broker cannot tell which store '{args.repo}' names for its caller "
                             f"({exc.strerror or exc})") from None
        if root is not None and not may_read(args.caller, root):
            raise UsageError(f"the broker answers only about a store its caller could read itself: "
                             f"'{root}' is not readable by {args.caller.shown()}")
    if getattr(args, "check", None):
        raise UsageError("the broker runs no --check command (it would run as the store's owner)")
    if getattr(args, "patch", "-") != "-":
        raise UsageError("the broker reads the patch from standard input only: 'oncepatch apply - < FILE'")


def main(argv: Sequence[str] | None = None, *, caller: Caller | None = None, confined: bool = False,
         stores: dict[str, Any] | None = None) -> int:
    """Run one command in this process; ``caller`` is who asked (the server's peer), else this process.

    Every handler sees the caller as ``args.caller``: the one place an authorize
    step reads who is calling (docs/SECURITY.md, the broker).  ``confined``: the
    call came to a broker, which refuses what would act with its rights
    (:func:`_confine`).  ``stores``: open repositories to reuse (``{path: GitStore}``), kept by a
    long-lived caller (the server's workers) between calls.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        point = os.environ.get(CRASH_ENV)
        if point and point not in POINTS:  # a test that names no point would never crash, and pass
            raise UsageError(f"{CRASH_ENV} names no crash point: '{point}' (known: {', '.join(sorted(POINTS))})")
        args = the_parser().parse_args(argv)
        args.caller = caller  # None: this process (the policy looks it up only when there is one)
        args.stores = stores
        if confined:
            _confine(args)
        handler = _HANDLERS[args.command]
        if getattr(args, "dir", None) and args.command != "init":
            handler = cli_dirs.around(args.command, handler)
        code, doc, text = handler(args)
    except OncepatchError as exc:
        doc = {"ok": False, "error": exc.envelope()}
        if as_json:
            _emit(doc, "", True)
        elif sys.stderr is not None:  # (None: started with file descriptor 2 closed; the exit status says it)
            sys.stderr.write(f"oncepatch: {exc.error_type}: {exc.message}\n")
            if exc.key:
                sys.stderr.write(f"key {doc['error']['key']} (next: {exc.next_action})\n")
            sys.stderr.write(cli_advice.details(doc["error"]))
        return exc.exit_code
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence: one envelope, exit 1
        err = {"type": "internal", "message": f"{type(exc).__name__}: {exc}", "retryable": False,
               "effect_status": "unknown", "key": None, "next_action": "query_before_retry"}
        if as_json:
            _emit({"ok": False, "error": err}, "", True)
        elif sys.stderr is not None:
            traceback.print_exc()
        return EXIT_INTERNAL
    if args.command not in ("mcp", "serve"):  # the protocol owned stdout; nothing may follow it
        _emit(doc, text, as_json)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

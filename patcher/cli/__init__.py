"""``oncepatch`` command line: a thin layer over the Python API (docs/DESIGN.md section 6).

Start-up stays lean: argparse and the receipts layer only; pygit2 is imported
inside the commands that need it (a replayed ``apply`` and ``status`` import
it only to ask git about a committed receipt).  Only this module prints.  With ``--json`` stdout is exactly one
JSON object (one per line for ``watch``); human text otherwise; logs and
progress go to stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from cas.errors import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, OncepatchError, UsageError
from patcher.cli.common import COMMON_OPTIONS, at_least_one, positive_seconds, seconds, store_root

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    import argparse
    from typing import Any
    from patcher.cli.common import Option

__all__ = ["main", "build_parser"]


#: ``apply``'s own options (besides ``--repo``, ``--store``, ``--json`` and the patch): the
#: parser is built from them, and so is the quick reading of a plain ``apply`` line.
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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, just that command's subparser is filled in."""
    from patcher.cli.parser import build_parser as build

    return build(APPLY_OPTIONS, _EXTRA_COMMANDS, only)


if TYPE_CHECKING:
    from argparse import Namespace as _Args
else:
    class _Args:
        """The parsed command line, as argparse's ``Namespace`` carries it (attributes only)."""

        def __init__(self, **values: Any) -> None:
            self.__dict__.update(values)


def _plain_apply(argv: list[str]) -> _Args | None:
    """``apply``'s arguments read without argparse, or ``None``: argparse then reads (and judges) them.

    Read here: ``apply``, one patch (a file, or ``-``), and the options of
    :data:`APPLY_OPTIONS` and :data:`~patcher.cli.common.COMMON_OPTIONS`
    as ``--name VALUE`` or ``--name=VALUE``, each value converted as
    argparse converts it.  Anything else — ``--help``, an unknown option, a
    value that starts with ``-``, a second patch, a value its conversion
    refuses — is argparse's to read, so its answers and messages stay the
    only ones.  The result is what argparse gives for the same line
    (``tests/unit/test_cli_args.py`` holds the two side by side).
    """
    if not argv or argv[0] != "apply":
        return None
    options = {flag: option for option in COMMON_OPTIONS + APPLY_OPTIONS for flag in option[0]}
    values: dict[str, Any] = {option[1]: option[2] for option in options.values()}
    values.update(command="apply", json=False, patch=None)
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--json":
            values["json"] = True
            continue
        if arg in options:
            flag, value = arg, next(rest, None)
        elif arg.startswith("--") and arg.partition("=")[0] in options:
            flag, _, value = arg.partition("=")
        elif arg.startswith("-") and arg != "-" or values["patch"] is not None:
            return None
        else:
            values["patch"] = arg
            continue
        if value is None or value.startswith("-"):
            return None
        _flags, dest, _default, kind, _metavar, _help = options[flag]
        try:
            # Every occurrence converted, as argparse converts each (the last one wins).
            values[dest] = kind(value) if kind is not None else value
        except Exception:  # noqa: BLE001 - refused: argparse reads the line again and reports it
            return None
    if values["patch"] is None:
        return None
    return _Args(**values)


#: Commands defined in other modules (recover, verify, watch, ...): each module has
#: ``register(subparsers)`` and ``HANDLERS``; loaded by :func:`_load_extra_commands`.
_EXTRA_COMMANDS: list[Callable[[Any], None]] = []
_HANDLERS: dict[str, Callable[[argparse.Namespace], tuple[int, dict[str, Any], str]]] = {}


def _read_patch(name: str) -> bytes:
    try:
        if name == "-":
            return sys.stdin.buffer.read()
        with open(name, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read patch '{name}': {exc.strerror}") from exc


def _cmd_apply(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.protocol import apply

    data = _read_patch(args.patch)
    res = apply(
        args.repo, data, key=args.key, branch=args.branch, contract_sha256=args.contract_sha256,
        attempt=args.attempt, format=args.format, check=args.check, message=args.message,
        store=args.store, lock_timeout=args.lock_timeout, check_timeout=args.check_timeout,
    )
    doc = res.to_json()
    if res.replayed:
        text = f"replayed: {res.status} {(res.commit or '')[:12]} (nothing re-executed)\n"
    elif res.already_applied:
        text = f"already applied in {(res.commit or '')[:12]}: no new commit\n"
    else:
        text = f"committed {(res.commit or '')[:12]}: {len(res.outputs)} file(s)\n"
    text += f"key {res.key}\nreceipt {res.receipt}\n"
    for w in res.warnings:
        text += f"warning: {w}\n"
    return EXIT_OK, doc, text


def _cmd_status(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from receipts.lookup import status
    from receipts.store import ReceiptStore

    rstore = ReceiptStore(store_root(args))
    receipt = status(args.key, store=rstore, adapters=_status_adapters)
    doc = {"ok": True, "receipt": receipt.to_doc(), "path": rstore.receipt_path(receipt.key)}
    text = (f"{receipt.status}{' (retryable)' if receipt.retryable else ''}  key {receipt.key}\n"
            f"call_id {receipt.call_id}\ncommit {receipt.commit or '-'}\n"
            f"fencing token {receipt.fencing_token}, updated {receipt.updated_at}\n")
    return EXIT_OK, doc, text


def _status_adapters(rstore: Any) -> dict[str, Any]:
    """The adapters ``status`` asks of a committed receipt (read-only: nothing is settled)."""
    from patcher.git_adapter import adapters

    return adapters(rstore, {}, read_only=True)


def _cmd_log(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from receipts.store import ReceiptStore

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

    lines = [
        f"{field(e, 'seq'):>5} {field(e, 'at')} {field(e, 'event'):<10} {field(e, 'status'):<10} "
        f"{(field(e, 'commit') or '-')[:12]:<12} {field(e, 'key')}"
        for e in events
    ]
    return EXIT_OK, {"ok": True, "events": events}, "\n".join(lines) + ("\n" if lines else "")


_HANDLERS.update(apply=_cmd_apply, status=_cmd_status, log=_cmd_log)


def _load_extra_commands() -> None:
    # Each module appends to _EXTRA_COMMANDS and _HANDLERS when imported.
    import importlib

    for name in ("patcher.cli.recovery", "patcher.cli.mcp"):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        if mod.register not in _EXTRA_COMMANDS:
            _EXTRA_COMMANDS.append(mod.register)
            _HANDLERS.update(mod.HANDLERS)


def _emit(doc: dict[str, Any], text: str, as_json: bool) -> None:
    if as_json:
        from receipts import jsonio

        sys.stdout.buffer.write(jsonio.dumps(doc) + b"\n")
    else:
        sys.stdout.write(text)
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        command = next((a for a in argv if not a.startswith("-")), None)
        if command not in _HANDLERS:
            _load_extra_commands()  # apply/status/log never need the other commands' modules
        known = command in _HANDLERS
        if command == "apply":
            from receipts.jsonio import keep_lean

            keep_lean()  # one call, then exit: start-up counts more than JSON speed
        args = _plain_apply(argv) if command == "apply" else None
        if args is None:
            from patcher.cli.parser import untranslated

            with untranslated():
                args = build_parser(command if known else None).parse_args(argv)
        code, doc, text = _HANDLERS[args.command](args)
    except OncepatchError as exc:
        doc = {"ok": False, "error": exc.envelope()}
        if as_json:
            _emit(doc, "", True)
        else:
            sys.stderr.write(f"oncepatch: {exc.error_type}: {exc.message}\n")
            if exc.key:
                sys.stderr.write(f"key {exc.key} (next: {exc.next_action})\n")
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
        else:
            import traceback

            traceback.print_exc()
        return EXIT_INTERNAL
    if args.command != "mcp":  # the protocol owned stdout; nothing may follow it
        _emit(doc, text, as_json)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``oncepatch`` command line: a thin layer over the Python API (DESIGN.md section 6).

Start-up stays lean: argparse and the receipts layer only; pygit2 is imported
inside the commands that need it (a replayed ``apply`` and ``status`` never
import it).  Only this module prints.  With ``--json`` stdout is exactly one
JSON object (one per line for ``watch``); human text otherwise; logs and
progress go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from cas.errors import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, OncepatchError, UsageError
from patcher.cli_common import add_common, at_least_one, positive_seconds, seconds, store_root

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["main", "build_parser"]


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter with the terminal width found without importing shutil.

    argparse makes a formatter for every ``add_argument`` (to check it), and the
    stock one imports shutil for the width: 1.5 ms of every short command.
    """

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        if width is None:
            try:
                width = int(os.environ["COLUMNS"])
            except (KeyError, ValueError):
                try:
                    width = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__ else 80
                except (AttributeError, ValueError, OSError):
                    width = 80
            width -= 2
        super().__init__(prog, indent_increment, max_help_position, width)


@contextlib.contextmanager
def _untranslated() -> Iterator[None]:
    """argparse's own words in English, without gettext.

    Every ``_()`` of argparse looks for message catalogues (importing
    ``locale`` and trying a file per language): about 3 ms of a 40 ms replay.
    oncepatch's own messages are English, so argparse's ("usage:", "the
    following arguments are required") are kept in English with them.
    """
    saved = argparse._, argparse.ngettext  # type: ignore[attr-defined]
    argparse._ = lambda message: message  # type: ignore[attr-defined]
    argparse.ngettext = lambda singular, plural, n: singular if n == 1 else plural  # type: ignore[attr-defined]
    try:
        yield
    finally:
        argparse._, argparse.ngettext = saved  # type: ignore[attr-defined]


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        # No abbreviations: '--js' would set --json for argparse while main() (which
        # chooses the output before parsing) saw no '--json'.
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, just that command's subparser is filled in.

    argparse spends most of a short command's start-up building help text for
    every subcommand, so a known command builds only its own.
    """
    parser = _Parser(prog="oncepatch", description="apply patches to git effectively once")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    if only is not None:
        sub = _OnlySubparsers(sub, only)  # type: ignore[assignment]

    p = sub.add_parser("apply", help="apply a patch as one atomic commit, once per key")
    add_common(p)
    p.add_argument("patch", help="patch file, or - for standard input")
    p.add_argument("--branch", default=None, help="target branch (default: the checked-out branch)")
    p.add_argument("--key", default=None, help="idempotency key (default: the call_id)")
    p.add_argument("--contract-sha256", default=None, help="sha256 of the contract the call was made under")
    p.add_argument("--attempt", type=at_least_one, default=1, help="attempt number: a new intent with the same patch")
    p.add_argument("--format", default="auto", help="auto, unified, apply_patch, ...")
    p.add_argument("--check", default=None, metavar="CMD", help="run CMD in a temporary worktree of the candidate")
    p.add_argument("--check-timeout", type=positive_seconds, default=600.0, help="seconds before --check is stopped")
    p.add_argument("--message", "-m", default=None, help="commit subject (default: names the touched files)")
    p.add_argument("--lock-timeout", type=seconds, default=30.0, help="seconds to wait for the key's lock")

    p = sub.add_parser("status", help="the verified receipt of a key or call_id")
    add_common(p)
    p.add_argument("key")

    p = sub.add_parser("log", help="the event ledger")
    add_common(p)
    p.add_argument("--limit", type=int, default=None, help="only the last N events")

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


class _NullParser:
    """Stands in for the subparsers of commands not invoked: every call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self


class _OnlySubparsers:
    """Wraps argparse's subparsers action: ``add_parser`` builds the named command only."""

    def __init__(self, sub: Any, only: str) -> None:
        self._sub = sub
        self._only = only

    def add_parser(self, name: str, **kw: Any) -> argparse.ArgumentParser:
        if name == self._only:
            return self._sub.add_parser(name, **kw)  # type: ignore[no-any-return]
        return _NullParser()  # type: ignore[return-value]  # filled in, then dropped


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
    receipt = status(args.key, store=rstore)
    doc = {"ok": True, "receipt": receipt.to_doc(), "path": rstore.receipt_path(receipt.key)}
    text = (f"{receipt.status}{' (retryable)' if receipt.retryable else ''}  key {receipt.key}\n"
            f"call_id {receipt.call_id}\ncommit {receipt.commit or '-'}\n"
            f"fencing token {receipt.fencing_token}, updated {receipt.updated_at}\n")
    return EXIT_OK, doc, text


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

    for name in ("patcher.cli_recovery", "patcher.cli_mcp"):
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
        with _untranslated():
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

"""CLI commands after a crash: ``recover``, ``verify``, ``watch``, ``resolve``, ``quarantine``, ``install-hook``.

Registered into :mod:`patcher.cli` on import; the same ``--json``, exit-code
and envelope rules hold.
"""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import sys
import threading
from typing import Any

from cas.durable import write_durable
from cas.errors import EXIT_IN_PROGRESS, EXIT_OK, EXIT_VERIFY, UsageError
from cas.gitdir import GitLayout, discover
from receipts import jsonio
from receipts.environ import env_float
from receipts.manual import resolve_by_hand
from receipts.errors import RecoveryFailed
from receipts.recovery import DEFAULT_TMP_AGE, IO_ERRORS, recover
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore, check_store_root
from receipts.verifier import verify
from receipts.watcher import Watcher
from patcher import doctor
from cas.progress import count
from patcher.cli.progress import shown as with_progress
from patcher.cli.common import add_common, at_least_one, positive_seconds, seconds, store_root, text

__all__ = ["register", "HANDLERS"]


def _adapters(rstore: Any, *, read_only: bool = False, lock_timeout: float | None = None) -> dict[str, Any]:
    # Deferred: patcher.cli imports this module, and a replayed apply or status must not load libgit2.
    import pygit2

    from patcher.git_adapter import adapters

    # A scan reads each commit and blob once: libgit2's object cache would only
    # grow (to hundreds of MiB over 100k receipts) without ever being hit.
    pygit2.settings.enable_caching(False)
    return adapters(rstore, {}, read_only=read_only, lock_timeout=lock_timeout)


def register(sub: Any) -> None:
    p = sub.add_parser("recover", help="settle every prepared/unknown receipt after a crash")
    add_common(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--tmp-age", type=seconds, default=600.0,
                   help="only remove leftovers older than this many seconds (default 600)")
    p.add_argument("--jobs", type=at_least_one, default=None,
                   help="worker processes for the first look at a large store (default: one per CPU; "
                        "1 = no workers)")
    p.add_argument("--lock-timeout", type=seconds, default=DEFAULT_LOCK_TIMEOUT,
                   help=f"seconds to wait for a worktree's index.lock (default {DEFAULT_LOCK_TIMEOUT:g})")

    p = sub.add_parser("verify", help="prove every receipt matches its commits and files")
    add_common(p)
    p.add_argument("--grace", type=seconds, default=None,  # read at the call: the parser is built once
                   help="a prepared receipt fails at once when its call is gone, and after this many "
                        "seconds while its call still holds the key (default $ONCEPATCH_VERIFY_GRACE or 300)")
    p.add_argument("--jobs", type=at_least_one, default=None,
                   help="worker processes for large stores (default: one per CPU; 1 = no workers)")

    p = sub.add_parser("watch", help="flag orphaned prepared receipts as they appear")
    add_common(p)
    p.add_argument("--grace", type=seconds, default=30.0,
                   help="seconds before a prepared receipt may be flagged (default 30)")
    p.add_argument("--rescan", type=positive_seconds, default=30.0,
                   help="seconds between full rescans (default 30)")
    p.add_argument("--once", action="store_true", help="one scan, then exit (0 nothing flagged, 6 flagged)")
    p.add_argument("--recover", action="store_true", help="resolve each flagged receipt on the spot")
    p.add_argument("--duration", type=seconds, default=None, help="stop after this many seconds (default: never)")

    p = sub.add_parser("resolve", help="settle an unknown receipt by hand")
    add_common(p)
    p.add_argument("key", metavar="KEY", type=text, help="the key (or call_id) of the unknown receipt")
    p.add_argument("--as", dest="as_", required=True, choices=["committed", "rejected"],
                   help="what happened: committed (the effect took place) or rejected (it did not); "
                        "a claim its adapter contradicts is refused")
    p.add_argument("--note", default="", type=text, help="why (recorded in the ledger)")
    p.add_argument("--lock-timeout", type=seconds, default=DEFAULT_LOCK_TIMEOUT,
                   help=f"seconds to wait for the key's lock and a worktree's index.lock "
                        f"(default {DEFAULT_LOCK_TIMEOUT:g})")

    p = sub.add_parser("quarantine", help="move a receipt, or the ledger, aside as evidence (never deleted)")
    add_common(p)
    p.add_argument("key", nargs="?", type=text, help="the key whose receipt file moves aside")
    p.add_argument("--ledger", action="store_true",
                   help="move events.jsonl aside and start a new ledger adopting the receipts that verify")
    p.add_argument("--note", default="", type=text, help="why (recorded with the evidence and in the ledger)")
    p.add_argument("--lock-timeout", type=seconds, default=DEFAULT_LOCK_TIMEOUT,
                   help=f"seconds to wait for the key's or the ledger's lock (default {DEFAULT_LOCK_TIMEOUT:g})")

    p = sub.add_parser("install-hook", help="install a git pre-commit hook that runs 'oncepatch verify'")
    add_common(p)


def _progress(n: int) -> None:
    count(n)  # shown by patcher.cli.progress while the scan runs long, on a terminal


#: What a person does about what recover cannot settle (docs/RECOVERY.md, "quarantine").
_QUARANTINE = ("'oncepatch quarantine KEY' moves a corrupt or missing receipt aside (kept as evidence, "
               "recorded in the ledger); 'oncepatch quarantine --ledger' does so for a broken ledger")
_QUARANTINE_HINT = f"next: recover never settles these; after looking at them, {_QUARANTINE} (docs/RECOVERY.md)"
_NEXT_AFTER_FAILURE = (f"next: 'oncepatch doctor' names the one command to run; 'oncepatch recover' settles "
                       f"what a crash left; for what it reports corrupt, {_QUARANTINE} (docs/RECOVERY.md)")

_NEXT_AFTER_UNREACHABLE = ("next: nothing was found wrong; run 'oncepatch verify' again once the remote can be "
                           "reached (docs/REMOTE.md)")


def _hint(text: str) -> None:
    """A next step for a person, on stderr (stdout stays the report a script reads)."""
    sys.stderr.write(f"{text}\n")


def _cmd_recover(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    try:  # an I/O error opening the store or the repository: nothing written yet
        rstore = ReceiptStore(store_root(args))
        adapters = _adapters(rstore, read_only=args.dry_run, lock_timeout=args.lock_timeout)
    except IO_ERRORS as exc:
        raise RecoveryFailed(exc, wrote=False) from exc
    git = adapters["apply_patch"]
    with with_progress("recovering: receipts scanned"):
        report = recover(rstore, adapters, dry_run=args.dry_run, tmp_age=args.tmp_age, progress=_progress,
                         extra_cleanup=git.cleanup, jobs=args.jobs or (os.cpu_count() or 1),
                         adapters_factory="patcher.cli.recovery:_adapters")
    doc = report.to_json()
    lines = [f"{'plan' if args.dry_run else 'recovered'}: {len(report.rows)} receipt(s) of {report.scanned}"]
    for r in report.rows:
        lines.append(f"  {r.key}: {r.from_} -> {r.to} ({r.reason}){' ' + r.commit[:12] if r.commit else ''}")
        lines += [f"    {n}" for n in r.notes]
    for s in report.skipped:
        lines.append(f"  skipped {s['key']}: {s['reason']}")
    for c in report.corrupt:
        lines.append(f"  corrupt {c['path']}: {c['reason']}")
    for k in report.ledger_repaired:
        lines.append(f"  ledger event added for {k}")
    for path in report.removed:
        lines.append(f"  {'would remove' if args.dry_run else 'removed'} {path}")
    if not report.changed and not report.skipped and not report.corrupt:
        lines.append("  nothing to do")
    if report.corrupt and not args.json:
        _hint(_QUARANTINE_HINT)
    # Exit 5 when a receipt is left unresolved (its call is alive, or its adapter
    # cannot tell right now): a script must not read "recovered" as "all settled".
    code = EXIT_VERIFY if report.corrupt else EXIT_IN_PROGRESS if report.skipped else EXIT_OK
    return code, doc, "\n".join(lines) + "\n"


def _cmd_verify(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    rstore = ReceiptStore(store_root(args))
    grace = args.grace if args.grace is not None else env_float("ONCEPATCH_VERIFY_GRACE", 300.0)
    with with_progress("verifying: receipts read"):
        report = verify(rstore, _adapters(rstore), grace=grace, progress=_progress,
                        jobs=args.jobs or (os.cpu_count() or 1), verifiers_factory="patcher.cli.recovery:_adapters")
    doc = report.to_json()
    # Quarantined evidence is reported on every run: verify is never ok-silently about it.
    shown = "".join(f"quarantined: {q.get('what')}{' of ' + repr(q['key']) if q.get('key') else ''} "
                    f"{'recorded in' if q.get('what') == 'missing_receipt' else 'moved to'} {q.get('to')}\n"
                    for q in report.quarantined)
    if report.ok:
        mode = ("signed store: allowed signers " + repr(report.signatures["allowed_signers"])
                if report.signatures["mode"] == "signed" else "unsigned store")
        text = shown + f"ok: {report.receipts} receipt(s), {report.ledger_events} ledger event(s) verified" + (
            f", {len(report.quarantined)} quarantine(s)" if report.quarantined else "") + f" ({mode})\n"
    else:
        # One line per failure, naming the receipt file (and its key when it could be read).
        text = "".join(
            f"{f.path}{f' (key {f.key!r})' if f.key is not None else ''}: {' '.join(f.reason.splitlines())}\n"
            for f in report.failures)
        if report.only_unreachable:
            # Nothing was found wrong: some receipts were not checked, their remote unreachable.
            text = shown + text + (f"verification incomplete: {len(report.failures)} receipt(s) not checked: "
                                   f"their git remote could not be reached\n")
            if not args.json:
                _hint(_NEXT_AFTER_UNREACHABLE)
            return EXIT_IN_PROGRESS, doc, text
        text = shown + text + f"verification failed: {len(report.failures)} problem(s)\n"
        if not args.json:
            _hint(_NEXT_AFTER_FAILURE)
    return (EXIT_OK if report.ok else EXIT_VERIFY), doc, text


def _warn(message: str) -> None:
    sys.stderr.write(f"oncepatch watch: {message}\n")


def _cmd_watch(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    rstore = ReceiptStore(store_root(args))
    out_lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        with out_lock:
            if args.json:
                sys.stdout.buffer.write(jsonio.dumps(obj) + b"\n")
            elif obj.get("flag") == "corrupt_receipt":
                key = obj.get("key")
                sys.stdout.write(f"corrupt: {obj['receipt']}: {obj['reason']}; after looking at it: 'oncepatch "
                                 f"quarantine {shlex.quote(key) if isinstance(key, str) else 'KEY'}'\n")
            elif obj.get("flag") == "unfinished":
                sys.stdout.write(f"unfinished: {obj['key']} committed, follow-up left undone: "
                                 f"{'; '.join(obj['left'])}\n")
            elif "flag" in obj:
                sys.stdout.write(f"orphan: {obj['key']} prepared {obj['age_s']:.1f}s ago; run 'oncepatch recover'\n")
            else:
                sys.stdout.write(f"recovered: {obj.get('recovered')} -> {obj.get('status')}\n")
                for removed in obj.get("removed") or ():
                    sys.stdout.write(f"  removed {removed}\n")
                for done in obj.get("done") or ():
                    sys.stdout.write(f"  {done}\n")
            sys.stdout.flush()

    # Without --recover the watcher only flags: its queries must not remove stale locks.
    adapters = _adapters(rstore, read_only=not args.recover)
    git = adapters["apply_patch"]

    def tidy() -> list[str]:
        removed: list[str] = git.cleanup(rstore, False, DEFAULT_TMP_AGE)
        return removed

    w = Watcher(rstore, adapters, grace=args.grace, rescan_interval=args.rescan, on_flag=emit,
                recover=args.recover, on_error=_warn, cleanup=tidy if args.recover else None)
    if args.once:
        flagged = w.scan_once()
        # With --json the last line is this summary (flag lines carry "flag", this one "flags").
        return (EXIT_VERIFY if flagged else EXIT_OK), {"ok": not flagged, "flags": flagged}, ""
    # A watcher that printed nothing until its first flag looked hung: one line says it runs.
    _warn(f"watching {rstore.root} (rescan every {args.rescan:g}s, grace {args.grace:g}s"
          f"{', recovering what it flags' if args.recover else ''}); Ctrl-C ends it")
    stop = threading.Event()
    if args.duration is not None:
        threading.Timer(args.duration, stop.set).start()
    try:
        w.run(stop)
    except KeyboardInterrupt:
        stop.set()
    return (EXIT_VERIFY if w.flags else EXIT_OK), {"ok": not w.flags, "flags": w.flags}, ""


def _cmd_resolve(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    rstore = ReceiptStore(store_root(args))
    receipt = resolve_by_hand(rstore, args.key, args.as_, args.note, lock_timeout=args.lock_timeout,
                              adapters=_adapters(rstore, lock_timeout=args.lock_timeout),
                              probes=_adapters(rstore, read_only=True, lock_timeout=args.lock_timeout))
    return EXIT_OK, {"ok": True, "receipt": receipt.to_doc()}, f"{receipt.key}: {receipt.status}\n"


def _cmd_quarantine(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from receipts.quarantine import quarantine_ledger, quarantine_receipt
    from receipts.store import ReceiptStore

    if (args.key is None) == (not args.ledger):
        raise UsageError("name one KEY, or --ledger")
    rstore = ReceiptStore(store_root(args))
    if args.ledger:
        record = quarantine_ledger(rstore, note=args.note, timeout=args.lock_timeout)
        text = (f"quarantined the ledger: moved to {record['to']}; a new ledger adopts "
                f"{len(record['adopted'])} receipt(s)\n")
        text += "".join(f"  not adopted (corrupt): {p}\n" for p in record["not_adopted"])
    else:
        record = quarantine_receipt(rstore, args.key, note=args.note, timeout=args.lock_timeout,
                                    evidence=_key_ref_evidence(args.repo, args.key))
        if record["what"] == "missing_receipt":
            text = (f"quarantined the missing receipt of '{args.key}': recorded in {record['to']} "
                    f"(nothing to move{'; ' + record['evidence'] + ' stays' if record.get('evidence') else ''})\n")
        else:
            text = f"quarantined the receipt of '{args.key}': moved to {record['to']}\n"
    return EXIT_OK, {"ok": True, "quarantined": record}, text


def _key_ref_evidence(repo: str, key: str) -> str | None:
    """``"key ref 'R' -> OID"`` when ``repo`` holds the key's ref (evidence of a call whose receipt is gone)."""
    import pygit2  # deferred: a replayed apply or status imports this module and must not load libgit2

    from cas.refs import KEY_REF_PREFIX
    from receipts.identity import key_hash

    ref = KEY_REF_PREFIX + key_hash(key)
    try:
        target = pygit2.Repository(discover(repo).git_dir).references.get(ref)
    except (pygit2.GitError, OSError, UsageError):
        return None
    return None if target is None else f"key ref '{ref}' -> {str(target.target)[:12]}"


def _hooks_dir(layout: GitLayout) -> tuple[str, bool]:
    """The folder git runs hooks from, and whether ``core.hooksPath`` (any config level) chose it.

    A relative ``core.hooksPath`` is taken from the top of the worktree (the
    git folder in a bare repository), ``~`` from the home folder, as git does.
    """
    import pygit2  # deferred: a replayed apply or status imports this module and must not load libgit2

    try:
        value = pygit2.Repository(layout.git_dir).config["core.hooksPath"]
    except (KeyError, pygit2.GitError):
        value = None
    if not value:
        return os.path.join(layout.common_dir, "hooks"), False
    path = os.path.expanduser(str(value))
    if not os.path.isabs(path):
        path = os.path.join(layout.workdir or layout.git_dir, path)
    return os.path.normpath(path), True


def _cmd_install_hook(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    layout = discover(args.repo)
    if args.store:  # the hook runs verify on it: an unusable store would block every commit
        check_store_root(os.path.abspath(args.store))
    hooks, configured = _hooks_dir(layout)
    hook = os.path.join(hooks, "pre-commit")
    chained = os.path.join(hooks, "pre-commit.before-oncepatch")
    exe = shlex.quote(sys.executable)
    store_arg = f" --store {shlex.quote(os.path.abspath(args.store))}" if args.store else ""
    # git runs hooks with its own PATH, where 'oncepatch' may be missing (a venv not
    # activated): the interpreter that installed the hook comes first, then PATH.
    # No --grace: verify fails at once on a prepared receipt whose call is gone (its
    # key lock is free), and a live call's only after $ONCEPATCH_VERIFY_GRACE (300 s).
    script = f"""#!/bin/sh
{doctor.HOOK_MARK}
# Runs the hook that was here before (if any; its failure blocks the commit), then
# 'oncepatch verify' (an orphaned or failing receipt blocks it: run 'oncepatch recover').
here="$(dirname "$0")"
if [ -x "$here/pre-commit.before-oncepatch" ]; then
  "$here/pre-commit.before-oncepatch" "$@" || exit $?
fi
if [ -x {exe} ]; then
  exec {exe} -m patcher.cli verify{store_arg}
fi
if command -v oncepatch >/dev/null 2>&1; then
  exec oncepatch verify{store_arg}
fi
echo "oncepatch pre-commit hook: neither {exe} nor 'oncepatch' on PATH; reinstall with 'oncepatch install-hook'" >&2
exit 1
"""
    framework = False  # the hook moved aside is the pre-commit framework's
    current: bytes | None = None
    if os.path.exists(hook):
        with open(hook, "rb") as fh:
            current = fh.read()
        if current == script.encode():
            return EXIT_OK, {"ok": True, "hook": hook, "chained": os.path.exists(chained), "changed": False}, \
                f"hook already installed: {hook}\n"
    # An earlier install (another --store) is rewritten; anyone else's hook is moved aside.
    if current is not None and doctor.HOOK_MARK.encode() not in current:
        if configured:
            # A hooks folder another tool manages (husky and the like find the
            # user's hook by the name it runs under): not renamed under it.
            raise UsageError(f"core.hooksPath is '{hooks}', whose pre-commit is not oncepatch's: add "
                             "'oncepatch verify' to it, or use the 'oncepatch-verify' hook of "
                             ".pre-commit-hooks.yaml (nothing was changed)")
        if os.path.exists(chained):
            raise UsageError(f"'{chained}' already exists: move it away first")
        os.rename(hook, chained)  # moved aside, never lost
        framework = doctor.PRE_COMMIT_FRAMEWORK_MARK in current
    try:
        os.makedirs(hooks, exist_ok=True)
    except OSError as exc:  # a file where the folder goes, or no way to make it
        raise UsageError(f"cannot make the hooks folder '{hooks}': {exc.strerror or exc} (nothing was changed)") from exc
    write_durable(hook, script.encode(), mode=0o755)
    st = os.stat(hook)
    os.chmod(hook, st.st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    text = f"installed {hook}" + (f" (previous hook kept as {chained})" if os.path.exists(chained) else "") + "\n"
    if framework:
        listed = _framework_lists_verify(layout.workdir)
        text += ("note: the previous hook is the pre-commit framework's; it runs first, then 'oncepatch verify'"
                 + (". .pre-commit-config.yaml lists 'oncepatch-verify' too, so verify now runs twice: "
                    f"one is enough; to keep the framework's alone: mv '{chained}' '{hook}'" if listed else "")
                 + "\n")
    doc = {"ok": True, "hook": hook, "chained": os.path.exists(chained), "changed": True}
    if framework:
        doc["pre_commit_framework"] = True
    return EXIT_OK, doc, text


def _framework_lists_verify(workdir: str | None) -> bool:
    """Whether the worktree's ``.pre-commit-config.yaml`` lists the ``oncepatch-verify`` hook."""
    try:
        with open(os.path.join(workdir or "", ".pre-commit-config.yaml"), "rb") as fh:
            return b"oncepatch-verify" in fh.read(1 << 20)
    except OSError:
        return False


HANDLERS = {
    "recover": _cmd_recover,
    "verify": _cmd_verify,
    "watch": _cmd_watch,
    "resolve": _cmd_resolve,
    "install-hook": _cmd_install_hook,
    "quarantine": _cmd_quarantine,
}

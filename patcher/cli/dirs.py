"""CLI commands of directory targets (docs/DIRECTORIES.md): ``init``, ``rollback``, ``gc``, and ``--dir`` elsewhere.

``--dir PATH`` (every command with ``--repo``, :func:`add_dir_option`) names
the target's object database as the repository; :func:`around` adds the
folder's own part to ``log`` (the generations), ``recover`` (finish a switch,
remove dead builds) and ``verify`` (the current generation's bytes).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from cas.errors import EXIT_OK, UsageError
from receipts.receipt import Receipt
from receipts.store import ReceiptStore
from patcher.cli.common import add_common, path_given, seconds, store_root, text

__all__ = ["register", "HANDLERS", "around", "gc_generations"]

Handler = Callable[[argparse.Namespace], tuple[int, dict[str, Any], str]]
EXIT_VERIFY = 6


def register(sub: Any) -> None:
    p = sub.add_parser("init", help="adopt a folder as a directory target's first generation (--dir)")
    p.add_argument("--dir", required=True, type=path_given, help="the folder to adopt")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--no-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lock-timeout", type=seconds, default=30.0, help="seconds to wait for the switch lock")
    p.add_argument("--share-folders", action="store_true",
                   help="one folder per git tree, unchanged sub-folders shared by symlinks between generations: "
                        "an apply costs the change, not the folder (docs/DIRECTORIES.md)")

    p = sub.add_parser("rollback",
                       help="switch a directory target back to an earlier generation, as a new keyed change")
    add_common(p)
    p.add_argument("--to", required=True, help="the generation (its tree hash, or a prefix) or its commit")
    p.add_argument("--key", required=True, type=text, help="idempotency key of the rollback")
    p.add_argument("--lock-timeout", type=seconds, default=30.0, help="seconds to wait for each lock")


def _need_dir(args: argparse.Namespace) -> str:
    if not getattr(args, "dir", None):
        raise UsageError(f"'oncepatch {args.command}' needs --dir PATH")
    return str(args.dir)


def _cmd_init(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.dirs import adopt

    made = adopt(args.dir, lock_timeout=args.lock_timeout, share_folders=args.share_folders)
    verb = "adopted" if made["adopted"] else "already a directory target"
    return EXIT_OK, {"ok": True, **made}, f"{verb}: '{made['path']}' -> generation {str(made['tree'])[:12]}\n"


def _cmd_rollback(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.dirs import rollback_patch
    from patcher.protocol import apply

    path = _need_dir(args)
    rstore = ReceiptStore(store_root(args))
    existing = rstore.read(args.key)
    # A retry of a rollback that landed finds the tip at the generation already: the patch it
    # was given is the one in the receipt's args, so the same diff is asked of the same base.
    patch, tree = rollback_patch(path, args.to)
    message = f"oncepatch: rollback to generation {tree}"
    if existing is not None and existing.identity.get("args", {}).get("message") == message:
        base = (existing.base or {}).get("commit")
        if base:
            patch, tree = rollback_patch(path, args.to, base=base)
    if not patch.strip():
        raise UsageError(f"the branch of '{path}' already is at generation {tree[:12]}: nothing to roll back",
                         key=args.key)
    res = apply(args.repo, patch, key=args.key, format="unified", message=message, store=args.store,
                lock_timeout=args.lock_timeout, caller=args.caller)
    doc = {**res.to_json(), "generation": tree}
    text = (f"{'replayed: ' if res.replayed else ''}rolled '{path}' back to generation {tree[:12]} "
            f"(commit {(res.commit or '')[:12]})\nkey {res.key}\nreceipt {res.receipt}\n")
    return EXIT_OK, doc, text


def gc_generations(args: argparse.Namespace, kept: Iterable[Receipt] | None = None
                   ) -> tuple[int, dict[str, Any], str]:
    """``gc --dir PATH``: remove the generation folders nothing needs (docs/DIRECTORIES.md).

    ``kept``: the receipts that remain (``gc --policy``'s plan, for a dry run); ``None``: the store's.
    """
    from patcher.dirs import prune_generations

    path = _need_dir(args)
    doomed = prune_generations(path, ReceiptStore(store_root(args)), dry_run=args.dry_run, kept=kept)
    verb = "would remove" if args.dry_run else "removed"
    return EXIT_OK, {"ok": True, "dry_run": args.dry_run, "generations": doomed}, \
        "".join(f"{verb} generation {t}\n" for t in doomed) or "nothing to remove\n"


HANDLERS: dict[str, Handler] = {"init": _cmd_init, "rollback": _cmd_rollback}


def _log(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.dirs import generations

    gens = generations(str(args.dir), ReceiptStore(store_root(args)))
    if args.limit is not None:
        gens = gens[:max(args.limit, 0)]
    lines = [f"  {'generation':<12} {'commit':<12} {'at':<20} key"] if gens else []
    for g in gens:
        lines.append(f"{'*' if g['current'] else ' '} {g['generation'][:12]:<12} {g['commit'][:12]:<12} "
                     f"{g['at']:<20} {g['key'] or '-'}")
    return EXIT_OK, {"ok": True, "generations": gens}, "\n".join(lines) + ("\n" if lines else "")


def around(command: str, handler: Handler) -> Handler:
    """The handler of ``command`` for a call with ``--dir``: the folder's own part added."""
    if command == "log":
        return _log
    if command == "recover":
        def recover(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
            code, doc, text = handler(args)
            from patcher.dirs import repair_leftovers

            notes = repair_leftovers(str(args.dir), dry_run=bool(getattr(args, "dry_run", False)))
            doc["dir"] = {"path": str(args.dir), "done": notes}
            return code, doc, text + "".join(f"{n}\n" for n in notes)
        return recover
    if command == "verify":
        def verify(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
            code, doc, text = handler(args)
            from cas.generations import layout_of
            from patcher.dirs import verify_dir

            folder = layout_of(str(args.dir)).path
            problems = verify_dir(folder)
            # As verify's contract has it (and Client.verify(dir=...)): each problem a failure, the folder its path.
            doc.setdefault("failures", []).extend({"key": None, "receipt": folder, "reason": p} for p in problems)
            doc["dir"] = {"path": folder, "problems": problems}
            if not problems:
                return code, doc, text
            doc["ok"] = False
            return code or EXIT_VERIFY, doc, text + "".join(f"{folder}: {p}\n" for p in problems) + (
                f"verification failed: {len(problems)} problem(s) in '{folder}'\n")
        return verify
    return handler

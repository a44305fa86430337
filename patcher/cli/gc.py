"""CLI command ``gc``: retention by a policy file (docs/LIFECYCLE.md, "gc"); ``--verify-archive`` proves a bundle."""

from __future__ import annotations

import argparse
import os
from typing import Any

from cas.errors import EXIT_OK, EXIT_VERIFY, SHOWN_PATH_CHARS, UsageError, clip
from receipts.archive import verify_archive
from receipts.gc import collect
from receipts.retention import load_retention
from receipts.signing import load_signing
from receipts.store import ReceiptStore
from patcher.cli.common import add_common, path_given, store_root
from patcher.cli.dirs import gc_generations

__all__ = ["register", "HANDLERS"]


def register(sub: Any) -> None:
    p = sub.add_parser("gc", help="retention: archive, redact and remove settled receipts by a policy",
                       description="Remove settled receipts a retention policy lets go (archived first), "
                                   "redact bodies, and compact the ledger with a chained checkpoint. "
                                   "Never deletes git objects. docs/LIFECYCLE.md")
    add_common(p)
    p.add_argument("--policy", type=path_given, default=None, metavar="FILE", help="the retention policy (TOML)")
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    # With --dir PATH (a directory target) and no --policy: the generation folders nothing needs.
    p.add_argument("--verify-archive", type=path_given, default=None, metavar="FILE",
                   help="prove an archive gc wrote (digests, receipts, the ledger range's chain)")


def _cmd_gc(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    if args.verify_archive is not None:
        if args.policy is not None:
            raise UsageError("give either --policy or --verify-archive, not both")
        return _verify(args)
    if args.policy is None:
        if getattr(args, "dir", None):
            return gc_generations(args)
        raise UsageError("gc needs --policy FILE (docs/LIFECYCLE.md has an example), or --dir PATH")
    policy = load_retention(args.policy)  # a misspelt key: exit 2 before the store is opened
    rstore = ReceiptStore(store_root(args))
    from patcher.git_adapter import adapters  # deferred: libgit2 only for a gc that runs

    report = collect(rstore, policy, adapters(rstore, {}, read_only=args.dry_run), dry_run=args.dry_run)
    doc = report.to_json()
    code, text = EXIT_OK, _text(doc)
    if getattr(args, "dir", None):  # then the generations the receipts that stay no longer need
        # A dry run removed nothing: the receipts its plan keeps are what would remain.  A real run
        # reads the store again (a receipt whose removal was skipped for a live call stays).
        code, gens, more = gc_generations(args, report.plan.kept if args.dry_run else None)
        doc["generations"], text = gens["generations"], text + more
    return code, doc, text


def _text(doc: dict[str, Any]) -> str:
    verb = "would remove" if doc["dry_run"] else "removed"
    lines: list[str] = []
    rows = doc["remove"] if doc["dry_run"] else doc["removed"]
    lines += [f"{verb} {r['status']:<10} {r['key']}" for r in rows]
    rows = doc["redact"] if doc["dry_run"] else doc["redacted"]
    lines += [f"{'would redact' if doc['dry_run'] else 'redacted'} {r['key']}" for r in rows]
    lines += [f"stays {s['status']:<10} {s['key']}: {s['reason']}" for s in doc["stays"]]
    lines += [f"skipped {s['key']}: {s['reason']}" for s in doc["skipped"]]
    if doc["compact"] is not None:
        c = doc["compacted"] or doc["compact"]
        lines.append(f"{'would compact' if doc['dry_run'] else 'compacted'} ledger events "
                     f"{c['first_seq']}..{c['last_seq']} into a checkpoint" if doc["dry_run"] or doc["compacted"]
                     else "ledger: nothing compacted (a key among the oldest events got a receipt since)")
    if doc["archive"]:
        lines.append(f"archive {doc['archive']} (sha256 {doc['archive_sha256']})")
    lines += doc["collected"]
    return "\n".join(lines or ["nothing to do"]) + "\n"


def _verify(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    path = os.path.abspath(args.verify_archive)
    if not os.path.isfile(path):
        raise UsageError(f"cannot read archive '{clip(path, SHOWN_PATH_CHARS)}': no such file")
    signing, store_events = None, None
    if args.store or os.environ.get("ONCEPATCH_STORE") or args.repo != ".":
        # A store given: its signing, and its ledger must name this bundle's digest.
        root = store_root(args)
        signing = load_signing(root)
        store_events = list(ReceiptStore(root).ledger.events())
    report = verify_archive(path, signing=signing, store_events=store_events)
    doc = report.to_json()
    if report.ok:
        text = (f"ok: archive {path}\n{report.receipts} receipt(s), ledger events {report.first_seq}..{report.last_seq}"
                f" (head {report.head})\n" if report.events else
                f"ok: archive {path}\n{report.receipts} receipt(s), no ledger events\n")
        return EXIT_OK, doc, text
    return EXIT_VERIFY, doc, "".join(f"FAIL {f}\n" for f in report.failures)


HANDLERS = {"gc": _cmd_gc}

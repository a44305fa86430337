"""CLI command ``drift``: is every applied change still there? (:mod:`patcher.drift`; docs/LIFECYCLE.md, "drift").

Exit 0 when nothing drifted, 7 (``EXIT_DRIFTED``, docs/DESIGN.md section 6)
when a receipt's path changed, was reverted, is gone from its branch or is
dirty in a worktree; 6 (``EXIT_VERIFY``) when a receipt could not be checked
at all (unreadable, or its repository cannot be opened), whatever the rest
says: a monitor must not read "0 drifted" of receipts nobody looked at.  A path undone by a compensating call (``oncepatch
revert``) is ``compensated``: not drift.
"""

from __future__ import annotations

import argparse
from typing import Any

from cas.errors import EXIT_DRIFTED, EXIT_OK, EXIT_VERIFY
from receipts.store import ReceiptStore
from patcher.cli.common import add_common, store_root

__all__ = ["register", "HANDLERS"]


def register(sub: Any) -> None:
    p = sub.add_parser("drift", help="compare every applied receipt's files with the branch head and the worktree")
    add_common(p)


def _line(item: dict[str, Any]) -> str:
    text = f"  {item['path']}: {item['state']}"
    if "commit" in item:
        who = (("by oncepatch" + (f", key {item['key']!r}" if item.get("key") else "")
                + (" (its receipt removed by gc)" if item.get("removed_by_gc") else ""))
               if item["by"] == "oncepatch" else "outside oncepatch")
        if item.get("compensated_by"):
            who = f"oncepatch revert, key {item['compensated_by']!r}"
        text += f" by {item['commit'][:12]} ({who}: {item['subject']!r})"
    if item.get("dirty"):
        text += f"; dirty in {', '.join(item['dirty'])}"
    return text


def _cmd_drift(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.drift import drift  # deferred: loads libgit2, which this module's import must not

    report = drift(ReceiptStore(store_root(args)))
    doc = {"ok": not report.drifted, **report.to_json()}
    lines: list[str] = []
    for r in report.receipts:
        lines.append(f"{r['key']}: {r['state']} ({r['commit'][:12]} on {r['branch']})")
        lines += [_line(p) for p in r["paths"] if p["state"] != "unchanged"]
    lines += [f"skipped {s.get('key') or s.get('path')}: {s['reason']}" for s in report.skipped]
    unchecked = report.unchecked
    lines.append(f"{len(report.receipts)} receipt(s), {len(report.drifted)} drifted"
                 + (f", {len(unchecked)} not checked" if unchecked else ""))
    if unchecked:  # "0 drifted" of receipts nobody looked at is no all-clear
        doc["ok"] = False
        return EXIT_VERIFY, doc, "\n".join(lines) + "\n"
    return (EXIT_DRIFTED if report.drifted else EXIT_OK), doc, "\n".join(lines) + "\n"


HANDLERS = {"drift": _cmd_drift}

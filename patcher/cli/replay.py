"""CLI command ``replay``: every recorded call decided again, without side effects (:mod:`receipts.rehearsal`).

Not a replay of one receipt (``apply`` with a used key does that): see
docs/LIFECYCLE.md, "replay".  Exit 0 when no call diverges, 7 (``drifted``,
docs/DESIGN.md section 6) when one does.
"""

from __future__ import annotations

import argparse
from typing import Any

from cas.errors import EXIT_DRIFTED, EXIT_OK
from receipts.rehearsal import rehearse
from receipts.store import ReceiptStore
from patcher.cli.common import add_common, at_least_one, store_root

__all__ = ["register", "HANDLERS"]


def register(sub: Any) -> None:
    p = sub.add_parser("replay", help="decide every recorded call again against today's store, changing nothing")
    add_common(p)
    p.add_argument("--from", dest="from_seq", type=at_least_one, default=1, metavar="SEQ",
                   help="only calls whose first ledger event is at SEQ or later (default 1)")


def _cmd_replay(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.cli.recovery import _adapters  # deferred: loads libgit2, which this module's import must not

    rstore = ReceiptStore(store_root(args))
    result = rehearse(rstore, _adapters(rstore, read_only=True), from_seq=args.from_seq)
    doc = {"ok": not result.divergent, **result.to_json()}
    lines = [f"{'seq':>5} {'recorded':<18} {'now':<8} key"]
    for r in result.rows:
        recorded = r["recorded"] + (f"->{r['recorded_outcome']}" if r["recorded_outcome"] else "")
        lines.append(f"{r['seq']:>5} {recorded:<18} {r['now']:<8} {r['key']}"
                     + (f"  DIVERGES: {r['why']}" if r["divergence"] else ""))
    lines.append(f"{len(result.rows)} call(s), {len(result.divergent)} divergence(s); nothing was changed")
    return (EXIT_DRIFTED if result.divergent else EXIT_OK), doc, "\n".join(lines) + "\n"


HANDLERS = {"replay": _cmd_replay}

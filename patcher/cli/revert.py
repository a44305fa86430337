"""CLI command ``revert``: compensate a key's git change with a new keyed apply (docs/LIFECYCLE.md, "revert")."""

from __future__ import annotations

import argparse
from typing import Any

from cas.errors import EXIT_OK
from receipts.store import ReceiptStore
from patcher.cli.common import add_common, seconds, store_root, text
from patcher.cli.progress import shown

__all__ = ["register", "HANDLERS"]


def register(sub: Any) -> None:
    p = sub.add_parser("revert", help="undo a key's change as a new keyed commit (compensation)",
                       description="Apply the inverse of KEY's commit to its branch as a new keyed call "
                                   "(NEW_KEY), once; its receipt names KEY ('compensates'). docs/LIFECYCLE.md")
    add_common(p)
    p.add_argument("key", metavar="KEY", type=text, help="the key (or call_id) whose change is undone")
    p.add_argument("--key", dest="new_key", required=True, metavar="NEW_KEY", type=text,
                   help="the idempotency key of the compensating call")
    p.add_argument("--lock-timeout", type=seconds, default=30.0, help="seconds to wait for each lock (default 30)")


def _cmd_revert(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.revert import revert  # deferred: libgit2 only for a revert

    with shown("reverting"):
        res = revert(args.repo, args.key, new_key=args.new_key, store=args.store, lock_timeout=args.lock_timeout,
                     caller=args.caller)
    doc = res.to_json()
    # The key its receipt names (KEY may have been given as a call_id).
    receipt = ReceiptStore(store_root(args)).read(res.key)
    compensates = receipt.args.get("compensates") if receipt is not None else None
    doc["compensates"] = compensates if isinstance(compensates, str) else args.key
    head = f"replayed: {res.status} {(res.commit or '')[:12]} (nothing re-executed)" if res.replayed else \
        f"committed {(res.commit or '')[:12]}: reverted {len(res.outputs)} file(s)"
    return EXIT_OK, doc, f"{head}\nkey {res.key} compensates {doc['compensates']}\nreceipt {res.receipt}\n"


HANDLERS = {"revert": _cmd_revert}

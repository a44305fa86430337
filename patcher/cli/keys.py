"""CLI command ``keys``: a signed store's keys (``init``, ``rotate``, ``list``; docs/SECURITY.md, "Keys")."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from cas.errors import EXIT_OK, UsageError
from receipts.flock import flocked
from receipts.receipt import now_iso
from receipts.signing import init_keys, list_keys, rotate_keys, signers_path
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore
from patcher.cli.common import add_common, seconds, store_root, text

__all__ = ["register", "HANDLERS"]

#: The lock a change of the allowed-signers list is made under (``locks/``; a key's lock is ``<64 hex>.lock``).
_KEYS_LOCK = "keys.lock"


def register(sub: Any) -> None:
    p = sub.add_parser("keys", help="a signed store's keys: init, rotate, list")
    add_common(p)
    p.add_argument("action", choices=["init", "rotate", "list"])
    p.add_argument("--note", default="", type=text, help="why (kept with the key in the allowed-signers list)")
    p.add_argument("--lock-timeout", type=seconds, default=DEFAULT_LOCK_TIMEOUT,
                   help="seconds to wait while another 'keys init' or 'keys rotate' changes the list")


def _cmd_keys(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    root = store_root(args)
    if args.action == "list":
        keys = list_keys(root)
        doc: dict[str, Any] = {"ok": True, "mode": "signed" if keys else "unsigned", "allowed_signers": signers_path(root),
               "keys": keys}
        text = "".join(f"{k['key_id']}  {k['status']:<8} {'private key here' if k['private_key'] else '-'}  "
                       f"created {k['created_at']}\n" for k in keys) or "unsigned store: no keys\n"
        return EXIT_OK, doc, text
    store = ReceiptStore(root)  # refuses a store path that is no folder before any key is made
    make = init_keys if args.action == "init" else rotate_keys
    # One change of the list at a time, its ledger event included: two rotations that each read the
    # list before the other wrote it kept one new key of the two, and the other's signed event then
    # named a key no list held (every later append refused, verify failing for good).
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(flocked(os.path.join(store.locks_dir, _KEYS_LOCK), args.lock_timeout,
                                       folder=store.locks_folder))
            signers, private_path = make(root, note=args.note or None)
        except OSError as exc:  # a store (or a key folder) this user may not write: nothing was changed
            name = os.fsdecode(exc.filename) if exc.filename else ""
            where = f" ('{os.path.join(store.locks_dir, name)}')" if name else ""  # (a relative one: in locks/)
            raise UsageError(f"cannot change the keys of the store '{root}': {exc.strerror or exc}{where}") from None
        active = signers.active
        retired = [k.key_id for k in signers.keys if k.status == "retired"]
        # Recorded in the ledger, signed by the new key (a store's story names its keys).
        event: dict[str, Any] = {"event": "keys_initialized" if args.action == "init" else "keys_rotated",
                                 "at": now_iso(), "key_id": active.key_id, "retired": retired}
        if args.note:
            event["note"] = args.note
        ReceiptStore(root).ledger.append(event)
    doc = {"ok": True, "key_id": active.key_id, "private_key": private_path, "allowed_signers": signers.path,
           "retired": retired}
    text = f"active key {active.key_id}\nprivate key {private_path}\nallowed signers {signers.path}\n"
    return EXIT_OK, doc, text


HANDLERS = {"keys": _cmd_keys}

"""Receipts for effects applied effectively once: identity, receipts, locks, ledger, recovery.

Generic over tools (never imports pygit2).  The public names:

* :func:`status` — the verified receipt of a key or call_id;
* :func:`effect` / :func:`perform` / :func:`effectful` — run any tool's side
  effect once per key (:mod:`receipts.effects`);
* :func:`write_file`, :func:`run_command` — two ready effects
  (:mod:`receipts.adapters`).
"""

from __future__ import annotations

from receipts.adapters.command import CommandAdapter, run_command
from receipts.adapters.file_write import FileWriteAdapter, write_file
from receipts.effects import (
    EffectCall,
    EffectRejected,
    EffectResult,
    EffectUnknown,
    InvalidEffectArgs,
    NoQueryAdapter,
    effect,
    effectful,
    perform,
)
from receipts.receipt import Receipt
from receipts.recovery import recover
from receipts.lookup import status
from receipts.store import ReceiptStore
from receipts.verifier import verify

__all__ = [
    "status",
    "effect",
    "perform",
    "effectful",
    "EffectCall",
    "EffectResult",
    "EffectRejected",
    "InvalidEffectArgs",
    "EffectUnknown",
    "NoQueryAdapter",
    "write_file",
    "run_command",
    "FileWriteAdapter",
    "CommandAdapter",
    "Receipt",
    "ReceiptStore",
    "recover",
    "verify",
]

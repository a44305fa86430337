"""Receipts for effects applied effectively once: identity, receipts, locks, ledger, recovery.

Generic over tools (never imports pygit2).  The public names below are loaded
on first use, so importing a submodule stays as cheap as before.

* :func:`status` — the verified receipt of a key or call_id;
* :func:`effect` / :func:`perform` / :func:`effectful` — run any tool's side
  effect once per key (:mod:`receipts.effects`);
* :func:`write_file`, :func:`run_command` — two ready effects
  (:mod:`receipts.adapters`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_WHERE = {
    "status": "receipts.lookup",
    "effect": "receipts.effects",
    "perform": "receipts.effects",
    "effectful": "receipts.effects",
    "EffectCall": "receipts.effects",
    "EffectResult": "receipts.effects",
    "EffectRejected": "receipts.effects",
    "InvalidEffectArgs": "receipts.effects",
    "EffectUnknown": "receipts.effects",
    "NoQueryAdapter": "receipts.effects",
    "write_file": "receipts.adapters.file_write",
    "FileWriteAdapter": "receipts.adapters.file_write",
    "run_command": "receipts.adapters.command",
    "CommandAdapter": "receipts.adapters.command",
    "Receipt": "receipts.receipt",
    "ReceiptStore": "receipts.store",
    "recover": "receipts.recovery",
    "verify": "receipts.verifier",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'receipts' has no attribute '{name}'")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

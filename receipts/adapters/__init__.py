"""Adapters for common effects besides ``apply_patch`` (which lives in ``patcher``).

* :mod:`receipts.adapters.file_write` — write bytes to a path atomically;
  queryable by digest, so a crash after the write is settled by ``recover``.
* :mod:`receipts.adapters.command` — run a command; not queryable, so a crash
  or a timeout leaves ``unknown`` for a person (``oncepatch resolve``).

:func:`builtin_adapters` gives both, keyed by tool name, for ``recover``.
"""

from __future__ import annotations

from typing import Any

from receipts.adapters.command import CommandAdapter
from receipts.adapters.file_write import FileWriteAdapter

__all__ = ["builtin_adapters"]


def builtin_adapters() -> dict[str, Any]:
    """``{tool: adapter}`` for the generic tools shipped here."""
    return {a.tool: a for a in (FileWriteAdapter(), CommandAdapter())}

"""oncepatch's top layer: the apply protocol, patch formats, the git adapter, the CLI, the MCP server.

Public API (loaded on first use, so ``import patcher.cli`` stays lean)::

    import patcher

    result = patcher.apply("/path/to/repo", patch_text, key="fix-issue-42")
    with patcher.Client("/path/to/repo") as client:   # keeps the repository open
        client.apply(patch_text, key="fix-issue-42")

Errors are :class:`patcher.OncepatchError` instances carrying the envelope.
"""

from __future__ import annotations

# Not typing's: every CLI process imports this package first, and the thin client
# (patcher.connect) must not pay for typing (mypy takes any TYPE_CHECKING as true).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cas.errors import OncepatchError
    from patcher.api import Client, status
    from patcher.protocol import ApplyResult, apply

__all__ = ["apply", "ApplyResult", "Client", "status", "OncepatchError"]

_WHERE = {
    "apply": "patcher.protocol",
    "ApplyResult": "patcher.protocol",
    "Client": "patcher.api",
    "status": "patcher.api",
    "OncepatchError": "cas.errors",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'patcher' has no attribute '{name}'")
    import importlib  # here, not above: the thin client never needs it (it brings `warnings`)

    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""oncepatch's top layer: the apply protocol, patch formats, the git adapter, the CLI, the MCP server.

Public API::

    import patcher

    result = patcher.apply("/path/to/repo", patch_text, key="fix-issue-42")
    with patcher.Client("/path/to/repo") as client:   # keeps the repository open
        client.apply(patch_text, key="fix-issue-42")

Errors are :class:`patcher.OncepatchError` instances carrying the envelope.
"""

from __future__ import annotations

from cas.errors import OncepatchError
from patcher.api import Client, status
from patcher.protocol import ApplyResult, apply

__all__ = ["apply", "ApplyResult", "Client", "status", "OncepatchError"]

"""oncepatch's version, as its installed distribution says (``oncepatch --version``, MCP ``server_info``)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["version"]


def version() -> str:
    """The installed ``oncepatch`` distribution's version; ``0+unknown`` when run from a bare checkout."""
    try:
        return metadata.version("oncepatch")
    except metadata.PackageNotFoundError:
        return "0+unknown"

"""Numbers read from ``ONCEPATCH_*`` variables of the environment.

A value that is not a number (or not finite) is ignored and the default
stands: these variables tune limits and timeouts, and a module that read them
with a bare ``int()`` at import crashed every command with a traceback.
"""

from __future__ import annotations

import math
import os

__all__ = ["env_int", "env_float"]


def env_int(name: str, default: int) -> int:
    """``int(os.environ[name])``, or ``default`` when unset, empty or not a whole number."""
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        return default


def env_float(name: str, default: float) -> float:
    """``float(os.environ[name])``, or ``default`` when unset, empty, not a number or not finite."""
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if math.isfinite(value) else default

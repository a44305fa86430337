"""Worker processes for the scans over a whole store (``verify``, ``recover``)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

__all__ = ["spawn_pool", "split"]

T = TypeVar("T")


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes started by spawn, not fork: the parent may hold libgit2 state and locks
    a fork would copy."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def split(items: list[T], parts: int) -> list[list[T]]:
    """``items`` in at most ``parts`` runs of consecutive items, as even as whole runs allow (none empty)."""
    size = -(-len(items) // parts)
    return [items[i:i + size] for i in range(0, len(items), size)]

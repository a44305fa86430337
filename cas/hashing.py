"""sha256 helpers (stdlib only).

Until something in the process imports ``hashlib``, small inputs (keys,
identities, receipts, ledger lines) are hashed with the interpreter's
built-in ``_sha256``: importing ``hashlib`` loads OpenSSL, ≈ 5 ms (up to 14 ms
measured) of a cold process that only replays a receipt.  Large inputs, and
every input once ``hashlib`` is loaded anyway (a process that applies or
scans), go to OpenSSL, which is 3–5× faster from 500 bytes on.  Both give the
same digests.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from collections.abc import Callable

    from hashlib import _Hash

__all__ = ["sha256_hex", "sha256_file", "git_blob_oid"]

_CHUNK = 1 << 20
#: Inputs up to this size are hashed without loading OpenSSL.
SMALL = 1 << 16


def _small_sha256() -> Callable[[bytes | memoryview], _Hash]:
    try:
        import _sha256  # type: ignore[import-not-found]  # built into CPython unless configured without it
    except ImportError:
        import hashlib

        return hashlib.sha256
    made: Callable[[bytes | memoryview], _Hash] = _sha256.sha256
    return made


_sha256_small = _small_sha256()


def sha256_hex(data: bytes | memoryview) -> str:
    if len(data) <= SMALL and "hashlib" not in sys.modules:
        return _sha256_small(data).hexdigest()
    import hashlib

    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str, *, dir_fd: int | None = None) -> str:
    """sha256 of a file's bytes, streamed (memory stays flat for large files); symlinks not followed."""
    import hashlib

    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def git_blob_oid(data: bytes) -> str:
    """The sha1 object id git gives ``data`` as a blob (no pygit2 needed)."""
    import hashlib

    h = hashlib.sha1(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()

"""sha256 helpers (hashlib)."""

from __future__ import annotations

import hashlib

__all__ = ["sha256_hex", "git_blob_oid"]

def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def git_blob_oid(data: bytes) -> str:
    """The sha1 object id git gives ``data`` as a blob (no pygit2 needed)."""
    h = hashlib.sha1(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()

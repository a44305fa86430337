"""sha256 helpers (hashlib)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["sha256_hex", "sha256_file", "git_blob_oid"]

_CHUNK = 1 << 20


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str, *, dir_fd: int | None = None) -> str:
    """sha256 of a file's bytes, streamed (memory stays flat for large files); symlinks not followed."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def git_blob_oid(data: bytes) -> str:
    """The sha1 object id git gives ``data`` as a blob (no pygit2 needed)."""
    h = hashlib.sha1(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()

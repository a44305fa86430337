"""The ``file_write`` effect: put bytes at a path atomically, once per key; queryable by digest.

Args (the identity): ``path`` (absolute, its folder resolved through
symlinks), ``sha256`` and ``size`` of the bytes (never the bytes), ``mode``.
The ``prepared`` receipt also records ``before_sha256``, the digest of what
was at the path before (``None``: nothing), so :meth:`FileWriteAdapter.query`
can tell after a crash:

* the file holds ``sha256`` → ``applied``;
* it still holds ``before_sha256`` (or is still absent) → ``not_applied``;
* anything else → ``unknown`` (someone else wrote it since: rewriting it
  could undo their change, so a person decides).

The write itself is :func:`cas.durable.write_durable` (tmp beside the target,
fsync, rename, fsync the folder): it happened entirely or not at all.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from cas.durable import fsync_dir, write_durable
from cas.errors import DurableWriteError, UsageError
from receipts.adapter import QueryResult
from receipts.effects import EffectCall, EffectRejected, EffectResult, InvalidEffectArgs, perform
from receipts.receipt import Receipt
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore

__all__ = ["TOOL", "TOOL_VERSION", "FileWriteAdapter", "file_args", "write_file", "file_sha256"]

TOOL = "file_write"
TOOL_VERSION = "1"


def file_sha256(path: str) -> str | None:
    """sha256 hex of the file at ``path`` (not following a final symlink); ``None`` if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_args(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> dict[str, Any]:
    """The normalised args of writing ``data`` to ``path``."""
    p = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(p)
    return {"path": os.path.join(os.path.realpath(folder), name), "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data), "mode": mode}


class FileWriteAdapter:
    tool = TOOL
    tool_version = TOOL_VERSION

    def prepare(self, args: dict[str, Any]) -> dict[str, Any]:
        """Validate before anything is written; remember what the path held.

        Raises:
            InvalidEffectArgs: no such folder, or the path is a folder.
        """
        path = str(args["path"])
        if not os.path.isdir(os.path.dirname(path)):
            raise InvalidEffectArgs(f"cannot write '{path}': no such folder")
        if os.path.isdir(path) and not os.path.islink(path):
            raise InvalidEffectArgs(f"cannot write '{path}': is a folder")
        return {"before_sha256": file_sha256(path)}

    def query(self, receipt: Receipt) -> QueryResult:
        args = receipt.args
        path, want = str(args.get("path")), args.get("sha256")
        try:
            now = file_sha256(path)
        except OSError as exc:
            return QueryResult("unknown", f"cannot read '{path}': {exc.strerror}")
        if now == want:
            return QueryResult("applied", "digest_matches",
                               {"result": {"path": path, "sha256": want, "size": args.get("size")}})
        if now == receipt.extra.get("before_sha256"):
            return QueryResult("not_applied", "file_unchanged")
        return QueryResult("unknown", f"'{path}' holds neither the old nor the new content")

    def settle(self, receipt: Receipt) -> list[str]:
        return []

    def confirm(self, receipt: Receipt) -> list[str]:
        return []

    def verify_committed(self, receipt: Receipt) -> list[str]:
        """Nothing to prove beyond the receipt itself: a file may change after the write."""
        return []

    def compensation(self, receipt: Receipt, data: bytes | None = None
                     ) -> tuple[dict[str, Any], Callable[[EffectCall], dict[str, Any]]]:
        """The write that undoes ``receipt``'s (:func:`receipts.effects.compensate`).

        The path held nothing before: the file is removed.  Else ``data``
        must be the bytes it held (the receipt keeps only their digest,
        ``before_sha256``).  Either way the file must still hold what the
        write put there: a later change is never overwritten (rejected, final).

        Raises:
            UsageError: ``data`` is missing, or is not what the path held before.
        """
        args, before = receipt.args, receipt.extra.get("before_sha256")
        path, written, mode = str(args["path"]), args.get("sha256"), int(args.get("mode", 0o644))
        if before is None:
            undo: dict[str, Any] = {"path": path, "sha256": None, "size": None, "mode": mode}
        else:
            if data is None or hashlib.sha256(data).hexdigest() != before:
                raise UsageError(f"undoing the write of '{path}' needs the bytes it held before "
                                 f"(sha256 {str(before)[:12]}): pass them as data")
            undo = file_args(path, data, mode)

        def run(call: EffectCall) -> dict[str, Any]:
            if file_sha256(path) != written:
                raise EffectRejected(f"'{path}' changed since the write being undone: left alone",
                                     retryable=False, effect_status="not_applied")
            if data is None:
                os.unlink(path)
                fsync_dir(os.path.dirname(path))
            else:
                write_durable(path, data, mode=mode)
            return {"path": path, "sha256": undo["sha256"], "size": undo["size"]}

        return undo, run


def write_file(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    key: str | None = None,
    store: ReceiptStore | str | os.PathLike[str] | None = None,
    mode: int = 0o644,
    attempt: int = 1,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> EffectResult:
    """Write ``data`` to ``path`` atomically and durably, once per key.

    Raises: as :func:`receipts.effects.effect`.
    """
    args = file_args(path, data, mode)

    def run(call: EffectCall) -> dict[str, Any]:
        try:
            write_durable(args["path"], data, mode=mode)
        except DurableWriteError as exc:
            if exc.effect_status == "unknown":
                raise  # renamed, only the folder sync failed: recorded as unknown
            # The helper left the target unchanged: provably not applied.
            raise EffectRejected(exc.message, retryable=True, effect_status="not_applied") from exc
        return {"path": args["path"], "sha256": args["sha256"], "size": args["size"]}

    return perform(TOOL, args, run, key=key, adapter=FileWriteAdapter(), store=store,
                   tool_version=TOOL_VERSION, attempt=attempt, lock_timeout=lock_timeout)

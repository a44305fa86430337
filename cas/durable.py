"""The one place durable state is written (stdlib only).

``write_durable(path, data)`` — the calling sequence, in order:

1. open a tmp file *beside* the target (same folder, so the rename is atomic):
   ``.<name>.optmp-<pid>-<random>`` with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (never
   reuses or follows someone else's file);
2. write all bytes (looping on short writes);
3. ``fsync`` the tmp file (data before name: a crash after the rename must not
   expose a short file);
4. optional crash hook (``before_replace``) — the tmp file is complete and synced;
5. ``os.replace`` tmp → target (atomic on POSIX);
6. ``fsync`` the folder (the rename itself is durable);
7. on any failure in 1–5 the tmp file is unlinked and the target is unchanged.

``append_durable(path, line)`` appends one record and fsyncs it (the ledger).

Both take an optional ``dir_fd``: the path is then relative to that open
folder, which is how worktree writes avoid following symlinked folders.
:func:`open_dir_nofollow` opens such a folder one component at a time with
``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable, Iterator

from cas.errors import DurableWriteError, UnsafeWorktreePath

__all__ = [
    "TMP_MARK",
    "write_durable",
    "append_durable",
    "fsync_dir",
    "open_dir_nofollow",
    "is_own_tmp",
]

#: Every tmp file this module creates has this in its name; cleanup only ever
#: deletes names containing it (git's prune rule: only what is provably ours).
TMP_MARK = ".optmp-"

_O_BINARY = getattr(os, "O_BINARY", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def is_own_tmp(name: str) -> bool:
    """True for a file name this module could have created as a tmp file."""
    return name.startswith(".") and TMP_MARK in name


def fsync_dir(path: str | None = None, *, dir_fd: int | None = None) -> None:
    """fsync a folder so that renames and creations inside it survive a crash."""
    if dir_fd is not None and path is None:
        os.fsync(dir_fd)
        return
    fd = os.open(path or ".", os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_durable(
    path: str,
    data: bytes | memoryview,
    *,
    mode: int = 0o644,
    dir_fd: int | None = None,
    before_replace: Callable[[], None] | None = None,
    sync_dir: bool = True,
) -> None:
    """Replace ``path`` with ``data`` atomically and durably (steps in the module docstring).

    ``mode`` is applied to the new file exactly (umask does not narrow it).

    Raises:
        DurableWriteError: the write failed; the target is unchanged, no tmp remains.
    """
    folder, name = os.path.split(path)
    tmp_name = f".{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    tmp = os.path.join(folder, tmp_name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY | _O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise DurableWriteError(path, exc) from exc
    try:
        try:
            _write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        # Whatever went wrong (ENOSPC, EIO, KeyboardInterrupt), leave no residue.
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(exc, OSError):
            raise DurableWriteError(path, exc) from exc
        raise
    if sync_dir:
        try:
            fsync_dir(folder or ".", dir_fd=dir_fd)
        except OSError as exc:
            # The rename happened; only its durability is in doubt.
            raise DurableWriteError(path, exc, effect_status="unknown") from exc


def append_durable(path: str, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if missing) and fsync it.

    A new file's folder is synced too.  Callers serialise appends with a lock.

    Raises:
        DurableWriteError: the append failed (a partial line may remain; readers
            of append-only logs must tolerate a torn last line).
    """
    created = not os.path.exists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_CLOEXEC, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(os.path.dirname(path) or ".")
    except OSError as exc:
        raise DurableWriteError(path, exc) from exc


@contextlib.contextmanager
def open_dir_nofollow(root: str, rel_dir: str, *, create: bool = False) -> Iterator[int]:
    """Yield an fd of ``root/rel_dir`` reached without following any symlink below ``root``.

    With ``create``, missing folders are made (and their parents synced).

    Raises:
        UnsafeWorktreePath: a component is a symlink or not a folder.
    """
    fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in [p for p in rel_dir.split("/") if p]:
            try:
                nfd = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                os.fsync(fd)
                nfd = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                st = None
                with contextlib.suppress(OSError):
                    st = os.lstat(part, dir_fd=fd)
                if st is not None and (stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode)):
                    raise UnsafeWorktreePath(
                        f"refusing to write through '{rel_dir}': '{part}' is not a real folder",
                        details={"path": rel_dir},
                    ) from exc
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)

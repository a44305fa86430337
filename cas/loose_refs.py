"""A branch moved the way git's files backend moves it (stdlib only).

git keeps a branch as a loose file ``<common>/refs/heads/<b>`` (or a line of
``packed-refs``) and moves it under ``<ref>.lock``: the lock is created
exclusively, filled with the new oid, the reflog lines are appended while it
is held, then the lock is renamed over the ref.  :func:`swap` does exactly
that, as a compare-and-swap, with oncepatch's flush rounds:

1. the lock is *born complete*: the new oid goes to a tmp file in the common
   git dir, which is hard-linked to ``<ref>.lock`` (exclusive like
   ``O_EXCL``; a crash never leaves an empty lock nobody could prove was
   ours — a stale lock holding the candidate oid is the dead call's);
2. under the lock the current value is read (loose file, else
   ``packed-refs``) and compared with the expected one; the caller's
   ``precondition`` runs (its fencing check);
3. the reflog lines (the ref's; ``HEAD``'s when ``HEAD`` names the branch) are
   appended, and the lock is synced;
4. the lock is renamed over the ref;
5. the folders whose entries changed (the ref's, and a reflog's when it was
   created) and the reflogs are returned, not synced: the caller syncs them
   with its next round, which must end before anything that relies on the
   move is renamed (the committed receipt).  So a move costs one flush of its
   own where libgit2 made four, one after another.  A crash before that round
   can lose the reflog line of a move that survived (git itself does not sync
   reflogs unless ``core.fsync`` says so); nothing in oncepatch takes a reflog
   line as proof of a move (recovery reads only lines that move the branch
   *away* from a candidate).

What :func:`swap` does not handle it reports with :class:`Unsupported`
*before* taking the lock or after releasing it, and the caller moves the ref
through libgit2 instead: a symbolic or unreadable ref, a ref to be created, a
repository whose refs or object ids are not the classic files backend and
SHA-1.  Which reflogs are written follows git's ``core.logAllRefUpdates``: an
existing reflog is always appended to; a missing one is created for
``refs/heads/``, ``refs/remotes/``, ``refs/notes/`` and ``HEAD`` when the
setting is true (the default outside bare repositories), for every ref when it
is ``always``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable

from cas.durable import TMP_MARK, link_as_lock, make_dirs, write_all, write_new
from cas.errors import GitStoreError, RefLockedError, RefMovedError

__all__ = ["REF_TMP_PREFIX", "Unsupported", "read_ref", "swap", "reflogs_for", "write_lock_content"]

#: The lock's content is written here (in the common git dir, outside refs/)
#: before it is linked to ``<ref>.lock``; a crash in between leaves
#: ``.ref<TMP_MARK><pid>-…``, which recovery removes once that pid is gone.
REF_TMP_PREFIX = ".ref"

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_LOOSE = re.compile(rb"([0-9a-f]{40})\s*")
_AUTO_LOG_PREFIXES = ("refs/heads/", "refs/remotes/", "refs/notes/")
#: link() failures that mean "no hard link here", not "locked".
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EOPNOTSUPP}


class Unsupported(Exception):
    """This ref or repository is left to libgit2 (nothing was changed)."""


def read_ref(common_dir: str, ref: str) -> str | None:
    """The oid ``ref`` holds on disk (loose file first, then ``packed-refs``); ``None`` if absent.

    Raises:
        Unsupported: a symbolic ref, or content that is not one SHA-1 oid.
    """
    try:
        fd = os.open(os.path.join(common_dir, ref), os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except FileNotFoundError:
        return _read_packed(common_dir, ref)
    except OSError as exc:  # a symlink (git's old symbolic refs: ELOOP), a folder, …
        raise Unsupported(f"'{ref}' is not a plain file: {exc}") from exc
    try:
        data = os.read(fd, 256)
    except OSError as exc:  # EISDIR
        raise Unsupported(f"'{ref}' is not a plain file: {exc}") from exc
    finally:
        os.close(fd)
    m = _LOOSE.fullmatch(data)
    if m is None:
        raise Unsupported(f"'{ref}' holds {data[:60]!r}, not an oid")
    return m.group(1).decode()


def _read_packed(common_dir: str, ref: str) -> str | None:
    try:
        with open(os.path.join(common_dir, "packed-refs"), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    needle = b" " + ref.encode() + b"\n"
    at = data.find(needle)
    while at != -1:
        start = at - 40
        if start >= 0 and (start == 0 or data[start - 1:start] == b"\n"):
            oid = data[start:at]
            if _LOOSE.fullmatch(oid):
                return oid.decode()
            raise Unsupported(f"packed-refs line of '{ref}' holds {oid!r}")
        at = data.find(needle, at + 1)
    if data and not data.endswith(b"\n"):
        raise Unsupported("packed-refs ends in an unterminated line")  # git refuses it too
    return None


def reflogs_for(git_dir: str, common_dir: str, ref: str, log_all: bool | str | None, bare: bool) -> list[str]:
    """The reflog files a move of ``ref`` appends to (git's rule; module docstring).

    ``log_all`` is ``core.logAllRefUpdates``: ``"always"``, its value as git's
    boolean, or ``None`` when unset.

    Raises:
        Unsupported: a reflog path is a folder (git would clear it first).
    """
    names = [(ref, os.path.join(common_dir, "logs", ref))]
    head_path = os.path.join(git_dir, "HEAD")
    if os.path.islink(head_path):  # core.preferSymlinkRefs
        if os.readlink(head_path) == ref:
            names.append(("HEAD", os.path.join(git_dir, "logs", "HEAD")))
    else:
        try:
            with open(head_path, "rb") as fh:
                head = fh.read(1024)
        except OSError:
            head = b""
        if head.startswith(b"ref:") and head[4:].strip().decode("utf-8", "replace") == ref:
            names.append(("HEAD", os.path.join(git_dir, "logs", "HEAD")))
    if log_all == "always":
        create_any, create_std = True, True
    elif log_all is None:
        create_any, create_std = False, not bare
    else:
        create_any, create_std = False, bool(log_all)
    out = []
    for name, path in names:
        if os.path.isdir(path):
            raise Unsupported(f"reflog '{path}' is a folder")
        if os.path.isfile(path):
            out.append(path)
        elif create_any or (create_std and (name == "HEAD" or name.startswith(_AUTO_LOG_PREFIXES))):
            out.append(path)
    return out


def write_lock_content(common_dir: str, new: str) -> str:
    """A tmp file holding what a ref lock for ``new`` holds (not synced); its path, for :func:`swap`'s ``synced``.

    Named as :func:`swap`'s own tmp files (recovery removes them for a dead pid).
    """
    if not _LOOSE.fullmatch(new.encode()):
        raise Unsupported(f"'{new}' is not an object id")
    tmp = os.path.join(common_dir, f"{REF_TMP_PREFIX}{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}")
    write_new(tmp, new.encode() + b"\n")
    return tmp


def swap(common_dir: str, ref: str, expected: str, new: str, reflog_line: bytes, reflogs: list[str],
         precondition: Callable[[], None] | None = None, synced: str | None = None) -> list[str]:
    """Move ``ref`` from ``expected`` to ``new`` (module docstring); return the paths left to sync.

    ``synced``: a file from :func:`write_lock_content` for ``new`` that the
    caller has synced since: the lock is taken by linking it, and its content
    needs no sync of its own before the rename (one flush point less).  It is
    gone when this returns or raises.

    Raises:
        RefLockedError: ``<ref>.lock`` exists (a live git, or a stale lock).
        RefMovedError: under the lock, the ref is not at ``expected`` (nothing written).
        Unsupported: the ref is not a plain loose or packed oid (nothing written).
        GitStoreError: a write or sync failed before the rename (the ref is unchanged).
        Whatever ``precondition`` raises (the ref is unchanged).
    """
    if not _LOOSE.fullmatch(new.encode()):
        if synced is not None:
            with contextlib.suppress(OSError):
                os.unlink(synced)
        raise Unsupported(f"'{new}' is not an object id")
    path = os.path.join(common_dir, ref)
    lock = path + ".lock"
    folders: dict[str, None] = {}
    logs: list[str] = []  # the reflogs appended to: synced with the folders
    fds: list[int] = []
    locked = False
    lock_fd: int | None = None
    try:
        lock_fd = _take_lock(common_dir, lock, new.encode() + b"\n", folders, synced)
        if lock_fd is not None:
            fds.append(lock_fd)
        locked = True
        actual = read_ref(common_dir, ref)
        if actual != expected:
            raise RefMovedError(ref, actual, expected)
        if precondition is not None:
            precondition()
        for log in reflogs:
            folder = os.path.dirname(log)
            for made in make_dirs(folder, 0o777):  # git's modes: 0777 less the umask
                folders[os.path.dirname(made)] = None
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_CLOEXEC, 0o666)
            fds.append(fd)
            if os.fstat(fd).st_size == 0:
                folders[folder] = None  # created now (or empty): its entry must be made durable
            write_all(fd, reflog_line)
            logs.append(log)
        if lock_fd is not None:
            os.fsync(lock_fd)  # the lock's content, before it becomes the ref (else synced by the caller)
        os.replace(lock, path)
        locked = False
    except OSError as exc:
        raise GitStoreError(f"cannot update ref '{ref}': {exc.strerror or exc}") from exc
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if locked:
            with contextlib.suppress(OSError):
                os.unlink(lock)
    folders[os.path.dirname(path)] = None
    return [*folders, *logs]


def _take_lock(common_dir: str, lock: str, content: bytes, folders: dict[str, None],
               synced: str | None = None) -> int | None:
    """Create ``lock`` holding ``content`` (hard link of a complete tmp file); return its open descriptor.

    ``synced``: that tmp file, already written and synced by the caller (``None`` is returned).
    """
    if synced is not None:
        try:
            for made in make_dirs(os.path.dirname(lock), 0o777):
                folders[os.path.dirname(made)] = None
            link_as_lock(synced, lock)
        except FileExistsError:
            raise RefLockedError(lock) from None
        except OSError as exc:
            if exc.errno in _NO_LINK:
                raise Unsupported(f"cannot link a lock into '{os.path.dirname(lock)}': {exc}") from exc
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(synced)  # gone either way (make_dirs may have failed first)
        return None
    tmp = os.path.join(common_dir, f"{REF_TMP_PREFIX}{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o666)
    try:
        write_all(fd, content)
        # A packed ref whose folder has no loose ref yet: the folder is made first, as git does.
        for made in make_dirs(os.path.dirname(lock), 0o777):
            folders[os.path.dirname(made)] = None
        link_as_lock(tmp, lock)
    except FileExistsError:
        os.close(fd)
        raise RefLockedError(lock) from None
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if exc.errno in _NO_LINK:  # refs/ on another file system, or one without hard links
            raise Unsupported(f"cannot link a lock into '{os.path.dirname(lock)}': {exc}") from exc
        raise
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd

"""What both layouts of a directory target do to folders (docs/DIRECTORIES.md), with no layout of their own.

Used by :mod:`cas.generations` (a whole folder per generation) and
:mod:`cas.tree_folders` (a folder per git tree, shared): a real folder told
from a link to one (``lstat``), a folder compared with its manifest without
following any link, an untrusted entry moved aside, a folder removed without
reaching outside it, one sync of the file system, a tree's files by path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from typing import Any

import pygit2

from cas.durable import fsync_dir

__all__ = ["DIR_FLAGS", "QUARANTINE", "compare_folder", "is_real_folder", "quarantine_entry", "read_file_bytes",
           "remove_tree", "syncfs", "tree_files"]

#: A folder opened as itself: a symlink in its place fails (``ELOOP``), never followed.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
#: The prefix of an entry found under a generation's (or tree's) name and not trusted; never removed.
QUARANTINE = ".quarantine-"


def quarantine_entry(folder: str, name: str) -> str | None:
    """Move ``folder/name`` aside to ``folder/.quarantine-<name>-<pid>-<rand>``, unread; return where (``None``:
    nothing there).  Never pointed at, linked from, nor removed by ``gc`` or ``recover``."""
    aside = os.path.join(folder, f"{QUARANTINE}{name}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.rename(os.path.join(folder, name), aside)
    except FileNotFoundError:
        return None
    fsync_dir(folder)
    return aside


def read_file_bytes(path: str) -> bytes | None:
    """The bytes of the regular file ``path``, or ``None`` when it is no regular file (a fifo, a device, a socket,
    a folder, a symlink: never followed, never waited on).

    ``O_NONBLOCK``: opening a fifo put where a file was must not wait for a
    writer that never comes (``verify`` hung there); the descriptor's own
    ``fstat`` decides, so an entry swapped after the caller's ``lstat`` is
    judged by what was opened.

    Raises:
        PermissionError: the file cannot be read (made ``0000`` by hand).
        OSError: any other failure of the disk.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a symlink; a socket; a folder
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def tree_files(repo: pygit2.Repository, tree: str) -> dict[str, tuple[str, int]]:
    """Every non-tree entry of ``tree`` by path: ``(blob id, filemode)``."""
    out: dict[str, tuple[str, int]] = {}

    def walk(t: pygit2.Tree, prefix: str) -> None:
        for entry in t:
            name = prefix + str(entry.name)
            if entry.filemode == pygit2.enums.FileMode.TREE:
                walk(repo[entry.id].peel(pygit2.Tree), name + "/")
            else:
                out[name] = (str(entry.id), int(entry.filemode))

    walk(repo[tree].peel(pygit2.Tree), "")
    return out


def is_real_folder(path: str) -> bool:
    """``path`` is a folder itself (``lstat``: a symlink to one is not, nor a path through a file).

    Any other error (a permission, an I/O error) is raised: never read as "no folder".
    """
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def syncfs(path: str) -> None:
    """syncfs(2) of the file system holding ``path`` (``os.sync()`` where libc has none)."""
    import ctypes
    import ctypes.util

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def compare_folder(root: str, manifest: dict[str, Any]) -> list[str] | None:
    """Entries below the folder ``root`` that differ from ``manifest`` (``{path: [inode, size, mtime_ns, mode]}``),
    sorted; ``None`` when ``root`` is no real folder.  Real folders are walked (each must be 0555), symlinks
    are compared as entries, never followed.
    """
    try:
        top = os.open(root, DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError, OSError):
        return None
    changed: list[str] = []
    met: set[str] = set()  # files of the manifest met, unchanged or not
    stack = [("", top)]
    while stack:
        rel, fd = stack.pop()
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    st = entry.stat(follow_symlinks=False)
                    path = rel + entry.name
                    mode = st.st_mode
                    if stat.S_ISDIR(mode):
                        if stat.S_IMODE(mode) != 0o555:
                            changed.append(path + "/")
                        try:
                            sub = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                        except OSError:
                            # A folder this user cannot open (made 0000 by hand): it differs, and the
                            # files listed below it are reported as not met.
                            if stat.S_IMODE(mode) == 0o555:
                                changed.append(path + "/")
                            continue
                        stack.append((path + "/", sub))
                        continue
                    want = manifest.get(path)
                    if want is None:
                        changed.append(path)
                        continue
                    met.add(path)
                    if (want[0] != st.st_ino or want[1] != st.st_size or want[2] != st.st_mtime_ns
                            or want[3] != mode):
                        changed.append(path)
        finally:
            os.close(fd)
    if len(met) != len(manifest):  # some listed file is gone, or was not met where the walk went (no lookup by path:
        changed += [path for path in manifest if path not in met]  # a symlink planted on its way is never followed)
    return sorted(changed)


def remove_tree(folder: str) -> None:
    """Remove a generation's folder (read-only as built), never reaching outside it.

    The entry is ``lstat``-ed first: a symlink (or any other non-folder) is
    unlinked, never followed -- a link planted as ``generations/<tree>`` or
    ``.tmp-...`` must not make this chmod or delete what it points at.  A real
    folder is walked through directory descriptors (``os.fwalk`` without
    following links: each folder opened ``O_NOFOLLOW`` and checked to be the
    one listed), made writable with ``fchmod`` on its descriptor (never a
    ``chmod`` by path, which a swapped-in symlink would redirect), then removed
    by ``shutil.rmtree``'s descriptor-based walk.
    """
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder)
        return
    for _root, _dirs, _files, root_fd in os.fwalk(folder, follow_symlinks=False):
        with contextlib.suppress(OSError):
            os.fchmod(root_fd, 0o755)
    shutil.rmtree(folder, ignore_errors=True)

"""One parsed copy of a worktree's index per process, reused while the file is unchanged.

git's index is one file rewritten whole; at 100k entries parsing it costs
tens of milliseconds, and a call needs it twice (the dirty check before
prepare, the update after the branch moved) — more in a long-lived caller.
:class:`IndexSnapshot` parses it once through a hard link (``index`` linked to
``index<TMP_MARK><pid>``, which libgit2 may rewrite without touching the real
file) and remembers the file's identity (inode, size, mtime): while the real
index still has that identity the parsed copy is current and is reused.

Writing (:meth:`IndexSnapshot.install`) happens while the caller holds
``index.lock``: libgit2 writes the linked copy, which is fsynced and renamed
over ``index``; the snapshot then describes the new file and stays valid for
the next call.

Entries are added with full stat data built here (libgit2's
``git_index_add``), so ``git diff-files`` sees the files clean without
re-hashing them and no second index (for ``git_index_add_bypath``) is read.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pygit2

from cas.durable import TMP_MARK, fsync_dir
from cas.errors import GitStoreError
from cas.objects import TreeEntry

__all__ = ["IndexSnapshot", "snapshot_for"]

_MODE_TREE = 0o040000
_cache: dict[str, IndexSnapshot] = {}
_cache_lock = threading.Lock()


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class IndexSnapshot:
    """A parsed copy of ``<git_dir>/index``; see the module docstring."""

    def __init__(self, git_dir: str) -> None:
        self.git_dir = git_dir
        self.index_path = os.path.join(git_dir, "index")
        self.tmp = os.path.join(git_dir, f"index{TMP_MARK}{os.getpid()}-{threading.get_ident()}")
        self.identity = _identity(self.index_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.link(self.index_path, self.tmp)  # no index yet: an empty one is written
            self.index = pygit2.Index(self.tmp)
        except (OSError, pygit2.GitError) as exc:
            raise GitStoreError(f"cannot read index '{self.index_path}': {exc}") from exc
        finally:
            # The parsed copy lives in memory; the link is only needed to read it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)

    def current(self) -> bool:
        """Whether the real index is still the file this copy was parsed from (or last wrote)."""
        return self.identity is not None and _identity(self.index_path) == self.identity

    def entry(self, path: str) -> TreeEntry | None:
        try:
            ie = self.index[path]
        except KeyError:
            return None
        return TreeEntry(str(ie.id), int(ie.mode))

    def stage(self, workdir: str, removed: list[str], added: list[tuple[str, TreeEntry]]) -> None:
        """Set the entries of these paths: removed, or added with the stat data of the files now on disk."""
        from pygit2.errors import check_error
        from pygit2.ffi import C, ffi

        for path in removed:
            with contextlib.suppress(OSError, KeyError, pygit2.GitError):
                self.index.remove(path)
        for path, te in added:
            st = os.lstat(os.path.join(workdir, path))
            e = ffi.new("git_index_entry *")
            e.ctime.seconds = int(st.st_ctime) & 0xFFFFFFFF
            e.ctime.nanoseconds = st.st_ctime_ns % 1_000_000_000
            e.mtime.seconds = int(st.st_mtime) & 0xFFFFFFFF
            e.mtime.nanoseconds = st.st_mtime_ns % 1_000_000_000
            e.dev = st.st_dev & 0xFFFFFFFF
            e.ino = st.st_ino & 0xFFFFFFFF
            e.mode = te.mode
            e.uid = st.st_uid & 0xFFFFFFFF
            e.gid = st.st_gid & 0xFFFFFFFF
            e.file_size = st.st_size & 0xFFFFFFFF
            ffi.buffer(ffi.addressof(e, "id"))[:] = bytes.fromhex(te.oid)
            c_path = ffi.new("char[]", os.fsencode(path))
            e.path = c_path
            check_error(C.git_index_add(self.index._index, e))

    def install(self) -> None:
        """Write the copy and rename it over ``index`` (caller holds ``index.lock``); durable."""
        try:
            self.index.write()
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)  # libgit2 syncs only files of a repository it opened
            finally:
                os.close(fd)
            os.replace(self.tmp, self.index_path)
            fsync_dir(self.git_dir)
        except (OSError, pygit2.GitError) as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.identity = None
            raise GitStoreError(f"cannot write index '{self.index_path}': {exc}") from exc
        self.identity = _identity(self.index_path)


def snapshot_for(git_dir: str) -> IndexSnapshot:
    """The current parsed copy of ``git_dir``'s index (reused when the file is unchanged)."""
    key = f"{git_dir}\0{threading.get_ident()}"
    with _cache_lock:
        snap = _cache.get(key)
    if snap is None or not snap.current():
        snap = IndexSnapshot(git_dir)
        with _cache_lock:
            _cache[key] = snap
    return snap

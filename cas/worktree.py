"""Bringing a checked-out worktree and its index to a new commit, path by path.

* :func:`dirty_paths` — which of the touched paths have uncommitted changes
  (index or working file differs from the base commit, or an untracked or
  ignored file sits where the patch writes), checked *before* anything is
  prepared, so a user's work is never overwritten.
* :func:`unsafe_worktree_paths` — touched paths whose folders in the worktree
  are symlinks or files (a write would go through them).
* :func:`materialise` — write each touched file atomically (tmp beside it,
  fsync, rename; symlinks as symlinks; exec bit from the mode), reached
  through folder fds opened with ``O_NOFOLLOW``; then update just those
  entries of the index and write it once (git's ``index.lock`` protocol,
  through libgit2).

While oncepatch holds ``index.lock`` it contains ``oncepatch-index-lock <pid>``
(see :func:`update_index`), and a marker file in the store names it: recovery
removes a stale ``index.lock`` only when one of these proves it was ours and
its owner is dead.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Mapping

import pygit2

from cas.durable import TMP_MARK, fsync_dir, open_dir_nofollow, write_durable
from cas.hashing import git_blob_oid
from cas.errors import GitStoreError, RefLockedError, UnsafeWorktreePath
from cas.objects import GitStore, TreeEntry

__all__ = [
    "INDEX_LOCK_MARK",
    "update_index",
    "dirty_paths",
    "unsafe_worktree_paths",
    "materialise",
    "worktree_matches",
    "worktree_files_match",
    "index_matches",
]

_MODE_LINK = 0o120000
_MODE_EXEC = 0o100755
_MODE_TREE = 0o040000


def dirty_paths(workdir: str, paths: list[str]) -> list[str]:
    """Touched paths whose index entry or working file differs from HEAD (or that are untracked/ignored)."""
    repo = pygit2.Repository(workdir)
    dirty = []
    for path in paths:
        try:
            flags = repo.status_file(path)
        except KeyError:
            # Not in HEAD, not in the index, not on disk... unless a folder sits there.
            full = os.path.join(workdir, path)
            if os.path.lexists(full) and not os.path.isdir(full):
                dirty.append(path)
            elif os.path.isdir(full) and not os.path.islink(full) and os.listdir(full):
                dirty.append(path)
            continue
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot read status of '{path}' in '{workdir}': {exc}") from exc
        if flags != pygit2.enums.FileStatus.CURRENT:
            dirty.append(path)
    return dirty


def unsafe_worktree_paths(workdir: str, paths: list[str]) -> list[str]:
    """Paths whose leading folders in ``workdir`` are symlinks (writing there would follow them)."""
    bad = []
    for path in paths:
        parts = path.split("/")[:-1]
        cur = workdir
        for part in parts:
            cur = os.path.join(cur, part)
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                break
            if stat.S_ISLNK(st.st_mode):
                bad.append(path)
                break
            if not stat.S_ISDIR(st.st_mode):
                break  # a file where a folder goes: the tree replaces it
    return bad


def _remove_path(workdir: str, path: str) -> None:
    folder, name = os.path.split(path)
    try:
        with open_dir_nofollow(workdir, folder) as dfd:
            try:
                st = os.lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            if stat.S_ISDIR(st.st_mode):
                return  # a folder: only its entries are ours to remove
            os.unlink(name, dir_fd=dfd)
            fsync_dir(dir_fd=dfd)
    except FileNotFoundError:
        return
    # Prune folders left empty, like git does.
    while folder:
        try:
            os.rmdir(os.path.join(workdir, folder))
        except OSError:
            break
        folder = os.path.dirname(folder)


def _write_path(workdir: str, path: str, data: bytes, mode: int) -> None:
    folder, name = os.path.split(path)
    with open_dir_nofollow(workdir, folder, create=True) as dfd:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(name, dir_fd=dfd)
            if stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
                # The tree replaced a folder by a file: the folder must be empty by now.
                os.rmdir(name, dir_fd=dfd)
        if mode == _MODE_LINK:
            tmp = f".{name}{TMP_MARK}{os.getpid()}-link"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            os.symlink(os.fsdecode(data), tmp, dir_fd=dfd)
            try:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            fsync_dir(dir_fd=dfd)
        else:
            file_mode = 0o755 if mode == _MODE_EXEC else 0o644
            umask = os.umask(0)
            os.umask(umask)
            write_durable(name, data, mode=file_mode & ~umask, dir_fd=dfd, sync_dir=False)
            fsync_dir(dir_fd=dfd)


def materialise(
    store: GitStore,
    workdir: str,
    changes: Mapping[str, TreeEntry | None],
    *,
    lock_marker: str | None = None,
) -> None:
    """Write the touched paths of ``workdir`` and its index to match ``changes``.

    Deletions go first (a file may give way to a folder of the same name), then
    writes in path order.  ``lock_marker``: a file to hold while the index lock
    is ours (see the module docstring).

    Raises:
        UnsafeWorktreePath: a folder on a path is a symlink.
        RefLockedError: the worktree's ``index.lock`` is held.
        GitStoreError: libgit2 failed.
    """
    deletes = sorted((p for p, e in changes.items() if e is None), reverse=True)
    writes = sorted((p, e) for p, e in changes.items() if e is not None)
    try:
        for path in deletes:
            _remove_path(workdir, path)
        for path, entry in writes:
            _write_path(workdir, path, store.read_blob(entry.oid), entry.mode)
    except UnsafeWorktreePath:
        raise
    except OSError as exc:
        raise GitStoreError(f"cannot write worktree '{workdir}': {exc}") from exc
    update_index(workdir, [p for p in deletes], [p for p, _ in writes], lock_marker=lock_marker)


#: Content of an index.lock held by oncepatch (git's own locks hold index data).
INDEX_LOCK_MARK = b"oncepatch-index-lock "


def update_index(
    workdir: str,
    removed: list[str],
    added: list[str],
    *,
    lock_marker: str | None = None,
    timeout: float = 10.0,
) -> None:
    """Update just these entries of ``workdir``'s index (stat data from the files), safely against git.

    The read-modify-write happens while we hold ``index.lock`` by git's own
    protocol (``O_CREAT|O_EXCL``), so a concurrent ``git add``/``git commit``
    either waits for us or we wait for it — neither update is lost.  libgit2
    can only write the index through its own lock, so the lock is handed over
    (ours unlinked, libgit2's created) at the last moment; if another process
    took it in that gap, libgit2's write fails and the whole step is redone.
    Our lock file holds ``oncepatch-index-lock <pid>`` so recovery can prove a
    stale one was ours.

    Raises:
        RefLockedError: ``index.lock`` stayed held for ``timeout`` seconds.
        GitStoreError: libgit2 failed.
    """
    wt_repo = pygit2.Repository(workdir)
    index_lock = os.path.join(os.path.realpath(wt_repo.path), "index.lock")
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            fd = os.open(index_lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if time.monotonic() >= deadline:
                raise RefLockedError(index_lock) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            continue
        try:
            os.write(fd, INDEX_LOCK_MARK + str(os.getpid()).encode() + b"\n")
        finally:
            os.close(fd)
        if lock_marker is not None:
            write_durable(lock_marker, index_lock.encode() + b"\n", sync_dir=False)
        handed_over = False
        try:
            index = wt_repo.index
            index.read(True)
            for path in removed:
                with contextlib.suppress(OSError, KeyError, pygit2.GitError):
                    index.remove(path)
            for path in added:
                index.add(path)
            os.unlink(index_lock)
            handed_over = True
            try:
                index.write()
                return
            except pygit2.GitError as exc:
                if not os.path.exists(index_lock) or time.monotonic() >= deadline:
                    if os.path.exists(index_lock):
                        raise RefLockedError(index_lock) from exc
                    raise GitStoreError(f"cannot write index of '{workdir}': {exc}") from exc
                # Someone took index.lock in the hand-over gap: start again from a fresh read.
        finally:
            if not handed_over:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(index_lock)
            if lock_marker is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_marker)


def worktree_matches(store: GitStore, workdir: str, changes: Mapping[str, TreeEntry | None]) -> bool:
    """Whether the working files and the index entries already equal ``changes``."""
    return worktree_files_match(store, workdir, changes) and index_matches(workdir, changes)


def worktree_files_match(store: GitStore, workdir: str, changes: Mapping[str, TreeEntry | None]) -> bool:
    """Whether the working files (not the index) equal ``changes``."""
    for path, entry in changes.items():
        full = os.path.join(workdir, path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            if entry is not None:
                return False
            continue
        if entry is None:
            if not stat.S_ISDIR(st.st_mode):
                return False
            continue
        if entry.mode == _MODE_LINK:
            if not stat.S_ISLNK(st.st_mode) or os.fsencode(os.readlink(full)) != store.read_blob(entry.oid):
                return False
            continue
        if not stat.S_ISREG(st.st_mode):
            return False
        if bool(st.st_mode & 0o100) != (entry.mode == _MODE_EXEC):
            return False
        with open(full, "rb") as fh:
            if git_blob_oid(fh.read()) != entry.oid:
                return False
    return True


def index_matches(workdir: str, changes: Mapping[str, TreeEntry | None]) -> bool:
    """Whether the index entries of ``workdir`` equal ``changes``."""
    index = pygit2.Repository(workdir).index
    for path, entry in changes.items():
        try:
            ie = index[path]
        except KeyError:
            if entry is not None:
                return False
            continue
        if entry is None or str(ie.id) != entry.oid or int(ie.mode) != entry.mode:
            return False
    return True

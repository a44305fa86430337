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
  entries of the index and write it once (git's ``index.lock`` protocol;
  in place where :mod:`cas.index` proves it, else through pygit2's ``Index``).

While oncepatch holds ``index.lock`` it contains ``oncepatch-index-lock <pid> <host>``
(see :func:`hold_index_lock`), and a marker file in the store names it: recovery
removes a stale ``index.lock`` only when one of these proves it was ours and
its owner is dead.

The apply protocol takes ``index.lock`` *before* it moves the branch and keeps
it until the index is written (:func:`hold_index_lock`, ``held=`` of
:func:`materialise`), and stages the new entries in the index before the
branch moves (:func:`cas.index.stage_ahead`): ``git commit`` reads HEAD and the index
first and takes ``index.lock`` after, so it must never find the new HEAD
beside the old index — its commit would silently revert the change just landed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Collection, Mapping

import pygit2

from cas.durable import TMP_MARK, DurableBatch, fsync_all, fsync_dir, open_dir_nofollow, write_new
from cas.git_filters import blob_id_by_git, needs_git, smudged_by_git
from cas.pids import gone
from cas.hashing import git_blob_oid
from cas.errors import DurableWriteError, GitStoreError, RefLockedError, UnsafeWorktreePath
from cas.objects import GitStore, TreeEntry

__all__ = [
    "INDEX_LOCK_MARK",
    "index_lock_owner",
    "IndexLock",
    "hold_index_lock",
    "drop_lock_marks",
    "break_dead_own_index_lock",
    "dead_own_index_lock",
    "outside_sparse_checkout",
    "cleaned_oid",
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


def dirty_paths(store: GitStore, workdir: str, paths: list[str], head_tree: str | None) -> list[str]:
    """Touched paths whose index entry or working file differs from ``head_tree`` (or that are untracked/ignored).

    A touched path that is a folder in the worktree (a folder giving way to a
    file) is dirty when it holds any file the patch does not touch itself.
    The index is read through :func:`cas.index.snapshot_for` (parsed
    once per process while unchanged); working files are compared by content.
    ``store`` reads the trees (a linked worktree shares the object database).
    """
    from cas.index import snapshot_for

    git_dir = os.path.realpath(store.worktree_repo(workdir).path)
    snap = snapshot_for(git_dir)
    touched = set(paths)

    def check() -> list[str]:
        dirty = []
        for path in paths:
            full = os.path.join(workdir, path)
            if os.path.isdir(full) and not os.path.islink(full):
                for folder, _dirs, files in os.walk(full):
                    rel = os.path.relpath(folder, workdir).replace(os.sep, "/")
                    if any(f"{rel}/{name}" not in touched for name in files):
                        dirty.append(path)
                        break
                continue
            want = store.lookup_file(head_tree, path)
            if snap.entry(path) != want or not worktree_files_match(store, workdir, {path: want}):
                dirty.append(path)
        return dirty

    dirty = check()
    if not snap.confirm():  # the raw index's checksum, verified meanwhile, failed: ask libgit2
        dirty = check()
    if not dirty:
        snap.check_writable(paths)
    return dirty


def outside_sparse_checkout(store: GitStore, workdir: str, paths: list[str]) -> list[str]:
    """Those of ``paths`` a sparse checkout leaves out of ``workdir``: their index entries are skip-worktree.

    Asked of git (``git ls-files -t``: ``S``), only for paths already found
    dirty in a worktree with ``core.sparseCheckout`` on; libgit2 does not
    expose the flag.
    """
    import subprocess

    try:
        sparse = store.worktree_repo(workdir).config.get_bool("core.sparseCheckout")
    except (KeyError, pygit2.GitError, ValueError):
        sparse = False
    if not sparse or not paths:
        return []
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        res = subprocess.run(["git", "ls-files", "-t", "-z", "--", *paths], cwd=workdir, env=env,
                             capture_output=True, check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if res.returncode != 0:
        return []
    skipped = {os.fsdecode(item[2:]) for item in res.stdout.split(b"\0") if item.startswith(b"S ")}
    return [p for p in paths if p in skipped]


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


#: Worktree files written per durable batch (each holds its bytes and an open folder until the batch commits).
_WRITE_CHUNK = 128


def _queue_path(batch: DurableBatch, stack: contextlib.ExitStack, folders: dict[str, int], workdir: str,
                path: str, data: bytes, mode: int, umask: int) -> None:
    """Queue ``path``'s new content in ``batch``, its folder reached without following symlinks."""
    folder, name = os.path.split(path)
    dfd = folders.get(folder)
    if dfd is None:
        dfd = folders[folder] = stack.enter_context(open_dir_nofollow(workdir, folder, create=True))
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(name, dir_fd=dfd)
        if stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            # The tree replaced a folder by a file: the folder must be empty by now.
            os.rmdir(name, dir_fd=dfd)
    if mode == _MODE_LINK:
        batch.add_in_dir(dfd, name, symlink=os.fsdecode(data))
    else:
        # git's modes: 0777 or 0666 less the umask (under umask 002, group-writable files)
        batch.add_in_dir(dfd, name, data, mode=(0o777 if mode == _MODE_EXEC else 0o666) & ~umask)


def materialise(
    store: GitStore,
    workdir: str,
    changes: Mapping[str, TreeEntry | None],
    *,
    lock_marker: str | None = None,
    held: IndexLock | None = None,
    timeout: float = 0.0,
    tree: str | None = None,
    sync_first: list[str] | None = None,
    defer_dir: list[str] | None = None,
) -> None:
    """Write the touched paths of ``workdir`` and its index to match ``changes``.

    ``sync_first``: paths made durable before any file of the worktree changes
    (a moved branch's folder and reflogs): synced in the first batch's first
    round, or at once when a deletion comes first or nothing is written.
    ``defer_dir``: the index's folder, once the new index is renamed into it,
    is appended here for the caller to sync, instead of synced at once.

    Deletions go first (a file may give way to a folder of the same name), then
    writes in path order.  ``lock_marker``: a file to hold while the index lock
    is ours (see the module docstring).  ``held``: the worktree's index lock,
    already taken by the caller (and left held); else ``index.lock`` is waited
    for up to ``timeout`` seconds (the caller's lock timeout).  ``tree``: the commit's tree
    the changes come from; given, :func:`plain_checkout` may skip libgit2's
    filters.

    Raises:
        UnsafeWorktreePath: a folder on a path is a symlink.
        RefLockedError: the worktree's ``index.lock`` stayed held.
        GitStoreError: libgit2 failed.
    """
    deletes = sorted((p for p, e in changes.items() if e is None), reverse=True)
    writes = sorted((p, e) for p, e in changes.items() if e is not None)
    wt_repo: pygit2.Repository | None = None
    plain = tree is not None and plain_checkout(store, workdir, [p for p, _ in writes], tree)
    # The last batch's folders are synced with the new index file, before its
    # rename (the index names those files): their descriptors stay open until then.
    last_folders: list[str | int] = []
    with contextlib.ExitStack() as keep:
        try:
            if sync_first and (deletes or not writes):
                try:
                    fsync_all(sync_first)
                except DurableWriteError as exc:
                    store.sync_failed(exc, sync_first)
                    raise
                store.mark_synced(sync_first)
                sync_first = None
            for path in deletes:
                _remove_path(workdir, path)
            # Written in durable batches: tmp files synced together, renamed in path
            # order, their folders synced together (not two fsyncs per file in turn).
            umask = os.umask(0)  # files get git's modes less the umask, as git checks them out
            os.umask(umask)
            for start in range(0, len(writes), _WRITE_CHUNK):
                batch = DurableBatch()
                synced, sync_first = sync_first, None
                if synced:
                    batch.sync_first(synced)
                last = start + _WRITE_CHUNK >= len(writes)
                with contextlib.ExitStack() as stack:
                    folders: dict[str, int] = {}
                    for path, entry in writes[start:start + _WRITE_CHUNK]:
                        data = store.read_blob(entry.oid)
                        mode = entry.mode
                        if mode == _MODE_LINK and not symlinks_on(store, workdir):
                            mode = 0o100644  # core.symlinks=false: git writes the target as a plain file
                        elif entry.mode != _MODE_LINK and not plain:
                            if wt_repo is None:
                                wt_repo = store.worktree_repo(workdir)
                            # '*.bat eol=crlf', 'ident', a filter driver: written as git would
                            data = smudged(workdir, path, data, wt_repo, oid=entry.oid)
                        _queue_path(batch, keep if last else stack, folders, workdir, path, data, mode, umask)
                    try:
                        batch.commit(defer_folders=last_folders if last else None)
                    except DurableWriteError as exc:
                        if synced:
                            store.sync_failed(exc, synced)
                        raise
                if synced:
                    store.mark_synced(synced)
        except UnsafeWorktreePath:
            raise
        except OSError as exc:
            raise GitStoreError(f"cannot write worktree '{workdir}': {exc}") from exc
        try:
            update_index(workdir, [p for p in deletes], [p for p, _ in writes], lock_marker=lock_marker, held=held,
                         timeout=timeout,
                         known=dict(writes), also_sync=last_folders, defer_dir=defer_dir)
        except BaseException:
            with contextlib.suppress(Exception):
                fsync_all(last_folders)  # the index failed; the files it would name are made durable anyway
            raise
        if last_folders:  # no index was written (nothing to change in it)
            fsync_all(last_folders)


#: Content of an index.lock held by oncepatch (git's own locks hold index data).
INDEX_LOCK_MARK = b"oncepatch-index-lock "


class IndexLock:
    """``<git-dir>/index.lock`` of one worktree, created by us (git's ``O_CREAT|O_EXCL`` protocol).

    Calling sequence: :func:`hold_index_lock`, then any number of
    :func:`update_index` calls with ``held=``, then :meth:`release` (also on
    every error).  While it is held no git command writes the index, and
    ``git commit`` cannot start.  The store marker (``lock_marker``) exists
    exactly while the lock may be ours.
    """

    def __init__(self, path: str, git_dir: str, identity: tuple[int, int], marker: str | None) -> None:
        self.path = path
        self.git_dir = git_dir
        self._identity = identity
        self._marker = marker

    def release(self) -> None:
        """Remove the lock file — only if it is still the one we created — then the marker (safe to repeat).

        Each removal is tried up to :data:`RELEASE_ATTEMPTS` times.  Race
        guarded: a transient I/O error (EIO, EINTR, ...) on the unlink left
        ``index.lock`` behind a call that had ended; its process alive, the
        lock is never taken for a dead call's, so a long-lived caller met its
        own lock on every later call (``in_progress``) until it exited.

        Raises:
            OSError: the lock file (or then the marker) could not be removed on
                any attempt; the lock is still ours, and ``release`` may be
                called again.
        """
        _with_retries(self._unlink_lock)
        if self._marker is not None:
            marker = self._marker
            _with_retries(lambda: _unlink_if_there(marker))
            self._marker = None

    def _unlink_lock(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._identity:
            _unlink_if_there(self.path)


#: How many times :meth:`IndexLock.release` tries each removal before it gives up.
RELEASE_ATTEMPTS = 4


def _unlink_if_there(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _with_retries(step: Callable[[], None]) -> None:
    """Run ``step``; on an ``OSError``, again (short pauses), up to :data:`RELEASE_ATTEMPTS` times in all."""
    for attempt in range(RELEASE_ATTEMPTS):
        try:
            step()
            return
        except OSError:
            if attempt == RELEASE_ATTEMPTS - 1:
                raise
            time.sleep(0.005 * (4 ** attempt))  # 5, 20, 80 ms: a busy device, an interrupted call


# Mark files kept for a thread's next index lock: {(git dir, pid, thread): path} (hold_index_lock's keep_mark).
_KEPT_MARKS: dict[tuple[str, int, int, str | None], str] = {}
_KEPT_MARKS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _KEPT_MARKS_LOCK
    _KEPT_MARKS_LOCK = threading.Lock()  # a thread of the parent may have held it
    _KEPT_MARKS.clear()  # the parent's (keyed by its pid): never the child's to use or remove


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _lock_mark(git_dir: str, keep: bool, *, fresh: bool, owner: str | None = None) -> str:
    """A tmp file beside ``index.lock`` holding this process's mark (the kept one, unless ``fresh``).

    ``owner``: the receipt store the call records in, named after pid and host (a
    lock another store's call left is settled through that store).
    """
    key = (git_dir, os.getpid(), threading.get_ident(), owner)
    if keep and not fresh:
        with _KEPT_MARKS_LOCK:
            found = _KEPT_MARKS.get(key)
        if found is not None:
            return found
    tmp = os.path.join(git_dir, f".index.lock{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}")  # per thread
    named = f" {owner}" if owner and "\n" not in owner else ""
    write_new(tmp, INDEX_LOCK_MARK + f"{os.getpid()} {socket.gethostname()}{named}\n".encode(
        "utf-8", "surrogateescape"), 0o644)
    if keep:
        with _KEPT_MARKS_LOCK:
            old, _KEPT_MARKS[key] = _KEPT_MARKS.get(key), tmp
        if old is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
    return tmp


def drop_lock_marks() -> None:
    """Remove the mark files this thread kept for its next index lock (see :func:`hold_index_lock`)."""
    me = (os.getpid(), threading.get_ident())
    with _KEPT_MARKS_LOCK:
        paths = [_KEPT_MARKS.pop(k) for k in [k for k in _KEPT_MARKS if k[1:3] == me]]
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def hold_index_lock(workdir: str, *, timeout: float, lock_marker: str | None = None,
                    git_dir: str | None = None, keep_mark: bool = False,
                    on_dead: Callable[[str], None] | None = None, owner: str | None = None) -> IndexLock:
    """Take ``workdir``'s ``index.lock``, waiting up to ``timeout`` seconds while someone else holds it.

    The file holds ``oncepatch-index-lock <pid> <host>``; ``lock_marker`` (a
    file in the store) is written to name it, and removed on release.  A lock
    that oncepatch left on this host and whose process is gone is removed
    (:func:`break_dead_own_index_lock`); any other is waited for, never removed.

    ``git_dir``: the worktree's git dir (real path), when the caller knows it.
    ``keep_mark``: the tmp file the lock is linked from is kept for this
    thread's next lock of the same worktree, until :func:`drop_lock_marks`
    (the apply protocol takes two locks per call, and drops them as it ends).
    ``on_dead``: called once with the lock's path when a dead oncepatch call
    holds it, before it is removed.  That call may have moved the branch and
    died before bringing this worktree along; the lock is what keeps ``git
    commit`` from committing the stale index, so the caller first settles the
    calls it protects (the apply protocol: as ``recover`` does).

    Raises:
        RefLockedError: ``index.lock`` stayed held (a live git, or a stale lock of git's).
        GitStoreError: ``workdir`` is not a worktree libgit2 can open.
    """
    if git_dir is None:
        try:
            git_dir = os.path.realpath(pygit2.Repository(workdir).path)
        except (pygit2.GitError, KeyError) as exc:
            raise GitStoreError(f"cannot open worktree '{workdir}': {exc}") from exc
    index_lock = os.path.join(git_dir, "index.lock")
    deadline = time.monotonic() + timeout
    delay = 0.002
    # The lock is born with its mark: written to a tmp file beside it, then
    # link()ed to 'index.lock' (exclusive like O_CREAT|O_EXCL).  Race guarded: a
    # call killed between creating an empty lock and writing its mark would leave
    # a lock nothing could prove ours, blocking every later call.
    tmp = _lock_mark(git_dir, keep_mark, fresh=False, owner=owner)
    try:
        remade = False
        while True:
            try:
                os.link(tmp, index_lock)
                break
            except FileNotFoundError:
                if remade or not keep_mark:
                    raise
                # The kept mark was removed (by hand, or by a recovery that took this pid for dead).
                tmp, remade = _lock_mark(git_dir, keep_mark, fresh=True, owner=owner), True
            except FileExistsError:
                if on_dead is not None and dead_own_index_lock(index_lock):
                    settle, on_dead = on_dead, None
                    settle(index_lock)
                    continue
                if break_dead_own_index_lock(index_lock):
                    continue
                if time.monotonic() >= deadline:
                    raise RefLockedError(index_lock) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
    finally:
        if not keep_mark:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    st = os.lstat(index_lock)
    lock = IndexLock(index_lock, git_dir, (st.st_dev, st.st_ino), None)
    if lock_marker is not None:
        try:
            # Proof for recovery after a *process* crash: it must outlive the process,
            # not the machine (a reboot ends every lock's owner), so it is not fsynced.
            with open(lock_marker, "wb") as fh:
                fh.write(index_lock.encode() + b"\n")
        except BaseException:
            lock.release()
            raise
        lock._marker = lock_marker
    return lock


def index_lock_owner(index_lock: str) -> str | None:
    """The receipt store an oncepatch ``index.lock`` names (see :func:`_lock_mark`), ``None`` if none."""
    try:
        with open(index_lock, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return None
    if not head.startswith(INDEX_LOCK_MARK):
        return None
    fields = head[len(INDEX_LOCK_MARK):].rstrip(b"\n").split(b" ", 2)
    return fields[2].decode("utf-8", "surrogateescape") if len(fields) == 3 and fields[2] else None


def _dead_own_pid(head: bytes) -> int | None:
    """The pid of the oncepatch call on this host that wrote an ``index.lock`` starting with ``head``, if it is gone."""
    fields = head[len(INDEX_LOCK_MARK):].split() if head.startswith(INDEX_LOCK_MARK) else []
    if len(fields) < 2 or fields[1].decode("utf-8", "replace") != socket.gethostname():
        return None  # not ours, or written elsewhere: its owner cannot be checked from here
    try:
        pid = int(fields[0])
    except ValueError:
        return None
    # Alive (or its pid reused: waiting is the safe side), unless gone or a zombie.
    return pid if gone(pid) else None


def dead_own_index_lock(index_lock: str) -> bool:
    """Whether ``index_lock`` is held by an oncepatch call on this host that is gone (nothing is removed)."""
    try:
        with open(index_lock, "rb") as fh:
            return _dead_own_pid(fh.read(256)) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False


def break_dead_own_index_lock(index_lock: str) -> bool:
    """Remove ``index_lock`` if oncepatch wrote it on this host and its process is gone; ``True`` if it is gone.

    Only a lock whose content proves it ours (``oncepatch-index-lock <pid>
    <host>``, this host, no such pid) is touched; git's own locks hold index
    data and are never removed.  Race guarded: two processes finding the same
    dead lock — the second must not remove the lock the first has just
    created in its place — so the read and the unlink happen under an flock on
    the lock's folder, which every breaker takes, and the file unlinked must be
    the one read.
    """
    import fcntl

    folder = os.path.dirname(index_lock)
    dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            fd = os.open(index_lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return True
        try:
            head = os.read(fd, 256)
            read_id = os.fstat(fd)
        finally:
            os.close(fd)
        pid = _dead_own_pid(head)
        if pid is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(index_lock)
            if (st.st_dev, st.st_ino) == (read_id.st_dev, read_id.st_ino):
                from cas.index import settle_ahead

                # The dead call's index may be staged ahead of a branch that never moved:
                # the index it replaced comes back before anyone else may write it.
                settle_ahead(folder, None, pid=pid)
                os.unlink(index_lock)
        return True
    finally:
        os.close(dfd)  # drops the flock


def update_index(
    workdir: str,
    removed: list[str],
    added: list[str],
    *,
    lock_marker: str | None = None,
    timeout: float = 0.0,
    held: IndexLock | None = None,
    known: Mapping[str, TreeEntry | None] | None = None,
    also_sync: list[str | int] | None = None,
    defer_dir: list[str] | None = None,
    unstat: Collection[str] = (),
    sync: bool = True,
) -> None:
    """Update just these entries of ``workdir``'s index (stat data from the files), safely against git.

    ``also_sync``: synced with the new index file before its rename (emptied once synced).
    ``unstat``: paths of ``known`` set without stat data: their files hold
    something else (an edit by hand), which git then sees as a change.
    ``defer_dir``: the index's folder is appended here, not synced (the caller syncs it).
    ``sync``: ``False`` writes the new index without syncing it (see :func:`cas.index.stage_ahead`).

    The read-modify-write happens while we hold ``index.lock`` (``held``, or
    taken here and released after), so a concurrent ``git add``/``git commit``
    either waits for us or we wait for it — neither update is lost.

    libgit2 writes an index only through its own ``<index>.lock``, so it is
    given a hard link of the index to rewrite (``index<TMP_MARK><pid>``,
    replaced by libgit2's write, the original untouched), which is then
    renamed over ``index`` while our ``index.lock`` is still held.  Race
    guarded: handing ``index.lock`` itself over to libgit2 opened a gap in
    which ``git commit`` could take the lock and commit the old index.

    Raises:
        RefLockedError: ``index.lock`` (unless ``held``) stayed held for ``timeout`` seconds (the
            caller's lock timeout; 0: not waited for).
        GitStoreError: libgit2 failed.
    """
    lock = held if held is not None else hold_index_lock(workdir, timeout=timeout, lock_marker=lock_marker)
    try:
        _write_index(workdir, lock, removed, added, known, also_sync, defer_dir, unstat, sync)
    finally:
        if held is None:
            lock.release()


def _write_index(workdir: str, lock: IndexLock, removed: list[str], added: list[str],
                 known: Mapping[str, TreeEntry | None] | None = None,
                 also_sync: list[str | int] | None = None, defer_dir: list[str] | None = None,
                 unstat: Collection[str] = (), sync: bool = True) -> None:
    """Set these entries in the parsed copy of the index and install it (``index.lock`` is held).

    ``known``: the entries just written for these paths (their files are not re-hashed).
    """
    from cas.index import snapshot_for

    snap = snapshot_for(lock.git_dir)
    entries: list[tuple[str, TreeEntry]] = []
    for path in added:
        given = (known or {}).get(path)
        if given is not None:
            entries.append((path, given))
            continue
        full = os.path.join(workdir, path)
        try:
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                data = os.fsencode(os.readlink(full))
                mode = _MODE_LINK
            else:
                with open(full, "rb") as fh:
                    data = fh.read()
                mode = _MODE_EXEC if st.st_mode & 0o100 else 0o100644
        except OSError as exc:
            raise GitStoreError(f"cannot stage '{path}' in '{workdir}': {exc}") from exc
        entries.append((path, TreeEntry(git_blob_oid(data), mode)))
    try:
        snap.stage(workdir, removed, entries, unstat)
    except pygit2.GitError as exc:
        raise GitStoreError(f"cannot stage in '{workdir}': {exc}") from exc
    snap.install(also_sync, defer_dir, sync)


def worktree_matches(store: GitStore, workdir: str, changes: Mapping[str, TreeEntry | None]) -> bool:
    """Whether the working files and the index entries already equal ``changes``."""
    return worktree_files_match(store, workdir, changes) and index_matches(workdir, changes)


def worktree_files_match(store: GitStore, workdir: str, changes: Mapping[str, TreeEntry | None]) -> bool:
    """Whether the working files (not the index) equal ``changes``."""
    for path, entry in changes.items():
        full = os.path.join(workdir, path)
        try:
            st = os.lstat(full)
        except (FileNotFoundError, NotADirectoryError):  # a file may stand where a folder goes
            if entry is not None:
                return False
            continue
        if entry is None:
            if not stat.S_ISDIR(st.st_mode):
                return False
            continue
        if entry.mode == _MODE_LINK:
            if stat.S_ISREG(st.st_mode) and not symlinks_on(store, workdir):
                with open(full, "rb") as fh:  # core.symlinks=false: the target as a plain file
                    if fh.read() != store.read_blob(entry.oid):
                        return False
                continue
            if not stat.S_ISLNK(st.st_mode) or os.fsencode(os.readlink(full)) != store.read_blob(entry.oid):
                return False
            continue
        if not stat.S_ISREG(st.st_mode):
            return False
        if bool(st.st_mode & 0o100) != (entry.mode == _MODE_EXEC) and file_mode_on(store, workdir):
            return False  # (core.fileMode=false: git ignores the executable bit, and so does this)
        with open(full, "rb") as fh:
            data = fh.read()
        if git_blob_oid(data) == entry.oid:
            continue
        wt = store.worktree_repo(workdir)
        if needs_git(wt, path):  # git's own clean side decides (a filter driver, an encoding, $Id$)
            by_git = blob_id_by_git(workdir, path)
            if by_git is not None:
                if by_git != entry.oid:
                    return False
                continue
        if data != smudged(workdir, path, store.read_blob(entry.oid), wt, oid=entry.oid) and (
                cleaned_oid(workdir, path, data) != entry.oid):
            # Neither the bytes git would write nor bytes git stores as the blob: changed.
            # (A CRLF file under 'text=auto eol=lf' or 'core.autocrlf=input' that git
            # cleans to its LF blob is not: git's status compares the clean side.)
            return False
    return True


def _attribute_files(repo: pygit2.Repository, common_dir: str) -> bool:
    """Whether any attributes file outside the worktree's folders exists or is configured (libgit2's sources)."""
    cfg = repo.config
    if "core.attributesFile" in cfg:
        return True
    if "core.autocrlf" in cfg and str(cfg["core.autocrlf"]).strip().lower() not in ("false", "no", "off", "0", ""):
        return True
    places = [os.path.join(common_dir, "info", "attributes")]
    for level, name in ((pygit2.enums.ConfigLevel.SYSTEM, "gitattributes"), (pygit2.enums.ConfigLevel.XDG, "attributes")):
        try:
            dirs = pygit2.settings.search_path[level]
        except (pygit2.GitError, ValueError):
            return True
        places += [os.path.join(d, name) for d in (dirs or "").split(os.pathsep) if d]
    return any(os.path.lexists(p) for p in places)


def plain_checkout(store: GitStore, workdir: str, paths: list[str], tree: str) -> bool:
    """Whether no attribute (nor ``core.autocrlf``) can filter these paths on checkout: blobs go to disk as they are.

    libgit2 decides that by reading ``.gitattributes`` from the working folders
    and, where there is none, from the index — at 100k entries a cold process
    parses the index for it (about 60 ms).  This answers from the files
    themselves: no ``.gitattributes`` on disk or in ``tree`` in any folder on
    the paths, none among the paths, no ``info/attributes``, no configured,
    global or system attributes file, ``core.autocrlf`` unset or false.  (An
    index holding a ``.gitattributes`` that is neither on disk nor in the
    commit is not looked for.)  When this says ``False`` libgit2 decides, as
    before.
    """
    repo = store.worktree_repo(workdir)
    if _attribute_files(repo, store.common_dir):
        return False
    folders = {""}
    for path in paths:
        if path.rsplit("/", 1)[-1] == ".gitattributes":
            return False
        parts = path.split("/")[:-1]
        folders.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for folder in folders:
        rel = f"{folder}/.gitattributes" if folder else ".gitattributes"
        if os.path.lexists(os.path.join(workdir, rel)):
            return False
        if store.lookup_file(tree, rel) is not None:
            return False
    return True


def smudged(workdir: str, path: str, blob: bytes, repo: pygit2.Repository | None = None, *,
            oid: str | None = None) -> bytes:
    """``blob`` as git would write it into ``workdir`` at ``path`` (``.gitattributes`` filters).

    Without filters for the path (the usual case) the bytes come back as they are.
    ``repo``: the worktree's repository, when the caller has it open.  ``oid``:
    the blob's id; given, a path whose conversion only git reproduces (a
    filter driver, ``working-tree-encoding``, ``ident``:
    :mod:`cas.git_filters`) is converted by git.
    """
    try:
        wt = repo if repo is not None else pygit2.Repository(workdir)
        filters = wt.load_filter_list(path, pygit2.enums.FilterMode.TO_WORKTREE)
        if oid is not None and needs_git(wt, path):
            by_git = smudged_by_git(workdir, path, oid)
            if by_git is not None:
                return by_git
    except (pygit2.GitError, KeyError, ValueError):
        return blob
    if filters is None:
        return blob
    try:
        converted = _apply_filters(filters, blob)
    except pygit2.GitError:
        return blob
    if converted is None:  # NUL bytes, which pygit2 would cut: git converts them
        by_git = smudged_by_git(workdir, path, oid if oid is not None else git_blob_oid(blob))
        return blob if by_git is None else by_git
    return converted


def file_mode_on(store: GitStore, workdir: str) -> bool:
    """``core.fileMode`` of the worktree (true unless set false): whether git compares the executable bit."""
    return _setting_on(store, workdir, "core.fileMode")


def _setting_on(store: GitStore, workdir: str, name: str) -> bool:
    """A boolean setting of the worktree's configuration that is true unless set false."""
    try:
        return bool(store.worktree_repo(workdir).config.get_bool(name))
    except (KeyError, pygit2.GitError, ValueError):
        return True


def symlinks_on(store: GitStore, workdir: str) -> bool:
    """``core.symlinks`` of the worktree (true unless set false): git checks symlinks out as plain files then."""
    return _setting_on(store, workdir, "core.symlinks")


def cleaned_oid(workdir: str, path: str, data: bytes) -> str:
    """The blob id git gives ``data``, the file of ``workdir`` at ``path``: its clean filters applied.

    Without filters for the path that is the id of the bytes themselves.  The
    worktree's repository is kept open per worktree (a few racily clean
    entries of one index are asked in a row).
    """
    try:
        repo = _CLEAN_REPOS.get(workdir)
        if repo is None:
            if len(_CLEAN_REPOS) > 8:
                _CLEAN_REPOS.clear()
            repo = _CLEAN_REPOS[workdir] = pygit2.Repository(workdir)
        filters = repo.load_filter_list(path, pygit2.enums.FilterMode.TO_ODB)
        converted = data if filters is None else _apply_filters(filters, data)
    except (pygit2.GitError, KeyError, ValueError):
        converted = data
    if converted is None:  # NUL bytes, which pygit2 would cut: git hashes the file
        return blob_id_by_git(workdir, path) or git_blob_oid(data)
    return git_blob_oid(converted)


_CLEAN_REPOS: dict[str, pygit2.Repository] = {}


def _apply_filters(filters: pygit2.filter.FilterList, data: bytes) -> bytes | None:
    """libgit2's filters applied to ``data``; ``None`` for data holding a NUL byte.

    pygit2's ``FilterList.apply_to_buffer`` reads its result as a C string: a
    binary file under ``text`` came back cut at its first NUL byte.  libgit2's
    own filters (line endings) add no NUL byte, so a result of data without
    one is whole; data with one is left to git (:mod:`cas.git_filters`).
    """
    if b"\0" in data:
        return None
    return filters.apply_to_buffer(data)


def index_matches(workdir: str, changes: Mapping[str, TreeEntry | None]) -> bool:
    """Whether the index entries of ``workdir`` equal ``changes`` (read as :func:`cas.index.snapshot_for` reads it).

    Raises:
        UsageError: an index neither the in-place reader nor libgit2 can read (a split index), with the fix named.
    """
    from cas.index import snapshot_for

    snap = snapshot_for(os.path.realpath(pygit2.Repository(workdir).path))

    def check() -> bool:
        return all(snap.entry(path) == entry for path, entry in changes.items())

    same = check()
    if not snap.confirm():  # the raw index's checksum failed: libgit2 answers
        same = check()
    return same

"""The worktree's index under git's ``index.lock``: the lock, entry updates, the index staged ahead.

* :class:`IndexLock` / :func:`hold_index_lock` — ``<git-dir>/index.lock``
  taken as git takes it (exclusive create, here a ``link()`` of a file
  holding ``oncepatch-index-lock <pid> <host>``), waited for up to the call's
  lock timeout; a lock oncepatch left on this host whose process is gone is
  broken (:func:`break_dead_own_index_lock`), any other is waited for, never
  removed;
* :func:`update_index` — just these entries of the index, read and written
  while the lock is held (:mod:`cas.index` reads and installs the file);
* :func:`stage_ahead` / :func:`settle_ahead` — the candidate's entries staged
  in the index before the branch moves, the index they replaced kept until
  the move is known.

Staged ahead, because ``git commit`` reads HEAD, then the index, and only then
takes ``index.lock``: had the branch moved first, a commit that read the new
HEAD and the old index would revert the change just landed.  git's own
commands change the index first and HEAD after, and so does the apply
protocol, under the branch's ref lock just before the rename that moves it
(docs/CONCURRENCY.md tells the race and why the staging is not earlier).  The
staged entries have no stat data: the files are written after them, and git
compares their content.  The index they replaced is kept, hard-linked, as
``<git-dir>/index.oncepatch-base.<pid>.<candidate>`` until :func:`settle_ahead`
knows whether the branch moved; whoever breaks a dead call's marked
``index.lock`` settles that pid's kept index first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

import pygit2

from cas.durable import TMP_MARK, fsync_all, fsync_dir, write_new
from cas.errors import GitStoreError, RefLockedError, UsageError
from cas.hashing import git_blob_oid
from cas.index import open_index, snapshot_for
from cas.index_raw import RawIndex, Unsupported
from cas.objects import TreeEntry
from cas.pids import gone

__all__ = ["INDEX_LOCK_MARK", "IndexLock", "LockMarker", "RELEASE_ATTEMPTS", "hold_index_lock", "drop_lock_marks",
           "index_lock_owner", "dead_own_index_lock", "break_dead_own_index_lock", "update_index", "KEPT_PREFIX",
           "kept_indexes", "drop_orphan_kept", "stage_ahead", "settle_ahead", "on_branch"]

#: Content of an index.lock held by oncepatch (git's own locks hold index data).
INDEX_LOCK_MARK = b"oncepatch-index-lock "
#: How many times :meth:`IndexLock.release` tries each removal before it gives up.
RELEASE_ATTEMPTS = 4


class LockMarker(Protocol):
    """A file outside the git dir naming a lock while it may be ours (the receipt store's ``tmp/`` marker).

    Its owner opens it as it must (the store: through folder descriptors, never
    following a symlink): here it is only written and removed.
    """

    path: str

    def write(self, data: bytes) -> None:
        """Create or replace the file with ``data`` (not synced)."""

    def remove(self) -> None:
        """Remove the file; nothing if it is gone."""


class IndexLock:
    """``<git-dir>/index.lock`` of one worktree, created by us.

    Calling sequence: :func:`hold_index_lock`, any number of :func:`update_index`
    calls with ``held=``, :meth:`release` (also on every error).  The store
    marker (``lock_marker``) exists exactly while the lock may be ours.
    """

    def __init__(self, path: str, git_dir: str, identity: tuple[int, int], marker: LockMarker | None) -> None:
        self.path = path
        self.git_dir = git_dir
        self._identity = identity
        self._marker = marker

    def release(self) -> None:
        """Remove the lock file — only if it is still the one we created — then the marker (safe to repeat).

        Each removal is tried up to :data:`RELEASE_ATTEMPTS` times: a transient
        I/O error left ``index.lock`` behind a call that had ended, and a
        long-lived caller (alive, so never taken for dead) met it on every call.

        Raises:
            OSError: a removal failed on every attempt; the lock is still ours.
        """
        _with_retries(self._unlink_lock)
        if self._marker is not None:
            _with_retries(self._marker.remove)
            self._marker = None

    def _unlink_lock(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._identity:
            _unlink_if_there(self.path)


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


# Mark files kept for a thread's next index lock: {(git dir, pid, thread, owner): path} (hold_index_lock's keep_mark).
_KEPT_MARKS: dict[tuple[str, int, int, str | None], str] = {}
_KEPT_MARKS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _KEPT_MARKS_LOCK
    _KEPT_MARKS_LOCK = threading.Lock()  # a thread of the parent may have held it
    _KEPT_MARKS.clear()  # the parent's (keyed by its pid): never the child's to use or remove


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
            _unlink_if_there(old)
    return tmp


def drop_lock_marks() -> None:
    """Remove the mark files this thread kept for its next index lock (see :func:`hold_index_lock`)."""
    me = (os.getpid(), threading.get_ident())
    with _KEPT_MARKS_LOCK:
        paths = [_KEPT_MARKS.pop(k) for k in [k for k in _KEPT_MARKS if k[1:3] == me]]
    for path in paths:
        _unlink_if_there(path)


def hold_index_lock(workdir: str, *, timeout: float, lock_marker: LockMarker | None = None,
                    git_dir: str | None = None, keep_mark: bool = False,
                    on_dead: Callable[[str], None] | None = None, owner: str | None = None) -> IndexLock:
    """Take ``workdir``'s ``index.lock``, waiting up to ``timeout`` seconds while someone else holds it.

    ``lock_marker``: a file in the store naming the lock, removed on release.
    ``git_dir``: the worktree's git dir (real path), when the caller knows it.
    ``keep_mark``: the tmp file the lock is linked from is kept for this
    thread's next lock of the worktree, until :func:`drop_lock_marks`.
    ``on_dead``: called once with the lock's path when a dead oncepatch call
    holds it, before it is removed: that call may have moved the branch
    without bringing this worktree along, and the lock keeps ``git commit``
    from committing the stale index until the caller has settled it.

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
            _unlink_if_there(tmp)
    st = os.lstat(index_lock)
    lock = IndexLock(index_lock, git_dir, (st.st_dev, st.st_ino), None)
    if lock_marker is not None:
        try:
            # Proof for recovery after a *process* crash: it must outlive the process,
            # not the machine (a reboot ends every lock's owner), so it is not fsynced.
            lock_marker.write(index_lock.encode() + b"\n")
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

    Race guarded: of two processes finding the same dead lock, the second must
    not remove the lock the first has just created in its place; the read and
    the unlink happen under an flock on the folder, and the file unlinked must
    be the one read.
    """
    folder = os.path.dirname(index_lock)
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            fd = os.open(index_lock, os.O_RDONLY | os.O_NOFOLLOW)
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
                # The dead call's index may be staged ahead of a branch that never moved:
                # the index it replaced comes back before anyone else may write it.
                settle_ahead(folder, None, pid=pid)
                os.unlink(index_lock)
        return True
    finally:
        os.close(dfd)  # drops the flock


def update_index(workdir: str, removed: list[str], added: list[str], *, lock_marker: LockMarker | None = None,
                 timeout: float = 0.0, held: IndexLock | None = None,
                 known: Mapping[str, TreeEntry | None] | None = None, also_sync: list[str | int] | None = None,
                 defer_dir: list[str] | None = None, unstat: Collection[str] = (), sync: bool = True) -> None:
    """Update just these entries of ``workdir``'s index (stat data from the files), safely against git.

    Under ``index.lock`` (``held``, or taken here, waiting up to ``timeout``
    seconds), so a concurrent ``git add``/``git commit`` waits for us or we for
    it.  libgit2 rewrites a hard link of the index, renamed over ``index``
    while our lock is held: handing ``index.lock`` itself to libgit2 opened a
    gap in which ``git commit`` could take the lock and commit the old index.

    ``known``: the entries just written for these paths (not re-hashed).
    ``unstat``: paths set without stat data (their files hold an edit by hand,
    which git then sees).  ``also_sync``, ``defer_dir``, ``sync``: as
    :meth:`cas.index.IndexSnapshot.install`.

    Raises:
        RefLockedError: ``index.lock`` (unless ``held``) stayed held for ``timeout`` seconds.
        GitStoreError: libgit2 failed.
    """
    lock = held if held is not None else hold_index_lock(workdir, timeout=timeout, lock_marker=lock_marker)
    try:
        snap = snapshot_for(lock.git_dir)
        entries: list[tuple[str, TreeEntry]] = []
        for path in added:
            given = (known or {}).get(path)
            if given is None:
                given = _entry_of_file(workdir, path)
            entries.append((path, given))
        try:
            snap.stage(workdir, removed, entries, unstat)
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot stage in '{workdir}': {exc}") from exc
        snap.install(also_sync, defer_dir, sync)
    finally:
        if held is None:
            lock.release()


def _entry_of_file(workdir: str, path: str) -> TreeEntry:
    """The index entry git would give the file ``path`` of ``workdir`` (symlink, executable or plain)."""
    full = os.path.join(workdir, path)
    try:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            return TreeEntry(git_blob_oid(os.fsencode(os.readlink(full))), 0o120000)
        with open(full, "rb") as fh:
            return TreeEntry(git_blob_oid(fh.read()), 0o100755 if st.st_mode & 0o100 else 0o100644)
    except OSError as exc:
        raise GitStoreError(f"cannot stage '{path}' in '{workdir}': {exc}") from exc


#: ``<git-dir>/index.oncepatch-base.<pid>.<candidate>``: the index a call's staged index replaced.
KEPT_PREFIX = "index.oncepatch-base."


def kept_indexes(git_dir: str, pid: int | None = None) -> list[str]:
    """The kept indexes in ``git_dir`` (of process ``pid`` only, if given).

    Raises:
        OSError: ``git_dir`` could not be listed (EIO, EACCES): never read as "none kept",
            which would leave a crashed call's staged index in place of the one it kept.
    """
    try:
        names = os.listdir(git_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    want = KEPT_PREFIX if pid is None else f"{KEPT_PREFIX}{pid}."
    return sorted(os.path.join(git_dir, n) for n in names if n.startswith(want))


def drop_orphan_kept(git_dir: str, candidate: str) -> list[str]:
    """Remove the kept indexes of ``candidate`` whose call is gone and whose ``index.lock`` is not there; return them.

    The lock was removed by hand (breaking it settles the kept index): the
    index has moved on since, and the kept one is no longer the one to bring
    back.  A kept index whose dead call's lock is still there is left for
    whoever breaks that lock.
    """
    dropped: list[str] = []
    for kept in kept_indexes(git_dir):
        pid_text, _dot, named = os.path.basename(kept)[len(KEPT_PREFIX):].partition(".")
        try:
            pid = int(pid_text)
        except ValueError:
            continue
        if named != candidate or not gone(pid):
            continue
        try:
            with open(os.path.join(git_dir, "index.lock"), "rb") as fh:
                if _dead_own_pid(fh.read(256)) == pid:
                    continue
        except (FileNotFoundError, NotADirectoryError):
            pass
        with contextlib.suppress(FileNotFoundError):
            os.unlink(kept)
            dropped.append(kept)
    return dropped


def stage_ahead(workdir: str, lock: IndexLock, changes: Mapping[str, TreeEntry | None], candidate: str) -> bool:
    """Set ``changes`` (path → the candidate's entry, ``None``: no file) in the index, keeping the index it replaces.

    ``lock``: the worktree's ``index.lock``, held.  Not synced: a crash brings
    the kept index back.  ``False``: the worktree has no index, nothing written.

    Raises:
        GitStoreError: the index could not be written (the kept one is left for :func:`settle_ahead`).
    """
    git_dir = lock.git_dir
    kept = os.path.join(git_dir, f"{KEPT_PREFIX}{os.getpid()}.{candidate}")
    try:
        for stale in kept_indexes(git_dir):
            # Its index.lock was removed by hand, not broken (that settles it): the
            # index has moved on since, and this is no longer the one to bring back.
            os.unlink(stale)
        try:
            os.link(os.path.join(git_dir, "index"), kept)
        except FileNotFoundError:
            return False
    except OSError as exc:
        raise GitStoreError(f"cannot keep the index of '{workdir}' as '{kept}': {exc}") from exc
    removed = sorted(p for p, e in changes.items() if e is None)
    added = sorted(p for p, e in changes.items() if e is not None)
    update_index(workdir, removed, added, held=lock, known=changes, unstat=set(added), sync=False)
    return True


def settle_ahead(git_dir: str, moved: bool | None, *, pid: int | None = None, sync_index: bool = False) -> None:
    """The staged index of process ``pid`` (this one by default): kept if the branch moved, else the kept one back.

    ``moved``: whether the branch moved to the candidate; ``None``: unknown (a
    failed swap, a dead call), then the staged index stays only when the
    candidate is on the branch and the index is readable (a machine crash may
    tear the unsynced index).  ``sync_index``: a staged index that stays is
    synced first (the files could not be written after it).  A kept index
    that cannot be removed is left for the next :func:`stage_ahead`.

    Raises:
        OSError: the kept index could not be put back.
    """
    index = os.path.join(git_dir, "index")
    for kept in kept_indexes(git_dir, os.getpid() if pid is None else pid):
        candidate = os.path.basename(kept)[len(KEPT_PREFIX):].split(".", 1)[-1]
        stays = moved if moved is not None else on_branch(git_dir, candidate) and _readable(index)
        if stays:
            with contextlib.suppress(OSError):
                if sync_index:
                    fsync_all([index, git_dir])
                os.unlink(kept)
        elif _same_file(kept, index):  # killed between keeping it and writing the staged one
            os.unlink(kept)
        else:
            os.replace(kept, index)
            fsync_dir(git_dir)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return False


def on_branch(git_dir: str, candidate: str) -> bool:
    """Whether ``candidate`` is the head of ``git_dir``'s checked-out branch, or behind it."""
    try:
        repo = pygit2.Repository(git_dir)
        tip = str(repo.head.target)
        return tip == candidate or bool(repo.descendant_of(tip, candidate))
    except (pygit2.GitError, KeyError, ValueError):
        return False


def _readable(index: str) -> bool:
    """Whether ``index`` reads whole (checksum verified): by :mod:`cas.index_raw` (a sparse index), else libgit2."""
    if not os.path.isfile(index):
        return False  # libgit2 would open it as an empty index
    with contextlib.suppress(Unsupported, OSError, ValueError):
        RawIndex(index).verified()
        return True
    with contextlib.suppress(UsageError, GitStoreError):
        open_index(index)
        return True
    return False

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

:class:`DurableBatch` is the same sequence for several files that must be
durable together (a receipt and the folders it relies on, a worktree's
files): every tmp file
is written first, then all are fsynced *at once* (one thread each, so the
filesystem commits them as one group instead of one journal commit after
another), then renamed in the order they were added, then every folder
touched is fsynced at once.  Step for step it keeps the single-file
guarantees: no file is renamed before its data is synced, the batch is
durable before ``commit`` returns, a failure before the renames leaves no tmp
file and no target changed.

Both take an optional ``dir_fd``: the path is then relative to that open
folder, which is how worktree writes avoid following symlinked folders.
:func:`open_dir_nofollow` opens such a folder one component at a time with
``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import sys
import threading
from queue import SimpleQueue
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

from cas.errors import DurableWriteError, UnsafeWorktreePath


__all__ = [
    "TMP_MARK",
    "BatchPart",
    "NotRegularFile",
    "open_regular",
    "DurableBatch",
    "fsync_all",
    "free_on_threads",
    "write_durable",
    "append_durable",
    "fsync_dir",
    "open_dir_nofollow",
    "is_own_tmp",
    "make_dirs",
    "write_all",
    "write_new",
    "exchange",
]

#: Every tmp file this module creates has this in its name; cleanup only ever
#: deletes names containing it (git's prune rule: only what is provably ours).
TMP_MARK = ".optmp-"

#: A batch syncs its first this-many tmp files through the descriptors that
#: wrote them (an open by name costs a path walk); larger batches reopen the
#: rest by name when syncing, so a batch never holds more descriptors.
_KEEP_OPEN_MAX = 64

_O_BINARY = getattr(os, "O_BINARY", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _token() -> str:
    """Eight random hex digits for tmp names (a seam: tests plant files at a known name)."""
    return os.urandom(4).hex()


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


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (looping on short writes)."""
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
) -> None:
    """Replace ``path`` with ``data`` atomically and durably (steps in the module docstring).

    ``mode`` is applied to the new file exactly (umask does not narrow it).

    Raises:
        DurableWriteError: the write failed; the target is unchanged, no tmp remains.
    """
    folder, name = os.path.split(path)
    tmp_name = f".{name}{TMP_MARK}{os.getpid()}-{_token()}"
    tmp = os.path.join(folder, tmp_name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY | _O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise DurableWriteError(path, exc) from exc
    try:
        try:
            write_all(fd, data)
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
    try:
        fsync_dir(folder or ".", dir_fd=dir_fd)
    except OSError as exc:
        # The rename happened; only its durability is in doubt.
        raise DurableWriteError(path, exc, effect_status="unknown") from exc


def append_durable(path: str, data: bytes, *, sync: bool = True) -> None:
    """Append ``data`` to ``path`` (created if missing) and fsync it.

    A new file's folder is synced too.  Callers serialise appends with a lock.
    ``sync=False``: the append is written but not fsynced; the caller fsyncs
    ``path`` before it relies on the record (:meth:`DurableBatch.commit`'s
    ``after_renames`` does, in the batch's last round).

    Raises:
        DurableWriteError: the append failed (a partial line may remain; readers
            of append-only logs must tolerate a torn last line).
    """
    created = not os.path.exists(path)
    try:
        # O_NOFOLLOW: a log replaced by a symlink is refused, never appended through.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
        try:
            write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(os.path.dirname(path) or ".")
    except OSError as exc:
        raise DurableWriteError(path, exc) from exc


@contextlib.contextmanager
def open_dir_nofollow(root: str, rel_dir: str, *, create: bool = False, mode: int = 0o777,
                      gained: list[int] | None = None) -> Iterator[int]:
    """Yield an fd of ``root/rel_dir`` reached without following any symlink below ``root``.

    With ``create``, missing folders are made (``mode``, less the umask) and
    their parents synced -- or, with ``gained``, the parents' descriptors are
    appended to it, kept open until the context exits, for the caller to sync.

    Raises:
        UnsafeWorktreePath: a component is a symlink or not a folder.
    """
    fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    kept: list[int] = []
    try:
        for part in [p for p in rel_dir.split("/") if p]:
            try:
                nfd = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
                    os.mkdir(part, mode, dir_fd=fd)
                if gained is None:
                    os.fsync(fd)
                else:
                    gained.append(fd)
                    kept.append(fd)
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
            if fd not in kept:
                os.close(fd)
            fd = nfd
        yield fd
    finally:
        for one in {fd, *kept}:
            os.close(one)


_T = TypeVar("_T")
_R = TypeVar("_R")


# -- freeing blocks -------------------------------------------------------------

#: Threads that free files' or folders' blocks at once (:func:`free_on_threads`).  Freeing is
#: paid inside the ``unlink``, ``rmdir`` or ``rename`` over a file, and on a disk that discards
#: freed blocks (ext4 ``-o discard``, as many virtual disks are mounted) it waits on the
#: device: measured, 300 small synced files freed one after another 1.7-2.9 ms each, on four
#: threads 0.2-0.3 ms each; 256 empty folders 0.70-0.81 s in turn, 0.11-0.13 s on four threads.
FREE_THREADS = 4


def free_on_threads(free: Callable[[_T], _R], items: list[_T]) -> list[_R]:
    """``[free(item) for item in items]``, spread over :data:`FREE_THREADS` threads (os calls only,
    never libgit2).  Where no thread can be started (Python 3.12 and later refuse new threads in
    exit handlers), the rest run in this thread.  ``free`` must not raise."""
    results: list[_R | None] = [None] * len(items)

    def part(n: int) -> None:
        for i in range(n, len(items), FREE_THREADS):
            results[i] = free(items[i])

    started = []
    for n in range(FREE_THREADS):
        thread = threading.Thread(target=part, args=(n,), daemon=True)
        try:
            thread.start()
        except RuntimeError:  # (at interpreter shutdown)
            for rest in range(n, FREE_THREADS):
                part(rest)
            break
        started.append(thread)
    for thread in started:
        thread.join()
    return results  # type: ignore[return-value]  # (every slot is filled by now)


# -- several files at once ------------------------------------------------------

_POOL: _Syncers | None = None
_POOL_PID = 0
_POOL_GUARD = threading.Lock()
_POOL_THREADS = 8
#: Rounds of this many paths are synced in the calling thread.  Two paths synced one after
#: the other cost two journal commits when the first is a folder (its commit does not carry
#: the second file's appended data); on two threads they share one (measured: a receipt's
#: folder and the ledger, median 4.5 ms one after the other, 0.46 ms together).
_INLINE_MAX = 1


def _forget_pool_in_child() -> None:
    # A forked child has none of the parent's threads, and a guard a parent thread
    # held at the fork would stay held for ever: start afresh.
    global _POOL, _POOL_PID, _POOL_GUARD
    _POOL, _POOL_PID, _POOL_GUARD = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


_Synced = str | int | tuple[int, str]


class _Round:
    """One round's syncs handed to the threads: what failed, and a latch the last one opens.

    The caller waits once for the whole round (a future per sync woke it once per
    unfinished sync, and cost a condition each: about half of a round's overhead).
    """

    __slots__ = ("_left", "_guard", "_done", "failures")

    def __init__(self, n: int) -> None:
        self._left = n
        self._guard = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()  # released by the round's last sync, in whichever thread
        self.failures: dict[int, tuple[_Synced, BaseException]] = {}  # by position in the round

    def run(self, n: int, target: _Synced) -> None:
        try:
            _fsync_path(target)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self.failures[n] = (target, exc)
        with self._guard:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done.release()

    def wait(self) -> None:
        self._done.acquire()


class _Syncers:
    """The fsync threads: daemons that take ``(round, position, target)`` from one queue."""

    def __init__(self) -> None:
        self._queue: SimpleQueue[tuple[_Round, int, _Synced]] = SimpleQueue()
        for n in range(_POOL_THREADS):
            threading.Thread(target=self._serve, name=f"oncepatch-fsync-{n}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            rnd, n, target = self._queue.get()
            rnd.run(n, target)

    def start(self, targets: list[_Synced], first: int = 0) -> _Round:
        """Hand ``targets`` to the threads (positions counted from ``first``); the caller waits on the round."""
        rnd = _Round(len(targets))
        for n, target in enumerate(targets, first):
            self._queue.put((rnd, n, target))
        return rnd


def _pool() -> _Syncers:
    """The fsync threads (re-made in a forked child, where the parent's threads do not exist)."""
    global _POOL, _POOL_PID
    pool = _POOL
    if pool is not None and _POOL_PID == os.getpid():
        return pool
    with _POOL_GUARD:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL = _Syncers()
            _POOL_PID = os.getpid()
        return _POOL


def _fsync_path(target: str | int | tuple[int, str]) -> None:
    if isinstance(target, int):
        os.fsync(target)
        return
    if isinstance(target, tuple):
        fd = os.open(target[1], os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW, dir_fd=target[0])
    else:
        fd = os.open(target, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shown(target: str | int | tuple[int, str]) -> str:
    if isinstance(target, int):
        return f"<fd {target}>"
    if isinstance(target, tuple):
        return target[1]
    return target


def fsync_all(paths: Iterable[str | int | tuple[int, str]], *, alongside: Callable[[], None] | None = None) -> None:
    """fsync every path (files or folders) concurrently; return when all are synced.

    A path may also be given as an open folder's fd, or as ``(folder fd, name)``.

    Concurrent fsyncs of one filesystem are committed together (ext4 and xfs
    group them into one journal commit), so n files cost about one flush, not n.

    ``alongside``: run in this thread while the syncs run in the pool's (work
    that waits on syncs of its own, so that the two waits overlap); this
    returns when both are done.  What it raises is raised once every sync
    has ended (the descriptors it was given stay usable until then).

    Raises:
        DurableWriteError: a sync failed (the first failure named; all were
            attempted, and ``failed`` lists every path that failed).
    """
    todo = list(dict.fromkeys(paths))
    if alongside is not None:
        _fsync_alongside(todo, alongside)
        return
    if not todo:
        return
    if len(todo) <= _INLINE_MAX:
        # A thread hand-off costs ~50-100 µs; for one file it buys nothing.
        failures: dict[int, tuple[_Synced, BaseException]] = {}
        for n, p in enumerate(todo):
            try:
                _fsync_path(p)
            except OSError as exc:
                failures[n] = (p, exc)
    else:
        rnd = _pool().start(todo[1:], first=1)
        try:
            _fsync_path(todo[0])  # this thread syncs one too instead of only waiting
        except OSError as exc:
            rnd.failures[0] = (todo[0], exc)
        finally:
            rnd.wait()
        failures = rnd.failures
    _raise_failures(failures)


def _raise_failures(failures: dict[int, tuple[_Synced, BaseException]]) -> None:
    """Raise the round's first failure (by position) as :class:`DurableWriteError` naming every failed path.

    Anything but an ``OSError`` (a bug) is raised as it is.
    """
    if not failures:
        return
    found = [failures[n] for n in sorted(failures)]
    for _target, exc in found:
        if not isinstance(exc, OSError):
            raise exc
    first = found[0]
    assert isinstance(first[1], OSError)
    _raise_sync_failure((first[0], first[1]), [target for target, _exc in found])


def _fsync_alongside(todo: list[str | int | tuple[int, str]], alongside: Callable[[], None]) -> None:
    """:func:`fsync_all` with ``alongside``: every sync in the pool, ``alongside()`` here."""
    rnd = _pool().start(todo) if todo else None
    try:
        alongside()
    finally:
        # Every sync ends before this returns or raises: a caller may close or unlink what they use.
        if rnd is not None:
            rnd.wait()
    if rnd is not None:
        _raise_failures(rnd.failures)


def _raise_sync_failure(first: tuple[str | int | tuple[int, str], OSError], failed: list[object]) -> None:
    err = DurableWriteError(_shown(first[0]), first[1])
    err.target = first[0]
    err.failed = list(failed)
    raise err from first[1]


class _Item:
    __slots__ = ("path", "shown", "data", "mode", "tmp", "dir_fd", "symlink", "fd")

    def __init__(self, path: str, data: bytes | memoryview | None, mode: int, *,
                 dir_fd: int | None = None, symlink: str | None = None, shown: str | None = None) -> None:
        self.path = path  # a name in ``dir_fd`` when that is given
        self.shown = shown or path  # the file as errors name it
        self.data = data
        self.mode = mode
        self.dir_fd = dir_fd
        self.symlink = symlink
        self.tmp: str | None = None
        self.fd: int | None = None  # the tmp file, kept open from its write to its sync


class BatchPart(Protocol):
    """Files written by someone else that a :class:`DurableBatch` makes durable with its own (:meth:`DurableBatch.join`)."""

    def to_sync(self) -> list[str]:
        """The files whose bytes must be synced before any of them or of the batch's gets its name."""
        ...

    def place(self) -> list[int]:
        """Give the synced files their names; return open folders to sync in the batch's last round."""
        ...

    def discard(self) -> None:
        """The batch failed before its renames: remove what was not placed."""
        ...


class DurableBatch:
    """Files made durable together, with two rounds of concurrent fsyncs (module docstring).

    ``add`` queues a file; ``commit`` writes, syncs and renames them all.
    """

    def __init__(self) -> None:
        self._items: list[_Item] = []
        self._paths: set[str] = set()
        self._open: dict[int, str] = {}  # descriptors to sync, and the file each is
        self._kept = 0  # tmp files still open from their write
        self._also: list[str] = []  # synced in the first round, written by someone else
        self._alongside: Callable[[], None] | None = None  # runs while the first round syncs
        self._parts: list[BatchPart] = []  # files written by someone else, placed before this batch's

    def __len__(self) -> int:
        return len(self._items)

    def add(self, path: str, data: bytes | memoryview, *, mode: int = 0o644) -> None:
        """Queue ``path`` with ``data`` (its tmp file is ``.<name>`` + :data:`TMP_MARK` + pid, beside it).

        Raises:
            ValueError: ``path`` is already in this batch.
        """
        if path in self._paths:
            raise ValueError(f"'{path}' is already in this batch")
        self._paths.add(path)
        self._items.append(_Item(path, data, mode))

    def add_in_dir(self, dir_fd: int, name: str, data: bytes | memoryview | None = None, *, mode: int = 0o644,
                   symlink: str | None = None, shown: str | None = None) -> None:
        """Queue ``name`` in the open folder ``dir_fd`` (reached without following links by the caller).

        With ``symlink``, the entry becomes a symbolic link to it (made as a tmp
        link, renamed like a file; only its folder is synced).  The caller keeps
        ``dir_fd`` open until :meth:`commit` returns.  ``shown``: the file's
        path as errors name it (default: ``name``).
        """
        if (data is None) == (symlink is None):
            raise ValueError("give exactly one of data and symlink")
        key = f"{dir_fd}\0{name}"
        if key in self._paths:
            raise ValueError(f"'{name}' is already in this batch")
        self._paths.add(key)
        self._items.append(_Item(name, data, mode, dir_fd=dir_fd, symlink=symlink, shown=shown))

    def sync_first(self, paths: list[str]) -> None:
        """Sync ``paths`` (written earlier, e.g. a moved ref's folder) in this batch's first round.

        So they are durable before any of this batch's files is renamed.
        """
        self._also.extend(paths)

    def join(self, part: BatchPart) -> None:
        """Make ``part``'s files durable with this batch's own, in the same two rounds.

        Its files are synced in the first round with the batch's tmp files,
        then placed (:meth:`BatchPart.place`) before the batch's first rename,
        and the folders it returns are synced in the last round.  A failure
        before the batch's renames discards it with the tmp files.  A batch
        with parts syncs its last round itself (no ``defer_folders``); the
        part's owner closes what it opened once :meth:`commit` has returned.
        """
        self._parts.append(part)

    def alongside_first(self, step: Callable[[], None]) -> None:
        """Run ``step`` in :meth:`commit` while the first round syncs; no file is renamed before it returns.

        For a step that makes something durable on its own which this batch's
        files rely on (libgit2's creation of a ref, which syncs its lock file
        and folder one after another): its syncs and the first round's
        overlap instead of following one another.  If it raises, nothing of
        the batch is renamed (its tmp files are removed) and the error
        propagates.
        """
        if self._alongside is not None:
            raise ValueError("a batch runs one step alongside its first round")
        self._alongside = step

    def commit(self, *, before_replace: Callable[[], None] | None = None,
               after_renames: Callable[[], Iterable[str | int]] | None = None,
               defer_folders: list[str | int] | None = None) -> None:
        """Write, sync and rename every queued file; then sync their folders.

        ``before_replace`` runs when every tmp file is written and synced and
        every file but the last is renamed, just before the last rename (a
        crash point: the last file is the one a caller cares about).
        ``after_renames`` runs after the last rename and returns more paths (or
        open folders' descriptors) to sync in the last round (a log the caller
        appended to without syncing, folders it made).
        ``defer_folders``: the last round is not made here; its folders (paths,
        or descriptors the caller keeps open) are appended to this list, and
        the caller syncs them with its next round.

        Raises:
            DurableWriteError: nothing was renamed (no tmp file left, every
                target unchanged) — or, with ``effect_status="unknown"``, the
                renames happened and only the last round's syncs failed.
        """
        if defer_folders is not None and self._parts:
            raise ValueError("a batch with parts syncs its last round itself")
        folders: dict[str | int, None] = {}
        try:
            for item in self._items:
                if item.dir_fd is not None:
                    folders[item.dir_fd] = None
                    self._write_tmp(item)
                    continue
                folder = os.path.dirname(item.path)
                for made in make_dirs(folder):
                    folders[os.path.dirname(made)] = None  # a new folder's entry lives in its parent
                folders[folder] = None
                self._write_tmp(item)
            targets: list[str | int | tuple[int, str]] = []
            for item in self._items:
                if item.symlink is not None:
                    continue
                if item.fd is not None:
                    targets.append(item.fd)
                    self._open[item.fd] = item.shown
                    item.fd = None
                else:
                    targets.append(_synced_file(item))
            targets += self._also
            for part in self._parts:
                targets += part.to_sync()
            try:
                fsync_all(targets, alongside=self._alongside)
            except DurableWriteError as err:  # name the files, not their descriptors
                named: list[object] = [self._open.get(t, t) if isinstance(t, int) else t for t in err.failed]
                if isinstance(err.target, int) and err.target in self._open:
                    again = DurableWriteError(self._open[err.target], err.cause)
                    again.target, again.failed = self._open[err.target], named
                    raise again from err.cause
                err.failed = named
                raise
            finally:
                self._close_open()
            placed: list[int] = []
            for part in self._parts:
                placed += part.place()  # named before this batch's files, which may name them
        except BaseException as exc:
            self._discard()
            for part in self._parts:
                part.discard()
            if isinstance(exc, OSError) and not isinstance(exc, DurableWriteError):
                # Name the file the system refused (a tmp file's folder, say), not the batch's first.
                failed = exc.filename if isinstance(exc.filename, str) else None
                raise DurableWriteError(failed or (self._items[0].shown if self._items else ""), exc) from exc
            raise
        last = len(self._items) - 1
        for n, item in enumerate(self._items):
            if n == last and before_replace is not None:
                try:
                    before_replace()
                except BaseException:
                    self._discard(start=n)
                    raise
            assert item.tmp is not None
            try:
                os.replace(item.tmp, item.path, src_dir_fd=item.dir_fd, dst_dir_fd=item.dir_fd)
            except OSError as exc:
                self._discard(start=n)
                raise DurableWriteError(item.shown, exc) from exc
            item.tmp = None
        extra = list(after_renames()) if after_renames is not None else []
        if defer_folders is not None:
            defer_folders.extend([*folders, *extra])
            return
        try:
            fsync_all([*folders, *placed, *extra])
        except DurableWriteError as exc:
            raise DurableWriteError(exc.path, exc.cause, effect_status="unknown") from exc.cause

    def _write_tmp(self, item: _Item) -> None:
        folder, name = os.path.split(item.path)
        tmp = os.path.join(folder, f".{name}{TMP_MARK}{os.getpid()}-{_token()}")
        if item.symlink is not None:
            os.symlink(item.symlink, tmp, dir_fd=item.dir_fd)
            item.tmp = tmp
            return
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY | _O_CLOEXEC, 0o600,
                     dir_fd=item.dir_fd)
        item.tmp = tmp
        keep = len(self._open) + self._kept < _KEEP_OPEN_MAX
        try:
            assert item.data is not None
            write_all(fd, item.data)
            os.fchmod(fd, item.mode)
        except BaseException:
            os.close(fd)
            raise
        if keep:  # synced through this descriptor: no second open by name
            item.fd = fd
            self._kept += 1
        else:
            os.close(fd)

    def _close_open(self) -> None:
        for fd in self._open:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._open.clear()
        for item in self._items:
            if item.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(item.fd)
                item.fd = None
        self._kept = 0

    def _discard(self, start: int = 0) -> None:
        self._close_open()
        for item in self._items[start:]:
            if item.tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(item.tmp, dir_fd=item.dir_fd)
                item.tmp = None


def _synced_file(item: _Item) -> str | tuple[int, str]:
    assert item.tmp is not None
    return (item.dir_fd, item.tmp) if item.dir_fd is not None else item.tmp


def make_dirs(folder: str, mode: int = 0o755) -> list[str]:
    """Create ``folder`` and its missing parents; return the folders created (outermost first)."""
    if os.path.isdir(folder):
        return []
    made: list[str] = []
    parent = os.path.dirname(folder)
    if parent and parent != folder:
        made += make_dirs(parent, mode)
    try:
        os.mkdir(folder, mode)
    except FileExistsError:
        return made
    return [*made, folder]



class NotRegularFile(OSError):
    """A path that :func:`open_regular` refuses: a folder, a FIFO, a device, a socket."""


def open_regular(path: str, *, dir_fd: int | None = None) -> int:
    """A descriptor of the regular file ``path`` (relative to ``dir_fd`` if given), open for reading.

    Opened without following a symlink and without blocking on a FIFO put in
    its place (it would hang the reader); the descriptor is blocking again.

    Raises:
        FileNotFoundError: there is none.
        NotRegularFile: something else is there.
        OSError: a symlink (``ELOOP``), or it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"'{path}' is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new(path: str, data: bytes, mode: int = 0o666) -> None:
    """Create ``path`` exclusively (not following a symlink) holding ``data``; not synced.

    For a lock file born holding its content: on any failure nothing is left.

    Raises:
        FileExistsError: ``path`` exists.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode)
    try:
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


#: renameat2's flag for an atomic swap of two names (Linux 3.15; ext4, xfs, btrfs, tmpfs, overlayfs).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
@functools.cache
def _renameat2() -> tuple[Callable[[int, bytes, int, bytes, int], int], Callable[[], int]] | None:
    """glibc's ``renameat2`` and its errno reader, through ctypes; ``None``: not there."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, ImportError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn, ctypes.get_errno


def exchange(a: str, b: str) -> bool:
    """Swap the files named ``a`` and ``b`` in one atomic step (``renameat2(RENAME_EXCHANGE)``).

    Returns ``False``, having changed nothing, where the system or the
    filesystem has no such call; the caller then renames.  Readers of ``b``
    see its old file or ``a``'s, never neither.

    Raises:
        OSError: the swap failed otherwise (a name missing, ...).
    """
    found = _renameat2()
    if found is None:
        return False
    fn, get_errno = found
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)

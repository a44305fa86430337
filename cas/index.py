"""A worktree's index: read once per process, updated in place or through pygit2's ``Index``.

The one module that updates git's index without libgit2 writing all of it
(at 100k entries libgit2 takes tens of milliseconds to parse the file and as
long to write it, twice a call: measured ×3.7, docs/DECISIONS.md "Speed").
:class:`IndexSnapshot` maps the file as bytes (:mod:`cas.index_raw`); what
that cannot prove switches it to libgit2 (:class:`_ParsedIndex`, a parse of a
hard link of the index, which libgit2 may rewrite without touching the real
file).  pygit2's ``Index`` sets an entry's path, id and mode only: the file
libgit2 writes is passed through :mod:`cas.index_raw` once more for the stat
data of the files just written and git's racy-clean rule; where that pass
cannot prove the file, it keeps the old index's mtime, so git compares the
content of every entry it could take for clean.

While the real index keeps the identity (inode, size, mtime) of the file read
or last written, the snapshot is reused: a long-lived caller's next call
neither reads nor verifies the index again (at 100k entries a 9.6 MB SHA-1).
:func:`prefetch` starts the read before the patch is planned.  A new file is
written beside the index, fsynced and renamed over it while the caller holds
``index.lock`` (:mod:`cas.index_lock`, which says why the index is staged
ahead of the branch).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Callable, Collection

import pygit2

from cas.durable import TMP_MARK, exchange, fsync_all, fsync_dir, write_all
from cas.errors import DurableWriteError, GitStoreError, UsageError
from cas.index_raw import MAX_PATHS, RawIndex, Unsupported
from cas.objects import TreeEntry

__all__ = ["IndexSnapshot", "snapshot_for", "prefetch", "open_index", "unreadable_index"]

_cache: dict[str, IndexSnapshot] = {}
_loading: dict[str, threading.Thread] = {}
_cache_lock = threading.Lock()


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _Index(pygit2.Index):
    """pygit2's ``Index`` opened from a path, without a finaliser's traceback when the open failed.

    pygit2's ``__del__`` raised ``AttributeError`` ("Exception ignored") for an
    index libgit2 refused (a split or sparse one): an object whose ``__init__``
    set nothing is not finalised.
    """

    def __del__(self) -> None:
        if vars(self):
            super().__del__()


#: git's mandatory extensions oncepatch meets, as (what the index is, what to run).
_MANDATORY = {
    "link": ("a split index (core.splitIndex)",
             "run 'git update-index --no-split-index' there (and 'git config core.splitIndex false')"),
    "sdir": ("a sparse index (index.sparse)", "run 'git sparse-checkout init --no-sparse-index' there"),
}


def open_index(path: str) -> pygit2.Index:
    """The index file at ``path`` parsed by libgit2.

    Raises:
        UsageError: an index with a mandatory extension libgit2 cannot read.
        GitStoreError: any other failure.
    """
    try:
        return _Index(path)
    except (OSError, pygit2.GitError) as exc:
        raise unreadable_index(path, exc) from exc


def unreadable_index(index_path: str, exc: Exception) -> UsageError | GitStoreError:
    """The error for an index libgit2 failed to read: a usage error naming the fix, when there is one."""
    found = re.search(r"mandatory extension: '([^']*)'", str(exc))
    if not found:
        return GitStoreError(f"cannot read index '{index_path}': {exc}")
    name = found.group(1)
    what, fix = _MANDATORY.get(name, (f"an index with git's mandatory extension '{name}'",
                                      "let git rewrite it without that extension"))
    return UsageError(f"'{index_path}' is {what}, which oncepatch cannot update: {fix}, "
                      "or apply to a branch that is not checked out (nothing was changed)")


class _ParsedIndex:
    """A copy of ``<git_dir>/index`` parsed by libgit2 (pygit2's public ``Index``); see the module docstring."""

    def __init__(self, git_dir: str) -> None:
        self.git_dir = git_dir
        self.index_path = os.path.join(git_dir, "index")
        self.tmp = _tmp_path(git_dir)
        self.identity = _identity(self.index_path)
        # The mtime the entries in memory were read against (git's racy-clean rule), kept across writes.
        self._stamp = self.identity[3] if self.identity is not None else None
        self._workdir: str | None = None
        self._stat: list[str] = []  # paths set whose stat data the written file gets
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.link(self.index_path, self.tmp)  # no index yet: an empty one is written
            self.index: pygit2.Index = _Index(self.tmp)
        except (OSError, pygit2.GitError) as exc:
            raise unreadable_index(self.index_path, exc) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)  # the parsed copy lives in memory

    def entry(self, path: str) -> TreeEntry | None:
        try:
            ie = self.index[path]
        except KeyError:
            return None
        return TreeEntry(str(ie.id), int(ie.mode))

    def stage(self, workdir: str, removed: list[str], added: list[tuple[str, TreeEntry]],
              unstat: Collection[str] = ()) -> None:
        """As :meth:`IndexSnapshot.stage`; the stat data is set as the file is written (:meth:`install`)."""
        for path in removed:
            with contextlib.suppress(OSError, KeyError, pygit2.GitError):
                self.index.remove(path)
        for path, te in added:
            self.index.add(pygit2.IndexEntry(path, pygit2.Oid(hex=te.oid), pygit2.enums.FileMode(te.mode)))
        self._workdir = workdir
        self._stat.extend(p for p, _te in added if p not in unstat)

    def install(self, also_sync: list[str | int] | None, defer_dir: list[str] | None, sync: bool) -> None:
        """As :meth:`IndexSnapshot.install`."""
        def write() -> None:
            self.index.write()
            self._stat_pass()
            if sync:
                fd = os.open(self.tmp, os.O_RDONLY)
                try:
                    _sync_with(fd, also_sync)  # libgit2 syncs only files of a repository it opened
                finally:
                    os.close(fd)

        # A copy whose entries all went to the file as they are in memory (no stat
        # data: the index staged ahead) stays current; one that lacks the stat data
        # the file got is read again when next asked.
        reusable = not self._stat
        self.identity = None
        _replace_index(self.git_dir, self.tmp, write, defer_dir, sync)
        if reusable:
            self.identity = _identity(self.index_path)

    def _stat_pass(self) -> None:
        """The file libgit2 wrote, through :mod:`cas.index_raw`: stat data set, racily clean entries smudged.

        Judged against the index the entries were read from (libgit2 writes its
        own mtime); a file the pass cannot prove keeps the old index's mtime.
        """
        stamp, workdir, paths = self._stamp, self._workdir, sorted(set(self._stat))
        self._stat.clear()
        if stamp is None or workdir is None:
            return
        with contextlib.suppress(Unsupported, OSError, ValueError):
            raw = RawIndex(self.tmp, stamp_ns=stamp)
            try:
                if raw.version == 4 or len(paths) > MAX_PATHS:
                    raise Unsupported("entries read in order")
                parts, state, hashed = raw.updated(workdir, _stat_changes(raw, workdir, paths))
            except Unsupported:
                raw = RawIndex(self.tmp, stamp_ns=stamp)
                raw.walk()
                parts, state, hashed = raw.updated(workdir, _stat_changes(raw, workdir, paths))
            filled = self.tmp + ".stat"
            try:
                _write_with_checksum(filled, parts, state, hashed, raw.mode, sync=False)
                os.replace(filled, self.tmp)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(filled)
                raise
            return
        st = os.stat(self.tmp)
        os.utime(self.tmp, ns=(st.st_atime_ns, stamp))


def _stat_changes(raw: RawIndex, workdir: str, paths: list[str]) -> list[tuple[int, TreeEntry, os.stat_result]]:
    """Each path's entry in ``raw`` with its file's stat data, for :meth:`RawIndex.updated`.

    Raises:
        Unsupported: a path's entry is not proven.
    """
    changes = []
    for path in paths:
        e, te = raw.locate(path), raw.entry(path)
        if e is None or te is None:
            raise Unsupported("a path set is not in the written index")
        changes.append((e, te, os.lstat(os.path.join(workdir, path))))
    return changes


class IndexSnapshot:
    """``<git_dir>/index`` as raw bytes while :mod:`cas.index_raw` can handle it, else parsed by libgit2.

    The first lookup or change the raw form cannot prove (a new or removed
    path, a conflict, an unknown extension, more than ``MAX_PATHS`` paths)
    switches it to libgit2's parse for the rest of its life.
    """

    def __init__(self, git_dir: str) -> None:
        self.git_dir = git_dir
        self.index_path = os.path.join(git_dir, "index")
        self._raw: RawIndex | None = None
        self._parsed: _ParsedIndex | None = None
        self._looked_up: set[str] = set()
        self._pending: tuple[list[bytes | memoryview], hashlib._Hash, int] | None = None
        self.identity: tuple[int, int, int, int] | None = None
        try:
            self._raw = RawIndex(self.index_path)
            self.identity = self._raw.identity
        except (Unsupported, FileNotFoundError):
            self._use_parsed()
        except OSError as exc:
            raise GitStoreError(f"cannot read index '{self.index_path}': {exc}") from exc

    @property
    def raw(self) -> bool:
        """Whether this snapshot still works on the raw bytes."""
        return self._raw is not None

    def _use_parsed(self) -> _ParsedIndex:
        if self._parsed is None:
            self._raw = None
            self._pending = None
            self._parsed = _ParsedIndex(self.git_dir)
            self.identity = self._parsed.identity
        return self._parsed

    def current(self) -> bool:
        """Whether the real index is still the file this copy was read from (or last wrote)."""
        return self.identity is not None and _identity(self.index_path) == self.identity

    def entry(self, path: str) -> TreeEntry | None:
        if self._raw is not None:
            self._looked_up.add(path)
            if len(self._looked_up) <= MAX_PATHS:
                with contextlib.suppress(Unsupported):
                    return self._raw.entry(path)
        return self._use_parsed().entry(path)

    def check_writable(self, paths: list[str]) -> None:
        """Refuse now, before anything is prepared, an update only libgit2 could write and cannot read.

        (A path new to a sparse index, or removed from it, needs libgit2, which refuses that index.)

        Raises:
            UsageError: as :func:`open_index` does, the fix named.
        """
        if self._raw is None:
            return
        with contextlib.suppress(Unsupported):
            if not self._raw.sparse() or (
                    len(paths) <= MAX_PATHS and all(self._raw.entry(p) is not None for p in paths)):
                return
        self._use_parsed()

    def confirm(self) -> bool:
        """Whether what :meth:`entry` answered stands: ``False`` when the raw form's checksum failed.

        After ``False`` this snapshot is libgit2's parse, and the lookups must be asked again.

        Raises:
            GitStoreError: the index is corrupt (reported by libgit2's parse).
        """
        if self._raw is not None:
            self._raw.scan_stamps()  # while the checksum thread hashes
            try:
                self._raw.verified()
            except Unsupported:
                self._use_parsed()
                return False
            self._raw.start_prefix()
        return True

    def stage(self, workdir: str, removed: list[str], added: list[tuple[str, TreeEntry]],
              unstat: Collection[str] = ()) -> None:
        """Set the entries of these paths: removed, or added with the stat data of the files now on disk.

        ``unstat``: added paths whose file is not the entry's content; their stat
        data stays zero, so git compares the file's content and sees the change.
        """
        if self._raw is not None and not removed and len(added) <= MAX_PATHS:
            try:
                changes = []
                for path, te in added:
                    e = self._raw.locate(path)
                    if e is None:
                        raise Unsupported("a path new to the index")
                    changes.append((e, te, _NO_STAT if path in unstat else os.lstat(os.path.join(workdir, path))))
                self._pending = self._raw.updated(workdir, changes)
                return
            except Unsupported:
                pass
        self._use_parsed().stage(workdir, removed, added, unstat)

    def install(self, also_sync: list[str | int] | None = None, defer_dir: list[str] | None = None,
                sync: bool = True) -> None:
        """Write the new index and rename it over ``index`` (caller holds ``index.lock``); durable.

        ``also_sync``: paths or descriptors (the folders of the worktree files
        the index names) synced with the new file before its rename, then emptied.
        ``defer_dir``: see :func:`_replace_index`.  ``sync``: ``False`` syncs
        nothing (an index only *seen* until the next replaces it: ``stage_ahead``).
        """
        if self._parsed is not None:
            self._parsed.install(also_sync, defer_dir, sync)
            self.identity = self._parsed.identity
            return
        if self._pending is None:
            return
        parts, state, hashed = self._pending
        previous = self._raw
        assert previous is not None
        self._pending = self._raw = self.identity = None
        tmp = _tmp_path(self.git_dir)
        kept: list[RawIndex] = []

        def keep(fd: int) -> None:
            # The file just written, mapped: the next call in this process reads
            # it without verifying the checksum it computed here.
            with contextlib.suppress(OSError, ValueError, Unsupported):
                kept.append(RawIndex(tmp, written=(fd, previous, previous.edits)))

        def mark(n: int, at: hashlib._Hash) -> None:
            # The new file's first n bytes are the old file's: the next write from it starts there.
            previous.written_prefix = (n, at)

        _replace_index(self.git_dir, tmp,
                       lambda: _write_with_checksum(tmp, parts, state, hashed, previous.mode, also_sync, keep,
                                                    sync=sync, mark=mark),
                       defer_dir, sync)
        if kept:  # renamed over the index under index.lock: that file is ours
            self._raw = kept[0]
            self.identity = kept[0].identity
            self._looked_up.clear()


#: The stat data of an entry set without it (``unstat``): git compares the file's content.
_NO_STAT = os.stat_result((0,) * 10 + (0.0, 0.0, 0.0, 0, 0, 0))


def _tmp_path(git_dir: str) -> str:
    """Where a new index is written beside ``index`` (recovery removes it for a dead pid)."""
    return os.path.join(git_dir, f"index{TMP_MARK}{os.getpid()}-{threading.get_ident()}")


#: An unsynced index at least this big is swapped into place (:func:`cas.durable.exchange`), not renamed.
_EXCHANGE_MIN = 1 << 20


def _replace_index(git_dir: str, tmp: str, write: Callable[[], None], defer_dir: list[str] | None = None,
                   sync: bool = True) -> None:
    """``write`` the synced new index to ``tmp``, rename it over ``index``, sync the folder.

    ``defer_dir``: the folder is appended to it instead, for the caller to sync
    before anything relies on the rename (the apply protocol: before the
    committed receipt).  ``sync``: ``False``, the folder is not synced at all.

    Raises:
        GitStoreError: nothing was renamed (``tmp`` removed), or the folder's sync failed.
    """
    index_path = os.path.join(git_dir, "index")
    try:
        write()
        if not sync and os.stat(tmp).st_size >= _EXCHANGE_MIN and exchange(tmp, index_path):
            # A swap, not a rename over it: ext4 starts writing out a file renamed over
            # another (auto_da_alloc), and the branch's rename that follows would wait
            # behind those megabytes; swapped in unsynced, this one is replaced before
            # it is ever written.
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # the old index (recovery removes a tmp file left by a dead pid)
        else:
            os.replace(tmp, index_path)
        if sync and defer_dir is not None:
            defer_dir.append(git_dir)
        elif sync:
            fsync_dir(git_dir)
    except (OSError, pygit2.GitError, DurableWriteError) as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise GitStoreError(f"cannot write index '{index_path}': {exc}") from exc


def _sync_with(fd: int, also: list[str | int] | None) -> None:
    """fsync ``fd``, with ``also`` in the same round (then emptied)."""
    if not also:
        os.fsync(fd)
        return
    fsync_all([fd, *also])
    also.clear()


#: Fewer bytes than this left to hash for a new index: hashed before it is written, without a thread.
_HASH_INLINE_MAX = 1 << 20


def _write_with_checksum(path: str, parts: list[bytes | memoryview], state: hashlib._Hash, hashed: int,
                         mode: int, also_sync: list[str | int] | None = None,
                         keep: Callable[[int], None] | None = None, *, sync: bool = True,
                         mark: Callable[[int, hashlib._Hash], None] | None = None) -> None:
    """Write ``parts`` and their SHA-1 to a new file ``path`` (permissions ``mode``) and fsync it; hashed while written.

    ``state``: the SHA-1 state over the first ``hashed`` bytes of ``parts``.
    ``also_sync``: synced with the file (then emptied); ``sync=False``: no fsync.
    ``keep``: given the file's descriptor once it is whole and synced.  ``mark``:
    given the first part's length and the state over it (unless ``hashed`` goes past it).
    """
    digest: list[bytes] = []

    def hash_parts() -> None:
        skip = hashed
        for i, part in enumerate(parts):
            if skip >= len(part):
                skip -= len(part)
            else:
                state.update(part[skip:] if skip else part)
                skip = 0
            if i == 0 and mark is not None and skip == 0:
                mark(len(part), state.copy())
        digest.append(state.digest())

    # A thread hashes while the file is written and its bulk synced; below
    # _HASH_INLINE_MAX bytes to hash that costs more than it saves (a thread's start,
    # and a sync the thread is often still running for).
    hasher: threading.Thread | None = None
    if sum(len(part) for part in parts) - hashed >= _HASH_INLINE_MAX:
        hasher = threading.Thread(target=hash_parts, daemon=True)
        hasher.start()
    else:
        hash_parts()
    # Read and write: ``keep`` maps it.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, mode)
        for part in parts:
            write_all(fd, part)
        if hasher is not None and hasher.is_alive():
            # The checksum covers what follows the first change (up to all of a
            # 9.6 MB index): sync the bulk while it is computed, then its 20 bytes.
            if sync:
                os.fsync(fd)
            hasher.join()
        write_all(fd, digest[0])
        if sync:
            _sync_with(fd, also_sync)
        else:
            assert not also_sync
        if keep is not None:
            keep(fd)
    finally:
        if hasher is not None:
            hasher.join()
        os.close(fd)


def _key(git_dir: str) -> str:
    return f"{git_dir}\0{threading.get_ident()}"


def prefetch(git_dir: str) -> None:
    """Start reading ``git_dir``'s index in a thread, for this thread's next :func:`snapshot_for`.

    What the thread fails on is left for :func:`snapshot_for` to meet again and report.
    """
    key = _key(git_dir)
    with _cache_lock:
        if key in _loading:
            return
        snap = _cache.get(key)
    if snap is not None and snap.current():
        return

    def load() -> None:
        with contextlib.suppress(Exception):  # read again, and reported, by snapshot_for
            fresh = IndexSnapshot(git_dir)
            with _cache_lock:
                _cache[key] = fresh

    thread = threading.Thread(target=load, name="oncepatch-index-read", daemon=True)
    with _cache_lock:
        _loading[key] = thread
    thread.start()


def snapshot_for(git_dir: str) -> IndexSnapshot:
    """The current copy of ``git_dir``'s index (reused when the file is unchanged)."""
    key = _key(git_dir)
    with _cache_lock:
        loading = _loading.pop(key, None)
    if loading is not None:
        loading.join()
    with _cache_lock:
        snap = _cache.get(key)
    if snap is None or not snap.current():
        snap = IndexSnapshot(git_dir)
        with _cache_lock:
            _cache[key] = snap
    return snap

"""One copy of a worktree's index per process, reused while the file is unchanged.

git's index is one file rewritten whole; at 100k entries libgit2 takes tens of
milliseconds to parse it and as long to write it, and a call needs it twice
(the dirty check before prepare, the update after the branch moved).

:class:`IndexSnapshot` first maps the file as bytes (:mod:`cas.index_raw`):
lookups and the update of entries a patch modifies go through the bytes,
the rest passes through unparsed.  Whatever the raw form cannot prove
switches the snapshot to libgit2 (:class:`_ParsedIndex`), which parses a hard
link of the index (``index`` linked to ``index<TMP_MARK><pid>``, which
libgit2 may rewrite without touching the real file).  Either way the file's
identity (inode, size, mtime) is remembered: while the real index still has
it, the copy is current and is reused.  After an install the raw form maps
the file it has just written (its checksum computed here, its entries where
they were), so a long-lived caller's next call neither reads nor verifies
the index again: at 100k entries that was a 9.6 MB SHA-1 and a scan per call.  :func:`prefetch` starts the read in a
thread before the patch is planned.

Writing (:meth:`IndexSnapshot.install`) happens while the caller holds
``index.lock``: the new file is written beside the index, fsynced and renamed
over it.  Entries get full stat data, so ``git diff-files`` sees the files
clean without re-hashing them; racily clean entries whose files changed are
smudged first, as git's writer does (see docs/DECISIONS.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import pygit2

from cas.durable import TMP_MARK, exchange, fsync_all, fsync_dir, write_all
from cas.errors import DurableWriteError, GitStoreError, UsageError
from cas.objects import TreeEntry

if TYPE_CHECKING:
    from cas.index_raw import RawIndex

__all__ = ["IndexSnapshot", "snapshot_for", "prefetch", "open_index", "unreadable_index"]

_MODE_TREE = 0o040000
_cache: dict[str, IndexSnapshot] = {}
_loading: dict[str, threading.Thread] = {}
_cache_lock = threading.Lock()


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _open_index(path: str) -> pygit2.Index:
    """``pygit2.Index(path)``, without the half-made object whose ``__del__`` fails when the open fails."""
    from pygit2.errors import check_error
    from pygit2.ffi import C, ffi

    cindex = ffi.new("git_index **")
    check_error(C.git_index_open(cindex, os.fsencode(path)))
    index: pygit2.Index = pygit2.Index.from_c(None, cindex)  # type: ignore[no-untyped-call]
    return index


def _mandatory_extension_refused(index_path: str, name: str) -> str:
    """Why an index with git's mandatory extension ``name`` is refused, and what to run."""
    how = {
        "link": ("a split index (core.splitIndex)",
                 "run 'git update-index --no-split-index' there (and 'git config core.splitIndex false')"),
        "sdir": ("a sparse index (index.sparse)",
                 "run 'git sparse-checkout init --no-sparse-index' there"),
    }.get(name, (f"an index with git's mandatory extension '{name}'", "let git rewrite it without that extension"))
    return (f"'{index_path}' is {how[0]}, which oncepatch cannot update: {how[1]}, "
            "or apply to a branch that is not checked out (nothing was changed)")


def open_index(path: str) -> pygit2.Index:
    """The index file at ``path`` parsed by libgit2.

    Raises:
        UsageError: an index with a mandatory extension libgit2 cannot read.
        GitStoreError: any other failure.
    """
    try:
        return _open_index(path)
    except (OSError, pygit2.GitError) as exc:
        raise unreadable_index(path, exc) from exc


def unreadable_index(index_path: str, exc: Exception) -> UsageError | GitStoreError:
    """The error for an index libgit2 failed to read: a usage error naming the fix, when there is one."""
    found = re.search(r"mandatory extension: '([^']*)'", str(exc))
    if found:
        return UsageError(_mandatory_extension_refused(index_path, found.group(1)))
    return GitStoreError(f"cannot read index '{index_path}': {exc}")


class _ParsedIndex:
    """A copy of ``<git_dir>/index`` parsed by libgit2; see the module docstring."""

    def __init__(self, git_dir: str) -> None:
        self.git_dir = git_dir
        self.index_path = os.path.join(git_dir, "index")
        self.tmp = _tmp_path(git_dir)
        self.identity = _identity(self.index_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.link(self.index_path, self.tmp)  # no index yet: an empty one is written
            self.index = _open_index(self.tmp)
        except (OSError, pygit2.GitError) as exc:
            raise unreadable_index(self.index_path, exc) from exc
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

    def stage(self, workdir: str, removed: list[str], added: list[tuple[str, TreeEntry]],
              unstat: Collection[str] = ()) -> None:
        """Set the entries of these paths: removed, or added with the stat data of the files now on disk.

        ``unstat``: added paths whose file is not the entry's content; their stat
        data stays zero, so git compares the file's content and sees the change.
        """
        from pygit2.errors import check_error
        from pygit2.ffi import C, ffi

        self._smudge_racy(workdir)
        for path in removed:
            with contextlib.suppress(OSError, KeyError, pygit2.GitError):
                self.index.remove(path)
        for path, te in added:
            if path in unstat:
                e = ffi.new("git_index_entry *")
                e.mode = te.mode
                ffi.buffer(ffi.addressof(e, "id"))[:] = bytes.fromhex(te.oid)
                c_path = ffi.new("char[]", os.fsencode(path))
                e.path = c_path
                check_error(C.git_index_add(self.index._index, e))
                continue
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

    def _smudge_racy(self, workdir: str) -> None:
        """Smudge racily clean entries whose files changed (size 0), as git's writer does.

        libgit2 does this only for an index opened through its repository; this
        one is opened from a path.  Seconds are compared, as git without
        nanosecond timestamps does: a superset of what git calls racy.
        """
        from pygit2.ffi import C, ffi

        from cas.index_raw import racy_file_changed

        if self.identity is None:
            return
        stamp = self.identity[3] // 1_000_000_000
        raw = self.index._index
        for i in range(C.git_index_entrycount(raw)):
            e = C.git_index_get_byindex(raw, i)
            if (e.mtime.seconds & 0xFFFFFFFF) < (stamp & 0xFFFFFFFF) or e.file_size == 0:
                continue
            if racy_file_changed(workdir, ffi.string(e.path), e.mode, e.file_size, e.mtime.seconds & 0xFFFFFFFF,
                                 e.mtime.nanoseconds, bytes(ffi.buffer(ffi.addressof(e, "id"))[:20]).hex()):
                ffi.cast("git_index_entry *", e).file_size = 0

    def install(self, also_sync: list[str | int] | None = None, defer_dir: list[str] | None = None,
                sync: bool = True) -> None:
        """Write the copy and rename it over ``index`` (caller holds ``index.lock``); durable if ``sync``.

        ``also_sync``: synced with the new file, before its rename; emptied once synced.
        ``defer_dir``: see :func:`_replace_index`.
        """
        def write() -> None:
            self.index.write()
            if not sync:
                return
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                _sync_with(fd, also_sync)  # libgit2 syncs only files of a repository it opened
            finally:
                os.close(fd)

        self.identity = None
        _replace_index(self.git_dir, self.tmp, write, defer_dir, sync)
        self.identity = _identity(self.index_path)


class IndexSnapshot:
    """``<git_dir>/index`` as raw bytes while :mod:`cas.index_raw` can handle it, else parsed by libgit2.

    Lookups and the update of entries a patch modifies go through the bytes;
    the first lookup or change the raw form cannot prove (a new or removed
    path, a conflict, an extension it does not know, more than
    :data:`cas.index_raw.MAX_PATHS` paths) switches this snapshot to libgit2's
    parse for the rest of its life.
    """

    def __init__(self, git_dir: str) -> None:
        from cas.index_raw import RawIndex, Unsupported

        self.git_dir = git_dir
        self.index_path = os.path.join(git_dir, "index")
        self._raw: RawIndex | None = None
        self._parsed: _ParsedIndex | None = None
        self._looked_up: set[str] = set()
        self._pending: tuple[list[bytes | memoryview], hashlib._Hash, int] | None = None
        try:
            self._raw = RawIndex(self.index_path)
            self.identity: tuple[int, int, int, int] | None = self._raw.identity
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
        from cas.index_raw import MAX_PATHS, Unsupported

        if self._raw is not None:
            self._looked_up.add(path)
            if len(self._looked_up) <= MAX_PATHS:
                try:
                    return self._raw.entry(path)
                except Unsupported:
                    pass
        return self._use_parsed().entry(path)

    def confirm(self) -> bool:
        """Whether what :meth:`entry` answered stands: ``False`` when the raw form's checksum failed.

        After ``False`` this snapshot is libgit2's parse, and the lookups must be
        asked again.

        Raises:
            GitStoreError: the index is corrupt (reported by libgit2's parse).
        """
        from cas.index_raw import Unsupported

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

        ``unstat``: see :meth:`_ParsedIndex.stage`.
        """
        from cas.index_raw import MAX_PATHS, Unsupported

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

        ``also_sync``: paths (or open descriptors) synced in the same round as
        the new file, before its rename — the folders of the worktree files the
        index describes; the list is emptied once they are synced.
        ``defer_dir``: see :func:`_replace_index`.
        ``sync``: ``False`` writes the file without syncing it (an index that
        only has to be *seen* until the next one replaces it: :mod:`cas.index_ahead`).
        """
        if self._parsed is not None:
            self._parsed.install(also_sync, defer_dir, sync)
            self.identity = self._parsed.identity
            return
        if self._pending is None:
            return
        from cas.index_raw import RawIndex, Unsupported

        parts, state, hashed = self._pending
        self._pending = None
        previous = self._raw
        assert previous is not None
        self.identity = None
        self._raw = None
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

    ``defer_dir``: the folder is appended to it instead of synced here; the
    caller syncs it in a round it makes anyway, before anything relies on the
    rename (the apply protocol: before the committed receipt).
    ``sync``: ``False``, the folder is not synced at all (nor was the file).

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

    ``state`` is the SHA-1 state over the first ``hashed`` bytes of ``parts``.
    ``also_sync``: synced with the file's last sync (then emptied).
    ``keep``: given the file's descriptor once it is whole and synced.
    ``sync``: ``False`` writes without any fsync (``also_sync`` must be empty then).
    ``mark``: given the length of the first part and a copy of the SHA-1 state over it
    (when ``hashed`` does not go past it), before ``keep`` is called.
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

    An apply calls this before it parses the patch, so that reading the index
    and verifying its checksum overlap the parsing and planning.  Whatever the
    thread fails on is left for :func:`snapshot_for` to meet again and report.
    """
    key = _key(git_dir)
    with _cache_lock:
        if key in _loading:
            return
        snap = _cache.get(key)
    if snap is not None and snap.current():
        return

    def load() -> None:
        try:
            fresh = IndexSnapshot(git_dir)
        except Exception:  # noqa: BLE001 - read again, and reported, by snapshot_for
            return
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

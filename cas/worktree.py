"""Bringing a checked-out worktree and its index to a new commit, path by path.

* :func:`dirty_paths` — which of the touched paths have uncommitted changes
  (index or working file differs from the base commit, or an untracked or
  ignored file sits where the patch writes), checked *before* anything is
  prepared, so a user's work is never overwritten.
* :func:`unsafe_worktree_paths` — touched paths whose folders in the worktree
  are symlinks (a write would go through them); :func:`in_the_way` — files
  that stand where a touched path's folder goes and that the patch does not remove.
* :func:`materialise` — write each touched file atomically (tmp beside it,
  fsync, rename; symlinks as symlinks; exec bit from the mode), reached
  through folder fds opened with ``O_NOFOLLOW``; then update just those
  entries of the index under git's ``index.lock`` (:mod:`cas.index_lock`,
  which also says why the apply protocol stages the index before the branch
  moves and holds the lock until the index is written).
* :func:`write_files` — the same writes without the index: the apply
  protocol writes the candidate's files ahead of its branch's move;
  :func:`originals_of` reads what they held first and :func:`put_back`
  brings it back (bytes, mode, links, the folders) when the branch did not
  move (docs/DESIGN.md section 4).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import pygit2

from cas.durable import TMP_MARK, DurableBatch, free_on_threads, fsync_all, fsync_dir, open_dir_nofollow
from cas.errors import DurableWriteError, GitStoreError, UnsafeWorktreePath
from cas.git_filters import apply_filters, blob_id_by_git, cleaned_oid, git_output, needs_git, smudged_by_git
from cas.hashing import git_blob_oid
from cas.index import IndexSnapshot, snapshot_for
from cas.index_lock import IndexLock, LockMarker, update_index
from cas.objects import GitStore, TreeEntry

__all__ = ["outside_sparse_checkout", "dirty_paths", "in_the_way", "unsafe_worktree_paths", "materialise", "write_files",
           "Original", "Originals", "originals_of", "put_back", "worktree_files_match", "index_matches"]

_MODE_LINK = 0o120000
_MODE_EXEC = 0o100755
_T = TypeVar("_T")


def dirty_paths(store: GitStore, workdir: str, paths: list[str], head_tree: str | None) -> list[str]:
    """Touched paths whose index entry or working file differs from ``head_tree`` (or that are untracked/ignored).

    A touched path that is a folder in the worktree (giving way to a file) is
    dirty when it holds a file the patch does not touch, or when the index or
    ``head_tree`` has a file there (deleted by hand).  Files are compared by content.
    A file or link standing where a touched path's folder goes, which the
    patch does not touch (:func:`in_the_way`), is answered instead: its own path.
    """
    blocking = in_the_way(workdir, paths)
    if blocking:
        return blocking  # untracked files (or links) where a folder goes: nothing is read further
    snap = snapshot_for(os.path.realpath(store.worktree_repo(workdir).path))
    touched = set(paths)

    def dirty(path: str) -> bool:
        full = os.path.join(workdir, path)
        if os.path.isdir(full) and not os.path.islink(full):
            if snap.entry(path) is not None or store.lookup_file(head_tree, path) is not None:
                return True  # a tracked file deleted by hand, a folder made in its place ('git status': D)
            return any(f"{os.path.relpath(folder, workdir).replace(os.sep, '/')}/{name}" not in touched
                       for folder, _dirs, files in os.walk(full) for name in files)
        want = store.lookup_file(head_tree, path)
        return snap.entry(path) != want or not worktree_files_match(store, workdir, {path: want})

    found = _confirmed(snap, lambda: [p for p in paths if dirty(p)])
    if not found:
        snap.check_writable(paths)
    return found


def _confirmed(snap: IndexSnapshot, answer: Callable[[], _T]) -> _T:
    """``answer()``, asked again when the raw index's checksum (verified meanwhile) failed: libgit2 answers then."""
    first = answer()
    return first if snap.confirm() else answer()


def outside_sparse_checkout(store: GitStore, workdir: str, paths: list[str]) -> list[str]:
    """Those of ``paths`` a sparse checkout leaves out of ``workdir``: their index entries are skip-worktree.

    Asked of git (``git ls-files -t``: ``S``; libgit2 does not expose the
    flag), for paths already found dirty in a worktree with ``core.sparseCheckout``.
    """
    if not paths or not _setting(store, workdir, "core.sparseCheckout", False):
        return []
    out = git_output(workdir, "ls-files", "-t", "-z", "--", *paths)
    skipped = {os.fsdecode(item[2:]) for item in (out or b"").split(b"\0") if item.startswith(b"S ")}
    return [p for p in paths if p in skipped]


def unsafe_worktree_paths(workdir: str, paths: list[str]) -> list[str]:
    """Paths whose leading folders in ``workdir`` are symlinks (writing there would follow them).

    A symlink that is itself one of ``paths`` gives way to a folder (the
    patch deletes it, as git's typechange): it is removed before the writes,
    never followed.
    """
    bad = []
    touched = set(paths)
    for path in paths:
        for where, st in _leading(workdir, path):
            if stat.S_ISLNK(st.st_mode) and where not in touched:
                bad.append(path)
                break
            if not stat.S_ISDIR(st.st_mode):
                break  # a file where a folder goes: the tree replaces it
    return bad


def _leading(workdir: str, path: str) -> Iterator[tuple[str, os.stat_result]]:
    """The leading folders of ``path`` in ``workdir`` that exist, each with its ``lstat``, up to the first missing one."""
    where = ""
    for part in path.split("/")[:-1]:
        where = f"{where}/{part}" if where else part
        try:
            st = os.lstat(os.path.join(workdir, where))
        except (FileNotFoundError, NotADirectoryError):
            return
        yield where, st
        if not stat.S_ISDIR(st.st_mode):
            return


def in_the_way(workdir: str, paths: list[str]) -> list[str]:
    """Files or symlinks of ``workdir`` that stand where a folder of a touched path goes, and that no touched path names.

    ``git apply`` refuses them ("already exists in working directory"):
    an untracked file ``x`` keeps ``x/y`` from being written, and the patch
    does not remove it.  A file the patch deletes gives way (not listed).
    """
    touched = set(paths)
    found: dict[str, None] = {}
    for path in paths:
        for where, st in _leading(workdir, path):
            if not stat.S_ISDIR(st.st_mode) and where not in touched:
                found.setdefault(where, None)
    return list(found)


#: Worktree files written per durable batch (each holds its bytes and an open folder until the batch commits),
#: and files removed per round of folder syncs.
_WRITE_CHUNK = 128
#: Files freed together on threads (:func:`cas.durable.free_on_threads`) from this many on; fewer in turn.
_FREE_AT_ONCE_FROM = 8


def _unlink_names(entries: list[tuple[int, str]]) -> None:
    """Unlink each ``(folder fd, name)``; on threads when there are many (:data:`_FREE_AT_ONCE_FROM`).

    Every unlink is attempted; the first failure (in ``entries``' order) is raised once all have ended.
    A name already gone is no failure.

    Raises:
        OSError: an unlink failed.
    """
    def one(entry: tuple[int, str]) -> OSError | None:
        try:
            os.unlink(entry[1], dir_fd=entry[0])
        except FileNotFoundError:
            return None
        except OSError as exc:
            return exc
        return None

    failures = [one(e) for e in entries] if len(entries) < _FREE_AT_ONCE_FROM else free_on_threads(one, entries)
    for exc in failures:
        if exc is not None:
            raise exc


def _remove_paths(workdir: str, paths: list[str]) -> None:
    """Remove the files or links at ``paths``, their folders synced together; then prune the folders left empty.

    Each folder is reached without following links, once per round; the folders
    of up to :data:`_WRITE_CHUNK` removals are synced in one round (concurrent
    fsyncs: about one flush for all, not one per file in turn), every removal
    durable before this returns.  A path whose folder is missing, a link or a
    file, or that is itself a folder, is left alone (nothing of ours is there).
    Emptied folders are removed deepest first, like git does.
    """
    emptied: dict[str, None] = {}
    for start in range(0, len(paths), _WRITE_CHUNK):
        with contextlib.ExitStack() as stack:
            folders: dict[str, int | None] = {}
            synced: dict[int, str] = {}
            doomed: list[tuple[int, str]] = []
            for path in paths[start:start + _WRITE_CHUNK]:
                folder, name = os.path.split(path)
                if folder not in folders:
                    try:
                        folders[folder] = stack.enter_context(open_dir_nofollow(workdir, folder))
                    except (FileNotFoundError, NotADirectoryError, UnsafeWorktreePath):
                        # A file or a symlink where a folder of the path goes: nothing of ours is below it
                        # (writes never go through one), and nothing is removed through a link.
                        folders[folder] = None
                dfd = folders[folder]
                if dfd is not None and _removable(dfd, name):
                    doomed.append((dfd, name))
                    synced[dfd] = folder
                    emptied[folder] = None
            _unlink_names(doomed)
            try:
                fsync_all(synced)
            except DurableWriteError as exc:
                shown = synced.get(exc.target, exc.path) if isinstance(exc.target, int) else exc.path
                raise GitStoreError(f"cannot write worktree '{workdir}': cannot sync '{shown or '.'}': "
                                    f"{exc.cause.strerror or exc.cause}") from exc
    for folder in sorted(emptied, key=lambda f: -f.count("/")):
        while folder:
            try:
                os.rmdir(os.path.join(workdir, folder))
            except OSError:
                break
            folder = os.path.dirname(folder)


def _queue_path(batch: DurableBatch, stack: contextlib.ExitStack, folders: dict[str, int], workdir: str,
                path: str, data: bytes, mode: int, umask: int) -> tuple[int, str] | None:
    """Queue ``path``'s new content in ``batch``, its folder reached without following symlinks.

    Returns ``(folder fd, name)`` when the write replaces a file that holds data (whose blocks its rename frees).
    """
    folder, name = os.path.split(path)
    dfd = folders.get(folder)
    if dfd is None:
        dfd = folders[folder] = stack.enter_context(open_dir_nofollow(workdir, folder, create=True))
    replaced = None
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(name, dir_fd=dfd)
        if stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            # The tree replaced a folder by a file: the folder must be empty by now.
            os.rmdir(name, dir_fd=dfd)
        elif stat.S_ISREG(st.st_mode) and st.st_size > 0 and st.st_nlink == 1:
            replaced = (dfd, name)
    if mode == _MODE_LINK:
        batch.add_in_dir(dfd, name, symlink=os.fsdecode(data))
    else:
        # git's modes: 0777 or 0666 less the umask (under umask 002, group-writable files)
        batch.add_in_dir(dfd, name, data, mode=(0o777 if mode == _MODE_EXEC else 0o666) & ~umask)
    return replaced


def _kept_aside(replaced: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A second name for each replaced file (``.<name>`` + :data:`~cas.durable.TMP_MARK` + pid, beside it).

    So that the batch's renames do not free the old files' blocks one after
    another (:func:`cas.durable.free_on_threads`): the second names are unlinked together,
    after the renames and before the folders' sync.  Made only for many
    files; a file that cannot be linked is freed by its rename, as before.
    Killed in between, the names are a dead call's tmp files (``recover``
    removes them).
    """
    if len(replaced) < _FREE_AT_ONCE_FROM:
        return []
    kept = []
    for dfd, name in replaced:
        aside = f".{name}{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.link(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue  # (no hard links here, a name too long, ...): its rename frees it
        kept.append((dfd, aside))
    return kept


def materialise(store: GitStore, workdir: str, changes: Mapping[str, TreeEntry | None], *,
                lock_marker: LockMarker | None = None, held: IndexLock | None = None, timeout: float = 0.0,
                tree: str | None = None, sync_first: list[str] | None = None,
                defer_dir: list[str] | None = None) -> None:
    """Write the touched paths of ``workdir`` and its index to match ``changes``.

    ``sync_first``: paths made durable before any file of the worktree changes
    (a moved branch's folder and reflogs): in the first batch's first round,
    or at once when a deletion comes first or nothing is written.
    ``defer_dir``: gets the index's folder to sync, instead of syncing it here.

    Deletions go first (a file may give way to a folder of the same name), then
    writes in path order.  ``lock_marker``, ``held``, ``timeout``: as
    :func:`cas.index_lock.update_index`.  ``tree``: the commit's tree the
    changes come from; given, :func:`plain_checkout` may skip libgit2's filters.

    Raises:
        UnsafeWorktreePath: a folder on a path is a symlink.
        RefLockedError: the worktree's ``index.lock`` stayed held.
        GitStoreError: libgit2 failed.
    """
    deletes, writes = _split(changes)
    # The last batch's folders are synced with the new index file, before its
    # rename (the index names those files): their descriptors stay open until then.
    last_folders: list[str | int] = []
    with contextlib.ExitStack() as keep:
        _write_paths(store, workdir, deletes, writes, tree=tree, sync_first=sync_first, keep=keep,
                     last_folders=last_folders)
        try:
            update_index(workdir, deletes, [p for p, _ in writes], lock_marker=lock_marker, held=held, timeout=timeout,
                         known=dict(writes), also_sync=last_folders, defer_dir=defer_dir)
        except BaseException:
            with contextlib.suppress(Exception):
                fsync_all(last_folders)  # the index failed; the files it would name are made durable anyway
            raise
        if last_folders:  # no index was written (nothing to change in it)
            fsync_all(last_folders)


def _split(changes: Mapping[str, TreeEntry | None]) -> tuple[list[str], list[tuple[str, TreeEntry]]]:
    """The deletions (deepest first) and the writes (in path order) of ``changes``."""
    deletes = sorted((p for p, e in changes.items() if e is None), reverse=True)
    writes = sorted((p, e) for p, e in changes.items() if e is not None)
    return deletes, writes


def _write_paths(store: GitStore, workdir: str, deletes: list[str], writes: list[tuple[str, TreeEntry]], *,
                 tree: str | None, sync_first: list[str] | None, keep: contextlib.ExitStack,
                 last_folders: list[str | int]) -> None:
    """Delete, then write, the files of ``workdir`` (:func:`materialise`'s file step; the index is left alone).

    The last batch's folders are not synced: they go to ``last_folders``, their
    descriptors kept open in ``keep``.

    Raises:
        UnsafeWorktreePath: a folder on a path is a symlink.
        GitStoreError: a file could not be written.
    """
    plain = tree is not None and plain_checkout(store, workdir, [p for p, _ in writes], tree)
    try:
        if sync_first and (deletes or not writes):
            first = sync_first
            _syncing(store, first, lambda: fsync_all(first))
            sync_first = None
        _remove_paths(workdir, deletes)
        # Written in durable batches: tmp files synced together, renamed in path
        # order, their folders synced together (not two fsyncs per file in turn).
        umask = os.umask(0)  # files get git's modes less the umask, as git checks them out
        os.umask(umask)
        for start in range(0, len(writes), _WRITE_CHUNK):
            last = start + _WRITE_CHUNK >= len(writes)
            batch = DurableBatch()
            if sync_first:
                batch.sync_first(sync_first)
            with contextlib.ExitStack() as stack:
                folders: dict[str, int] = {}
                replaced: list[tuple[int, str]] = []
                for path, entry in writes[start:start + _WRITE_CHUNK]:
                    data, mode = store.read_blob(entry.oid), entry.mode
                    if mode == _MODE_LINK and not _setting(store, workdir, "core.symlinks"):
                        mode = 0o100644  # core.symlinks=false: git writes the target as a plain file
                    elif mode != _MODE_LINK and not plain:
                        # '*.bat eol=crlf', 'ident', a filter driver: written as git would
                        data = smudged(workdir, path, data, store.worktree_repo(workdir), oid=entry.oid)
                    one = _queue_path(batch, keep if last else stack, folders, workdir, path, data, mode, umask)
                    if one is not None:
                        replaced.append(one)
                kept = _kept_aside(replaced)

                def free_kept() -> list[str | int]:
                    _unlink_names(kept)  # before the last round: the folders' sync records them gone
                    kept.clear()
                    return []

                try:
                    _syncing(store, sync_first, lambda: batch.commit(
                        defer_folders=last_folders if last else None, after_renames=free_kept if kept else None))
                finally:
                    for dfd, aside in kept:  # the batch failed: the second names go (the files keep theirs)
                        with contextlib.suppress(OSError):
                            os.unlink(aside, dir_fd=dfd)
            sync_first = None
    except OSError as exc:  # (an UnsafeWorktreePath, not an OSError, goes through as it is)
        raise GitStoreError(f"cannot write worktree '{workdir}': {exc}") from exc


def write_files(store: GitStore, workdir: str, changes: Mapping[str, TreeEntry | None], *,
                tree: str | None = None) -> None:
    """Write the touched files of ``workdir`` to match ``changes``, durably; the index is left alone.

    As :func:`materialise` writes them (deletions first, git's modes and
    filters; ``tree``: the tree the changes come from), every file and folder
    synced before this returns.  The apply protocol writes the candidate's
    files this way before its branch moves (docs/DESIGN.md section 4), and
    ``recover`` writes the base's back where a call killed before the move left them.

    Raises:
        UnsafeWorktreePath: a folder on a path is a symlink.
        GitStoreError: a file could not be written.
    """
    deletes, writes = _split(changes)
    folders: list[str | int] = []
    with contextlib.ExitStack() as keep:
        _write_paths(store, workdir, deletes, writes, tree=tree, sync_first=None, keep=keep, last_folders=folders)
        try:
            fsync_all(folders)
        except OSError as exc:
            raise GitStoreError(f"cannot write worktree '{workdir}': {exc}") from exc


@dataclass(frozen=True, slots=True)
class Original:
    """What one touched path of a worktree held: ``kind`` ``none``, ``dir``, ``file`` (``data``, ``mode``) or ``link``."""

    kind: str
    data: bytes = b""
    mode: int = 0


@dataclass(frozen=True, slots=True)
class Originals:
    """The touched paths of one worktree as they were (:func:`originals_of`), for :func:`put_back`.

    ``folders``: the folders on those paths that existed (the others were made by the write).
    """

    workdir: str
    paths: dict[str, Original]
    folders: frozenset[str]


def originals_of(workdir: str, paths: list[str]) -> Originals:
    """Read what ``paths`` of ``workdir`` hold now: bytes and mode of a file, a link's target, a folder, nothing.

    Held in memory until the call knows whether its branch moved (a touched
    file is at most the size of the patch's target, read for the write anyway).

    Raises:
        UnsafeWorktreePath: a folder on a path is a symlink.
        GitStoreError: a path could not be read, or is neither file, link nor folder.
    """
    found: dict[str, Original] = {}
    folders: set[str] = set()
    touched = set(paths)
    try:
        for path in paths:
            depth = path.count("/")
            for where, st in _leading(workdir, path):
                if stat.S_ISLNK(st.st_mode) and where not in touched:
                    raise UnsafeWorktreePath(f"refusing to write '{path}' in '{workdir}': '{where}' is a symlink")
                if not stat.S_ISDIR(st.st_mode):
                    break  # a file, or a link the patch replaces, where a folder goes: nothing below it
                folders.add(where)
                depth -= 1
            # every leading folder there (none missing, none a file or link): the path itself is read
            found[path] = _original(workdir, path) if depth == 0 else Original("none")
    except OSError as exc:
        raise GitStoreError(f"cannot read worktree '{workdir}': {exc}") from exc
    return Originals(workdir, found, frozenset(folders))


def _original(workdir: str, path: str) -> Original:
    folder, name = os.path.split(path)
    with open_dir_nofollow(workdir, folder) as dfd:
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return Original("none")
        if stat.S_ISLNK(st.st_mode):
            return Original("link", os.fsencode(os.readlink(name, dir_fd=dfd)))
        if stat.S_ISDIR(st.st_mode):
            return Original("dir")
        if not stat.S_ISREG(st.st_mode):
            raise GitStoreError(f"cannot write '{path}' in '{workdir}': it is neither a file, a link nor a folder")
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        with os.fdopen(fd, "rb") as fh:
            return Original("file", fh.read(), stat.S_IMODE(os.fstat(fh.fileno()).st_mode))


def put_back(originals: Originals) -> None:
    """Make the touched paths of a worktree hold again what :func:`originals_of` read: bytes, mode, links, folders.

    Safe to repeat.  Files and links come back through one durable batch;
    what the write made where nothing was is removed, and so are the folders
    it made (left empty); a folder that gave way to a file is made again.
    The index is not touched (its caller puts back the index it kept).

    Raises:
        UnsafeWorktreePath: a folder on a path is a symlink.
        GitStoreError: a path could not be put back.
    """
    workdir, paths = originals.workdir, originals.paths
    try:
        for path in sorted(paths, reverse=True):  # deepest first: a folder empties before its own path
            if paths[path].kind not in ("file", "link"):
                _unlink_entry(workdir, path)
        batch = DurableBatch()
        with contextlib.ExitStack() as stack:
            for path in sorted(paths):
                was = paths[path]
                if was.kind not in ("file", "link") or _still(workdir, path, was):
                    continue  # (a write that failed before its renames changed nothing)
                folder, name = os.path.split(path)
                dfd = stack.enter_context(open_dir_nofollow(workdir, folder, create=True))
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISDIR(os.lstat(name, dir_fd=dfd).st_mode):
                        os.rmdir(name, dir_fd=dfd)  # a folder the write made where the file was: empty by now
                if was.kind == "link":
                    batch.add_in_dir(dfd, name, symlink=os.fsdecode(was.data))
                else:
                    batch.add_in_dir(dfd, name, was.data, mode=was.mode)
            batch.commit()
        made = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)} - originals.folders
        for folder in sorted(made, key=lambda f: (-f.count("/"), f)):
            if paths.get(folder, Original("none")).kind == "dir":
                continue
            with contextlib.suppress(OSError):  # not empty, or gone: not the write's to remove
                os.rmdir(os.path.join(workdir, folder))
                fsync_dir(os.path.dirname(os.path.join(workdir, folder)))
        for path in sorted(p for p, was in paths.items() if was.kind == "dir"):
            os.makedirs(os.path.join(workdir, path), exist_ok=True)
    except OSError as exc:
        raise GitStoreError(f"cannot put back worktree '{workdir}': {exc}") from exc


def _still(workdir: str, path: str, was: Original) -> bool:
    """Whether ``path`` holds ``was`` (a file or a link) now: same kind, bytes and mode."""
    try:
        if was.kind == "link":
            return os.fsencode(os.readlink(os.path.join(workdir, path))) == was.data
        now = _original(workdir, path)
    except (OSError, UnsafeWorktreePath, GitStoreError):
        return False
    return now == was


def _unlink_entry(workdir: str, path: str) -> bool:
    """Remove the file or link at ``path`` (not a folder), its folder synced; whether there was one to remove."""
    folder, name = os.path.split(path)
    try:
        with open_dir_nofollow(workdir, folder) as dfd:
            if not _removable(dfd, name):
                return False
            os.unlink(name, dir_fd=dfd)
            fsync_dir(dir_fd=dfd)
    except (FileNotFoundError, NotADirectoryError, UnsafeWorktreePath):
        # A file or a symlink where a folder of the path goes: nothing of ours is below it
        # (writes never go through one), and nothing is removed through a link.
        return False
    return True


def _removable(dfd: int, name: str) -> bool:
    """Whether the open folder ``dfd`` holds a file or link ``name`` (not a folder: only its entries are ours)."""
    try:
        st = os.lstat(name, dir_fd=dfd)
    except FileNotFoundError:
        return False
    return not stat.S_ISDIR(st.st_mode)


def _syncing(store: GitStore, synced: list[str] | None, step: Callable[[], None]) -> None:
    """Run ``step``, which makes ``synced`` durable; tell ``store`` whether it did."""
    try:
        step()
    except DurableWriteError as exc:
        if synced:
            store.sync_failed(exc, synced)
        raise
    if synced:
        store.mark_synced(synced)


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
            if stat.S_ISREG(st.st_mode) and not _setting(store, workdir, "core.symlinks"):
                with open(full, "rb") as fh:  # core.symlinks=false: the target as a plain file
                    target: bytes | None = fh.read()
            else:
                target = os.fsencode(os.readlink(full)) if stat.S_ISLNK(st.st_mode) else None
            if target != store.read_blob(entry.oid):
                return False
            continue
        if not stat.S_ISREG(st.st_mode):
            return False
        if bool(st.st_mode & 0o100) != (entry.mode == _MODE_EXEC) and _setting(store, workdir, "core.fileMode"):
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
    for level, name in ((pygit2.enums.ConfigLevel.SYSTEM, "gitattributes"),
                        (pygit2.enums.ConfigLevel.XDG, "attributes")):
        try:
            dirs = pygit2.settings.search_path[level]
        except (pygit2.GitError, ValueError):
            return True
        places += [os.path.join(d, name) for d in (dirs or "").split(os.pathsep) if d]
    return any(os.path.lexists(p) for p in places)


def plain_checkout(store: GitStore, workdir: str, paths: list[str], tree: str) -> bool:
    """Whether no attribute (nor ``core.autocrlf``) can filter these paths on checkout: blobs go to disk as they are.

    libgit2 decides that from the working folders' ``.gitattributes`` and,
    where there is none, the index's — at 100k entries a cold process parses
    the index for it (about 60 ms).  This answers from the files: no
    ``.gitattributes`` on disk or in ``tree`` in any folder on the paths or
    among them, no ``info/attributes``, no configured, global or system
    attributes file, ``core.autocrlf`` unset or false.  (One only in the index
    is not looked for.)  ``False``: libgit2 decides.
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

    ``repo``: the worktree's repository, when the caller has it open.  ``oid``:
    the blob's id; given, a path whose conversion only git reproduces
    (:mod:`cas.git_filters`) is converted by git.
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
        converted = apply_filters(filters, blob)
    except pygit2.GitError:
        return blob
    if converted is None:  # NUL bytes, which pygit2 would cut: git converts them
        by_git = smudged_by_git(workdir, path, oid if oid is not None else git_blob_oid(blob))
        return blob if by_git is None else by_git
    return converted


def _setting(store: GitStore, workdir: str, name: str, default: bool = True) -> bool:
    """A boolean setting of the worktree's configuration (``default`` where unset or unreadable)."""
    try:
        return bool(store.worktree_repo(workdir).config.get_bool(name))
    except (KeyError, pygit2.GitError, ValueError):
        return default


def index_matches(workdir: str, changes: Mapping[str, TreeEntry | None]) -> bool:
    """Whether the index entries of ``workdir`` equal ``changes`` (read as :func:`cas.index.snapshot_for` reads it).

    Raises:
        UsageError: an index neither the in-place reader nor libgit2 can read (a split index), with the fix named.
    """
    snap = snapshot_for(os.path.realpath(pygit2.Repository(workdir).path))
    return _confirmed(snap, lambda: all(snap.entry(path) == entry for path, entry in changes.items()))

"""Worktrees that have the target branch checked out: checks before, writes ahead of and after the move."""

from __future__ import annotations

import functools
import os
import shlex
from collections.abc import Callable
from typing import Any

import filelock

from cas.errors import GitStoreError, OncepatchError, RefLockedError, UsageError
from cas.gitdir import worktrees_on
from cas.hashing import sha256_hex
from cas.durable import fsync_dir
from cas.index import prefetch
from cas.index_lock import IndexLock, hold_index_lock, on_branch, settle_ahead, stage_ahead, update_index
from cas.objects import GitStore, TreeEntry
from cas.worktree import (Originals, dirty_paths, materialise, originals_of, outside_sparse_checkout, put_back,
                          unsafe_worktree_paths, write_files)
from receipts.engine import settle
from receipts.states import needs_resolution
from receipts.store import ReceiptStore
from patcher.errors import DirtyPath, UnsafePath
from patcher.git_adapter import GitAdapter
from patcher.markers import foreign_index_lock, index_marker, index_markers

__all__ = ["prefetch_indexes", "settle_dead_calls", "check_worktrees", "hold_index_locks", "release_index_locks",
           "IndexesAhead", "materialise_all"]


def prefetch_indexes(gstore: GitStore, branch: str) -> None:
    """Start reading the index of every worktree on ``branch`` in the background (:func:`cas.index.prefetch`)."""
    for workdir, _git_dir in worktrees_on(gstore.common_dir, branch, gstore.main_workdir):
        try:
            prefetch(os.path.realpath(gstore.worktree_repo(workdir).path))
        except GitStoreError:
            continue  # check_worktrees meets it again


def settle_dead_calls(rstore: ReceiptStore, stores: dict[str, Any] | None,
                      own_key: str | None = None) -> Callable[[str], None]:
    """An ``on_dead`` for :func:`cas.index_lock.hold_index_lock`: settle the dead calls that held ``index_lock``.

    A call killed after its branch moved and before its worktree followed
    leaves its marked ``index.lock`` (and a marker in the store naming it).
    Removing the lock alone would let ``git commit`` commit the stale index,
    reverting that call's change; so each call the store's markers tie to the
    lock is settled first, as ``recover`` settles it (its receipt resolved,
    its touched paths brought to the branch where they still show the base,
    the lock removed).  A marker whose call is settled already is left alone;
    one whose key lock another process holds (settling it too) is waited for,
    up to :data:`SETTLE_WAIT` seconds.  ``own_key``: the caller's key, whose
    lock it holds itself (never waited for).

    Raises:
        RefLockedError: a call the lock protects could not be settled (its
            repository moved since, say): the lock stays, ``next_action``
            is ``recover``.
    """

    def on_dead(index_lock: str) -> None:
        other = foreign_index_lock(index_lock, rstore)
        if other is not None:
            # Another store's call: its receipt and marker are there, not here.  Removing
            # the lock would let 'git commit' commit the stale index over its change.
            raise _left_locked(index_lock, {"reason": "crashed_call_other_store", "store": other},
                               f"a crashed call of the receipt store '{other}': run 'oncepatch recover "
                               f"--store {shlex.quote(other)}', then retry")
        unsettled: list[str] = []
        for h, named in index_markers(rstore):
            if named != index_lock and os.path.exists(os.path.dirname(named)):
                continue  # another worktree's lock
            try:
                receipt = rstore.read_hash(h)
            except OncepatchError:
                continue  # a corrupt receipt: recover reports it
            if receipt is None or receipt.key == own_key:
                continue
            if named != index_lock:
                # Its lock's folder is gone (the repository moved since the crash): it may be
                # this very lock, under its old path.  Unresolved, it is not broken here.
                if needs_resolution(receipt.status):
                    unsettled.append(receipt.key)
                continue
            lock = rstore.key_lock(receipt.key)
            try:
                lock.acquire(timeout=SETTLE_WAIT, poll_interval=0.01)
            except filelock.Timeout:
                unsettled.append(receipt.key)  # still held by another process all this while
                continue
            try:
                current = rstore.read(receipt.key)
                if current is None:
                    continue
                adapter = GitAdapter(rstore, stores if stores is not None else {})
                if needs_resolution(current.status):
                    current = settle(rstore, current, adapter)
                elif current.status == "committed":
                    adapter.settle(current)
                if needs_resolution(current.status):
                    unsettled.append(current.key)
            except OncepatchError:
                unsettled.append(receipt.key)
            finally:
                lock.release()
        if unsettled:
            # Removing the lock would let 'git commit' commit the stale index over that change.
            keys = sorted(set(unsettled))
            raise _left_locked(index_lock, {"reason": "crashed_call_unsettled", "keys": keys},
                               f"a crashed call whose change the worktree does not show yet (key "
                               f"{', '.join(repr(k) for k in keys)}), and it cannot be settled from here: "
                               f"run 'oncepatch recover' (or 'oncepatch resolve')")

    return on_dead


def _left_locked(index_lock: str, details: dict[str, Any], by: str) -> RefLockedError:
    """The refusal to take ``index_lock``, left by ``by``, which only ``recover`` may remove."""
    err = RefLockedError(index_lock, next_action="recover", details=details)
    err.message = f"'{index_lock}' was left by {by}; do not remove the lock by hand"
    return err


#: How long a call waits for another process settling the same dead call (seconds).
SETTLE_WAIT = 10.0


def check_worktrees(gstore: GitStore, branch: str, paths: list[str], on_dead: Callable[[str], None] | None = None,
                    owner: str | None = None, *, timeout: float) -> list[tuple[str, str]]:
    """The worktrees on ``branch``, after refusing dirty or symlinked touched paths (before prepare).

    ``on_dead``: see :func:`settle_dead_calls`.

    Raises:
        DirtyPath: a touched path has uncommitted changes (or an untracked file) there.
        UnsafePath: a folder on a touched path is a symlink there.
        RefLockedError: a worktree's ``index.lock`` stayed held (nothing is written then).
        UsageError: a worktree's HEAD cannot be read (EACCES, EIO): the branch may be checked out there.
    """
    try:
        found = worktrees_on(gstore.common_dir, branch, gstore.main_workdir, strict=True)
    except OSError as exc:
        # Read as "not checked out there", the call would move the branch under that worktree
        # and leave its index a staged revert of the commit: cannot tell is refused instead.
        head = exc.filename if isinstance(exc.filename, str) else "HEAD"
        raise UsageError(f"cannot tell whether '{branch}' is checked out in the worktree of git dir '{os.path.dirname(head)}': "
                         f"cannot read '{head}' ({exc.strerror or exc}); nothing was changed",
                         details={"reason": "worktree_head_unreadable", "path": head, "errno": exc.errno}) from None
    for workdir, _git_dir in found:
        bad = unsafe_worktree_paths(workdir, paths)
        if bad:
            raise UnsafePath(f"refusing to write '{bad[0]}' in '{workdir}': a folder on its path is a symlink",
                             details={"paths": bad, "worktree": workdir, "reason": "through_symlink"})
        # Race guarded: another call moves the branch (holding index.lock) and only
        # then brings the index along; read in between, HEAD and the index disagree
        # and a clean path looks dirty.  Under index.lock both are read as one state.
        lock = hold_index_lock(workdir, timeout=timeout, git_dir=_git_dir, keep_mark=True, on_dead=on_dead,
                               owner=owner)
        try:
            tip = gstore.resolve(branch)
            tip_tree = gstore.commit_tree(tip) if tip else None
            dirty = dirty_paths(gstore, workdir, paths, tip_tree)
            sparse = outside_sparse_checkout(gstore, workdir, dirty) if dirty else []
        finally:
            lock.release()
        if sparse:
            # Not a change to commit or stash: a retry would meet the same.
            raise DirtyPath(
                f"'{sparse[0]}' is outside the sparse checkout of '{workdir}'{_more(sparse)}: oncepatch writes "
                "only files the checkout has; widen it ('git sparse-checkout add') or apply to a branch that is "
                "not checked out",
                retryable=False, next_action="fix_input",
                details={"paths": sparse, "worktree": workdir, "reason": "outside_sparse_checkout"},
            )
        if dirty:
            raise DirtyPath(f"'{dirty[0]}' has uncommitted changes in '{workdir}'{_more(dirty)}: commit or stash them "
                            f"first", details={"paths": dirty, "worktree": workdir})
    return found


def _more(paths: list[str]) -> str:
    return f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""


def hold_index_locks(rstore: ReceiptStore, worktrees: list[tuple[str, str]], key: str,
                     timeout: float, on_dead: Callable[[str], None] | None = None) -> dict[str, IndexLock]:
    """Take the ``index.lock`` of every worktree on the branch (in path order), before the branch moves.

    They stay held until the touched paths are materialised
    (:func:`release_index_locks` after :func:`materialise_all`).  Race guarded:
    ``git commit`` reads HEAD, then takes ``index.lock`` and builds its tree
    from the index; if it read our new HEAD while the index still had the old
    entries, its commit would revert our change (a lost update, with both
    commits in ``git log``).

    Raises:
        RefLockedError: an ``index.lock`` stayed held (those taken are released).
    """
    held: dict[str, IndexLock] = {}
    try:
        for workdir, git_dir in sorted(worktrees):
            marker = index_marker(rstore, key) if not held else None
            held[workdir] = hold_index_lock(workdir, timeout=timeout, lock_marker=marker, git_dir=git_dir,
                                            keep_mark=True, on_dead=on_dead, owner=rstore.root)
    except BaseException:
        release_index_locks(held)
        raise
    return held


def release_index_locks(held: dict[str, IndexLock]) -> None:
    """Release every lock of ``held`` (:meth:`cas.index_lock.IndexLock.release`), each even when another fails.

    Raises:
        OSError: a lock could not be removed (the first such error, once all were tried).
    """
    failed: OSError | None = None
    for lock in held.values():
        try:
            lock.release()
        except OSError as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


#: How many times :meth:`IndexesAhead.settle` tries to settle a worktree's index.
SETTLE_ATTEMPTS = 3


class IndexesAhead:
    """The files and indexes of the worktrees on the branch, written ahead of its move, for one call.

    Calling sequence, with the index locks held throughout: :meth:`stage`
    once, then :meth:`write_files` once (which stages the deletions last),
    both with the candidate, under the branch's lock just before it moves;
    then :meth:`settle` once, whatever happened.

    A call killed after the files are written leaves a worktree whose index
    and files hold the change (docs/RECOVERY.md): a person who removes the
    dead call's ``index.lock`` and runs ``git commit -a`` then commits nothing
    of it against a branch that moved, or the whole change against one that
    did not (git refuses while the branch's lock is left), never a revert.
    """

    def __init__(self, gstore: GitStore, held: dict[str, IndexLock], paths: list[str]) -> None:
        self._gstore = gstore
        self._held = held
        self._paths = paths
        self._staged: list[str] = []  # the git dirs whose index shows the candidate (or may)
        self._files: list[tuple[str, Originals]] = []  # (git dir, what its worktree held) where files may be written
        self._candidate: str | None = None
        self._changes: dict[str, TreeEntry | None] = {}
        #: workdir -> the entries its touched files hold now (written ahead, whole)
        self.written: dict[str, dict[str, TreeEntry | None]] = {}

    def _changes_of(self, candidate: str) -> dict[str, TreeEntry | None]:
        if self._candidate != candidate:
            tree = self._gstore.commit_tree(candidate)
            self._candidate = candidate
            self._changes = {p: self._gstore.lookup_file(tree, p) for p in self._paths}
        return self._changes

    def write_files(self, candidate: str) -> None:
        """Write ``candidate``'s version of the touched files in every held worktree, keeping what they held.

        Then the deletions :meth:`stage` left are staged in each index.

        Raises:
            UnsafeWorktreePath: a folder on a touched path is a symlink (nothing moved; :meth:`settle` puts back).
            GitStoreError: a file could not be read or written (the same).
        """
        assert not self._files, "written once per call"  # (after stage())
        if not self._held:
            return
        changes = self._changes_of(candidate)
        tree = self._gstore.commit_tree(candidate)
        staged = set(self._staged)
        for workdir, lock in sorted(self._held.items()):
            originals = originals_of(workdir, self._paths)
            self._files.append((lock.git_dir, originals))  # before any write: settle() looks at it
            write_files(self._gstore, workdir, changes, tree=tree)
            self.written[workdir] = changes
            later = _deletions_after_files(changes)
            if later and lock.git_dir in staged:
                update_index(workdir, later, [], held=lock, sync=False)

    def stage(self, candidate: str) -> None:
        """Stage ``candidate``'s entries of the touched paths in every held worktree's index (deletions: see below).

        A deleted path's entry is removed only after the files are written
        (:meth:`write_files`), unless a path the candidate adds goes through
        it or under it (the index cannot hold both).  Race guarded: killed in
        between, a person who removes ``index.lock`` and runs ``git commit -a``
        would commit the deletion alone (the file, still there, is untracked
        to git then), half of the change; with the entry kept, the commit
        stages the old files again, nothing of the change.

        Raises:
            GitStoreError: an index could not be written (nothing has moved; :meth:`settle` restores).
        """
        assert not self._staged, "staged once per call"
        if not self._held:
            return
        changes = self._changes_of(candidate)
        later = set(_deletions_after_files(changes))
        first = {p: e for p, e in changes.items() if p not in later}
        for workdir, lock in sorted(self._held.items()):
            self._staged.append(lock.git_dir)  # before any write: settle() looks at it
            if not stage_ahead(workdir, lock, first, candidate):
                self._staged.pop()  # no index there yet: the materialised files make the first

    def settle(self, materialised: bool, moved: bool | None) -> None:
        """Keep the files and staged indexes if the branch moved to the candidate, else bring back what they replaced.

        ``moved``: whether the swap moved the branch; ``None``: unknown (see
        :func:`cas.index_lock.settle_ahead`; the files stay where the
        candidate is on the branch).  ``materialised``: the index was written
        after the move (else a staged index that stays is synced first).
        Files are put back before their index: a ``git commit`` that takes
        the lock next sees them as they were.

        Raises:
            OSError, GitStoreError: a worktree could not be put back; the caller must then leave
                the index locks held (a marked dead lock is settled by whoever breaks it).
        """
        for git_dir, originals in self._files:
            assert self._candidate is not None
            if moved if moved is not None else on_branch(git_dir, self._candidate):
                continue
            _repeated(functools.partial(put_back, originals))
            self.written.pop(originals.workdir, None)
        self._files.clear()
        for git_dir in self._staged:
            # A transient fault (EIO on the rename or the folder's sync) is tried again:
            # a settle that fails leaves the call's index.lock held (see _settle_and_release).
            # settle_ahead repeats safely: a kept index already put back is not there any more.
            _repeated(functools.partial(settle_ahead, git_dir, moved, sync_index=not materialised),
                      then=functools.partial(fsync_dir, git_dir))
        self._staged.clear()


def _deletions_after_files(changes: dict[str, TreeEntry | None]) -> list[str]:
    """The deletions of ``changes`` staged after the files are written: those no added path collides with."""
    added = {p for p, e in changes.items() if e is not None}
    folders = {a[:i] for a in added for i, c in enumerate(a) if c == "/"}  # the folders an added path goes through

    def collides(path: str) -> bool:
        return path in folders or any(path[:i] in added for i, c in enumerate(path) if c == "/")

    return sorted(p for p, e in changes.items() if e is None and not collides(p))


def _repeated(step: Callable[[], None], then: Callable[[], None] | None = None) -> None:
    """``step``, tried up to :data:`SETTLE_ATTEMPTS` times; ``then`` after a retry that succeeded."""
    for attempt in range(SETTLE_ATTEMPTS):
        try:
            step()
            if attempt and then is not None:
                then()  # the rename of the attempt that failed on its sync
            return
        except (OSError, GitStoreError):
            if attempt == SETTLE_ATTEMPTS - 1:
                raise


def materialise_all(gstore: GitStore, rstore: ReceiptStore, worktrees: list[tuple[str, str]], branch: str,
                    paths: list[str], key: str, held: dict[str, IndexLock] | None, timeout: float,
                    written: dict[str, dict[str, TreeEntry | None]] | None = None) -> list[str]:
    """Bring each worktree's touched paths and index to the branch's *current* head; return warnings.

    Under a per-worktree lock, the head is re-read and its entries for the
    touched paths are written — not this call's candidate: when two calls land
    one after the other and the first materialises last, it must not roll a
    shared path back to its own older version.

    ``held``: index locks taken by :func:`hold_index_locks` (used, not released).
    ``written``: :attr:`IndexesAhead.written`; a worktree whose files already
    hold the head's entries only gets its index entries (with stat data).
    ``timeout``: the call's lock timeout, for each worktree's materialise lock
    (and its ``index.lock`` when not ``held``).

    The commit has landed when this runs, so a failure here does not undo it:
    it becomes a warning in the receipt, and ``recover`` materialises again.
    """
    warnings: list[str] = []
    if not worktrees:
        return warnings
    for workdir, _git_dir in worktrees:
        lk = rstore.file_lock("worktree-" + sha256_hex(workdir.encode()) + ".lock")
        wt_lock = lk.lock_file
        try:
            lk.acquire(timeout=timeout, poll_interval=0.005)
        except filelock.Timeout:
            warnings.append(f"worktree '{workdir}' not updated: its materialise lock '{wt_lock}' stayed held")
            continue
        try:
            tip = gstore.resolve(branch)
            tree = gstore.commit_tree(tip) if tip else None
            # A touched path that is a folder at the head (a file gave way to it)
            # is "no file here": its own files are touched paths too.
            changes: dict[str, TreeEntry | None] = {p: gstore.lookup_file(tree, p) for p in paths}
            lock = (held or {}).get(workdir)
            # The branch's move is made durable before the worktree changes (in its first round).
            # The index's folder joins the moved branch's: synced in the finalise batch's
            # first round, before the committed receipt (one flush point less).
            renamed: list[str] = []
            try:
                if lock is not None and (written or {}).get(workdir) == changes:
                    update_index(workdir, [p for p, e in changes.items() if e is None],
                                 [p for p, e in changes.items() if e is not None], held=lock, known=changes,
                                 defer_dir=renamed)
                    continue
                materialise(gstore, workdir, changes, lock_marker=None if lock else index_marker(rstore, key),
                            held=lock, timeout=timeout, tree=tree, sync_first=gstore.unsynced(), defer_dir=renamed)
            finally:
                gstore.defer_sync(renamed)
        except OncepatchError as exc:
            warnings.append(f"worktree '{workdir}' not updated: {exc.message}")
        finally:
            lk.release()
    return warnings

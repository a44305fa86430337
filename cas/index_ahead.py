"""A worktree's index staged ahead of its branch: the new entries are in the index before the branch moves.

Race guarded: ``git commit`` reads HEAD, then the index, and only then takes
``index.lock``; it builds its tree from the index it read.  Had the branch
moved first and the index followed, a ``git commit`` that read the new HEAD
and the old index in between, and took ``index.lock`` the moment we released
it, would commit the old index on top of the new commit: a silent revert of
the change, with both commits in the log.  Git's own commands change the
index first and HEAD after, and so does the apply protocol.  While it holds
``index.lock`` and before the branch moves, :func:`stage_ahead` sets the
touched entries of the index to the candidate's, without stat data (the files
still hold the base: git compares their content and sees them changed).  After
the move the files are written, and the index again with their stat data
(:func:`cas.worktree.materialise`).

The apply protocol stages the index under the branch's ref lock, after its
compare-and-swap found the branch at the base and its fence held, just before
the rename that moves the branch: a ``git commit`` that reads the staged
index then also finds the branch moved by the time it can take
``index.lock``.  Staged before the compare, a refused call (the ref lock
held, a fence lost) would leave a window in which git could read the staged
entries on the unmoved branch and commit them as its own.

The index it replaced is kept, hard-linked, as
``<git-dir>/index.oncepatch-base.<pid>.<candidate>`` until the call knows
whether the branch moved (:func:`settle_ahead`): renamed back over ``index``
when it did not (the ref's rename failed), removed when it did.  A call killed
in between leaves it beside its marked ``index.lock``, and whoever breaks that
lock settles the kept index of that lock's pid first (:func:`settle_ahead`
with ``moved`` unknown): it comes back unless the candidate is on the
worktree's branch and the index is readable.

Not closed here: a ``git commit`` that read the index before the call took
``index.lock`` and takes the lock after the call released it writes its stale
index back (its commit then fails on HEAD, which moved).  That is git's own
race; it loses a concurrent ``git add`` the same way (docs/CONCURRENCY.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cas.durable import fsync_all, fsync_dir
from cas.errors import GitStoreError
from cas.objects import TreeEntry

if TYPE_CHECKING:
    from cas.worktree import IndexLock

__all__ = ["KEPT_PREFIX", "kept_indexes", "stage_ahead", "settle_ahead"]

#: ``<git-dir>/index.oncepatch-base.<pid>.<candidate>``: the index a call's staged index replaced.
KEPT_PREFIX = "index.oncepatch-base."


def kept_indexes(git_dir: str, pid: int | None = None) -> list[str]:
    """The kept indexes in ``git_dir`` (of process ``pid`` only, if given)."""
    try:
        names = os.listdir(git_dir)
    except OSError:
        return []
    want = KEPT_PREFIX if pid is None else f"{KEPT_PREFIX}{pid}."
    return sorted(os.path.join(git_dir, n) for n in names if n.startswith(want))


def _candidate_of(kept: str) -> str:
    return os.path.basename(kept)[len(KEPT_PREFIX):].split(".", 1)[-1]


def stage_ahead(workdir: str, lock: IndexLock, changes: Mapping[str, TreeEntry | None], candidate: str) -> bool:
    """Set ``changes`` (path → the candidate's entry, ``None``: no file) in the index, keeping the index it replaces.

    ``lock``: the worktree's ``index.lock``, held.  Once per call: only the
    branch's rename follows.  The new index is not synced: it only has to be
    seen until the index of the materialised files replaces it, and a crash
    brings the kept one back.  Returns whether the index was staged
    (``False``: the worktree has no index yet, and nothing was written).

    Raises:
        GitStoreError: the index could not be written (the kept one is left for :func:`settle_ahead`).
    """
    from cas.worktree import update_index

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

    ``moved``: whether the branch moved to the candidate; ``None``: unknown
    (the swap failed, maybe after its rename; a dead call), then the staged
    index stays only when the candidate is on the worktree's branch and the
    index is readable (a crash of the machine may leave the unsynced staged
    index torn).  ``sync_index``: a staged index that stays is synced with its
    folder first (the files could not be written after it).  A kept index
    that cannot be removed is left for the next :func:`stage_ahead`.

    Raises:
        OSError: the kept index could not be put back.
    """
    index = os.path.join(git_dir, "index")
    for kept in kept_indexes(git_dir, os.getpid() if pid is None else pid):
        stays = moved if moved is not None else _on_branch(git_dir, _candidate_of(kept)) and _readable(index)
        if not stays:
            _restore(git_dir, kept)
            continue
        with contextlib.suppress(OSError):
            if sync_index:
                fsync_all([index, git_dir])
            os.unlink(kept)


def _restore(git_dir: str, kept: str) -> None:
    index = os.path.join(git_dir, "index")
    try:
        same = os.path.samefile(kept, index)
    except FileNotFoundError:
        same = False
    if same:  # killed between keeping it and writing the staged one
        os.unlink(kept)
        return
    os.replace(kept, index)
    fsync_dir(git_dir)


def _on_branch(git_dir: str, candidate: str) -> bool:
    """Whether ``candidate`` is the head of ``git_dir``'s checked-out branch, or behind it."""
    import pygit2

    try:
        repo = pygit2.Repository(git_dir)
        tip = str(repo.head.target)
        return tip == candidate or bool(repo.descendant_of(tip, candidate))
    except (pygit2.GitError, KeyError, ValueError):
        return False


def _readable(index: str) -> bool:
    """Whether libgit2 reads ``index`` whole (its checksum verified)."""
    import pygit2

    from cas.index_cache import _open_index

    if not os.path.isfile(index):
        return False  # libgit2 would open it as an empty index
    with contextlib.suppress(pygit2.GitError, OSError, ValueError):
        _open_index(index)
        return True
    return False

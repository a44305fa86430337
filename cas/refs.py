"""The refs half of :class:`cas.objects.GitStore`: reading refs, moving the branch, the key ref.

Every ref is written by libgit2, through a reference transaction
(``Repository.transaction()``: git's ``<ref>.lock`` protocol, the reflog
entry, and with ``enable_fsync_gitdir`` the syncs of the lock and its folder):

* :meth:`RefUpdates.compare_and_swap`: lock the branch, re-read it *under the
  lock* and compare it with the expected old value, check that the new
  value's objects exist (:meth:`cas.objects.GitStore.ensure_objects`), run
  the caller's precondition, set it;
* :meth:`RefUpdates.create_key_ref`: the create-only ``refs/oncepatch/keys/<h>``,
  with a reflog entry (its reflog is created as ``git update-ref
  --create-reflog`` would; libgit2 appends as ``core.logAllRefUpdates`` allows);
* folders the caller left unsynced (a worktree's new index, see
  :func:`cas.worktree.materialise`), and what is known when their sync fails.

Why the key ref is not in the branch's transaction: libgit2 commits a
transaction's refs one lock-file rename at a time, so a crash between them can
leave either one alone.  The branch moves first and the key ref follows; a key
ref therefore always proves that the branch moved, and a branch move without
its key ref is found by recovery through reachability and the reflog.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import pygit2

from cas.durable import fsync_all, make_dirs
from cas.errors import DurableWriteError, GitStoreError, RefLockedError, RefMovedError, RefUpdateUnknown
from cas.signature import IdentityUnknown, Signature, git_clean

T = TypeVar("T")

__all__ = ["RefUpdates", "KEY_REF_PREFIX"]

KEY_REF_PREFIX = "refs/oncepatch/keys/"


def _sync_unknown(exc: DurableWriteError) -> RefUpdateUnknown:
    return RefUpdateUnknown(f"the branch moved but '{exc.path}' could not be synced: {exc.cause}")


class RefUpdates:
    """Ref reads and moves of an open repository (a base of :class:`cas.objects.GitStore`, which opens it)."""

    repo: pygit2.Repository
    git_dir: str
    common_dir: str

    if TYPE_CHECKING:  # GitStore's, called from here
        def flush_objects(self) -> None: ...
        def ensure_objects(self, ref: str, new: str) -> None: ...
        def default_signature(self, kind: str = "committer") -> Signature: ...

    def _init_refs(self) -> None:
        # Folders the caller left unsynced (defer_sync), which a later batch syncs.
        self._unsynced: dict[str, None] = {}
        self._sync_failure: DurableWriteError | None = None

    def resolve(self, ref: str) -> str | None:
        """The oid a ref points at now (peeled through symbolic refs), ``None`` if absent."""
        try:
            r = self.repo.references.get(ref)
        except (pygit2.GitError, ValueError) as exc:
            raise GitStoreError(f"cannot read ref '{ref}': {exc}") from exc
        if r is None:
            return None
        try:
            return str(r.resolve().target)
        except (pygit2.GitError, KeyError):
            return None

    def _lock_path(self, ref: str) -> str:
        folder = self.common_dir if ref.startswith("refs/") else self.git_dir
        return os.path.join(folder, ref + ".lock")

    def compare_and_swap(self, ref: str, expected: str | None, new: str, message: str,
                         *, lock_timeout: float = 1.0, precondition: Callable[[], None] | None = None,
                         before_libgit2: Callable[[], None] | None = None) -> None:
        """Move ``ref`` from ``expected`` to ``new`` atomically, or not at all (one libgit2 transaction).

        Calling sequence, all under ``<ref>.lock``: the ref is re-read and
        compared with ``expected``; ``new`` and the objects this call wrote
        are checked to exist, and written again if gone
        (:meth:`cas.objects.GitStore.ensure_objects`); ``precondition`` runs;
        the ref is set, with a reflog entry carrying ``message``.

        A held ``<ref>.lock`` is waited for up to ``lock_timeout`` seconds (git
        holds its ref locks for milliseconds; like git's
        ``core.filesRefLockTimeout``), then reported.

        ``before_libgit2`` runs once before the transaction first takes the
        lock (libgit2 creates ``<ref>.lock`` empty and fills it only when
        committing): the apply protocol writes the marker that proves such an
        empty lock its own.

        ``precondition`` runs while ``<ref>.lock`` is held, after the compare and
        before the swap; whatever it raises aborts the transaction (the ref is
        not moved, the lock is released) and propagates.  The apply protocol
        checks its fencing token there, so that check and the move are one step.

        Raises:
            RefLockedError: ``<ref>.lock`` stayed held (a live git, or a stale lock).
            RefMovedError: under the lock, the ref is not at ``expected``.
            ObjectsMissing: under the lock, an object ``new`` needs is gone (nothing moved).
            RefUpdateUnknown: the commit of the transaction failed; the ref may have moved.
        """
        self.flush_objects()  # the objects a ref will name are durable before it moves
        if before_libgit2 is not None:
            before_libgit2()
        _while_locked(lambda: self._compare_and_swap_once(ref, expected, new, message, precondition), lock_timeout)

    @contextlib.contextmanager
    def _locked(self, ref: str, verb: str, noun: str) -> Iterator[Callable[[str, str], None]]:
        """One libgit2 transaction holding ``<ref>.lock``; yields ``set_target(oid, message)``.

        The transaction commits as the ``with`` block ends (nothing set: the
        lock is released).

        Raises:
            RefLockedError: ``<ref>.lock`` is held.
            GitStoreError: libgit2 failed before anything was set.
            RefUpdateUnknown: the commit of the transaction failed after the target was set.
        """
        committing = False

        def set_target(oid: str, message: str) -> None:
            nonlocal committing
            txn.set_target(ref, pygit2.Oid(hex=oid), message=" ".join(message.split()))
            committing = True  # the context manager commits on a clean exit

        try:
            self._use_reflog_identity()
            with self.repo.transaction() as txn:
                try:
                    txn.lock_ref(ref)
                except pygit2.GitError as exc:
                    raise RefLockedError(self._lock_path(ref)) from exc
                yield set_target
        except pygit2.GitError as exc:
            if not committing:
                raise GitStoreError(f"cannot {verb} ref '{ref}': {exc}") from exc
            # The rename of <ref>.lock may have happened before the failure
            # (libgit2 fsyncs the folder after renaming): only a query can tell.
            raise RefUpdateUnknown(f"{noun} of ref '{ref}' failed after locking: {exc}") from exc

    def _compare_and_swap_once(self, ref: str, expected: str | None, new: str, message: str,
                               precondition: Callable[[], None] | None) -> None:
        with self._locked(ref, "update", "update") as set_target:
            actual = self.resolve(ref)  # re-read under the lock: the compare of the CAS
            if actual != expected:
                raise RefMovedError(ref, actual, expected)
            # Race: a 'git gc --prune=now' since the objects were written removed them
            # (unreferenced until this move): the ref must never name a missing object.
            self.ensure_objects(ref, new)
            if precondition is not None:
                # Race: a check made before taking the lock can be stale by the time
                # the ref moves (a paused owner whose key was taken over meanwhile).
                precondition()
            set_target(new, message)

    def create_key_ref(self, ref: str, target: str, message: str, *, lock_timeout: float = 1.0) -> bool:
        """Create ``ref`` → ``target`` if it does not exist; ``False`` if it already points there.

        One libgit2 transaction: ``<ref>.lock`` taken, the ref re-read under it
        (create-only), ``target`` checked to exist, the ref set with a reflog
        entry.  A held lock is waited for up to ``lock_timeout`` seconds (a
        ``git pack-refs`` holds it for milliseconds).

        Raises:
            RefMovedError: it exists and points elsewhere.
            RefLockedError: ``<ref>.lock`` stayed held (a crashed or live writer).
            ObjectsMissing: ``target`` is not in the repository.
            RefUpdateUnknown: the commit of the transaction failed; the ref may exist.
        """
        current = self.resolve(ref)
        if current == target:
            return False
        if current is not None:
            raise RefMovedError(ref, current, None)
        self._create_reflog(ref)
        return _while_locked(lambda: self._create_once(ref, target, message), lock_timeout)

    def _create_once(self, ref: str, target: str, message: str) -> bool:
        with self._locked(ref, "create", "creation") as set_target:
            current = self.resolve(ref)
            if current == target:
                return False  # the transaction ends with nothing set: the lock is released
            if current is not None:
                raise RefMovedError(ref, current, None)
            self.ensure_objects(ref, target)
            set_target(target, message)
        return True

    def _use_reflog_identity(self) -> None:
        """Make the committer identity git writes in reflogs (``GIT_COMMITTER_*``, then the configuration) libgit2's.

        libgit2 reads only the configuration for a reflog entry's identity; the
        repository's ident (``set_ident``) takes precedence there.  Its time is
        the moment of the move (a ``GIT_COMMITTER_DATE`` is not carried over).
        With no identity configured git writes its guess, and so does this; an
        identity libgit2 refuses leaves libgit2 its own.
        """
        try:
            sig = self.default_signature("committer")
        except IdentityUnknown as exc:  # git too writes a reflog line with its guess (git_committer_info(0))
            sig = exc.guess
        except (ValueError, pygit2.GitError):
            return
        try:
            self.repo.set_ident(git_clean(sig.name), git_clean(sig.email))
        except (ValueError, pygit2.GitError):
            pass

    def _create_reflog(self, ref: str) -> None:
        """An empty reflog for ``ref`` if it has none (git's ``update-ref --create-reflog``): libgit2 appends to it.

        Created empty in one step, not synced: libgit2 syncs the file and its
        folder when it appends the entry (``enable_fsync_gitdir``).

        Raises:
            GitStoreError: the file could not be created.
        """
        path = os.path.join(self.common_dir, "logs", ref)
        try:
            make_dirs(os.path.dirname(path), 0o777)  # 0777 and 0666 less the umask, as git makes them
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            return
        except OSError as exc:
            raise GitStoreError(f"cannot create the reflog of '{ref}': {exc}") from exc
        os.close(fd)

    def unsynced(self) -> list[str]:
        """The folders left unsynced with :meth:`defer_sync`, not yet synced (they stay listed)."""
        return list(self._unsynced)

    def sync_failed(self, exc: DurableWriteError, paths: list[str]) -> None:
        """A round that synced ``paths`` (from :meth:`unsynced`) failed: note it if one of them failed.

        A sync is not retried as if nothing happened (a second fsync after a
        failed one can succeed with the data lost): the durability of what the
        folder holds is unknown from here on (:meth:`take_sync_failure`).
        """
        if any(p in exc.failed for p in paths) and self._sync_failure is None:
            self._sync_failure = exc

    def take_sync_failure(self) -> RefUpdateUnknown | None:
        """The failed sync of a deferred folder since the last call, as the error to report."""
        exc, self._sync_failure = self._sync_failure, None
        return None if exc is None else _sync_unknown(exc)

    def mark_synced(self, paths: list[str]) -> None:
        """``paths`` (from :meth:`unsynced`) were synced by the caller: not listed any more."""
        for p in paths:
            self._unsynced.pop(p, None)

    def defer_sync(self, paths: list[str]) -> None:
        """Folders whose renames the caller left unsynced (a worktree's new index): synced in a later round."""
        self._unsynced.update(dict.fromkeys(paths))

    def take_unsynced(self) -> list[str]:
        """The folders left unsynced with :meth:`defer_sync`, not yet synced; the caller now syncs them."""
        todo = list(self._unsynced)
        self._unsynced.clear()
        return todo

    def sync_refs(self) -> None:
        """Sync the folders left with :meth:`defer_sync` that no batch has synced yet.

        Raises:
            RefUpdateUnknown: a sync failed: the branch moved, what the folder holds may not be durable.
        """
        if not self._unsynced:
            return
        todo = self.take_unsynced()
        try:
            fsync_all(todo)
        except DurableWriteError as exc:
            raise _sync_unknown(exc) from exc


def _while_locked(attempt: Callable[[], T], timeout: float) -> T:
    """``attempt()``, tried again while it finds the ref's lock held, for up to ``timeout`` seconds.

    A ``git pack-refs`` or another writer holds a ref's lock for milliseconds;
    the waits grow from 1 ms to 50 ms.

    Raises:
        RefLockedError: the lock stayed held.
    """
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            return attempt()
        except RefLockedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

"""The refs half of :class:`cas.objects.GitStore`: reading refs, moving the branch, the key ref.

* :meth:`RefUpdates.compare_and_swap`: one reference transaction — git's
  ``.lock`` protocol on the branch, the value re-read *under the lock*, checked
  against the expected old value, then set (with a reflog entry); written by
  :mod:`cas.loose_refs` for a plain loose or packed branch, else by libgit2;
* :meth:`RefUpdates.create_key_ref`: the create-only ``refs/oncepatch/keys/<h>``;
* the syncs a move leaves to the caller's next round (``defer_sync``), and
  what is known when one of them fails.

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
from collections.abc import Callable
from typing import TYPE_CHECKING

import pygit2

from cas.durable import DurableBatch, fsync_all
from cas.errors import DurableWriteError, GitStoreError, RefLockedError, RefMovedError, RefUpdateUnknown
from cas.loose_refs import Unsupported, reflogs_for, swap, write_lock_content
from cas.signature import IdentityUnknown, Signature, guessed_identity, signature_line

__all__ = ["RefUpdates", "KEY_REF_PREFIX", "KEY_REF_TMP_PREFIX"]

KEY_REF_PREFIX = "refs/oncepatch/keys/"
#: A key ref's content is written here (in the common git dir, outside refs/) before
#: it is linked to ``<ref>.lock``; a crash in between leaves ``.keyref<TMP_MARK><pid>-…``.
KEY_REF_TMP_PREFIX = ".keyref"


def _sync_unknown(exc: DurableWriteError) -> RefUpdateUnknown:
    return RefUpdateUnknown(f"the branch moved but '{exc.path}' could not be synced: {exc.cause}")


class RefUpdates:
    """Ref reads and moves of an open repository (a base of :class:`cas.objects.GitStore`, which opens it)."""

    repo: pygit2.Repository
    git_dir: str
    common_dir: str

    if TYPE_CHECKING:  # GitStore's, called from here
        def flush_objects(self) -> None: ...
        def default_signature(self, kind: str = "committer") -> Signature: ...

    def _init_refs(self) -> None:
        self._files_refs: bool | None = None
        # (ref, new oid, tmp file): a ref lock's content written and synced ahead (stage_ref_content).
        self._ref_content: tuple[str, str, str] | None = None
        # Folders and reflogs of refs moved with defer_sync, which a later batch syncs.
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

    def stage_ref_content(self, ref: str, new: str, batch: DurableBatch) -> None:
        """Write what ``ref``'s lock will hold to move to ``new``, synced in ``batch``'s first round.

        The move (:meth:`compare_and_swap`, when :mod:`cas.loose_refs` makes it)
        then links that file as the lock and makes no sync of its own before
        the rename: the apply protocol syncs it with the objects and the
        ``prepared`` receipt, one flush point less per call.  A move to another
        oid (re-staged on a moved branch), or through libgit2, does without it;
        :meth:`drop_ref_content` removes it if it was never used.
        """
        self.drop_ref_content()
        if not (ref.startswith("refs/") and self._files_backend()):
            return
        try:
            tmp = write_lock_content(self.common_dir, new)
        except (OSError, Unsupported):
            return  # the move writes its lock as usual
        self._ref_content = (ref, new, tmp)
        batch.sync_first([tmp])

    def drop_ref_content(self) -> None:
        """Remove the file :meth:`stage_ref_content` wrote if no move used it."""
        if self._ref_content is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ref_content[2])
            self._ref_content = None

    def _lock_path(self, ref: str) -> str:
        folder = self.common_dir if ref.startswith("refs/") else self.git_dir
        return os.path.join(folder, ref + ".lock")

    def compare_and_swap(self, ref: str, expected: str | None, new: str, message: str,
                         *, lock_timeout: float = 1.0, precondition: Callable[[], None] | None = None,
                         defer_sync: bool = False, before_libgit2: Callable[[], None] | None = None) -> None:
        """Move ``ref`` from ``expected`` to ``new`` atomically, or not at all.

        A branch held as a loose or packed oid is moved here, the way git's files
        backend moves it (:mod:`cas.loose_refs`); anything else through a libgit2
        transaction.  With ``defer_sync`` the syncs that make the rename (and the
        reflog line) durable are left to the caller's next batch (:meth:`take_unsynced`);
        :meth:`sync_refs` makes them at once.

        A held ``<ref>.lock`` is waited for up to ``lock_timeout`` seconds (git
        holds its ref locks for milliseconds; like git's
        ``core.filesRefLockTimeout``), then reported.

        ``before_libgit2`` runs once before libgit2's transaction takes the lock
        (libgit2 creates ``<ref>.lock`` empty and fills it only when committing;
        the files-backend path's lock is born complete): the apply protocol
        writes the marker that proves such an empty lock its own.

        ``precondition`` runs while ``<ref>.lock`` is held, after the compare and
        before the swap; whatever it raises aborts the transaction (the ref is
        not moved, the lock is released) and propagates.  The apply protocol
        checks its fencing token there, so that check and the move are one step.

        Raises:
            RefLockedError: ``<ref>.lock`` stayed held (a live git, or a stale lock).
            RefMovedError: under the lock, the ref is not at ``expected``.
            RefUpdateUnknown: the commit of the transaction failed; the ref may have moved.
        """
        self.flush_objects()  # the objects a ref will name are durable before it moves
        deadline = time.monotonic() + lock_timeout
        delay = 0.001
        files = self._files_backend() and expected is not None and ref.startswith("refs/")
        while True:
            try:
                if files and expected is not None:
                    try:
                        self._swap_loose(ref, expected, new, message, precondition, defer_sync)
                        return
                    except Unsupported:
                        files = False
                if before_libgit2 is not None:
                    before_libgit2()
                    before_libgit2 = None
                self._compare_and_swap_once(ref, expected, new, message, precondition)
                return
            except RefLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def _files_backend(self) -> bool:
        """Refs in files and SHA-1 ids: what :mod:`cas.loose_refs` writes (read once per store)."""
        if self._files_refs is None:
            cfg = self.repo.config
            plain = True
            for name, ok in (("extensions.refstorage", ("files",)), ("extensions.objectformat", ("sha1",))):
                try:
                    value = cfg[name]
                except KeyError:
                    continue
                plain = plain and str(value).strip().lower() in ok
            self._files_refs = plain
        return self._files_refs

    def _swap_loose(self, ref: str, expected: str, new: str, message: str,
                    precondition: Callable[[], None] | None, defer_sync: bool) -> None:
        cfg = self.repo.config
        log_all: bool | str | None
        try:
            raw = cfg["core.logAllRefUpdates"]
        except KeyError:
            log_all = None  # unset
        else:
            if raw is not None and str(raw).strip().lower() == "always":
                log_all = "always"
            else:
                try:  # git's boolean: a key without a value is true, an empty value false
                    log_all = cfg.get_bool("core.logAllRefUpdates")
                except (pygit2.GitError, ValueError) as exc:
                    raise Unsupported(f"core.logAllRefUpdates: {exc}") from exc
        logs = reflogs_for(self.git_dir, self.common_dir, ref, log_all, self.repo.is_bare)
        synced: str | None = None
        if self._ref_content is not None and self._ref_content[:2] == (ref, new):
            synced = self._ref_content[2]
            self._ref_content = None  # swap consumes it, whatever happens
        folders = swap(self.common_dir, ref, expected, new, self._reflog_line(expected, new, message), logs,
                       precondition, synced)
        self._unsynced.update(dict.fromkeys(folders))
        if not defer_sync:
            self.sync_refs()

    def sync_refs(self) -> None:
        """Sync the folders and reflogs of refs moved with ``defer_sync`` that no batch has synced yet.

        Raises:
            RefUpdateUnknown: a sync failed: the ref moved, its durability is unknown.
        """
        if not self._unsynced:
            return
        todo = list(self._unsynced)
        self._unsynced.clear()
        try:
            fsync_all(todo)
        except DurableWriteError as exc:
            raise _sync_unknown(exc) from exc

    def unsynced(self) -> list[str]:
        """The folders and reflogs of refs moved with ``defer_sync`` not yet synced (they stay listed)."""
        return list(self._unsynced)

    def sync_failed(self, exc: DurableWriteError, paths: list[str]) -> None:
        """A round that synced ``paths`` (from :meth:`unsynced`) failed: note it if one of them failed.

        A sync is not retried as if nothing happened (a second fsync after a
        failed one can succeed with the data lost): the move's durability is
        unknown from here on (:meth:`take_sync_failure`).
        """
        if any(p in exc.failed for p in paths) and self._sync_failure is None:
            self._sync_failure = exc

    def take_sync_failure(self) -> RefUpdateUnknown | None:
        """The failed sync of a moved ref's folder or reflog since the last call, as the error to report."""
        exc, self._sync_failure = self._sync_failure, None
        return None if exc is None else _sync_unknown(exc)

    def mark_synced(self, paths: list[str]) -> None:
        """``paths`` (from :meth:`unsynced`) were synced by the caller: not listed any more."""
        for p in paths:
            self._unsynced.pop(p, None)

    def defer_sync(self, paths: list[str]) -> None:
        """Folders whose renames the caller left unsynced (a worktree's new index): synced with the moved refs'."""
        self._unsynced.update(dict.fromkeys(paths))

    def take_unsynced(self) -> list[str]:
        """The folders and reflogs of refs moved with ``defer_sync``, not yet synced; the caller now syncs them."""
        todo = list(self._unsynced)
        self._unsynced.clear()
        return todo

    def _compare_and_swap_once(self, ref: str, expected: str | None, new: str, message: str,
                               precondition: Callable[[], None] | None) -> None:
        committing = False
        try:
            with self.repo.transaction() as txn:
                try:
                    txn.lock_ref(ref)
                except pygit2.GitError as exc:
                    raise RefLockedError(self._lock_path(ref)) from exc
                actual = self.resolve(ref)  # re-read under the lock: the compare of the CAS
                if actual != expected:
                    raise RefMovedError(ref, actual, expected)
                if precondition is not None:
                    # Race: a check made before taking the lock can be stale by the time
                    # the ref moves (a paused owner whose key was taken over meanwhile).
                    precondition()
                txn.set_target(ref, pygit2.Oid(hex=new), message=message)
                committing = True  # the context manager commits on a clean exit
        except pygit2.GitError as exc:
            if not committing:
                raise GitStoreError(f"cannot update ref '{ref}': {exc}") from exc
            # The rename of <ref>.lock may have happened before the failure
            # (libgit2 fsyncs the folder after renaming): only a query can tell.
            raise RefUpdateUnknown(f"update of ref '{ref}' failed after locking: {exc}") from exc

    def create_key_ref(self, ref: str, target: str, message: str, *, batch: DurableBatch | None = None) -> bool:
        """Create ``ref`` → ``target`` if it does not exist; ``False`` if it already points there.

        Written the way git writes a loose ref: ``<ref>.lock`` created
        exclusively (the lock), filled, synced, renamed to ``<ref>``; its reflog
        entry appended while the lock is held.  With ``batch`` this joins the
        caller's batch (synced with the receipt, renamed before it); without,
        it is written at once.

        Raises:
            RefMovedError: it exists and points elsewhere.
            RefLockedError: ``<ref>.lock`` exists (a crashed or live writer).
        """
        current = self.resolve(ref)
        if current == target:
            return False
        if current is not None:
            raise RefMovedError(ref, current, None)
        path = os.path.join(self.common_dir, ref)
        own = batch is None
        batch = batch if batch is not None else DurableBatch()
        batch.add(path, target.encode() + b"\n", lock=path + ".lock", lock_tmp_dir=self.common_dir,
                  tmp_prefix=KEY_REF_TMP_PREFIX, locked=lambda: RefLockedError(path + ".lock"))
        batch.append(os.path.join(self.common_dir, "logs", ref), self._reflog_line(None, target, message))
        if own:
            batch.commit()
        return True

    def _reflog_line(self, old: str | None, new: str, message: str) -> bytes:
        try:
            who = signature_line(self.default_signature())
        except IdentityUnknown as exc:  # git too writes a reflog line with its guess (git_committer_info(0))
            who = signature_line(exc.guess)
        except (ValueError, pygit2.GitError):
            who = signature_line(guessed_identity())
        one_line = " ".join(message.split())
        return b"%s %s %s\t%s\n" % ((old or "0" * 40).encode(), new.encode(), who, one_line.encode("utf-8"))

    def reflog_names(self, ref: str, oid: str) -> bool:
        """Whether the reflog of ``ref`` ever recorded ``oid`` as a new value."""
        path = os.path.join(self.common_dir, "logs", ref)
        try:
            with open(path, "rb") as fh:
                needle = oid.encode()
                for line in fh:
                    parts = line.split(b" ", 2)
                    if len(parts) >= 2 and parts[1] == needle:
                        return True
        except FileNotFoundError:
            return False
        return False

"""The ``apply_patch`` adapter: after a crash, ask git whether a call's commit landed.

:meth:`GitAdapter.query` (docs/DESIGN.md section 5), for a ``prepared`` or
``unknown`` receipt, in order:

1. lock files the dead owner left in the middle of its ref update are
   removed — only when provably its own: ``<branch>.lock`` holding exactly the
   receipt's candidate oid, ``refs/oncepatch/keys/<h>.lock``;
2. the key ref points at the candidate → applied (the key ref is only created
   after the branch moved);
3. the candidate is reachable from the branch, or the branch's reflog shows
   it moving *away* from the candidate (reset since) → applied; an entry
   that only moves it *to* the candidate proves nothing (libgit2 writes it
   before the ref itself);
4. otherwise → not applied (``crashed_before_commit``).

A local git effect can always be queried, so this adapter never answers
``unknown``.  :meth:`GitAdapter.settle` then brings stale worktrees along and
creates a missing key ref.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Mapping
from typing import Any


from cas.durable import TMP_MARK, open_regular
from cas.errors import GitStoreError, OncepatchError, RefMovedError, UsageError
from cas.gitdir import common_dir_of, worktrees_on
from cas.loose_objects import stale_tmp_objdirs
from cas.objects import GitStore, TreeEntry, open_store
from cas.pids import gone
from cas.index_lock import (break_dead_own_index_lock, dead_own_index_lock, drop_orphan_kept, hold_index_lock,
                            update_index)
from cas.worktree import index_matches, materialise, worktree_files_match, write_files
from receipts.adapter import QueryResult
from receipts.adapters import builtin_adapters
from receipts.errors import CorruptReceipt
from receipts.identity import key_hash
from receipts.receipt import Receipt
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore
from patcher.args import TOOL
from patcher.check import check_worktree_root, verified_path
from patcher.dirs import sync, target_of, unfinished_switch
from patcher.evidence import KEY_REF_PREFIX, BranchHistory, contradictions
from patcher.markers import foreign_index_lock, index_marker, index_markers, ref_lock_marker

__all__ = ["GitAdapter", "KEY_REF_PREFIX", "adapters"]



def adapters(rstore: ReceiptStore, stores: dict[str, Any] | None = None, *,
             read_only: bool = False, lock_timeout: float | None = None) -> dict[str, Any]:
    """The adapter registry, ``{tool: adapter}``: the generic tools' (:mod:`receipts.adapters`) and git's.

    What ``recover``, ``watch``, ``verify`` and ``resolve`` ask, for every
    tool alike (the engine, :mod:`receipts.engine`, settles each call through
    its tool's adapter).  ``read_only``: a stale lock is only reported;
    ``lock_timeout``: how long git's locks are waited for (the default's when ``None``).
    """
    git = GitAdapter(rstore, stores, read_only=read_only,
                     lock_timeout=DEFAULT_LOCK_TIMEOUT if lock_timeout is None else lock_timeout)
    return {**builtin_adapters(), git.tool: git}


class GitAdapter:
    tool = TOOL

    def __init__(self, rstore: ReceiptStore | None = None, stores: dict[str, Any] | None = None, *,
                 read_only: bool = False, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self._rstore = rstore
        self._lock_timeout = lock_timeout  # for a worktree's index.lock (recover's --lock-timeout)
        self._stores = stores if stores is not None else {}
        # ``recover --dry-run`` and a flag-only ``watch`` query too: then a stale lock is
        # only reported, never removed (a dry run changes nothing).
        self._read_only = read_only
        self._where: dict[str, str] = {}  # a receipt's repository path -> where it is settled (_place)
        self._histories: dict[tuple[str, str], BranchHistory] = {}  # (common dir, branch): verify's walks
        self._fetched: dict[Any, Any] = {}  # remote mode: what verify fetched, per (common dir, remote, key)

    def _store(self, receipt: Receipt) -> GitStore:
        """The receipt's repository, opened; never another one found above its folder.

        Raises:
            GitStoreError: it is gone (libgit2 would open an enclosing repository,
                which knows nothing of the call: asking it would answer wrongly).
        """
        repo = str(receipt.args.get("repo"))
        named = receipt.extra.get("remote")
        if isinstance(named, dict) and named.get("local"):
            repo = str(named["local"])  # remote mode: the identity's repo is the remote's URL (docs/REMOTE.md)
        where = self._where.get(repo)  # once per repository and run (verify asks per receipt)
        if where is None:
            where = self._where[repo] = self._place(repo)
        return open_store(where, self._stores)

    def _place(self, repo: str) -> str:
        """Where the receipts naming ``repo`` are settled and checked: ``repo``, or the store's own repository.

        A store inside a git dir (``<git-common-dir>/oncepatch``) belongs to
        that repository: moved or copied with it, its receipts are that
        repository's, not the path they name.

        Raises:
            GitStoreError: ``repo`` is gone (libgit2 would open an enclosing
                repository, which knows nothing of the call) and the store is
                not inside a repository.
        """
        home = _store_home(self._rstore) if self._rstore is not None else None
        try:
            gstore = open_store(repo, self._stores)
            opened = gstore.repo.workdir or gstore.git_dir
            # A call names its repository by a worktree or, where none can be found (a linked
            # worktree of a --separate-git-dir repository), by its git dir: either is this one.
            if os.path.realpath(repo) not in {os.path.realpath(p) for p in (opened, gstore.git_dir, gstore.common_dir)}:
                raise GitStoreError(f"repository '{repo}' is gone ('{opened.rstrip(os.sep)}' encloses its folder)")
        except (GitStoreError, UsageError):
            if home is None:
                raise
            return home  # moved with its store
        if home is not None and os.path.realpath(gstore.common_dir) != home:
            return home  # a copy, store and all: not the original it names
        return repo

    # -- query -------------------------------------------------------------------

    def _remove_own_stale_locks(self, gstore: GitStore, receipt: Receipt, notes: list[str]) -> None:
        """Remove ref locks the dead owner of ``receipt`` provably left (caller holds the key lock).

        Proof, per lock file: it holds exactly the receipt's candidate oid (libgit2
        wrote it at commit time), or it is empty — libgit2 creates the lock empty
        and fills it only when committing; git fills its locks at once — and no
        older than the marker the owner wrote just before locking (the branch), or
        it is the lock of a key ref that does not exist (only oncepatch writes one).
        """
        branch = _branch_of(receipt)
        candidate = receipt.candidate or ""
        marker = ref_lock_marker(self._rstore, receipt.key) if self._rstore is not None else None
        try:
            marker_mtime: float | None = marker.stat().st_mtime if marker else None
        except FileNotFoundError:
            marker_mtime = None
        key_ref = KEY_REF_PREFIX + key_hash(receipt.key)
        for ref in (branch, key_ref):
            lock = os.path.join(gstore.common_dir, ref + ".lock")
            with contextlib.suppress(FileNotFoundError):
                with open(lock, "rb") as fh:
                    content = fh.read().strip().decode("ascii", "replace")
                ours = bool(candidate) and content == candidate
                if not ours and content == "" and marker_mtime is not None:
                    ours = os.stat(lock).st_mtime >= marker_mtime
                if not ours and content == "" and ref == key_ref and gstore.resolve(key_ref) is None:
                    # Only oncepatch writes a key ref, under the key's lock (held by the caller);
                    # a git that locks refs it finds (pack-refs) finds none here.
                    ours = True
                if ours and self._read_only:
                    notes.append(f"would remove stale '{lock}' left by the crashed call")
                elif ours:
                    os.unlink(lock)
                    notes.append(f"removed stale '{lock}' left by the crashed call")
        if marker and not self._read_only:
            marker.remove()

    def query(self, receipt: Receipt) -> QueryResult:
        """Whether the call of ``receipt`` moved its branch (docs/DESIGN.md section 5).

        Applied only where the branch holds the candidate or its reflog shows it
        did: the key ref alone is never believed.

        Raises:
            CorruptReceipt: the key ref points at the candidate, which the branch never held.
        """
        candidate = receipt.candidate
        if not candidate:
            return QueryResult("not_applied", "crashed_before_commit")
        gstore = self._store(receipt)
        if "remote" in receipt.extra:  # remote mode: the remote's key ref and receipt are the truth
            from patcher import remote_refs  # (deferred: a replay never needs it, nor its subprocess)

            return remote_refs.query_remote(self._rstore, gstore, receipt, remote_refs.remote_of(receipt))
        notes: list[str] = []
        self._remove_own_stale_locks(gstore, receipt, notes)
        branch = _branch_of(receipt)
        key_ref = KEY_REF_PREFIX + key_hash(receipt.key)
        by_key_ref = gstore.resolve(key_ref) == candidate
        if gstore.has_object(candidate):
            tip = gstore.resolve(branch)
            # Not reflog_names(): the reflog entry (base -> candidate) is appended *before*
            # renaming <branch>.lock, so a crash between the two leaves the candidate named
            # in the reflog of a branch that never moved.  Only an entry that moves the
            # branch *from* the candidate (a reset or a later move) proves it was there.
            proof = ("reachable_from_branch" if tip is not None and gstore.is_ancestor(candidate, tip)
                     else "named_in_reflog" if _reflog_left(gstore.common_dir, branch, candidate) else None)
            if proof is not None:
                return QueryResult("applied", "key_ref" if by_key_ref else proof,
                                   self._fields(gstore, candidate, notes))
        if by_key_ref:
            # The key ref is created after the branch moved (cas/refs.py), so it never points
            # at a candidate the branch never held -- unless it was set by hand.  Believing it
            # would settle as committed a call whose change is on no branch.
            path = self._rstore.receipt_path(receipt.key) if self._rstore is not None else key_ref
            raise CorruptReceipt(path, f"key ref '{key_ref}' points at the candidate {candidate[:12]}, which "
                                       f"branch '{branch}' never held (neither on it nor in its reflog)",
                                 key=receipt.key)
        if not self._read_only:
            notes += self._put_back_ahead(gstore, receipt)
        return QueryResult("not_applied", "crashed_before_commit", {"notes": notes})

    def _put_back_ahead(self, gstore: GitStore, receipt: Receipt) -> list[str]:
        """Undo what the dead call of ``receipt`` wrote ahead of a move that never happened (caller holds the key lock).

        The apply protocol writes the candidate's index entries and touched
        files before the branch moves (docs/DESIGN.md section 4).  A path is
        put back to the base (as git checks it out) only where its file or
        index entry still holds the candidate's, i.e. what this call wrote: a
        file edited since is left alone.  Nothing is put back once the branch
        has changed any of the touched paths since the base (a person who
        committed the change, or part of it, made it theirs).  The dead call's
        ``index.lock`` is broken on the way, which puts back the index it kept.

        Raises:
            RefLockedError: a worktree's ``index.lock`` stayed held (the receipt stays ``prepared``).
            GitStoreError: a file could not be written.
        """
        candidate = receipt.candidate
        if not candidate or not gstore.has_object(candidate):
            return []
        branch = _branch_of(receipt)
        tip = gstore.resolve(branch)
        base_commit = (receipt.base or {}).get("commit")
        base_tree = gstore.commit_tree(base_commit) if base_commit else None
        cand_tree = gstore.commit_tree(candidate)
        tip_tree = gstore.commit_tree(tip) if tip else None
        touched = [str(p) for p in receipt.extra.get("touched", [])] or [str(o["path"]) for o in receipt.outputs]
        was = {p: gstore.lookup_file(base_tree, p) for p in touched}
        ahead = {p: gstore.lookup_file(cand_tree, p) for p in touched}
        ours = [p for p in touched if was[p] != ahead[p]]
        done: list[str] = []
        if any(gstore.lookup_file(tip_tree, p) != was[p] for p in touched):
            # The branch changed a touched path since the crash: a person committed the change
            # (or part of it) as theirs.  What the worktree holds is theirs too, left as it is.
            ours = []
            done.append(f"left the worktree alone: branch '{branch}' has changed the call's paths since")
        for workdir, git_dir in worktrees_on(gstore.common_dir, branch, gstore.main_workdir, strict=True):
            # The dead call's own index.lock still there: whoever breaks it puts back the index it
            # kept (recover's cleanup, a later call), so only files written ahead are work here.
            dead_lock = dead_own_index_lock(os.path.join(os.path.realpath(git_dir), "index.lock"))
            # A write ahead killed half way leaves its tmp files beside the touched paths, also
            # where no file was renamed into place yet (nothing else to put back then).
            for tmp in _remove_dead_tmp_files(workdir, git_dir, touched):
                done.append(f"removed '{tmp}' left by a crashed call")
            if not any(_matches(gstore, workdir, p, (ahead[p],))
                       or (not dead_lock and _index_matches(workdir, p, (ahead[p],))) for p in ours):
                drop_orphan_kept(os.path.realpath(git_dir), candidate)
                continue
            freed = _remove_dead_marked_index_lock(git_dir)  # the kept index back first
            if freed is not None:
                done.append(f"removed stale '{freed}' left by a crashed call")
            marker = index_marker(self._rstore, receipt.key) if self._rstore is not None else None
            lock = hold_index_lock(workdir, timeout=self._lock_timeout, lock_marker=marker, git_dir=git_dir)
            try:
                files = {p: was[p] for p in ours
                         if _matches(gstore, workdir, p, (ahead[p],)) and not _holds_others(workdir, p, touched)}
                entries = {p: was[p] for p in ours if _index_matches(workdir, p, (ahead[p],))}
                write_files(gstore, workdir, files, tree=base_tree)
                if entries:  # (its lock removed by hand: the index still shows the candidate)
                    kept = [p for p, e in entries.items() if e is not None]
                    update_index(workdir, [p for p, e in entries.items() if e is None], kept, held=lock,
                                 known=entries, unstat=set(kept))
                drop_orphan_kept(lock.git_dir, candidate)
            finally:
                lock.release()
            done.append(f"put back {len(files)} file(s) and {len(entries)} index entr(ies) in '{workdir}' as "
                        f"before the call (its branch never moved)")
        return done

    @staticmethod
    def _fields(gstore: GitStore, commit: str, notes: list[str]) -> dict[str, Any]:
        return {"commit": commit, "tree": gstore.commit_tree(commit), "notes": notes}

    # -- settle ------------------------------------------------------------------

    def settle(self, receipt: Receipt) -> list[str]:
        """Create a missing key ref; bring worktrees whose touched paths still show the base."""
        done: list[str] = []
        gstore = self._store(receipt)
        candidate = receipt.commit or receipt.candidate
        if not candidate:
            return done
        if "remote" in receipt.extra:  # remote mode moves no local branch nor worktree
            from patcher import remote_refs

            return remote_refs.settle_remote(gstore, receipt, remote_refs.remote_of(receipt))
        key_ref = KEY_REF_PREFIX + key_hash(receipt.key)
        if gstore.resolve(key_ref) is None:
            gstore.create_key_ref(key_ref, candidate, f"oncepatch recover: {receipt.call_id}")
            done.append(f"created '{key_ref}'")
        branch = _branch_of(receipt)
        tip = gstore.resolve(branch)
        if tip is None:
            return done
        touched = [str(p) for p in receipt.extra.get("touched", [])] or [
            str(o["path"]) for o in receipt.outputs
        ]
        base_commit = (receipt.base or {}).get("commit")
        base_tree = gstore.commit_tree(base_commit) if base_commit else None
        tip_tree = gstore.commit_tree(tip)
        done += _undone_since(gstore, branch, tip, candidate, base_tree, tip_tree, touched)
        for workdir, _gd in worktrees_on(gstore.common_dir, branch, gstore.main_workdir, strict=True):
            # A call killed while writing a touched file (or the index) leaves its tmp file
            # beside it: untracked residue in the user's worktree unless removed here.
            for tmp in _remove_dead_tmp_files(workdir, _gd, touched):
                done.append(f"removed '{tmp}' left by a crashed call")
            drop_orphan_kept(os.path.realpath(_gd), candidate)  # its index.lock removed by hand
            stale: dict[str, TreeEntry | None] = {}
            index_only: dict[str, TreeEntry | None] = {}
            current: dict[str, TreeEntry] = {}
            left: list[str] = []
            for path in touched:
                want = gstore.lookup_file(tip_tree, path)
                was = gstore.lookup_file(base_tree, path)
                if _matches(gstore, workdir, path, (want,)) and _index_matches(workdir, path, (want,)):
                    if want is not None:
                        current[path] = want
                    continue
                if _matches(gstore, workdir, path, (was, want)) and _index_matches(workdir, path, (was, want)):
                    stale[path] = want
                else:
                    left.append(path)
                    if was != want and _index_matches(workdir, path, (was,)):
                        # The file was edited since the crash: it is kept.  The index
                        # still holds the base, a staged revert of the commit that
                        # the next 'git commit' would make; it gets the commit's entry.
                        index_only[path] = want
            if stale or index_only or current:
                # A call killed inside update_index leaves its marked index.lock, maybe
                # without the store marker (killed before writing it): materialise would
                # wait on it and give up.  Its pid is gone, so it is provably stale.
                freed = _remove_dead_marked_index_lock(_gd)
                if freed is not None:
                    done.append(f"removed stale '{freed}' left by a crashed call")
                marker = index_marker(self._rstore, receipt.key) if self._rstore is not None else None
                if stale:
                    materialise(gstore, workdir, stale, lock_marker=marker, timeout=self._lock_timeout)
                    done.append(f"materialised {len(stale)} path(s) in '{workdir}'")
                if index_only:
                    kept = [p for p, e in index_only.items() if e is not None]
                    update_index(workdir, [p for p, e in index_only.items() if e is None], kept,
                                 lock_marker=marker, timeout=self._lock_timeout, known=index_only,
                                 unstat=set(kept))
                    done.append(f"staged the commit's version of {len(index_only)} path(s) in the index of "
                                f"'{workdir}' (the files keep their edits)")
                if current:
                    # Files and entries already the commit's, written ahead of the move by a call
                    # killed before it gave the entries their stat data (crash point after-ref):
                    # without it, 'git diff-index HEAD' reports each such path as modified until
                    # something refreshes the index.  The stat data of the files, as step 6 gives it.
                    # Looked at again under the index's lock: a file edited since keeps no stat data.
                    try:
                        lock = hold_index_lock(workdir, timeout=self._lock_timeout, lock_marker=marker, git_dir=_gd)
                        try:
                            same = {p: e for p, e in current.items() if _matches(gstore, workdir, p, (e,))
                                    and _index_matches(workdir, p, (e,))}
                            if same:
                                update_index(workdir, [], list(same), held=lock, known=same)
                        finally:
                            lock.release()
                    except OncepatchError as exc:
                        done.append(f"stat data of {len(current)} path(s) not refreshed in '{workdir}': {exc.message}")
            if left:
                done.append(f"left {len(left)} path(s) in '{workdir}' alone: changed since the crash")
        if self._rstore is not None and not self._read_only:
            # Committed now: the marker no longer protects the call's index.lock (left by a
            # call killed after its move, with worktree and index already written ahead).
            index_marker(self._rstore, receipt.key).remove()
        layout = target_of(gstore)
        if layout is not None:  # a directory target: its folder follows the branch (docs/DIRECTORIES.md)
            done += sync(gstore, layout, self._lock_timeout)
        return done

    def unfinished(self, receipt: Receipt) -> list[str]:
        """What :meth:`settle` would still do for the committed ``receipt``, read-only (``watch`` asks).

        A directory target: its folder not at the branch's tip
        (:func:`patcher.dirs.unfinished_switch`).  Nothing else is looked at.
        """
        try:
            gstore = self._store(receipt)
        except Exception:  # noqa: BLE001 - a repository that cannot be opened is verify's to report
            return []
        layout = target_of(gstore)
        return [] if layout is None else unfinished_switch(gstore, layout)

    # -- believing a committed receipt -------------------------------------------------

    def confirm(self, receipt: Receipt) -> list[str]:
        """Why git contradicts the committed ``receipt`` a replay would answer from, or ``[]`` (the cheap form).

        :func:`patcher.evidence.contradictions` with ``cheap=True``: the key
        ref at the commit stands for "on the branch"; the commit, its trailer
        and the outputs are read.
        """
        try:
            gstore = self._store(receipt)
        except Exception as exc:  # noqa: BLE001 - a missing repository contradicts the receipt
            return [f"repository '{receipt.args.get('repo')}' cannot be opened: {exc}"]
        return contradictions(gstore, receipt, cheap=True)

    def verify_committed(self, receipt: Receipt) -> list[str]:
        """Why git contradicts the committed ``receipt``, or ``[]`` (:func:`patcher.evidence.contradictions`).

        ``verify``, ``status`` and ``recover`` ask this: the commit exists,
        carries the call's trailer, the key ref points at it, it is (or was,
        by the reflog) on the call's branch, and every output matches its blob.
        """
        try:
            gstore = self._store(receipt)
        except Exception as exc:  # noqa: BLE001 - a missing repository is a verification failure
            return [f"repository '{receipt.args.get('repo')}' cannot be opened: {exc}"]
        gstore.forget_made()  # proof is what the repository holds now
        if "remote" in receipt.extra:  # remote mode: checked against the remote's claim too
            from patcher import remote_refs

            return remote_refs.verify_remote(self._rstore, gstore, receipt, remote_refs.remote_of(receipt),
                                             self._fetched)
        branch = str(receipt.args.get("branch") or "")
        place = (gstore.common_dir, branch)
        history = self._histories.get(place)
        if history is None:
            history = self._histories[place] = BranchHistory(gstore, branch)
        return contradictions(gstore, receipt, history=history)

    def verify_rejected(self, receipt: Receipt) -> list[str]:
        """Why the remote contradicts a remote-mode ``rejected`` receipt, or ``[]`` (a local one: never).

        :func:`patcher.remote_refs.verify_rejected_remote`: the remote's key ref
        claims the key for this very call (a push that landed after the
        receipt was settled).
        """
        if "remote" not in receipt.extra or not receipt.candidate:
            return []
        try:
            gstore = self._store(receipt)
        except Exception as exc:  # noqa: BLE001 - a missing repository is a verification failure
            return [f"repository '{receipt.args.get('repo')}' cannot be opened: {exc}"]
        from patcher import remote_refs

        return remote_refs.verify_rejected_remote(self._rstore, gstore, receipt, remote_refs.remote_of(receipt),
                                                  self._fetched)

    def verify_refs(self, rstore: ReceiptStore, receipts: Mapping[str, tuple[str, str, str | None]]
                    ) -> list[tuple[str, str, str]]:
        """Key refs the store has no committed receipt for: ``[(key hash, where, reason)]``.

        ``receipts``: ``{key hash: (tool, status, repo)}`` of every intact
        receipt file of the store.  The repositories looked at: the one the
        store lives in (the default ``<git-common-dir>/oncepatch``) and every
        one its ``apply_patch`` receipts name.  A key ref whose receipt is
        committed is checked from the receipt's side (:meth:`verify_committed`:
        the ref points at its commit); any other key ref — no receipt (a store
        deleted or emptied), or a receipt that says it never committed — is a failure.
        """
        places: dict[str, str] = {}
        home = _store_home(rstore)
        if home is not None:
            places[home] = home
        tried: set[str] = set()
        for tool, _status, repo in receipts.values():
            if tool == self.tool and repo is not None and repo not in self._where and repo not in tried:
                tried.add(repo)  # asked once: a repository gone is reported by its receipts
                with contextlib.suppress(GitStoreError, UsageError):
                    self._where[repo] = self._place(repo)
        for where in self._where.values():
            places.setdefault(os.path.realpath(where), where)
        out: list[tuple[str, str, str]] = []
        seen: set[str] = set()
        for where in places.values():
            try:
                gstore = open_store(where, self._stores)
            except (GitStoreError, UsageError):
                continue  # reported by the receipts that name it
            if gstore.common_dir in seen:
                continue
            seen.add(gstore.common_dir)
            for ref in sorted(gstore.repo.listall_references()):
                if not ref.startswith(KEY_REF_PREFIX):
                    continue
                h = ref[len(KEY_REF_PREFIX):]
                found = receipts.get(h)
                name = f"{gstore.common_dir}:{ref}"
                if found is None:
                    if not os.path.lexists(rstore.path_for_hash(h)):
                        out.append((h, name, f"key ref '{ref}' has no receipt in the store '{rstore.root}' "
                                          "(the store was deleted or emptied, or the key was applied through "
                                          "another store); if you know its key, 'oncepatch quarantine KEY' records it"))
                elif found[1] not in ("committed", "prepared", "unknown"):
                    out.append((h, name, f"key ref '{ref}' exists but its receipt is '{found[1]}': "
                                      "the receipt says the call never committed"))
        return out

    # -- retention ---------------------------------------------------------------------

    def check_tombstone(self, receipt: Receipt) -> None:
        """Raise unless the key ref of a receipt ``oncepatch gc`` removes still stands for it.

        gc keeps the ref of a receipt it removes as a tombstone, so the key
        never runs again (:mod:`receipts.retired`); nothing here removes it.
        A missing ref, or one at the receipt's commit (or candidate), stands.

        Raises:
            RefMovedError: the ref points at another commit (the receipt stays).
            GitStoreError: its repository cannot be read.
        """
        ref = KEY_REF_PREFIX + key_hash(receipt.key)
        current = self._store(receipt).resolve(ref)
        if current is not None and current not in {receipt.commit, receipt.candidate}:
            raise RefMovedError(ref, current, receipt.commit)

    # -- cleanup -------------------------------------------------------------------

    @staticmethod
    def _cleanup_check_worktrees(rstore: ReceiptStore, dry_run: bool) -> list[str]:
        """Remove temporary check worktrees whose owner is gone (its key lock is free).

        Listed, read and removed through a descriptor of ``tmp/worktrees`` reached
        without following a symlink; the processes are looked for in the folder's
        own path (:func:`patcher.check.verified_path`).
        """
        removed: list[str] = []
        root = check_worktree_root(rstore)
        try:
            stack = contextlib.ExitStack()
            root_fd = stack.enter_context(rstore.folder_fd(root))
        except (FileNotFoundError, NotADirectoryError):
            return removed
        with stack:
            for name in sorted(os.listdir(root_fd)):
                h = name.split("-", 1)[0]
                if len(h) != 64:
                    continue
                lk = rstore.try_lock_hash(h)
                if lk is None:
                    continue  # a live check is running there
                try:
                    path = os.path.join(root, name)
                    repo = _check_worktree_repo(root_fd, name)
                    removed.append(path)
                    if dry_run:
                        continue
                    # A call killed while its check ran left the check running (in a session of its
                    # own, so that a timeout can kill it whole): it goes before its folder does.
                    with contextlib.suppress(OSError):
                        entry_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                           dir_fd=root_fd)
                        try:
                            _stop_processes_in(verified_path(entry_fd, path))
                        except CorruptReceipt:
                            pass  # swapped meanwhile: no process is looked for through it
                        finally:
                            os.close(entry_fd)
                    with contextlib.suppress(OSError):
                        shutil.rmtree(name, dir_fd=root_fd)
                    if repo is not None:
                        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
                        # Run from the repository, not from here: recover may have been started inside
                        # the folder just removed, where git cannot even read its working folder.
                        subprocess.run(["git", "--git-dir", repo, "worktree", "prune"], capture_output=True,
                                       env=env, check=False, cwd=repo)
                finally:
                    lk.release()
        return removed

    def _common_dirs(self, rstore: ReceiptStore) -> list[str]:
        """The repositories at hand: the one the store lives in, and every one this recovery opened."""
        common_dirs = {os.path.realpath(str(g.common_dir)) for g in self._stores.values()}
        home = _store_home(rstore)
        if home is not None:
            common_dirs.add(home)
        return sorted(common_dirs)

    def _cleanup_dead_index_locks(self, rstore: ReceiptStore, dry_run: bool,
                                  protected: frozenset[str] = frozenset()) -> list[str]:
        """Remove marked ``index.lock`` files of dead calls in the repositories at hand.

        Race guarded: a call also takes ``index.lock`` briefly *before* its key lock and
        receipt (the dirty-path check); killed there, no receipt or marker names the lock
        and it would block every later call.  The repositories looked at: the one the
        store lives in (the default ``<git-common-dir>/oncepatch``) and every one this
        recovery opened for a receipt.
        """
        removed: list[str] = []
        for common_dir in self._common_dirs(rstore):
            for git_dir in _git_dirs_of(common_dir):
                # While a call the store's markers tie to an index lock is unresolved, no dead
                # marked lock is removed here: the marker names the lock by the path it had,
                # which a moved repository no longer has.
                # Nor one another store's unsettled call left (its recover settles it).
                foreign = foreign_index_lock(os.path.join(os.path.realpath(git_dir), "index.lock"), rstore)
                stale = (None if protected or foreign is not None
                         else _remove_dead_marked_index_lock(git_dir, remove=not dry_run))
                if stale is not None:
                    removed.append(stale)
                # The index update's and ref locks' tmp files of dead calls (never a lock).
                removed += _remove_dead_tmp_files(None, git_dir, [], remove=not dry_run)
        return removed

    def cleanup(self, rstore: ReceiptStore, dry_run: bool, tmp_age: float) -> list[str]:
        """Remove index-lock markers (and the stale ``index.lock`` they prove ours) of dead owners.

        Not those of a call still unresolved (``prepared``, ``unknown``: its
        repository could not be asked, say it moved): its lock is what keeps
        ``git commit`` from committing the stale index over its change.
        """
        removed: list[str] = self._cleanup_check_worktrees(rstore, dry_run)
        protected = _protected_index_locks(rstore)
        removed += self._cleanup_dead_index_locks(rstore, dry_run, protected)
        for common_dir in self._common_dirs(rstore):
            removed += _remove_old_object_tmp_files(common_dir, tmp_age, remove=not dry_run)
        for name in rstore.tmp_names():  # through tmp/'s descriptor, as every marker is read and removed
            kind, _, h = name.partition("-lock-")
            if kind not in ("ref", "index"):
                continue
            marker = rstore.tmp_file(name)
            if kind == "index" and _unresolved(rstore, h):
                continue  # protected (see above); settled by a later recover, then removed
            lk = rstore.try_lock_hash(h)
            if lk is None:
                continue  # its owner is alive (and may hold the index lock right now)
            try:
                if kind == "ref":
                    # Its stale ref locks are handled by query() under the key lock; an
                    # orphan marker (the call failed cleanly or was settled) is just removed.
                    if rstore.read_hash(h) is not None and _unresolved(rstore, h):
                        continue
                else:
                    try:
                        index_lock = marker.read().decode("utf-8", "surrogateescape").strip()
                    except FileNotFoundError:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        if index_lock.endswith("index.lock") and dead_own_index_lock(index_lock):
                            # cas breaks it under the folder's flock (a bare unlink could hit a
                            # live call's lock created in its place since the read).
                            if dry_run or break_dead_own_index_lock(index_lock):
                                removed.append(index_lock)
                removed.append(marker.path)
                if not dry_run:
                    marker.remove()
            finally:
                lk.release()
        return list(dict.fromkeys(removed))  # a lock found both ways is listed once


def _branch_of(receipt: Receipt) -> str:
    return str((receipt.base or {}).get("ref") or receipt.args.get("branch"))
def _undone_since(gstore: GitStore, branch: str, tip: str, candidate: str, base_tree: str | None, tip_tree: str,
                  touched: list[str]) -> list[str]:
    """A warning when the branch's tip holds a touched path as it was *before* the call.

    A commit made since undid the change: a revert by hand, or a ``git
    commit -a`` of old files (which a call killed after its move left before
    the worktree was written ahead of the move, docs/DESIGN.md section 4).
    The receipt stays ``committed`` (the call's commit is on the branch);
    this says the tip no longer holds its change.
    """
    if tip == candidate:
        return []
    cand_tree = gstore.commit_tree(candidate)
    undone = [p for p in touched
              if gstore.lookup_file(tip_tree, p) == gstore.lookup_file(base_tree, p) != gstore.lookup_file(cand_tree, p)]
    if not undone:
        return []
    return [f"warning: '{branch}' at {tip[:12]} has {', '.join(repr(p) for p in undone)} back as before this call: "
            f"a later commit undid its change (a revert by hand, or a commit of old files after a crash?); "
            f"'git revert' that commit, or apply the change again under a new key"]


def _stop_processes_in(folder: str) -> None:
    """SIGKILL every process of this host whose working folder lies in ``folder`` (a dead call's check).

    Told by ``/proc/<pid>/cwd`` (Linux; elsewhere nothing is done): a process
    working in a check worktree of a call that is gone is that check, or one it
    started; a shell leading its own process group (the check's, started in a
    session of its own) takes its group along.  Never this process, its
    ancestors or anything of its session (someone who ran ``recover`` from
    inside that folder, piped into a pager), nor its own group; never a
    folder reached through a symlink.  Looked for again until
    none is left (a shell may start another meanwhile), a few rounds at most.
    """
    if os.path.islink(folder) or not os.path.isdir(folder):
        return
    real = os.path.realpath(folder)
    spared = _self_and_ancestors()
    own_group, own_session = os.getpgid(0), os.getsid(0)
    for _round in range(5):
        try:
            pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
        except OSError:
            return
        found = []
        for pid in pids:
            if pid in spared:
                continue
            try:
                if os.getsid(pid) == own_session:
                    continue  # started from where this recover was (a pipe's other end): not the check
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if cwd.removesuffix(" (deleted)") == real or cwd.startswith(real + "/"):
                found.append(pid)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid and pid != own_group:
                    os.killpg(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _self_and_ancestors() -> set[int]:
    """This process and its ancestors, by ``/proc/<pid>/stat``'s parent pids."""
    found = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    found.add(1)
    return found


def _pid_of_tmp(rest: str) -> int | None:
    """The pid in the tail ``<pid>-<rand>`` / ``<pid>`` / ``<pid>.lock`` of a tmp file name."""
    head = rest.split("-", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _git_dir_tmp_prefixes(git_dir: str) -> list[tuple[str, str]]:
    """Where cas leaves tmp files of its own in a git dir: beside the index (``index.optmp-<pid>…``,
    ``.index.lock.optmp-<pid>``).  (libgit2's tmp files of objects: :func:`_remove_old_object_tmp_files`.)"""
    real = os.path.realpath(git_dir)
    return [(real, f"index{TMP_MARK}"), (real, f".index.lock{TMP_MARK}")]


def _remove_old_object_tmp_files(common_dir: str, tmp_age: float, *, remove: bool = True) -> list[str]:
    """Remove libgit2's tmp files of loose objects, and cas's temporary object folders, older than ``tmp_age`` seconds.

    A killed writer's (:func:`cas.loose_objects.stale_tmp_objdirs`).
    """
    return stale_tmp_objdirs(os.path.join(os.path.realpath(common_dir), "objects"), tmp_age, remove=remove)


def _remove_dead_tmp_files(workdir: str | None, git_dir: str, touched: list[str], *,
                           remove: bool = True) -> list[str]:
    """Remove tmp files of dead processes beside the touched paths and beside the index.

    Only names cas writes (``.<name>.optmp-<pid>-<rand>`` by the durable-write helper,
    ``index.optmp-<pid>[…]`` and ``.index.lock.optmp-<pid>`` by the index update) whose
    pid is gone.  ``workdir=None``: only those beside the index.  ``remove=False``
    (a dry run): only list them.
    """
    removed: list[str] = []
    candidates: list[tuple[str, str]] = []
    real_root = os.path.realpath(workdir) if workdir is not None else ""
    for folder_rel in sorted({os.path.dirname(p) for p in touched} if workdir is not None else ()):
        folder = os.path.join(real_root, folder_rel) if folder_rel else real_root
        if os.path.realpath(folder) != os.path.normpath(folder):
            continue  # a symlink on the way: never follow it
        names = {f".{os.path.basename(p)}{TMP_MARK}" for p in touched if os.path.dirname(p) == folder_rel}
        candidates += [(folder, prefix) for prefix in sorted(names)]
    candidates += _git_dir_tmp_prefixes(git_dir)
    for folder, prefix in candidates:
        try:
            entries = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if not entry.startswith(prefix):
                continue
            pid = _pid_of_tmp(entry[len(prefix):])
            if pid is None or not gone(pid):
                continue
            path = os.path.join(folder, entry)
            if not remove:
                if os.path.isfile(path):
                    removed.append(path)
                continue
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(path)
                removed.append(path)
    return removed


def _store_home(rstore: ReceiptStore) -> str | None:
    """The git common dir a store lives in (the default ``<git-common-dir>/oncepatch``), else ``None``."""
    parent = os.path.realpath(os.path.dirname(rstore.root))
    if os.path.isfile(os.path.join(parent, "HEAD")) and os.path.isdir(os.path.join(parent, "objects")):
        return parent
    return None


def _remove_dead_marked_index_lock(git_dir: str, *, remove: bool = True) -> str | None:
    """Remove ``<git_dir>/index.lock`` if a dead oncepatch call wrote it; return its path then.

    With ``remove=False`` only tell (a dry run).
    """
    lock = os.path.join(os.path.realpath(git_dir), "index.lock")
    if not dead_own_index_lock(lock):
        return None
    if remove:

        # Not a bare unlink: a call may break the same dead lock and create its own in its
        # place between our read and our unlink; cas re-reads and unlinks under the folder's
        # flock, and only the file it read.
        if not break_dead_own_index_lock(lock):
            return None
    return lock


def _git_dirs_of(common_dir: str) -> list[str]:
    """The common dir and every linked worktree's git dir (each has its own index)."""
    found = [common_dir]
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        root = os.path.join(common_dir, "worktrees")
        found += [os.path.join(root, n) for n in sorted(os.listdir(root))]
    return found


def _reflog_left(common_dir: str, ref: str, oid: str) -> bool:
    """Whether the reflog of ``ref`` records the ref moving away from ``oid`` (so it pointed there)."""
    needle = oid.encode()
    try:
        with open(os.path.join(common_dir, "logs", ref), "rb") as fh:
            return any(line.split(b" ", 1)[0] == needle for line in fh)
    except FileNotFoundError:
        return False


def _protected_index_locks(rstore: ReceiptStore) -> frozenset[str]:
    """The ``index.lock`` paths the store's markers name for calls still unresolved."""
    return frozenset(named for h, named in index_markers(rstore) if _unresolved(rstore, h))


def _unresolved(rstore: ReceiptStore, h: str) -> bool:
    try:
        r = rstore.read_hash(h)
    except Exception:  # noqa: BLE001 - a corrupt receipt: keep the marker for a person
        return True
    return r is not None and r.status in ("prepared", "unknown")


def _check_worktree_repo(root_fd: int, name: str) -> str | None:
    """The repository the temporary check worktree ``name`` of ``root_fd`` belongs to (from its ``.git`` file)."""
    try:
        entry_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        try:
            with os.fdopen(open_regular(".git", dir_fd=entry_fd), "rb") as fh:
                text = fh.read(1 << 16).decode("utf-8", "surrogateescape").strip()
        finally:
            os.close(entry_fd)
    except OSError:
        return None
    if not text.startswith("gitdir:"):
        return None
    return common_dir_of(os.path.realpath(text[len("gitdir:"):].strip()))


def _matches(gstore: GitStore, workdir: str, path: str, entries: tuple[TreeEntry | None, ...]) -> bool:
    """Whether the worktree's file at ``path`` is one of ``entries`` (``None``: no file)."""
    return any(worktree_files_match(gstore, workdir, {path: e}) for e in entries)


def _holds_others(workdir: str, path: str, touched: list[str]) -> bool:
    """Whether ``path`` is a folder of ``workdir`` holding a file the call does not touch (someone else's since)."""
    full = os.path.join(workdir, path)
    if os.path.islink(full) or not os.path.isdir(full):
        return False
    mine = set(touched)
    return any(f"{os.path.relpath(folder, workdir).replace(os.sep, '/')}/{name}" not in mine
               for folder, _dirs, files in os.walk(full) for name in files)


def _index_matches(workdir: str, path: str, entries: tuple[TreeEntry | None, ...]) -> bool:
    """Whether the index's entry of ``path`` is one of ``entries``."""
    return any(index_matches(workdir, {path: e}) for e in entries)

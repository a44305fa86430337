"""The git steps of the apply protocol (docs/DESIGN.md section 4): a call that is not a replay.

:func:`patcher.protocol.apply` normalises the call and builds its
:class:`receipts.engine.Call`; the engine does what every tool shares (the
key's lock, lookup, replay, conflict, settling a dead owner's call, the
``prepared`` receipt with its fencing token, the fence, ``committed`` /
``rejected`` / ``unknown`` and their ledger events).  What is git's is here,
one function per step, in the order :func:`_execute` runs them:

1. :func:`_precheck` (before the key's lock, first calls only) and
   :func:`_open`: decode the patch, refuse unsafe paths, open the repository;
2. :func:`_plan`: plan against the branch's head, check the worktrees;
3. stage (``write_stage``), :func:`_check_candidate` (``--check``), ``after-stage``;
4. :func:`_prepare`: the staged objects and the ``prepared`` receipt, one
   batch (``after-prepare``); the fence;
5. :func:`_land` under the branch writers' turn: :func:`_hold_index_locks`,
   :func:`_refuse_changed_worktrees`, :func:`_move_branch` (the branch's
   compare-and-swap, :func:`_move_refs`, re-staged onto a moved head by
   :func:`_restage`; the worktrees' indexes and files written first,
   ``after-index-ahead``, ``after-worktree-ahead``; ``after-ref``),
   :func:`_materialise` the worktrees' index entries (``after-materialise``);
6. :func:`_finalise`: the key ref and the ``committed`` receipt, one batch
   (``before-receipt-replace``).

The crash and pause points armed on the way: docs/DESIGN.md section 4.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cas.crash import crash_hook, crash_point
from cas.durable import DurableBatch, fsync_all
from cas.errors import (DurableWriteError, GitStoreError, ObjectsMissing, OncepatchError, RefLockedError,
                        RefMovedError, UsageError, clip)
from cas.gitdir import all_worktrees, read_head, worktrees_on, worktrees_rebasing
from cas.hashing import sha256_hex
from cas.index_lock import IndexLock
from cas.objects import GitStore, open_store
from cas.worktree import dirty_paths
from receipts.engine import Call, after_effect, pause_point
from receipts.errors import FencedOff, IdempotencyConflict, InProgress
from receipts.flock import flocked
from receipts.identity import key_hash
from receipts.retired import retired_message, retirement
from receipts.store import ReceiptStore
from patcher.args import CallArgs
from patcher.check import check_worktree_root, run_check
from patcher.dirs import refuse_outside_edits, sync, target_of
from patcher.errors import Conflict, DirtyPath, PatchError, UnsafePath
from patcher.formats import parse_patch
from patcher.git_adapter import GitAdapter
from patcher.grades import grade_warnings
from patcher.markers import ref_lock_marker, refuse_planted_markers
from patcher.model import Patch
from patcher.outcome import KEY_REF_PREFIX, ApplyResult, foreign_error, replay_final
from patcher.stage import Staged, StagePlan, plan_stage, stage, touched_paths, write_stage
from patcher.worktrees import (IndexesAhead, check_worktrees, hold_index_locks, materialise_all, prefetch_indexes,
                               release_index_locks, settle_dead_calls)

__all__ = ["locked_apply", "MAX_RESTAGE_ROUNDS"]

MAX_RESTAGE_ROUNDS = 16


@contextlib.contextmanager
def _writer_turn(rstore: ReceiptStore, gstore: GitStore, branch: str, timeout: float) -> Iterator[None]:
    """Hold this branch's turn: oncepatch writers of one branch re-stage and swap one at a time.

    Race guarded: writers that all stage optimistically and then compare-and-swap
    starve one another — a call whose re-stage is slower keeps losing to calls that
    staged later (seen: 16 lost rounds in a row, 8 processes on 2 CPUs), and gives
    up with a spurious ``conflict``.  In turn, only a writer that is not oncepatch
    (git itself) can move the branch between our re-stage and our swap.

    Only progress depends on this lock, never correctness (the swap is still a
    compare-and-swap under git's ref lock): it is an flock the kernel drops when
    its holder dies, and a call that cannot get it within ``timeout`` (the call's
    lock timeout; its holder is stopped, say) goes ahead without it.
    """
    name = "branch-" + sha256_hex(f"{gstore.common_dir}\0{branch}".encode()) + ".lock"
    with contextlib.ExitStack() as held:
        with contextlib.suppress(InProgress):
            held.enter_context(flocked(os.path.join(rstore.locks_dir, name), timeout, folder=rstore.locks_folder))
        yield


def locked_apply(call: Call, args: CallArgs, lock_timeout: float, check_timeout: float,
                 _stores: dict[str, Any], *, remote_steps: Callable[[_Run], ApplyResult] | None = None) -> ApplyResult:
    """Steps 1 to 7 for a call with no final receipt (``call.previous``: the one read without the lock, if any).

    ``remote_steps``: remote mode's steps (:func:`patcher.remote_push.execute_remote`) run under
    the key's lock in place of the local ones, with the same engine call and the same truthful envelope.

    Raises:
        OncepatchError: a subclass with the envelope fields, carrying the call's key.
    """
    pre: _PreCheck | None = None
    if call.previous is None:
        # First call: every input error is found before the lock is taken, so a
        # rejected patch leaves the store (and the repository) exactly as it was.
        try:
            refuse_planted_markers(call.store, call.key)
            if args.check is not None:  # the check's worktree is made there
                call.store.check_folders(check_worktree_root(call.store), before_any_effect=True)
            if remote_steps is None:
                pre = _precheck(args, _stores, call.store, lock_timeout)
            else:  # remote mode plans on the remote's head, fetched under the key's lock
                _refuse_store_paths(args, call.store.root, touched_paths(parse_patch(args.patch, args.format)))
        except GitStoreError as exc:
            # Read before anything is written (say, a blob a partial clone never fetched):
            # nothing happened, whatever libgit2's failure would mean later on.
            exc.effect_status, exc.next_action = "not_started", "fix_input"
            raise exc.with_key(call.key) from None
        except OncepatchError as exc:
            raise exc.with_key(call.key)
        except Exception as exc:  # nothing of the key is written before its lock
            raise foreign_error(exc, effect_status="not_started", key=call.key) from exc

    call.adapter = GitAdapter(call.store, _stores, lock_timeout=lock_timeout)  # settles a dead owner's call of the key
    try:
        with call.claimed(lock_timeout) as final:
            if final is not None:
                return replay_final(call, final)
            run = _Run(call, args, _stores, check_timeout, lock_timeout)
            try:
                return _execute(run, pre) if remote_steps is None else remote_steps(run)
            except Exception as exc:
                err = _truthful(run, exc)
                if err is exc:
                    raise
                raise err from exc
    except OncepatchError as exc:
        raise exc.with_key(call.key)
    except Exception as exc:
        # Taking the key's lock, settling a dead owner's call of the key: whatever
        # that call did may be there, half recorded.
        raise foreign_error(exc, effect_status="unknown", next_action="query_before_retry", key=call.key) from exc


@dataclass(slots=True)
class _Run:
    """What the steps of one execution share (under the key's lock)."""

    call: Call
    args: CallArgs
    stores: dict[str, Any] | None
    check_timeout: float
    lock_timeout: float  # every lock of the call is waited for this long
    gstore: GitStore = field(init=False)
    patch: Patch = field(init=False)
    paths: list[str] = field(init=False)
    message: str = field(init=False)
    worktrees: list[tuple[str, str]] = field(default_factory=list)
    #: What is known of the branch: ``untouched`` (provably not moved by this call),
    #: ``swapping`` (the move was under way when it failed: only a query can tell)
    #: or ``moved``.  :func:`_truthful` builds the failed call's envelope from it.
    branch: str = "untouched"

    @property
    def rstore(self) -> ReceiptStore:
        return self.call.store

    @property
    def key(self) -> str:
        return self.call.key


@dataclass(frozen=True, slots=True)
class _PreCheck:
    patch: Patch
    plan: StagePlan
    worktrees: list[tuple[str, str]]


def _precheck(args: CallArgs, stores: dict[str, Any], rstore: ReceiptStore, lock_timeout: float) -> _PreCheck:
    """Parse, plan against the branch's current head and check worktrees; write nothing.

    (Unless a dead call's ``index.lock`` is met: that call is settled first, see
    :func:`patcher.worktrees.settle_dead_calls`.)
    """
    parsed = parse_patch(args.patch, args.format)
    _refuse_store_paths(args, rstore.root, touched_paths(parsed))
    gstore = open_store(args.where, stores)
    refuse_outside_edits(gstore, touched_paths(parsed))  # a directory target's generation, written to outside
    _read_identities(gstore)
    prefetch_indexes(gstore, args.branch)  # read while the patch is planned
    _refuse_rebasing(gstore, args)
    plan = plan_stage(gstore, _branch_head(gstore, args), parsed)
    worktrees = (check_worktrees(gstore, args.branch, touched_paths(parsed), settle_dead_calls(rstore, stores),
                                 owner=rstore.root, timeout=lock_timeout)
                 if not plan.already_applied else [])
    return _PreCheck(parsed, plan, worktrees)


def _refuse_store_paths(args: CallArgs, store_root: str, paths: list[str]) -> None:
    """Refuse a patch that writes into the receipt store, when the store lies inside a worktree of the repository.

    (``--store .opstore`` from a worktree.)  Committed, such a file would be
    checked out over the store's own receipts, by this call or by any later
    checkout of the branch.  Worktrees are compared by their real paths (a
    store named through a symlink is the same folder).

    Raises:
        UnsafePath: a touched path is the store's folder, lies in it, or is a folder above it.
    """
    store = os.path.realpath(store_root)
    if store.startswith(args.layout.common_dir + "/"):
        return  # the default store, inside the git dir: no worktree is there (nor any look at them per call)
    workdirs = set(all_worktrees(args.layout.common_dir))
    if args.layout.workdir:
        workdirs.add(os.path.realpath(args.layout.workdir))
    for workdir in sorted(workdirs):
        if not store.startswith(workdir.rstrip("/") + "/"):
            continue
        inside = store[len(workdir.rstrip("/")) + 1:]
        for path in paths:
            if path == inside or path.startswith(inside + "/") or inside.startswith(path + "/"):
                raise UnsafePath(
                    f"refusing to write '{path}': the receipt store '{store_root}' lies there in the "
                    f"worktree '{workdir}' (keep the store outside the worktree: the default is inside .git)",
                    details={"path": path, "reason": "in_store", "store": store_root})


def _read_identities(gstore: GitStore) -> None:
    """Author and committer, read afresh for this call (once); what git would not take is refused here.

    Raises:
        UsageError: a ``GIT_<KIND>_DATE`` git documents no form for, or a name libgit2 refuses.
    """
    try:
        gstore.read_identities()
    except ValueError as exc:
        raise UsageError(f"commit identity: {exc}") from None


def _refuse_rebasing(gstore: GitStore, args: CallArgs) -> None:
    """Refuse a branch a worktree is rebasing or bisecting (git counts it as checked out there).

    Moved under the rebase, the branch would make its last step fail ("cannot
    lock ref ... but expected ..."), the person's rebased commits left on a
    detached HEAD; ``git branch -f`` refuses such a branch for the same reason.

    Raises:
        Conflict: retryable once the rebase or bisect is over; nothing written.
    """
    busy = worktrees_rebasing(gstore.common_dir, args.branch)
    if busy:
        raise Conflict(f"'{args.branch}' is being rebased or bisected in '{busy[0]}': nothing was moved; "
                       f"retry once that is finished or aborted", effect_status="not_started",
                       details={"reason": "branch_rebasing", "git_dir": busy[0]})


def _branch_head(gstore: GitStore, args: CallArgs) -> str | None:
    """The branch's commit; ``None`` only for the unborn branch HEAD names (a repository with no commit yet).

    Raises:
        UsageError: the branch does not exist (a patch is never applied as a new root commit by accident).
    """
    head = gstore.resolve(args.branch)
    if head is None and read_head(args.layout.git_dir) != args.branch:
        raise UsageError(f"branch '{clip(args.branch)}' does not exist: create it first (e.g. 'git branch "
                         f"{clip(args.branch.removeprefix('refs/heads/'))}')")
    return head


def _execute(run: _Run, pre: _PreCheck | None) -> ApplyResult:
    """The steps, in order (module docstring)."""
    _open(run, pre)
    plan = _plan(run, pre)
    base = plan.base_commit
    staged, candidate = write_stage(run.gstore, plan, run.message, run.patch)
    if candidate is None:
        return _already_applied(run, staged)
    _check_candidate(run, base, candidate)
    crash_point("after-stage")

    _prepare(run, base, candidate, staged)
    run.call.fence()
    pause_point("before-ref")
    with _writer_turn(run.rstore, run.gstore, run.args.branch, run.lock_timeout):
        staged, warnings = _land(run, staged)
    crash_point("after-materialise")
    return _finalise(run, staged, warnings)


def _open(run: _Run, pre: _PreCheck | None) -> None:
    """Decode the patch (the pre-check's, if any), refuse unsafe paths, open the repository."""
    args = run.args
    run.patch = pre.patch if pre is not None else parse_patch(args.patch, args.format)
    run.paths = touched_paths(run.patch)
    if pre is None:
        _refuse_store_paths(args, run.rstore.root, run.paths)
    gstore = run.gstore = open_store(args.where, run.stores)
    gstore.discard_pending()  # whatever an earlier call staged and never wrote
    if pre is None:
        refuse_outside_edits(gstore, run.paths)
        _read_identities(gstore)  # (read by the pre-check otherwise)
    run.message = _commit_message(args, run.patch, run.call.call_id, run.key)


def _plan(run: _Run, pre: _PreCheck | None) -> StagePlan:
    """The change against the branch's head now (the pre-check's, if the head is the same), worktrees checked."""
    gstore, args = run.gstore, run.args
    # Under the key lock: a call of this store that holds the key has written its
    # receipt by the time the lock is ours (read by the engine, and replayed).
    _check_key_ref_free(gstore, run.rstore, run.key)
    base = _branch_head(gstore, args)
    if pre is not None and pre.plan.base_commit == base:
        run.worktrees = pre.worktrees
        return pre.plan
    if pre is None:
        _refuse_rebasing(gstore, args)
    plan = plan_stage(gstore, base, run.patch)
    run.worktrees = (check_worktrees(gstore, args.branch, run.paths,
                                     settle_dead_calls(run.rstore, run.stores, run.key), owner=run.rstore.root,
                                     timeout=run.lock_timeout)
                     if not plan.already_applied else [])
    return plan


def _check_candidate(run: _Run, base: str | None, candidate: str) -> None:
    """``--check CMD`` on the candidate's tree; a failing check is recorded ``rejected``.

    Raises:
        CheckFailed: the check failed (or timed out).
    """
    if run.args.check is None:
        return
    run.gstore.flush_objects()  # git checks the candidate out: its objects must be on disk
    run_check(run.rstore, run.gstore, candidate, run.args.check, key=run.key, timeout=run.check_timeout,
              on_fail=lambda err: _reject(run, err, base, candidate))


def _prepare(run: _Run, base: str | None, candidate: str, staged: Staged) -> None:
    """The staged objects as loose objects and the ``prepared`` receipt naming them: one durable batch.

    The objects are renamed into ``objects/`` before the receipt; both are
    synced before either is renamed (:meth:`cas.objects.GitStore.flush_objects_with`).
    """
    run.gstore.flush_objects_with(lambda batch: run.call.prepare(
        batch=batch, base={"ref": run.args.branch, "commit": base}, candidate=candidate, outputs=staged.outputs,
        extra={"touched": run.paths, "grades": {k: list(v) for k, v in staged.grades.items()}}))


def _land(run: _Run, staged: Staged) -> tuple[Staged, list[str]]:
    """Move the branch and bring its worktrees along, under their index locks; return what landed and warnings."""
    held = _hold_index_locks(run)
    ahead = IndexesAhead(run.gstore, held, run.paths)
    materialised = False
    moved: bool | None = None  # unknown until the swap returns
    try:
        _refuse_changed_worktrees(run)
        staged = _move_branch(run, staged, ahead)
        moved = True
        crash_point("after-ref")
        pause_point("after-ref")
        warnings = _materialise(run, held, ahead.written)
        materialised = not warnings
        warnings += _switch_generation(run)
    except BaseException as exc:
        _settle_and_release(ahead, held, materialised, moved, exc)
        raise
    else:
        _settle_and_release(ahead, held, materialised, moved, None)
    finally:
        run.gstore.forget_recent()  # the worktrees were the last readers of this call's blobs
    return staged, warnings


def _hold_index_locks(run: _Run) -> dict[str, IndexLock]:
    """The index locks of the worktrees on the branch; a held one is ``rejected``, retryable.

    Raises:
        RefLockedError: an index lock is held by someone else.
    """
    try:
        return hold_index_locks(run.rstore, run.worktrees, run.key, run.lock_timeout,
                                on_dead=settle_dead_calls(run.rstore, run.stores, run.key))
    except RefLockedError as exc:
        _reject(run, exc, *_base_and_candidate(run), retryable=True)
        raise


def _refuse_changed_worktrees(run: _Run) -> None:
    """Refuse (``rejected``, retryable, nothing moved) when the worktrees changed since they were checked.

    Raises:
        Conflict: a worktree checked the branch out or switched away from it.
        DirtyPath: with ``--check``, a touched path was edited while the check ran.
    """
    args = run.args
    base, candidate = _base_and_candidate(run)
    # Race guarded: a 'git checkout' or 'git switch' (or a rebase ending) in
    # some worktree since the pre-check put the branch there or took it away.
    # Moving it now would leave that worktree's index a staged revert of the
    # commit, or write the branch's files into a worktree on another branch.
    if _worktrees_now(run.gstore, args.branch) != sorted(run.worktrees):
        switched = Conflict(
            f"a worktree checked '{args.branch}' out or switched away from it while the call ran; "
            f"nothing was moved: retry", details={"reason": "worktree_switched"})
        _reject(run, switched, base, candidate)
        raise switched
    if run.worktrees:
        # Race guarded: the touched paths were found clean before the key's lock, the
        # writer turn and the index locks were waited for (seconds beside other calls,
        # and --check runs for as long as it takes): an edit a person made meanwhile
        # would be overwritten by the files written ahead of the move, and lost.
        # Under the index locks, look again.
        _dirty_again(run.gstore, run.worktrees, args.branch, base, run.paths,
                     "--check" if args.check else "the call", lambda err: _reject(run, err, base, candidate))


def _move_branch(run: _Run, staged: Staged, ahead: IndexesAhead) -> Staged:
    """The branch's compare-and-swap with the candidate written in the worktrees' files and indexes first.

    Under the branch's lock, after the compare and the fence: the indexes
    (``after-index-ahead``), then the touched files (``after-worktree-ahead``),
    then the move, which libgit2 syncs before it returns.  A failure before the
    move puts files and indexes back (:meth:`IndexesAhead.settle`).
    """
    # Proof for recovery that an empty ref lock left behind was ours (see GitAdapter):
    # written only when libgit2 moves the branch (its lock is born empty).
    ref_marker = ref_lock_marker(run.rstore, run.key)
    marked: list[str] = []

    def write_marker() -> None:
        # Through tmp/'s descriptor (receipts.store.StoreFile): a tmp/ swapped for a symlink is refused.
        ref_marker.write(run.args.branch.encode() + b"\n")
        marked.append(ref_marker.path)

    def ahead_of_the_move(candidate: str) -> None:
        # The worktrees' indexes first, then their files, all before the branch moves.
        # Killed in between, a person who removes index.lock and runs 'git commit -a'
        # (or 'git add -A') stages the old files again: nothing of the change, not half
        # of it (files first, its new files would be left out as untracked).
        ahead.stage(candidate)
        crash_point("after-index-ahead")
        ahead.write_files(candidate)

    try:
        return _move_refs(run, staged, before_libgit2=write_marker, before_swap=ahead_of_the_move)
    finally:
        # Reached on every outcome but a crash: our ref locks are released by now.
        if marked:
            ref_marker.remove()


def _materialise(run: _Run, held: dict[str, IndexLock], written: dict[str, dict[str, Any]]) -> list[str]:
    """Bring the touched paths of the worktrees on the branch to the new commit; return warnings.

    ``written``: the files already written ahead of the move (their index entries get stat data).

    Raises:
        RefUpdateUnknown: the move's own sync failed in a worktree's round (receipt ``unknown``).
    """
    gstore = run.gstore
    try:
        warnings = materialise_all(gstore, run.rstore, run.worktrees, run.args.branch, run.paths, run.key, held,
                                   run.lock_timeout, written)
    except BaseException:
        with contextlib.suppress(Exception):
            gstore.sync_refs()  # the move is made durable even when this fails
        raise
    failed_sync = gstore.take_sync_failure()
    if failed_sync is not None:  # the move's own sync failed in a worktree's round (receipt unknown: _truthful)
        raise failed_sync
    return warnings


def _switch_generation(run: _Run) -> list[str]:
    """A directory target (docs/DIRECTORIES.md): build the branch tip's generation, switch the folder to it.

    A failure is a warning, as a worktree's is: the branch moved; ``recover``
    (the git adapter's ``settle``) switches again.
    """
    layout = target_of(run.gstore)
    if layout is None:
        return []
    warnings: list[str] = []
    try:
        sync(run.gstore, layout, run.lock_timeout, warnings)
    except OncepatchError as exc:
        return warnings + [f"'{layout.path}' not switched to the new generation: {exc.message}; run "
                           f"'oncepatch recover --dir {layout.path}'"]
    return warnings


def _finalise(run: _Run, staged: Staged, warnings: list[str]) -> ApplyResult:
    """The key ref and the ``committed`` receipt: one batch, the key ref renamed first.

    A committed receipt always has its key ref: libgit2 creates it (and syncs
    it) while the batch's first round syncs the receipt's tmp file, and the
    receipt is renamed only once both are done.  The first round also syncs
    the branch's folder when the move left that to it.

    Raises:
        IdempotencyConflict: the key ref was created meanwhile through another store.
        RefUpdateUnknown: the move's own sync failed (receipt ``unknown``).
    """
    call, gstore = run.call, run.gstore
    candidate = _base_and_candidate(run)[1]
    assert candidate is not None
    ref_folders = gstore.take_unsynced()

    def create_key_ref() -> None:
        try:
            gstore.create_key_ref(KEY_REF_PREFIX + key_hash(run.key), candidate, f"oncepatch: {call.call_id}")
        except RefMovedError as exc:
            # Another store committed the same key since the pre-check: the branch *has* moved.
            raise IdempotencyConflict(
                f"the branch moved to {candidate[:12]}, but the key ref of '{run.key}' was created meanwhile by "
                f"a call through another store: run 'oncepatch recover', and use one store per repository",
                key=run.key, effect_status="applied", next_action="recover",
                details={"commit": candidate}) from exc

    def add_key_ref(batch: DurableBatch) -> None:
        batch.sync_first(ref_folders)
        # libgit2 syncs the key ref's reflog, lock and folders one after another: that runs
        # while the committed receipt's tmp file syncs, and the receipt is renamed after both.
        batch.alongside_first(create_key_ref)

    fields: dict[str, Any] = {"commit": candidate, "tree": staged.tree}
    if warnings:
        assert call.receipt is not None
        fields["extra"] = {**call.receipt.extra, "warnings": warnings}
    try:
        path = call.commit(before_replace=crash_hook("before-receipt-replace"), add_to_batch=add_key_ref, **fields)
    except DurableWriteError as exc:
        gstore.sync_failed(exc, ref_folders)
        unknown = gstore.take_sync_failure()
        if unknown is not None:
            # The branch moved and its own sync failed: never retried as if nothing
            # happened (a second fsync may succeed with the data lost).  Receipt unknown: _truthful.
            raise unknown from exc
        with contextlib.suppress(Exception):
            fsync_all(ref_folders)  # the move is made durable even when finalising failed
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            fsync_all(ref_folders)  # the move is made durable even when finalising failed
        raise
    assert call.receipt is not None
    return ApplyResult(run.key, call.call_id, "committed", False, candidate, staged.tree, call.receipt.outputs,
                       path, warnings=(*grade_warnings(staged.grades), *warnings),
                       grades={p: list(g) for p, g in staged.grades.items()})


def _base_and_candidate(run: _Run) -> tuple[str | None, str | None]:
    """The base commit and the candidate of this attempt's prepared receipt (as last re-staged)."""
    receipt = run.call.receipt
    assert receipt is not None
    return (receipt.base or {}).get("commit"), receipt.candidate


def _settle_and_release(ahead: IndexesAhead, held: dict[str, IndexLock], materialised: bool, moved: bool | None,
                        failed: BaseException | None) -> None:
    """Settle the staged indexes (:class:`patcher.worktrees.IndexesAhead`), then release the index locks.

    When an index cannot be put back, its lock stays held: released, git would
    commit the staged entries on a branch that did not move.  A lock that stays
    is settled as a dead call's once this process has ended (``recover``, or the
    next call).  ``failed``: the error the call is ending with; this one is
    noted on it (in its message too, which the envelope carries).

    Raises:
        GitStoreError: an index could not be settled, and the call had not failed.
    """
    try:
        ahead.settle(materialised, moved)
    except Exception as exc:
        note = (f"the index of a worktree could not be put back ({exc}); its index.lock stays held until "
                f"this process ends, then 'oncepatch recover' settles it")
        if failed is None:
            raise GitStoreError(note) from exc
        if isinstance(failed, OncepatchError):
            failed.message = f"{failed.message}; {note}"
        failed.add_note(note)
        return
    release_index_locks(held)


def _dirty_again(gstore: GitStore, worktrees: list[tuple[str, str]], branch: str, base: str | None,
                 paths: list[str], what: str, reject: Callable[[OncepatchError], None]) -> None:
    """Refuse (retryable, nothing moved) when a touched path changed in a worktree since the pre-check.

    A path is changed when it differs from the branch's tip now and from the
    call's base: another call that landed since brought the worktrees to the
    tip (under these same locks); a ``git update-ref`` that moved the branch
    left them at the base (the move's conflict check answers that).

    Raises:
        DirtyPath: a touched path differs from both there now.
    """
    tip = gstore.resolve(branch)
    trees = [gstore.commit_tree(c) if c else None for c in dict.fromkeys((tip, base))]
    for workdir, _git_dir in worktrees:
        dirty = paths
        for tree in trees:
            dirty = dirty_paths(gstore, workdir, dirty, tree) if dirty else []
        if dirty:
            err = DirtyPath(f"'{dirty[0]}' was changed in '{workdir}' while {what} ran: nothing was moved; "
                            f"commit or stash the change, then retry", details={"paths": dirty, "worktree": workdir})
            reject(err)
            raise err


def _check_key_ref_free(gstore: GitStore, rstore: ReceiptStore, key: str) -> None:
    """Refuse a key whose key ref exists while this store has no committed receipt of it.

    The key ref is the repository's, the receipt the store's: the key was
    committed through another store (``--store``, ``ONCEPATCH_STORE``), or
    ``oncepatch gc`` retired it (its receipt archived, the ref kept as a
    tombstone: :mod:`receipts.retired`).  Executed again, the branch would
    move and the key ref, created only if absent, could not follow.

    Raises:
        IdempotencyConflict: the key ref exists (nothing written).
    """
    ref = KEY_REF_PREFIX + key_hash(key)
    found = gstore.resolve(ref)
    if found is not None:
        entry = retirement(rstore, key)  # the ledger is read only for a key ref without a receipt
        if entry is not None:
            raise IdempotencyConflict(f"{retired_message(key, entry)}; use a new key", key=key,
                                      details={"key_ref": ref, "commit": found, "retired": entry})
        raise IdempotencyConflict(
            f"key '{key}' already has a commit in this repository ({ref} -> {found[:12]}) but this store "
            f"has no receipt of it: it was applied through another store (--store / ONCEPATCH_STORE), or its "
            f"receipt was removed; use that store, or another key",
            key=key, details={"key_ref": ref, "commit": found})


def _worktrees_now(gstore: GitStore, branch: str) -> list[tuple[str, str]]:
    return sorted(worktrees_on(gstore.common_dir, branch, gstore.main_workdir))


def _move_refs(run: _Run, staged: Staged, *, before_libgit2: Callable[[], None] | None = None,
               before_swap: Callable[[str], None] | None = None) -> Staged:
    """Compare-and-swap the branch to the candidate (re-staging onto a moved head, :func:`_restage`).

    ``before_libgit2``: see
    :meth:`GitStore.compare_and_swap`.  ``before_swap``: called with the
    candidate under the branch's lock, after the compare and the fence, before the move.

    Returns the staged change that landed (the prepared receipt names its base and candidate).

    Raises:
        Conflict: the branch moved and the patch no longer applies (rejected, retryable).
        RefLockedError: the branch's lock file is held (rejected, retryable).
        ObjectsMissing: under the branch's lock, the candidate's objects were gone and could not be
            written again (rejected, retryable).
        RefUpdateUnknown: the ref update failed half way (receipt ``unknown``).
        FencedOff: another process took the key over or settled this attempt.
    """
    rounds = 0
    while True:
        base, candidate = _base_and_candidate(run)
        assert candidate is not None
        run.branch = "untouched"  # "swapping" once the precondition has passed under the ref lock
        try:
            run.gstore.compare_and_swap(run.args.branch, base, candidate, f"oncepatch: {run.call.call_id}",
                                        lock_timeout=run.lock_timeout,
                                        precondition=_under_ref_lock(run, candidate, before_swap),
                                        before_libgit2=before_libgit2)
            run.branch = "moved"
            return staged
        except _NotStaged as failed:
            err = failed.error
            err.effect_status = "not_applied"
            if isinstance(err, GitStoreError):  # an I/O failure, not the repository's state
                err.retryable, err.next_action = True, "retry"
            _reject(run, err, base, candidate)
            raise err from None
        except RefMovedError as moved:
            rounds += 1
            staged = _restage(run, moved.actual, rounds)
        except (RefLockedError, ObjectsMissing) as exc:
            _reject(run, exc, base, candidate, retryable=True)
            raise
        except GitStoreError:
            # A write that failed before the rename (cas.refs): the ref is unchanged.
            # (RefUpdateUnknown, a failure after it, is not one: the branch stays "swapping".)
            run.branch = "untouched"
            raise


def _under_ref_lock(run: _Run, candidate: str, before_swap: Callable[[str], None] | None) -> Callable[[], None]:
    """What runs under the branch's ref lock, after the compare, before the move."""

    def precondition() -> None:
        # The fence is checked again under the branch's ref lock: between the
        # caller's check and the swap this process may have been paused, its key
        # lock broken and the key taken over (then the ref must not move).
        run.call.fence()
        _refuse_held_key_ref(run)
        if before_swap is not None:
            # Staged after the compare, the objects' check and the fence; only libgit2's
            # commit of the transaction follows.
            try:
                before_swap(candidate)
            except OncepatchError as exc:  # an index or a file could not be written: nothing has moved
                raise _NotStaged(exc) from exc
            crash_point("after-worktree-ahead")
        run.branch = "swapping"  # from here a failure may come after the rename

    return precondition


def _refuse_held_key_ref(run: _Run) -> None:
    """Refuse to move the branch while the key ref's ``.lock`` is there: the key ref could not follow.

    Race guarded: the key ref is created after the branch moved (cas.refs says
    why not in one transaction); a ``.lock`` left by a crashed writer, or held
    by one, would make that creation fail with the branch moved.  Looked at
    under the branch's lock, before anything is staged: the compare-and-swap
    waits for it like for the branch's own lock (up to the lock timeout), then
    the call is rejected, retryable, nothing moved.  A lock taken after this
    look is the after-the-move failure :func:`_truthful` reports truthfully.

    Raises:
        RefLockedError: ``refs/oncepatch/keys/<h>.lock`` exists.
    """
    lock = os.path.join(run.gstore.common_dir, KEY_REF_PREFIX + key_hash(run.key) + ".lock")
    if os.path.lexists(lock):
        raise RefLockedError(lock, details={"ref": KEY_REF_PREFIX + key_hash(run.key)})


def _restage(run: _Run, new_base: str | None, rounds: int) -> Staged:
    """Stage the patch again onto the branch's new head and record it (``restaged``); else reject.

    Raises:
        Conflict: too many rounds, a ``--check`` that ran on the old candidate,
            a patch that no longer applies or is already in the new head.
        FencedOff: another process took the key over or settled this attempt.
    """
    args, paths = run.args, run.paths
    moved = f"branch '{args.branch}' moved to {str(new_base)[:12]}"
    conflict: Conflict | None = None
    new_candidate: str | None = None
    if rounds > MAX_RESTAGE_ROUNDS:
        conflict = Conflict(f"branch '{args.branch}' kept moving: gave up after {MAX_RESTAGE_ROUNDS} rounds",
                            details={"paths": paths})
    elif args.check is not None:
        # A re-staged candidate is another tree than the one the check passed:
        # it must not land unchecked.  The retry checks the new head's candidate.
        conflict = Conflict(f"{moved} while --check ran on the candidate: nothing was moved; retry to check the "
                            f"change on the new head", details={"paths": paths, "reason": "moved_during_check"})
    else:
        try:
            staged, new_candidate = stage(run.gstore, new_base, run.patch, run.message)
        except PatchError as exc:
            conflict = Conflict(f"{moved} and the patch no longer applies there: {exc.message}",
                                details={"paths": paths, "cause": exc.envelope()})
        else:
            if new_candidate is None:
                conflict = Conflict(f"{moved}, which already contains this change", details={"paths": paths})
    if conflict is not None or new_candidate is None:
        assert conflict is not None
        _reject(run, conflict, *_base_and_candidate(run))
        raise conflict
    run.gstore.flush_objects()
    run.call.update("restaged", base={"ref": args.branch, "commit": new_base},
                    candidate=new_candidate, outputs=staged.outputs)
    return staged


class _NotStaged(Exception):
    """An index could not be staged under the branch's lock (the ref was not moved)."""

    def __init__(self, error: OncepatchError) -> None:
        super().__init__(error.message)
        self.error = error


def _reject(run: _Run, err: OncepatchError, base: str | None, candidate: str | None, *,
            retryable: bool | None = None) -> None:
    """Record a rejection after staging (conflict, failed check, stale lock): base and candidate, no outputs.

    A remote-mode receipt keeps its ``remote`` field: the remote and the clone it names are
    where ``verify`` checks that the staged candidate never landed (docs/REMOTE.md).
    """
    if run.call.prepared and err.effect_status == "not_started":
        err.effect_status = "not_applied"  # (its receipt said prepared: something was started)
    envelope = err.with_key(run.key).envelope()
    if retryable is not None:
        envelope["retryable"] = retryable
    prepared = run.call.receipt if run.call.prepared else None
    named = prepared.extra.get("remote") if prepared is not None else None
    run.call.reject(envelope, base={"ref": run.args.branch, "commit": base}, candidate=candidate, outputs=(),
                    extra={"remote": named} if named is not None else {})


def _truthful(run: _Run, exc: Exception) -> OncepatchError:
    """The error a failed execution ends with, its envelope saying what git holds; its receipt recorded.

    The one place every failure of :func:`_execute` goes through (docs/DESIGN.md
    section 6: ``effect_status`` never claims less than happened):

    * the branch moved, or may have (:attr:`_Run.branch`): ``applied`` or
      ``unknown``, ``next_action: recover``, whatever failed (materialising,
      the key ref, the receipt, the ledger, the OS); the receipt is recorded
      ``unknown`` (:meth:`receipts.engine.Call.unfinished`) and ``recover``
      finishes the call;
    * the ``prepared`` receipt written, the branch provably not moved:
      ``not_applied``; what is not recorded yet is recorded ``rejected``,
      retryable (best effort: a ``prepared`` receipt left behind is settled
      the same way by the key's next call);
    * before that: ``not_started`` (objects written by then are garbage git
      prunes, never referenced).

    A foreign error (the OS's, libgit2's, a bug's) becomes one of the tree.
    """
    call = run.call
    if run.branch != "untouched":
        # (Moved, it is applied: libgit2 synced the move before returning; a folder
        # synced later that fails is the worktrees', not the branch's.)
        err = after_effect(exc, run.key, "applied" if run.branch == "moved" else "unknown")
        call.unfinished(err)
        return err
    if not call.prepared:
        if not isinstance(exc, OncepatchError):
            return foreign_error(exc, effect_status="not_started", key=run.key)
        if isinstance(exc, DurableWriteError) and exc.effect_status == "unknown":
            # The prepared receipt was renamed, its folder's sync failed: the branch is untouched.
            exc.effect_status, exc.next_action, exc.retryable = "not_applied", "retry", True
        elif isinstance(exc, GitStoreError) and exc.effect_status == "unknown":
            # libgit2 failed to write the call's objects (a full disk): no receipt names
            # them and the branch is untouched, so nothing happened that a query could find.
            exc.effect_status, exc.next_action, exc.retryable = "not_started", "retry", True
        return exc.with_key(run.key)
    if isinstance(exc, FencedOff):
        return exc.with_key(run.key)  # the key is another attempt's: what it did is its own to say
    if isinstance(exc, OncepatchError):
        err = exc.with_key(run.key)
        if err.effect_status != "not_applied":
            err.effect_status = "not_applied"
            if err.next_action in ("query_before_retry", "none", "recover"):
                err.next_action, err.retryable = "retry", True
    else:
        err = foreign_error(exc, effect_status="not_applied", key=run.key)
    assert call.receipt is not None
    if call.receipt.status == "prepared":
        with contextlib.suppress(Exception):
            _reject(run, err, *_base_and_candidate(run), retryable=err.retryable)
    return err


def _already_applied(run: _Run, staged: Staged) -> ApplyResult:
    """Every edit is already in the branch: committed, naming the commit that has it; no new commit."""
    path = run.call.commit(
        event={"already_applied": True},
        base={"ref": run.args.branch, "commit": staged.base_commit}, candidate=None,
        commit=staged.base_commit, tree=staged.base_tree, outputs=staged.outputs,
        extra={"already_applied": True},
    )
    return ApplyResult(run.key, run.call.call_id, "committed", False, staged.base_commit, staged.base_tree,
                       staged.outputs, path, already_applied=True)


def _commit_message(args: CallArgs, patch: Patch, call_id: str, key: str) -> str:
    if args.message:
        subject = args.message.rstrip("\n")
    else:
        targets = [e.target for e in patch.edits]
        shown = ", ".join(targets[:3]) + (f" and {len(targets) - 3} more" if len(targets) > 3 else "")
        subject = f"oncepatch: apply patch to {shown}"
    # Paths (and argv) that are not UTF-8 arrive with their bytes as surrogates: the
    # message is UTF-8, so such a byte is shown as '\xe9'.
    subject = subject.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return f"{subject}\n\nOncepatch-Call: {call_id}\nOncepatch-Key: {key_hash(key)}\n"

"""Steps 1 to 7 of the apply protocol (docs/DESIGN.md section 4): a call that is not a replay.

:func:`patcher.protocol.apply` normalises the call, computes its identity
and replays a final receipt; what is left comes here, under the key's lock
(:func:`locked_apply`): the pre-check made before the lock, the stage, the
``prepared`` receipt, the branch's compare-and-swap (re-staged onto a moved
head), the worktrees, the key ref and the ``committed`` receipt.  The crash
points armed on the way are the ones ``tests/integration/test_crash_matrix.py``
predicts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from cas.record import record
from cas.crash import crash_hook, crash_point
from cas.durable import DurableBatch, fsync_all
from cas.errors import (DurableWriteError, GitStoreError, OncepatchError, RefLockedError, RefMovedError,
                        RefUpdateUnknown, UsageError)
from cas.gitdir import read_head
from receipts.errors import FencedOff, IdempotencyConflict
from receipts.jsonio import use_fast as use_fast_json
from receipts.identity import key_hash
from receipts.receipt import Receipt, now_iso
from receipts.store import ReceiptStore
from patcher.args import TOOL, TOOL_VERSION, CallArgs
from patcher.errors import Conflict, PatchError
from patcher.formats import parse_patch
from patcher.markers import ref_lock_marker
from patcher.model import Patch
from patcher.protocol import KEY_REF_PREFIX, ApplyResult, check_same_intent, replay_final

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from typing import Any
    from receipts.states import Status
    from cas.objects import GitStore
    from cas.worktree import IndexLock
    from patcher.stage import Staged, StagePlan
    from patcher.worktrees import IndexesAhead

__all__ = ["locked_apply", "open_store", "owner_info", "MAX_RESTAGE_ROUNDS", "PAUSE_ENV"]

MAX_RESTAGE_ROUNDS = 16


#: Seconds a call waits for its turn among the oncepatch writers of one branch
#: (:func:`_writer_turn`); past it the call goes ahead without its turn.
WRITER_TURN_TIMEOUT = 30.0


#: Test seam (like ``ONCEPATCH_CRASH_AT``): ``ONCEPATCH_PAUSE_AT=<point>`` makes the
#: process stop itself with SIGSTOP at that point, so a test can break its key lock
#: and let another process take the key over before sending SIGCONT.  Points:
#: ``after-prepare``, ``before-ref`` (after the fence check made without locks,
#: before the branch's locks), ``after-ref`` (the branch moved; the worktrees'
#: index locks still held, their files not yet written), ``before-finalise`` (the
#: branch moved; before the final fence).
PAUSE_ENV = "ONCEPATCH_PAUSE_AT"


def _pause_point(name: str) -> None:
    if os.environ.get(PAUSE_ENV) == name:
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)


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
    from cas.hashing import sha256_hex
    from receipts.errors import InProgress
    from receipts.flock import flocked

    os.makedirs(rstore.locks_dir, exist_ok=True)
    name = "branch-" + sha256_hex(f"{gstore.common_dir}\0{branch}".encode()) + ".lock"
    turn = flocked(os.path.join(rstore.locks_dir, name), timeout)
    try:
        turn.__enter__()
    except InProgress:
        yield
        return
    try:
        yield
    finally:
        turn.__exit__(None, None, None)


def _proc_start_time() -> str | None:
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return None


#: (pid, start time) of this process, read from /proc once per process (a forked child reads its own).
_STARTED: tuple[int, str | None] | None = None


def owner_info() -> dict[str, Any]:
    global _STARTED
    pid = os.getpid()
    if _STARTED is None or _STARTED[0] != pid:
        _STARTED = (pid, _proc_start_time())
    return {"host": os.uname().nodename, "pid": pid, "start_time": _STARTED[1], "since": now_iso()}


def locked_apply(rstore: ReceiptStore, args: CallArgs, identity: dict[str, Any], call_id: str, the_key: str,
                 args_sha: str, existing: Receipt | None, path: str, lock_timeout: float, check_timeout: float,
                 _stores: dict[str, Any]) -> ApplyResult:
    """Steps 1 to 7 for a call with no final receipt (``existing``: the one read without the lock, if any).

    Raises:
        OncepatchError: a subclass with the envelope fields, carrying ``the_key``.
    """
    pre: _PreCheck | None = None
    if existing is None:
        # First call: every input error is found before the lock is taken, so a
        # rejected patch leaves the store (and the repository) exactly as it was.
        try:
            pre = _precheck(args, _stores, rstore, lock_timeout)
        except GitStoreError as exc:
            # Read before anything is written (say, a blob a partial clone never fetched):
            # nothing happened, whatever libgit2's failure would mean later on.
            exc.effect_status, exc.next_action = "not_started", "fix_input"
            raise exc.with_key(the_key) from None
        except OncepatchError as exc:
            raise exc.with_key(the_key)

    with rstore.lock(the_key, timeout=lock_timeout):
        existing = rstore.read(the_key)
        if existing is not None:
            check_same_intent(existing, args_sha, the_key)
            if existing.status in ("prepared", "unknown"):
                from patcher.git_adapter import GitAdapter
                from receipts.recovery import resolve_receipt

                # A live owner would hold the lock: this one is dead. Settle it first.
                existing = resolve_receipt(rstore, existing, GitAdapter(rstore, _stores, lock_timeout=lock_timeout))
            if existing.is_final:
                return replay_final(existing, path, rstore)
        try:
            return _execute(rstore, args, identity, call_id, the_key, args_sha, existing, check_timeout,
                            _stores, pre, lock_timeout)
        except OncepatchError as exc:
            raise exc.with_key(the_key)
        finally:
            gstore = _stores.get(args.where)
            if gstore is not None:
                gstore.drop_ref_content()  # unused: a re-staged or libgit2 move, or no move at all


@record
class _PreCheck:
    patch: Patch
    plan: StagePlan
    worktrees: list[tuple[str, str]]


def _precheck(args: CallArgs, stores: dict[str, Any], rstore: ReceiptStore, lock_timeout: float) -> _PreCheck:
    """Parse, plan against the branch's current head and check worktrees; write nothing.

    (Unless a dead call's ``index.lock`` is met: that call is settled first, see
    :func:`patcher.worktrees.settle_dead_calls`.)
    """
    use_fast_json()  # this process executes: JSON speed now matters more than start-up
    from patcher.stage import plan_stage, touched_paths
    from patcher.worktrees import check_worktrees, prefetch_indexes, settle_dead_calls

    parsed = parse_patch(args.patch, args.format)
    _refuse_store_paths(args, rstore.root, touched_paths(parsed))
    gstore = open_store(args.where, stores)
    _read_identities(gstore)
    prefetch_indexes(gstore, args.branch)  # read while the patch is planned
    plan = plan_stage(gstore, _branch_head(gstore, args), parsed)
    worktrees = (check_worktrees(gstore, args.branch, touched_paths(parsed), settle_dead_calls(rstore, stores),
                                 owner=rstore.root, timeout=lock_timeout)
                 if not plan.already_applied else [])
    return _PreCheck(parsed, plan, worktrees)


def _refuse_store_paths(args: CallArgs, store_root: str, paths: list[str]) -> None:
    """Refuse a patch that writes into the receipt store, when the store lies inside a worktree of the repository.

    (``--store .opstore`` from a worktree.)  Committed, such a file would be
    checked out over the store's own receipts, by this call or by any later
    checkout of the branch.  Every worktree of the repository is looked at
    (the main one, the linked ones, the one the call came from), all by their
    real paths (a store named through a symlink is the same folder).
    Nothing is written before this check.

    Raises:
        UnsafePath: a touched path is the store's folder, lies in it, or is a folder above it.
    """
    from cas.gitdir import all_worktrees
    from patcher.errors import UnsafePath

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


def _branch_head(gstore: GitStore, args: CallArgs) -> str | None:
    """The branch's commit; ``None`` only for the unborn branch HEAD names (a repository with no commit yet).

    Raises:
        UsageError: the branch does not exist (a patch is never applied as a new root commit by accident).
    """
    head = gstore.resolve(args.branch)
    if head is None and read_head(args.layout.git_dir) != args.branch:
        raise UsageError(f"branch '{args.branch}' does not exist: create it first (e.g. 'git branch "
                         f"{args.branch.removeprefix('refs/heads/')}')")
    return head


def open_store(repo_path: str, stores: dict[str, Any] | None) -> GitStore:
    """An open :class:`GitStore`, reused from ``stores`` by long-lived callers."""
    from cas.objects import GitStore

    if stores is None:
        return GitStore(repo_path)
    found = stores.get(repo_path)
    if found is None:
        found = stores[repo_path] = GitStore(repo_path)
    return found


def _execute(
    rstore: ReceiptStore,
    args: CallArgs,
    identity: dict[str, Any],
    call_id: str,
    key: str,
    args_sha: str,
    previous: Receipt | None,
    check_timeout: float,
    stores: dict[str, Any] | None,
    pre: _PreCheck | None,
    lock_timeout: float,
) -> ApplyResult:
    from patcher.stage import plan_stage, touched_paths, write_stage
    from patcher.worktrees import IndexesAhead, check_worktrees, hold_index_locks, materialise_all, settle_dead_calls

    use_fast_json()
    parsed = pre.patch if pre is not None else parse_patch(args.patch, args.format)
    if pre is None:
        _refuse_store_paths(args, rstore.root, touched_paths(parsed))
    gstore = open_store(args.where, stores)
    gstore.discard_pending()  # whatever an earlier call staged and never wrote
    if pre is None:
        _read_identities(gstore)  # (read by the pre-check otherwise)
    message = _commit_message(args, parsed, call_id, key)
    paths = touched_paths(parsed)
    # Under the key lock: a call of this store that holds the key has written its
    # receipt by the time the lock is ours (read above, and replayed).
    _check_key_ref_free(gstore, key)
    base = _branch_head(gstore, args)
    if pre is not None and pre.plan.base_commit == base:
        plan, worktrees = pre.plan, pre.worktrees
    else:
        plan = plan_stage(gstore, base, parsed)
        worktrees = (check_worktrees(gstore, args.branch, paths, settle_dead_calls(rstore, stores, key),
                                     owner=rstore.root, timeout=lock_timeout)
                     if not plan.already_applied else [])
    staged, candidate = write_stage(gstore, plan, message, parsed)
    if candidate is None:
        return _already_applied(rstore, identity, call_id, key, args_sha, previous, args, staged)
    if args.check is not None:
        from patcher.check import run_check

        gstore.flush_objects()  # git checks the candidate out: its objects must be on disk
        run_check(rstore, gstore, candidate, args.check, key=key, timeout=check_timeout,
                  on_fail=lambda err: _reject(rstore, identity, call_id, key, args_sha, previous, args, err,
                                              base, candidate))
    crash_point("after-stage")

    token = (previous.fencing_token if previous is not None else 0) + 1
    receipt = _new_receipt(
        identity, call_id, key, args_sha, previous, "prepared", token,
        base={"ref": args.branch, "commit": base},
        candidate=candidate,
        outputs=staged.outputs,
        extra={"touched": paths, "grades": {k: list(v) for k, v in staged.grades.items()}},
    )
    # The staged objects and the receipt naming them: one batch, synced together;
    # with them, the branch lock's content (the move then needs no sync of its own).
    batch = DurableBatch()
    gstore.add_pending_to(batch)
    gstore.stage_ref_content(args.branch, candidate, batch)  # removed if unused: locked_apply
    rstore.record(receipt, "prepared", batch=batch)
    crash_point("after-prepare")
    _pause_point("after-prepare")

    _fence(rstore, key, token)
    _pause_point("before-ref")
    with _writer_turn(rstore, gstore, args.branch, lock_timeout):
        try:
            held = hold_index_locks(rstore, worktrees, key, lock_timeout, on_dead=settle_dead_calls(rstore, stores, key))
        except RefLockedError as exc:
            _reject(rstore, identity, call_id, key, args_sha, receipt, args, exc, base, candidate, retryable=True)
            raise
        ahead = IndexesAhead(gstore, held, paths)
        materialised = False
        moved: bool | None = None  # unknown until the swap returns
        try:
            # Race guarded: a 'git checkout' or 'git switch' (or a rebase ending) in
            # some worktree since the pre-check put the branch there or took it away.
            # Moving it now would leave that worktree's index a staged revert of the
            # commit, or write the branch's files into a worktree on another branch.
            if _worktrees_now(gstore, args.branch) != sorted(worktrees):
                switched = Conflict(
                    f"a worktree checked '{args.branch}' out or switched away from it while the call ran; "
                    f"nothing was moved: retry", details={"reason": "worktree_switched"})
                _reject(rstore, identity, call_id, key, args_sha, receipt, args, switched, base, candidate)
                raise switched
            if args.check is not None and worktrees:
                # The check ran for seconds since the touched paths were found clean: a
                # person may have edited one meanwhile.  Under the index locks, look again.
                _dirty_again(gstore, worktrees, args.branch, base, paths, lambda err: _reject(
                    rstore, identity, call_id, key, args_sha, receipt, args, err, base, candidate))
            # Proof for recovery that an empty ref lock left behind was ours (see GitAdapter):
            # written only when libgit2 moves the branch (its lock is born empty).
            ref_marker = ref_lock_marker(rstore, key)
            marked: list[str] = []

            def write_marker() -> None:
                os.makedirs(rstore.tmp_dir, exist_ok=True)
                with open(ref_marker, "wb") as fh:
                    fh.write(args.branch.encode() + b"\n")
                marked.append(ref_marker)

            try:
                # The move's syncs join the next round: a worktree's first (its files change
                # only after the move is durable), and in any case the finalise batch's
                # first (they end before the committed receipt is renamed).
                # The candidate is staged in the worktrees' indexes under the branch's lock, before it moves.
                receipt, staged = _move_refs(gstore, rstore, receipt, parsed, message, staged, paths, token, args,
                                             lock_timeout, defer_sync=True, before_libgit2=write_marker,
                                             before_swap=ahead.stage)
                moved = True
            finally:
                # Reached on every outcome but a crash: our ref locks are released by now.
                if marked:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(ref_marker)
            candidate = receipt.candidate
            assert candidate is not None
            crash_point("after-ref")
            _pause_point("after-ref")

            try:
                warnings = materialise_all(gstore, rstore, worktrees, args.branch, paths, key, held, lock_timeout)
                materialised = not warnings
            except BaseException:
                with contextlib.suppress(Exception):
                    gstore.sync_refs()  # the move is made durable even when this fails
                raise
            failed_sync = gstore.take_sync_failure()
            if failed_sync is not None:  # the move's own sync failed in a worktree's round
                _record_unknown(rstore, receipt, failed_sync)
                raise failed_sync
        except BaseException as exc:
            _settle_and_release(ahead, held, materialised, moved, exc)
            raise
        else:
            _settle_and_release(ahead, held, materialised, moved, None)
        finally:
            gstore.forget_recent()  # the worktrees were the last readers of this call's blobs
    crash_point("after-materialise")

    _pause_point("before-finalise")
    ref_folders = gstore.take_unsynced()
    try:
        _fence(rstore, key, token)
        final = receipt.evolve(status="committed", commit=candidate, tree=staged.tree, error=None)
        if warnings:
            final = final.evolve(extra={**final.extra, "warnings": warnings})
        # The key ref and the committed receipt: one batch, the key ref renamed first
        # (a committed receipt always has its key ref); its first round also syncs
        # the branch's folder when the move left that to it.
        batch = DurableBatch()
        batch.sync_first(ref_folders)
        try:
            gstore.create_key_ref(KEY_REF_PREFIX + key_hash(key), candidate, f"oncepatch: {call_id}", batch=batch)
        except RefMovedError as exc:
            # Another store committed the same key since the pre-check: the branch *has* moved.
            raise IdempotencyConflict(
                f"the branch moved to {candidate[:12]}, but the key ref of '{key}' was created meanwhile by a "
                f"call through another store: run 'oncepatch recover', and use one store per repository",
                key=key, effect_status="applied", next_action="recover",
                details={"commit": candidate}) from exc
        path = rstore.record(final, "committed", before_replace=crash_hook("before-receipt-replace"), batch=batch)
    except DurableWriteError as exc:
        gstore.sync_failed(exc, ref_folders)
        unknown = gstore.take_sync_failure()
        if unknown is not None:
            # The branch moved and its own sync failed: never retried as if nothing
            # happened (a second fsync may succeed with the data lost).
            _record_unknown(rstore, receipt, unknown)
            raise unknown from exc
        with contextlib.suppress(Exception):
            fsync_all(ref_folders)  # the move is made durable even when finalising failed
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            fsync_all(ref_folders)  # the move is made durable even when finalising failed
        raise
    from patcher.grades import grade_warnings

    return ApplyResult(key, call_id, "committed", False, candidate, staged.tree, final.outputs, path,
                       warnings=(*grade_warnings(staged.grades), *warnings),
                       grades={p: list(g) for p, g in staged.grades.items()})


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
    from patcher.worktrees import release_index_locks

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
                 paths: list[str], reject: Callable[[OncepatchError], None]) -> None:
    """Refuse (retryable, nothing moved) when a touched path changed in a worktree since the pre-check.

    Raises:
        DirtyPath: a touched path differs from the base there now.
    """
    from cas.worktree import dirty_paths
    from patcher.errors import DirtyPath

    tree = gstore.commit_tree(base) if base else None
    for workdir, _git_dir in worktrees:
        dirty = dirty_paths(gstore, workdir, paths, tree)
        if dirty:
            err = DirtyPath(f"'{dirty[0]}' was changed in '{workdir}' while --check ran: nothing was moved; "
                            f"commit or stash the change, then retry", details={"paths": dirty, "worktree": workdir})
            reject(err)
            raise err


def _check_key_ref_free(gstore: GitStore, key: str) -> None:
    """Refuse a key whose key ref exists while this store has no committed receipt of it.

    The key ref is the repository's, the receipt the store's: the key was
    committed through another store (``--store``, ``ONCEPATCH_STORE``), or its
    receipt was removed.  Executed again, the branch would move and the key
    ref, created only if absent, could not follow.

    Raises:
        IdempotencyConflict: the key ref exists (nothing written).
    """
    ref = KEY_REF_PREFIX + key_hash(key)
    found = gstore.resolve(ref)
    if found is not None:
        raise IdempotencyConflict(
            f"key '{key}' already has a commit in this repository ({ref} -> {found[:12]}) but this store "
            f"has no receipt of it: it was applied through another store (--store / ONCEPATCH_STORE), or its "
            f"receipt was removed; use that store, or another key",
            key=key, details={"key_ref": ref, "commit": found})


def _worktrees_now(gstore: GitStore, branch: str) -> list[tuple[str, str]]:
    from cas.gitdir import worktrees_on

    return sorted(worktrees_on(gstore.common_dir, branch, gstore.main_workdir))


def _move_refs(
    gstore: GitStore,
    rstore: ReceiptStore,
    receipt: Receipt,
    parsed: Patch,
    message: str,
    staged: Staged,
    paths: list[str],
    token: int,
    args: CallArgs,
    lock_timeout: float,
    *,
    defer_sync: bool = False,
    before_libgit2: Callable[[], None] | None = None,
    before_swap: Callable[[str], None] | None = None,
) -> tuple[Receipt, Staged]:
    """Compare-and-swap the branch to the candidate (re-staging onto a moved head).

    ``defer_sync``: the move's folder syncs are left to the next batch
    (:meth:`GitStore.take_unsynced`).  ``before_libgit2``: see
    :meth:`GitStore.compare_and_swap`.  ``before_swap``: called with the
    candidate under the branch's lock, after the compare and the fence, before the move.

    Returns the receipt as last recorded (its base and candidate may have been
    re-staged) and the staged change that landed.

    Raises:
        Conflict: the branch moved and the patch no longer applies (rejected, retryable).
        RefLockedError: the branch's lock file is held (rejected, retryable).
        RefUpdateUnknown: the ref update failed half way (receipt ``unknown``).
        FencedOff: a newer attempt owns the key.
    """
    from patcher.stage import stage

    key, call_id = receipt.key, receipt.call_id
    base = (receipt.base or {}).get("commit")
    candidate = receipt.candidate
    assert candidate is not None
    rounds = 0

    def under_ref_lock() -> None:
        # The fence is checked again under the branch's ref lock: between the
        # caller's check and the swap this process may have been paused, its key
        # lock broken and the key taken over (then the ref must not move).
        _fence(rstore, key, token)
        if before_swap is not None:
            # Staged after the compare and the fence; only the reflog lines, the lock's
            # sync and the rename follow.  Later, a crash would leave the reflog naming
            # a candidate that never landed (cas.loose_refs writes it before the rename).
            assert candidate is not None
            try:
                before_swap(candidate)
            except OncepatchError as exc:  # an index could not be staged: nothing has moved
                raise _NotStaged(exc) from exc
            crash_point("after-index-ahead")

    while True:
        try:
            gstore.compare_and_swap(args.branch, base, candidate, f"oncepatch: {call_id}", lock_timeout=lock_timeout,
                                    precondition=under_ref_lock, defer_sync=defer_sync,
                                    before_libgit2=before_libgit2)
            break
        except _NotStaged as failed:
            err = failed.error
            err.effect_status = "not_applied"
            if isinstance(err, GitStoreError):  # an I/O failure, not the repository's state
                err.retryable, err.next_action = True, "retry"
            _reject(rstore, receipt.identity, call_id, key, receipt.args_sha256, receipt, args, err, base, candidate)
            raise err from None
        except RefMovedError as moved:
            rounds += 1
            new_base = moved.actual
            conflict: OncepatchError | None = None
            new_candidate: str | None = None
            if rounds > MAX_RESTAGE_ROUNDS:
                conflict = Conflict(
                    f"branch '{args.branch}' kept moving: gave up after {MAX_RESTAGE_ROUNDS} rounds",
                    details={"paths": paths},
                )
            elif args.check is not None:
                # A re-staged candidate is another tree than the one the check passed:
                # it must not land unchecked.  The retry checks the new head's candidate.
                conflict = Conflict(
                    f"branch '{args.branch}' moved to {str(new_base)[:12]} while --check ran on the "
                    f"candidate: nothing was moved; retry to check the change on the new head",
                    details={"paths": paths, "reason": "moved_during_check"},
                )
            else:
                try:
                    staged, new_candidate = stage(gstore, new_base, parsed, message)
                except PatchError as exc:
                    conflict = Conflict(
                        f"branch '{args.branch}' moved to {str(new_base)[:12]} and the patch no longer "
                        f"applies there: {exc.message}",
                        details={"paths": paths, "cause": exc.envelope()},
                    )
                else:
                    if new_candidate is None:
                        conflict = Conflict(
                            f"branch '{args.branch}' moved to {str(new_base)[:12]}, which already "
                            "contains this change", details={"paths": paths})
            if conflict is not None:
                _reject(rstore, receipt.identity, call_id, key, receipt.args_sha256, receipt, args, conflict,
                        base, candidate)
                raise conflict
            assert new_candidate is not None
            base, candidate = new_base, new_candidate
            receipt = receipt.evolve(base={"ref": args.branch, "commit": base}, candidate=candidate,
                                     outputs=staged.outputs)
            _fence(rstore, key, token)
            batch = DurableBatch()
            gstore.add_pending_to(batch)
            rstore.record(receipt, "restaged", batch=batch)
        except RefLockedError as exc:
            _reject(rstore, receipt.identity, call_id, key, receipt.args_sha256, receipt, args, exc, base,
                    candidate, retryable=True)
            raise
        except RefUpdateUnknown as exc:
            _record_unknown(rstore, receipt, exc)
            raise
    return receipt, staged


class _NotStaged(Exception):
    """An index could not be staged under the branch's lock (the ref was not moved)."""

    def __init__(self, error: OncepatchError) -> None:
        super().__init__(error.message)
        self.error = error


def _record_unknown(rstore: ReceiptStore, receipt: Receipt, exc: RefUpdateUnknown) -> None:
    """The branch may have moved and no one can tell yet: the receipt says ``unknown``."""
    rstore.record(receipt.evolve(status="unknown", error=exc.envelope()), "unknown")


def _fence(rstore: ReceiptStore, key: str, token: int) -> None:
    """The receipt on disk must still be this attempt's own ``prepared`` one; else another process took over.

    Races guarded: this process lost its key lock (stopped, lock file broken by
    hand, NFS) and resumes after another process took the key — with the next
    token, or by settling this attempt's receipt (``recover`` and the takeover in
    :func:`apply` keep the token and change the status).
    """
    if rstore.unchanged_since_written(key):
        return  # the bytes this process wrote last: its own prepared receipt
    current = rstore.read(key)
    if current is None:
        return
    if current.fencing_token != token:
        raise FencedOff(
            f"key '{key}' was taken over by attempt {current.fencing_token} (this is attempt {token})",
            key=key,
            details={"fencing_token": token, "current_token": current.fencing_token},
        )
    if current.status != "prepared":
        raise FencedOff(
            f"key '{key}' was settled as {current.status} by another process while attempt {token} ran",
            key=key,
            details={"fencing_token": token, "current_token": current.fencing_token,
                     "current_status": current.status},
        )


def _reject(
    rstore: ReceiptStore,
    identity: dict[str, Any],
    call_id: str,
    key: str,
    args_sha: str,
    previous: Receipt | None,
    args: CallArgs,
    err: OncepatchError,
    base: str | None,
    candidate: str | None,
    *,
    retryable: bool | None = None,
) -> None:
    """Record a rejection after staging (conflict, failed check, stale lock)."""
    envelope = err.with_key(key).envelope()
    if retryable is not None:
        envelope["retryable"] = retryable
    token = previous.fencing_token if previous is not None and previous.status == "prepared" else (
        (previous.fencing_token if previous is not None else 0) + 1)
    receipt = _new_receipt(identity, call_id, key, args_sha, previous, "rejected", token,
                           retryable=bool(envelope["retryable"]), base={"ref": args.branch, "commit": base},
                           candidate=candidate, error=envelope)
    if previous is not None and previous.status == "prepared":
        _fence(rstore, key, token)
    rstore.record(receipt, "rejected")


def _new_receipt(identity: dict[str, Any], call_id: str, key: str, args_sha: str, previous: Receipt | None,
                 status: Status, token: int, **fields: Any) -> Receipt:
    """A receipt of this call with ``status`` and ``token``, owned by this process, born with the key's first one."""
    now = now_iso()
    return Receipt(key=key, call_id=call_id, identity=identity, args_sha256=args_sha, tool=TOOL,
                   tool_version=TOOL_VERSION, status=status, fencing_token=token, owner=owner_info(),
                   created_at=previous.created_at if previous is not None else now, updated_at=now, **fields)


def _already_applied(
    rstore: ReceiptStore,
    identity: dict[str, Any],
    call_id: str,
    key: str,
    args_sha: str,
    previous: Receipt | None,
    args: CallArgs,
    staged: Staged,
) -> ApplyResult:
    """Every edit is already in the branch: committed, naming the commit that has it; no new commit."""
    receipt = _new_receipt(
        identity, call_id, key, args_sha, previous, "committed", (previous.fencing_token if previous else 0) + 1,
        base={"ref": args.branch, "commit": staged.base_commit}, candidate=None,
        commit=staged.base_commit, tree=staged.base_tree, outputs=staged.outputs,
        extra={"already_applied": True},
    )
    path = rstore.record(receipt, "committed", already_applied=True)
    return ApplyResult(key, call_id, "committed", False, staged.base_commit, staged.base_tree, staged.outputs,
                       path, already_applied=True)


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

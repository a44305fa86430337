"""Remote mode: a call's key claimed on a git remote through one atomic push (docs/REMOTE.md).

The same engine call as a local one (:class:`receipts.engine.Call`: the key's
lock, ``prepared`` with its fencing token, the fence, ``committed``); only
the branch's move differs: one ``git push --atomic`` that moves the remote's
branch by lease and creates the key's two refs, create-only, all or nothing.
:func:`execute_remote` runs the steps of docs/REMOTE.md, "How a call runs",
with the crash and pause points ``before-push`` and ``after-push``: a push
refused by a lease fetches again and answers from the remote or re-stages
(bounded); one that sent nothing is rejected, retryable; one whose answer
was lost leaves the effect unknown (recover asks the remote).

The local branch and worktrees are not moved: the remote's branch is the
target, ``git pull`` brings it (docs/REMOTE.md says why).  The refs, the fetch and
the push are :mod:`patcher.remote_refs`'s (the git adapter asks it too, for
``recover`` and ``verify``).
"""

from __future__ import annotations

import random
import time

from cas.crash import crash_hook, crash_point
from cas.durable import DurableBatch
from cas.errors import OncepatchError, RefUpdateUnknown
from receipts.engine import check_same_intent, pause_point
from receipts.environ import env_int
from receipts.errors import CorruptReceipt
from receipts.identity import key_hash
from receipts.receipt import Receipt
from patcher.errors import Conflict, PatchError
from patcher.evidence import KEY_REF_PREFIX
from patcher.execute import _check_candidate, _open, _reject, _Run
from patcher.grades import grade_warnings
from patcher.outcome import ApplyResult
from patcher.remote_mode import Remote
from patcher.remote_refs import (RemoteRejected, RemoteUnreachable, fetch, follow, push, read_remote_receipt,
                                 receipt_commit, remote_problems)
from patcher.stage import Staged, stage

__all__ = ["MAX_REMOTE_ROUNDS", "execute_remote"]

#: Re-stages onto a moved remote head before the call gives up with a conflict.  Higher than
#: the local bound: no turn-taking lock spans machines, so a loser may lose several rounds.
MAX_REMOTE_ROUNDS = env_int("ONCEPATCH_REMOTE_ROUNDS", 64)
#: The first wait after a lost lease is up to this long (then doubling, up to ``BACKOFF_MAX_S``).
BACKOFF_S = 0.01
BACKOFF_MAX_S = 0.1


def execute_remote(run: _Run) -> ApplyResult:
    """The remote-mode steps (module docstring), under the key's lock; ``run.args.remote`` is set.

    Raises:
        OncepatchError: as :func:`patcher.execute.locked_apply` (``_truthful`` builds the envelope).
    """
    args, call = run.args, run.call
    remote = args.remote
    assert remote is not None
    _open(run, None)
    gstore = run.gstore
    h = key_hash(run.key)
    head, key_commit, receipt_ref = fetch(gstore, remote, args.branch, h)
    if key_commit is not None or receipt_ref is not None:
        return _answer_from_remote(run, remote, head, key_commit, receipt_ref, restages=0)
    staged, candidate = stage(gstore, head, run.patch, run.message)
    if candidate is None:
        return _already_applied_remote(run, remote, staged)
    _check_candidate(run, head, candidate)
    crash_point("after-stage")
    gstore.flush_objects()
    extra_remote = {"name": remote.name, "url": remote.url, "local": args.where, "restages": 0}
    call.prepare(base={"ref": args.branch, "commit": head}, candidate=candidate, outputs=staged.outputs,
                 extra={"touched": run.paths, "grades": {k: list(v) for k, v in staged.grades.items()},
                        "remote": extra_remote})
    restages = 0
    while True:
        receipt = call.receipt
        assert receipt is not None and receipt.candidate is not None
        base = (receipt.base or {}).get("commit")
        candidate = receipt.candidate
        extra = {**receipt.extra, "remote": {**extra_remote, "restages": restages}}
        final = receipt.evolve(status="committed", error=None, retryable=None, commit=candidate, tree=staged.tree,
                               extra=extra)
        rcommit = receipt_commit(run.rstore, run.gstore, final)
        gstore.flush_objects()
        call.fence()
        if restages == 0:
            pause_point("before-push")  # (the first push only: a test moves the remote meanwhile)
        run.branch = "swapping"  # from here the remote's branch may have moved
        pushed = push(gstore, remote, args.branch, str(base), candidate, h, rcommit)
        if pushed.outcome == "pushed":
            run.branch = "moved"
            break
        if pushed.outcome == "unknown":
            raise RefUpdateUnknown(f"the push to remote '{remote.name}' failed once sent, and whether it landed "
                                   f"cannot be told here: {pushed.detail}; 'oncepatch recover' asks the remote",
                                   details={"remote": remote.name})
        run.branch = "untouched"
        if pushed.outcome == "unreachable":
            err = RemoteUnreachable(f"cannot push to remote '{remote.name}' ({remote.url}): {pushed.detail}",
                                    effect_status="not_applied", details={"remote": remote.name})
            _reject(run, err, base, candidate, retryable=True)
            raise err
        # Every ref refused: a lease (the remote moved, or the key was claimed meanwhile), or the server's
        # own reason.  The fetch tells: nothing moved there, so no lease was lost and a re-stage onto the
        # same head would only be refused again.
        _back_off(restages)
        head, key_commit, receipt_ref = fetch(gstore, remote, args.branch, h)
        if key_commit is not None or receipt_ref is not None:
            return _answer_from_remote(run, remote, head, key_commit, receipt_ref, restages=restages)
        if head == base:
            said = f" (the server said: {pushed.server})" if pushed.server else ""
            refused = RemoteRejected(f"remote '{remote.name}' ({remote.url}) refused the push: {pushed.detail}{said}; "
                                     f"no lease was lost (its branch and the key's refs are as the push expected "
                                     f"them) and nothing changed there; the same call lands once the server accepts "
                                     f"it", details={"remote": remote.name})
            _reject(run, refused, base, candidate)
            raise refused
        restages += 1
        staged = _restage_remote(run, head, restages)
    crash_point("after-push")
    pause_point("after-push")
    return _finalise_remote(run, remote, staged, final, rcommit, restages)


def _back_off(lost: int) -> None:
    """Wait a random while before fetching again after ``lost + 1`` lost leases in a row.

    Race guarded: the machine that just won starts its next call at once, half a
    round ahead of the loser, which learns of its loss only from its push's answer:
    locked in that phase, one call lost 60 rounds in a row (3 machines × 30 keys).
    A random wait, growing with the losses, shifts the loser's phase.
    """
    time.sleep(random.uniform(0, min(BACKOFF_S * (2 ** lost), BACKOFF_MAX_S)))


def _restage_remote(run: _Run, new_base: str | None, rounds: int) -> Staged:
    """The patch staged again on the remote's new head and recorded (``restaged``); else rejected.

    Raises:
        Conflict: too many rounds, a ``--check`` that ran on the old candidate, a patch
            that no longer applies or is already in the new head.
    """
    args = run.args
    name = args.remote.name if args.remote is not None else ""
    moved = f"branch '{args.branch}' of remote '{name}' moved to {str(new_base)[:12]}"
    conflict: Conflict | None = None
    staged, candidate = None, None
    if rounds > MAX_REMOTE_ROUNDS:
        conflict = Conflict(f"{moved} again: gave up after {MAX_REMOTE_ROUNDS} rounds", details={"paths": run.paths})
    elif args.check is not None:
        conflict = Conflict(f"{moved} while --check ran on the candidate: nothing was pushed; retry to check the "
                            f"change on the new head", details={"paths": run.paths, "reason": "moved_during_check"})
    else:
        try:
            staged, candidate = stage(run.gstore, new_base, run.patch, run.message)
        except PatchError as exc:
            conflict = Conflict(f"{moved} and the patch no longer applies there: {exc.message}",
                                details={"paths": run.paths, "cause": exc.envelope()})
        else:
            if candidate is None:
                conflict = Conflict(f"{moved}, which already contains this change", details={"paths": run.paths})
    if conflict is not None or staged is None or candidate is None:
        assert conflict is not None
        receipt = run.call.receipt
        assert receipt is not None
        _reject(run, conflict, (receipt.base or {}).get("commit"), receipt.candidate)
        raise conflict
    run.gstore.flush_objects()
    run.call.update("restaged", base={"ref": args.branch, "commit": new_base}, candidate=candidate,
                    outputs=staged.outputs)
    return staged

def _finalise_remote(run: _Run, remote: Remote, staged: Staged, final: Receipt, rcommit: str,
                     restages: int) -> ApplyResult:
    """After the push: the local refs follow, then the local key ref and ``committed``, one batch."""
    call, gstore = run.call, run.gstore
    h = key_hash(run.key)
    candidate = final.commit
    assert candidate is not None
    follow(gstore, remote, run.args.branch, h, candidate, rcommit)

    def add_key_ref(batch: DurableBatch) -> None:
        gstore.create_key_ref(KEY_REF_PREFIX + h, candidate, f"oncepatch: {call.call_id}")

    path = call.commit(before_replace=crash_hook("before-receipt-replace"), add_to_batch=add_key_ref,
                       event={"remote": remote.name, "restages": restages},
                       commit=candidate, tree=final.tree, extra=final.extra)
    return ApplyResult(run.key, call.call_id, "committed", False, candidate, final.tree, final.outputs, path,
                       warnings=tuple(grade_warnings(staged.grades)),
                       grades={p: list(g) for p, g in staged.grades.items()},
                       remote={"name": remote.name, "url": remote.url, "restages": restages})


def _answer_from_remote(run: _Run, remote: Remote, head: str | None, key_commit: str | None,
                        receipt_commit: str | None, *, restages: int) -> ApplyResult:
    """The key is claimed on the remote: a replay of its receipt (checked first), or a conflict.

    Raises:
        IdempotencyConflict: the remote's receipt is another call's.
        CorruptReceipt: the remote's refs or receipt contradict each other or git.
    """
    call, gstore = run.call, run.gstore
    h = key_hash(run.key)
    where = f"{remote.url}#{KEY_REF_PREFIX}{h}"
    if receipt_commit is None or key_commit is None:
        raise CorruptReceipt(where, "the remote has only one of the key's two refs (an atomic push makes both)",
                             key=run.key, next_action="none")
    theirs = read_remote_receipt(run.rstore, gstore, remote, h, receipt_commit)
    try:
        check_same_intent(theirs, call.args_sha256, run.key, call.identity)
    except OncepatchError as exc:
        if call.prepared:
            receipt = call.receipt
            assert receipt is not None
            exc.effect_status = "not_applied"
            _reject(run, exc, (receipt.base or {}).get("commit"), receipt.candidate)
        raise
    problems = remote_problems(gstore, theirs, key_commit, head)
    if problems:
        raise CorruptReceipt(where, "; ".join(problems), key=run.key, next_action="none",
                             details={"remote": remote.name})
    assert theirs.commit is not None
    follow(gstore, remote, run.args.branch, h, theirs.commit, receipt_commit)
    extra_remote = {"name": remote.name, "url": remote.url, "local": run.args.where, "restages": restages,
                    "answered_from_remote": True}
    extra = {**theirs.extra, "remote": extra_remote}

    def add_key_ref(batch: DurableBatch) -> None:
        gstore.create_key_ref(KEY_REF_PREFIX + h, str(theirs.commit), f"oncepatch: {call.call_id}")

    path = call.commit(add_to_batch=add_key_ref, event={"remote": remote.name, "answered_from_remote": True},
                       base=theirs.base, candidate=theirs.candidate, commit=theirs.commit, tree=theirs.tree,
                       outputs=theirs.outputs, extra=extra)
    return ApplyResult(run.key, call.call_id, "committed", True, theirs.commit, theirs.tree, theirs.outputs, path,
                       remote={"name": remote.name, "url": remote.url, "restages": restages,
                               "answered_from_remote": True})


def _already_applied_remote(run: _Run, remote: Remote, staged: Staged) -> ApplyResult:
    """The remote's branch already has every edit: committed locally, naming its commit; nothing pushed."""
    path = run.call.commit(
        event={"already_applied": True, "remote": remote.name},
        base={"ref": run.args.branch, "commit": staged.base_commit}, candidate=None,
        commit=staged.base_commit, tree=staged.base_tree, outputs=staged.outputs,
        extra={"already_applied": True, "remote": {"name": remote.name, "url": remote.url, "local": run.args.where,
                                                   "restages": 0}},
    )
    return ApplyResult(run.key, run.call.call_id, "committed", False, staged.base_commit, staged.base_tree,
                       staged.outputs, path, already_applied=True,
                       remote={"name": remote.name, "url": remote.url, "restages": 0})


# -- what the git adapter asks -------------------------------------------------------------------

"""Compensation for a git change (``oncepatch revert KEY --key NEW_KEY``; docs/LIFECYCLE.md, "revert").

Undoing a change is not a rollback: it is a new keyed effect with its own
receipt.  :func:`revert` reads the original key's committed receipt, takes
the inverse of its commit's diff (:func:`cas.revert.inverse_patch`: a
function of that commit alone, so a retry sends the same patch) and applies
it through the one apply path (:func:`patcher.protocol.apply`) under
``NEW_KEY``, strict (only exact hunks), with ``compensates: KEY`` in the
args.  So the same ``NEW_KEY`` and ``KEY`` replay, ``NEW_KEY`` with another
``KEY`` is an idempotency conflict, and a crash during it is recovered as any
call's.

Before the first attempt (no receipt for ``NEW_KEY`` yet) a three-way merge
(:func:`cas.revert.revert_conflicts`, as ``git revert``) tells whether later
commits touched the same lines: then a ``conflict`` error, nothing written.
"""

from __future__ import annotations

from typing import Any

from cas.errors import GitStoreError, UsageError
from cas.gitdir import discover
from cas.objects import open_store
from cas.revert import inverse_patch, revert_conflicts
from receipts.errors import ReceiptNotFound
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore
from patcher.args import TOOL, normalise_branch
from patcher.errors import Conflict
from patcher.outcome import ApplyResult
from patcher.protocol import Caller, apply, store_root_for

__all__ = ["revert"]


def revert(repo: str, key: str, *, new_key: str, store: str | None = None,
           lock_timeout: float = DEFAULT_LOCK_TIMEOUT, caller: Caller | None = None,
           _stores: dict[str, Any] | None = None) -> ApplyResult:
    """Apply the inverse of ``key``'s commit to its branch under ``new_key``, once (module docstring).

    Raises:
        ReceiptNotFound: ``key`` has no receipt (exit 2).
        UsageError: ``key`` is not a committed git change of its own (exit 2).
        Conflict: later commits changed the same lines (exit 4, nothing written).
        OncepatchError: as :func:`patcher.protocol.apply`.
    """
    stores: dict[str, Any] = {} if _stores is None else _stores
    layout = discover(repo)
    rstore = ReceiptStore(store_root_for(layout.common_dir, store))
    original = rstore.find(key)
    if original is None:
        raise ReceiptNotFound(f"no receipt for key '{key}': nothing to revert", key=new_key,
                              details={"compensates": key})
    if original.tool != TOOL or not original.commit or original.status != "committed":
        raise UsageError(f"key '{key}' is not a committed git change (tool '{original.tool}', status "
                         f"'{original.status}'): nothing to revert", key=new_key)
    if original.extra.get("already_applied"):
        raise UsageError(f"key '{key}' made no commit of its own (its edits were already on the branch at "
                         f"{original.commit[:12]}): nothing of it to revert", key=new_key)
    branch = str(original.args.get("branch") or "")
    gstore = open_store(layout.workdir or layout.git_dir, stores)
    try:
        patch = inverse_patch(gstore, original.commit)
        if rstore.read(new_key) is None:  # a first attempt; a retry replays or conflicts by its receipt
            head = gstore.resolve(normalise_branch(branch, layout))
            conflicts = revert_conflicts(gstore, original.commit, head) if head is not None else []
            if conflicts:
                raise Conflict(f"cannot revert key '{original.key}': later commits changed the same lines of "
                               f"{', '.join(repr(p) for p in conflicts)}", key=new_key, retryable=False,
                               effect_status="not_started", next_action="fix_input",
                               details={"paths": conflicts, "compensates": original.key})
    except GitStoreError as exc:
        raise UsageError(f"cannot revert key '{original.key}': {exc.message}", key=new_key) from exc
    return apply(repo, patch, key=new_key, branch=branch, format="unified", message=f"Revert {original.key}",
                 store=store, lock_timeout=lock_timeout, strict=True, caller=caller, compensates=original.key,
                 _stores=stores)

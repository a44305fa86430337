"""The ``apply_patch`` adapter: after a crash, ask git whether a call's commit landed.

:meth:`GitAdapter.query` (DESIGN.md section 5), for a ``prepared`` or
``unknown`` receipt, in order:

1. lock files the dead owner left in the middle of its ref update are
   removed — only when provably its own: ``<branch>.lock`` holding exactly the
   receipt's candidate oid, ``refs/oncepatch/keys/<h>.lock``;
2. the key ref points at the candidate → applied (the key ref is only created
   after the branch moved);
3. the candidate is reachable from the branch, or named in the branch's
   reflog (the branch moved on, or was reset since) → applied;
4. otherwise → not applied (``crashed_before_commit``).

A local git effect can always be queried, so this adapter never answers
``unknown``.  :meth:`GitAdapter.settle` then brings stale worktrees along and
creates a missing key ref.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from cas.crash import crash_hook, crash_point
from cas.errors import OncepatchError
from cas.gitdir import worktrees_on
from cas.objects import GitStore, TreeEntry
from receipts.adapter import QueryResult
from receipts.errors import StillUnknown
from receipts.identity import key_hash
from receipts.receipt import Receipt
from receipts.store import ReceiptStore
from patcher.args import TOOL

__all__ = ["GitAdapter", "KEY_REF_PREFIX"]

KEY_REF_PREFIX = "refs/oncepatch/keys/"


class GitAdapter:
    tool = TOOL

    def __init__(self, stores: dict[str, Any] | None = None) -> None:
        self._stores = stores if stores is not None else {}

    def _store(self, receipt: Receipt) -> GitStore:
        from patcher.protocol import open_store

        return open_store(str(receipt.args.get("repo")), self._stores)

    # -- query -------------------------------------------------------------------

    def _remove_own_stale_locks(self, gstore: GitStore, receipt: Receipt, notes: list[str]) -> None:
        branch = str((receipt.base or {}).get("ref") or receipt.args.get("branch"))
        candidate = receipt.candidate or ""
        lock = os.path.join(gstore.common_dir, branch + ".lock")
        with contextlib.suppress(FileNotFoundError):
            with open(lock, "rb") as fh:
                content = fh.read().strip().decode("ascii", "replace")
            if candidate and content == candidate:
                os.unlink(lock)
                notes.append(f"removed stale '{lock}' left by the crashed call")
        key_lock = os.path.join(gstore.common_dir, KEY_REF_PREFIX + key_hash(receipt.key) + ".lock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(key_lock)
            notes.append(f"removed stale '{key_lock}' left by the crashed call")

    def query(self, receipt: Receipt) -> QueryResult:
        candidate = receipt.candidate
        if not candidate:
            return QueryResult("not_applied", "crashed_before_commit")
        gstore = self._store(receipt)
        notes: list[str] = []
        self._remove_own_stale_locks(gstore, receipt, notes)
        branch = str((receipt.base or {}).get("ref") or receipt.args.get("branch"))
        key_ref = KEY_REF_PREFIX + key_hash(receipt.key)
        if gstore.resolve(key_ref) == candidate:
            return QueryResult("applied", "key_ref", {"notes": notes})
        if gstore.has_object(candidate):
            tip = gstore.resolve(branch)
            if tip is not None and gstore.is_ancestor(candidate, tip):
                return QueryResult("applied", "reachable_from_branch", {"notes": notes})
            if gstore.reflog_names(branch, candidate):
                return QueryResult("applied", "named_in_reflog", {"notes": notes})
        return QueryResult("not_applied", "crashed_before_commit", {"notes": notes})

    # -- settle ------------------------------------------------------------------

    def settle(self, receipt: Receipt, rstore: ReceiptStore | None = None) -> list[str]:
        """Create a missing key ref; bring worktrees whose touched paths still show the base."""
        from cas.worktree import materialise

        done: list[str] = []
        gstore = self._store(receipt)
        candidate = receipt.commit or receipt.candidate
        if not candidate:
            return done
        key_ref = KEY_REF_PREFIX + key_hash(receipt.key)
        if gstore.resolve(key_ref) is None:
            gstore.create_key_ref(key_ref, candidate, f"oncepatch recover: {receipt.call_id}")
            done.append(f"created '{key_ref}'")
        branch = str((receipt.base or {}).get("ref") or receipt.args.get("branch"))
        tip = gstore.resolve(branch)
        if tip is None:
            return done
        touched = [str(p) for p in receipt.extra.get("touched", [])] or [
            str(o["path"]) for o in receipt.outputs
        ]
        base_commit = (receipt.base or {}).get("commit")
        base_tree = gstore.commit_tree(base_commit) if base_commit else None
        tip_tree = gstore.commit_tree(tip)
        for workdir, _gd in worktrees_on(gstore.common_dir, branch):
            stale: dict[str, TreeEntry | None] = {}
            left: list[str] = []
            for path in touched:
                want = gstore.lookup_path(tip_tree, path).entry
                was = gstore.lookup_path(base_tree, path).entry if base_tree else None
                if _matches(gstore, workdir, path, want) and _index_matches(workdir, path, want):
                    continue
                if _matches_any(gstore, workdir, path, (was, want)) and _index_any(workdir, path, (was, want)):
                    stale[path] = want
                else:
                    left.append(path)
            if stale:
                marker = None
                if rstore is not None:
                    os.makedirs(rstore.tmp_dir, exist_ok=True)
                    marker = os.path.join(rstore.tmp_dir, f"index-lock-{key_hash(receipt.key)}")
                materialise(gstore, workdir, stale, lock_marker=marker)
                done.append(f"materialised {len(stale)} path(s) in '{workdir}'")
            if left:
                done.append(f"left {len(left)} path(s) in '{workdir}' alone: changed since the crash")
        return done

    # -- resolve (used under the key lock) ---------------------------------------------

    def resolve(self, rstore: ReceiptStore, receipt: Receipt) -> Receipt:
        """Settle a ``prepared``/``unknown`` receipt whose owner is gone; return the new receipt.

        Caller holds the key's lock.

        Raises:
            StillUnknown: the adapter cannot tell (never for git).
        """
        result = self.query(receipt)
        crash_point("recover-after-resolve")
        if result.status == "applied":
            gstore = self._store(receipt)
            commit = receipt.candidate
            assert commit is not None
            new = receipt.evolve(status="committed", commit=commit, tree=gstore.commit_tree(commit), error=None,
                                 extra={**receipt.extra, "recovered": result.reason})
            try:
                notes = self.settle(new, rstore)
            except OncepatchError as exc:
                notes = [f"worktree not updated: {exc.message}"]
            if notes:
                new = new.evolve(extra={**new.extra, "recovery_notes": notes})
            rstore.write(new, before_replace=crash_hook("recover-before-receipt-replace"))  # type: ignore[arg-type]
            rstore.ledger.append_receipt_event("recovered", new, reason=result.reason)
            return new
        if result.status == "not_applied":
            err = {
                "type": "crashed_before_commit",
                "message": "the call stopped before its commit landed; a retry executes it once",
                "retryable": True,
                "effect_status": "not_applied",
                "key": receipt.key,
                "next_action": "retry",
            }
            new = receipt.evolve(status="rejected", retryable=True, error=err,
                                 extra={**receipt.extra, "recovered": result.reason})
            rstore.write(new, before_replace=crash_hook("recover-before-receipt-replace"))  # type: ignore[arg-type]
            rstore.ledger.append_receipt_event("recovered", new, reason=result.reason)
            return new
        raise StillUnknown(f"outcome of key '{receipt.key}' cannot be told: {result.reason}", key=receipt.key)


def _matches(gstore: GitStore, workdir: str, path: str, entry: TreeEntry | None) -> bool:
    from cas.worktree import worktree_files_match

    return worktree_files_match(gstore, workdir, {path: entry})


def _matches_any(gstore: GitStore, workdir: str, path: str, entries: tuple[TreeEntry | None, ...]) -> bool:
    return any(_matches(gstore, workdir, path, e) for e in entries)


def _index_matches(workdir: str, path: str, entry: TreeEntry | None) -> bool:
    from cas.worktree import index_matches

    return index_matches(workdir, {path: entry})


def _index_any(workdir: str, path: str, entries: tuple[TreeEntry | None, ...]) -> bool:
    return any(_index_matches(workdir, path, e) for e in entries)

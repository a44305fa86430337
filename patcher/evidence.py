"""What git holds for a committed ``apply_patch`` receipt: whether it is believed (docs/DESIGN.md section 3).

A receipt's digests prove only that nobody edited it without re-sealing it;
whoever can write the store can re-seal.  So a ``committed`` receipt is
believed only where git agrees (:func:`contradictions`): its commit, the
call's trailer, the key ref, the branch, the tree and every output, as
docs/DESIGN.md section 3 lists them, with the rule for an
``already_applied`` receipt (someone else's commit: no trailer nor key ref
asked of it) and the replay's cheap form (``cheap=True``: a key ref at the
commit stands for "on the branch", no walk of the history).
A missing key ref contradicts the receipt in both forms, but for a receipt
that records its follow-up as not done (``warnings``: ``recover`` settled the
call and could not create the key ref, a full disk): it is believed where the
commit is on the branch (the history is walked), and the next ``recover``
creates the ref.
"""

from __future__ import annotations

import hashlib
import os

import pygit2

from cas.objects import GitStore
from cas.refs import KEY_REF_PREFIX
from receipts.identity import key_hash
from receipts.receipt import Receipt

__all__ = ["BranchHistory", "KEY_REF_PREFIX", "contradictions", "trailer_problems"]

_DIR_MODE = 0o040000


class BranchHistory:
    """One branch's commits, walked from its tip once and only as far as asked, and its reflog.

    Kept for a whole verification: receipts of one branch, checked one after
    another, share one walk of its history (each its own walk would be
    quadratic in the number of calls).
    """

    def __init__(self, gstore: GitStore, branch: str) -> None:
        self._gstore = gstore
        self.branch = branch
        self.tip = gstore.resolve(branch)
        self._seen: set[bytes] = set()
        self._walk: pygit2.Walker | None = None
        self._done = self.tip is None
        self._reflog: frozenset[str] | None = None

    def reaches(self, commit: str) -> bool:
        """Whether ``commit`` is the tip or reachable from it."""
        if self.tip is None:
            return False
        try:
            raw = pygit2.Oid(hex=commit).raw
        except ValueError:
            return False
        if raw in self._seen or commit == self.tip:
            return True
        if self._done:
            return False
        try:
            if self._walk is None:
                self._walk = self._gstore.repo.walk(pygit2.Oid(hex=self.tip), pygit2.enums.SortMode.NONE)
            for found in self._walk:
                self._seen.add(found.id.raw)
                if found.id.raw == raw:
                    return True
        except (pygit2.GitError, KeyError, ValueError):
            pass  # a tip or history with a missing commit (pruned, shallow): what was walked is what is known
        self._done = True
        return False

    def refresh(self) -> bool:
        """Follow the branch to where it is now (a call may have moved it since); whether it moved.

        What was walked stays known: those commits were on the branch.
        """
        tip = self._gstore.resolve(self.branch)
        self._reflog = None
        if tip == self.tip:
            return False
        self.tip, self._walk, self._done = tip, None, tip is None
        return True

    def logged(self, commit: str) -> bool:
        """Whether the branch's reflog names ``commit`` (moved to it or away from it)."""
        if self._reflog is None:
            found: set[str] = set()
            try:
                with open(os.path.join(self._gstore.common_dir, "logs", *self.branch.split("/")), "rb") as fh:
                    for line in fh:
                        parts = line.split(b" ", 2)
                        found.update(p.decode("ascii", "replace") for p in parts[:2])
            except (FileNotFoundError, NotADirectoryError):
                pass
            self._reflog = frozenset(found)
        return commit in self._reflog


def trailer_problems(message: bytes, receipt: Receipt) -> list[str]:
    """Why ``message`` is not the commit message of ``receipt``'s call (its trailers), or ``[]``."""
    text = message.decode("utf-8", "replace").rstrip("\n")
    block = text.rsplit("\n\n", 1)[-1].splitlines() if "\n\n" in text else []
    calls = [line.split(":", 1)[1].strip() for line in block if line.startswith("Oncepatch-Call:")]
    keys = [line.split(":", 1)[1].strip() for line in block if line.startswith("Oncepatch-Key:")]
    if calls != [receipt.call_id]:
        return [f"commit {receipt.commit} does not carry this call's trailer 'Oncepatch-Call: {receipt.call_id}'"
                + (f" (it names {', '.join(repr(c) for c in calls)})" if calls else "")]
    if keys and keys != [key_hash(receipt.key)]:
        return [f"commit {receipt.commit}'s trailer 'Oncepatch-Key' names another key"]
    return []


def contradictions(gstore: GitStore, receipt: Receipt, *, cheap: bool = False,
                   history: BranchHistory | None = None) -> list[str]:
    """What git holds that contradicts the committed ``receipt`` (the module docstring); ``[]`` when it agrees.

    ``history``: the branch's, when the caller keeps one across receipts.
    """
    commit = receipt.commit
    if not commit:
        return ["committed receipt names no commit"]
    try:
        found = gstore.repo.get(pygit2.Oid(hex=commit))
    except (ValueError, pygit2.GitError) as exc:
        return [f"commit {commit} is unreadable: {exc}"]
    if found is None:
        return [f"commit {commit} does not exist"]
    if not isinstance(found, pygit2.Commit):
        return [f"{commit} is not a commit"]
    already = bool(receipt.extra.get("already_applied"))
    problems = [] if already else trailer_problems(found.raw_message, receipt)
    key_ref = KEY_REF_PREFIX + key_hash(receipt.key)
    at = gstore.resolve(key_ref)
    branch = str(receipt.args.get("branch") or "")
    if receipt.base is not None and receipt.base.get("ref") not in (None, branch):
        problems.append(f"base ref '{receipt.base.get('ref')}' is not the call's branch '{branch}'")
    if at is not None and at != commit:
        problems.append(f"key ref '{key_ref}' points at {at[:12]}, not at {commit[:12]}")
    elif at is None and not already and not _follow_up_pending(receipt):
        # (The cheap form too: a replay answers only what status would show.)
        problems.append(f"key ref '{key_ref}' does not point at {commit[:12]}")
    if not (cheap and at == commit and not already):
        problems += _branch_problems(gstore, commit, branch, history, key_ref_agrees=at == commit and not already)
    tree = str(found.tree_id)
    if receipt.tree and receipt.tree != tree:
        problems.append(f"tree {receipt.tree[:12]} differs from commit's tree {tree[:12]}")
    return problems + _output_problems(gstore, receipt, commit, tree)


def _follow_up_pending(receipt: Receipt) -> bool:
    """Whether the receipt records that settling it left its follow-up (the key ref among it) not done.

    (:func:`receipts.engine.settle` writes the warning when the adapter's
    ``settle`` failed; ``recover`` runs it again for such a receipt.)
    """
    return any(str(w).startswith("follow-up not done") for w in receipt.extra.get("warnings") or ())


def _branch_problems(gstore: GitStore, commit: str, branch: str, history: BranchHistory | None, *,
                     key_ref_agrees: bool) -> list[str]:
    """Why ``commit`` is neither on ``branch`` nor in its reflog, or ``[]``."""
    if history is None or history.branch != branch:
        history = BranchHistory(gstore, branch)
    if history.tip is None:
        history.refresh()
    if history.tip is None:
        if key_ref_agrees:
            return []  # the branch was deleted (and its reflog with it): the key ref is what git keeps
        return [f"branch '{branch}' does not exist: commit {commit[:12]} cannot be shown to be on it"]
    if history.reaches(commit) or history.logged(commit):
        return []
    # Race guarded: verify beside running calls (a pre-commit hook) keeps one walk for all
    # receipts; a call that moved the branch since is seen by looking again.
    history.refresh()
    if history.reaches(commit) or history.logged(commit):
        return []
    return [f"commit {commit[:12]} is not on branch '{branch}' (nor in its reflog)"]


def _output_problems(gstore: GitStore, receipt: Receipt, commit: str, tree: str) -> list[str]:
    """Each output of ``receipt`` whose blob, mode or digest differs from ``tree``'s."""
    problems: list[str] = []
    for out in receipt.outputs:
        path = str(out.get("path"))
        try:
            entry = gstore.lookup_path(tree, path).entry
        except Exception as exc:  # noqa: BLE001 - an unreadable tree is a verification failure
            problems.append(f"'{path}' cannot be read in {commit[:12]}: {exc}")
            continue
        if out.get("op") == "delete":
            # Gone, or given way to a folder of the same name.
            if entry is not None and entry.mode != _DIR_MODE:
                problems.append(f"'{path}' should be deleted in {commit[:12]} but exists")
            continue
        if entry is None:
            problems.append(f"'{path}' is missing from {commit[:12]}")
            continue
        if out.get("blob") and entry.oid != out.get("blob"):
            problems.append(f"'{path}' blob {entry.oid[:12]} differs from the receipt's {str(out.get('blob'))[:12]}")
            continue
        try:
            data = gstore.read_blob(entry.oid)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"'{path}' blob {entry.oid[:12]} is unreadable: {exc}")
            continue
        if hashlib.sha256(data).hexdigest() != out.get("sha256"):
            problems.append(f"'{path}' sha256 differs from the receipt's output digest")
        if out.get("mode") is not None and int(out["mode"]) != entry.mode:
            problems.append(f"'{path}' mode {entry.mode:o} differs from the receipt's {int(out['mode']):o}")
    return problems

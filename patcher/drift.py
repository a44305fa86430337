"""Is my change still there?  Every applied receipt's outputs against the branch head and the worktree.

``verify`` is about the receipts' own truth; ``drift`` is about what came
after.  The per-path states (``unchanged``, ``changed``, ``reverted``,
``gone``, ``dirty``, ``compensated``), which receipts count as applied and
what is skipped: docs/LIFECYCLE.md, "drift".  A commit's key is named from
its ``Oncepatch-Key`` trailer by this store's receipts, and by its ledger for
a key whose receipt ``oncepatch gc`` removed (``removed_by_gc: true``).
Reads only: nothing in the repository or the store changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pygit2

from cas.errors import OncepatchError
from cas.gitdir import worktrees_on
from cas.objects import GitStore, TreeEntry, open_store
from cas.worktree import worktree_files_match
from receipts.errors import CorruptLedger
from receipts.identity import key_hash
from receipts.receipt import Receipt
from receipts.store import ReceiptStore
from patcher.args import TOOL
from patcher.evidence import BranchHistory

__all__ = ["DriftReport", "drift", "NO_GIT_OUTPUTS", "UNCHECKED"]

DRIFTED = ("changed", "reverted", "gone", "dirty")
#: Not drift: a path undone on purpose by a compensating call (module docstring).
COMPENSATED = "compensated"


#: ``skipped[].kind``: a receipt of a tool without git outputs (nothing to compare: not drift, not a failure) ...
NO_GIT_OUTPUTS = "no_git_outputs"
#: ... or one that could not be checked (unreadable, its repository not openable): ``drift`` exits 6.
UNCHECKED = "unchecked"


@dataclass
class DriftReport:
    receipts: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    @property
    def drifted(self) -> list[dict[str, Any]]:
        return [r for r in self.receipts if r["state"] in DRIFTED]

    @property
    def unchecked(self) -> list[dict[str, str]]:
        """The skipped receipts that were not checked for want of a reading (not for having no git outputs)."""
        return [s for s in self.skipped if s.get("kind") != NO_GIT_OUTPUTS]

    def to_json(self) -> dict[str, Any]:
        return {"receipts": self.receipts, "drifted": len(self.drifted), "skipped": self.skipped,
                "unchecked": len(self.unchecked)}


def _trailers(message: str) -> dict[str, str]:
    text = message.rstrip("\n")
    block = text.rsplit("\n\n", 1)[-1].splitlines() if "\n\n" in text else []
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block)
            if k.startswith("Oncepatch-")}


def _entry(gstore: GitStore, tree: str | None, path: str) -> TreeEntry | None:
    return gstore.lookup_file(tree, path)


def _first_parent_chain(repo: pygit2.Repository, tip: str, stop: str) -> Iterator[pygit2.Commit]:
    """Commits from ``tip`` back along first parents, down to (not including) ``stop``."""
    commit = repo.get(tip)
    while isinstance(commit, pygit2.Commit) and str(commit.id) != stop:
        yield commit
        if not commit.parents:
            return
        commit = commit.parents[0]


def _last_change(gstore: GitStore, tip: str, since: str, path: str) -> pygit2.Commit | None:
    """The newest commit after ``since`` on ``tip``'s first-parent line that changed ``path``."""
    for commit in _first_parent_chain(gstore.repo, tip, since):
        parent = str(commit.parents[0].tree_id) if commit.parents else None
        if _entry(gstore, str(commit.tree_id), path) != _entry(gstore, parent, path):
            return commit
    return None


@dataclass
class _Keys:
    """What the store knows of keys: each key by its sha256, which keys gc removed, who compensates whom."""

    by_hash: dict[str, str] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    #: compensated key -> the keys of the calls that compensate it
    compensators: dict[str, set[str]] = field(default_factory=dict)

    def link(self, key: str, compensates: object) -> None:
        self.by_hash.setdefault(key_hash(key), key)
        if isinstance(compensates, str):
            self.compensators.setdefault(compensates, set()).add(key)


def _known_keys(rstore: ReceiptStore, receipts: list[Receipt]) -> _Keys:
    """The keys of ``receipts`` and of the ledger's events (a removed key is only there)."""
    keys = _Keys()
    for r in receipts:
        keys.link(r.key, r.args.get("compensates"))
    last: dict[str, str] = {}
    try:
        for e in rstore.ledger.events():
            k = e.get("key")
            if isinstance(k, str):
                keys.link(k, e.get("compensates"))
                last[k] = str(e.get("event"))
    except CorruptLedger:
        pass  # names from the receipts only: 'oncepatch verify' reports the ledger
    keys.removed = {k for k, kind in last.items() if kind == "removed"}
    return keys


def _who(commit: pygit2.Commit, keys: _Keys) -> dict[str, Any]:
    """Who made ``commit``: oncepatch (its trailers, the key named through ``keys``) or outside it."""
    trailers = _trailers(commit.message)
    out: dict[str, Any] = {"commit": str(commit.id), "subject": commit.message.split("\n", 1)[0]}
    if "Oncepatch-Call" in trailers or "Oncepatch-Key" in trailers:
        out["by"] = "oncepatch"
        out["key_sha256"] = trailers.get("Oncepatch-Key")
        out["call_id"] = trailers.get("Oncepatch-Call")
        out["key"] = keys.by_hash.get(out["key_sha256"] or "")
        if out["key"] in keys.removed:
            out["removed_by_gc"] = True
    else:
        out["by"] = "outside"
    return out


def _paths(gstore: GitStore, receipt: Receipt, commit: str) -> dict[str, TreeEntry | None]:
    """What the receipt's commit wrote: its outputs (a delete: ``None``), else the commit's own changes."""
    found: dict[str, TreeEntry | None] = {}
    if receipt.outputs:
        for out in receipt.outputs:
            blob = out.get("blob")
            found[str(out["path"])] = (TreeEntry(str(blob), int(out.get("mode") or 0o100644))
                                       if out.get("op") != "delete" and blob else None)
        return found
    c = gstore.repo.get(commit)
    assert isinstance(c, pygit2.Commit)
    parent_tree = c.parents[0].tree if c.parents else None
    diff = c.tree.diff_to_tree(parent_tree, swap=True) if parent_tree is not None else c.tree.diff_to_tree(swap=True)
    for delta in diff.deltas:
        for f in (delta.old_file, delta.new_file):
            found.setdefault(f.path, None)
    tree = str(c.tree_id)
    return {p: _entry(gstore, tree, p) for p in found}


@dataclass
class _Branch:
    """One branch, looked at once for all its receipts: one walk of its history (a walk per receipt is
    quadratic in the number of calls), its tip's tree, the worktrees that have it checked out."""

    history: BranchHistory
    tip_tree: str | None
    worktrees: list[str]


def _branch(gstore: GitStore, name: str, seen: dict[tuple[str, str], _Branch]) -> _Branch:
    found = seen.get((gstore.common_dir, name))
    if found is None:
        history = BranchHistory(gstore, name)
        found = seen[(gstore.common_dir, name)] = _Branch(
            history, gstore.commit_tree(history.tip) if history.tip is not None else None,
            [w for w, _g in worktrees_on(gstore.common_dir, name, gstore.main_workdir)])
    return found


def _applied_commit(gstore: GitStore, receipt: Receipt, branch: _Branch) -> tuple[str | None, str]:
    """The receipt's commit when its change is applied, and how that is known."""
    if receipt.status == "committed" and receipt.commit:
        return receipt.commit, "committed"
    if receipt.status in ("prepared", "unknown") and receipt.candidate:
        if gstore.has_object(receipt.candidate) and branch.history.reaches(receipt.candidate):
            return receipt.candidate, f"{receipt.status}, its candidate on the branch ('oncepatch recover' records it)"
    return None, receipt.status


def _one(gstore: GitStore, receipt: Receipt, keys: _Keys,
         branches: dict[tuple[str, str], _Branch]) -> dict[str, Any] | None:
    name = str((receipt.base or {}).get("ref") or receipt.args.get("branch"))
    named = receipt.extra.get("remote")
    if isinstance(named, dict) and named.get("name"):
        # Remote mode (docs/REMOTE.md) moved the remote's branch, not the local one: its
        # remote-tracking branch, as last fetched (drift reads; it fetches nothing).
        name = f"refs/remotes/{named['name']}/{name.removeprefix('refs/heads/')}"
    branch = _branch(gstore, name, branches)
    tip, tip_tree, worktrees = branch.history.tip, branch.tip_tree, branch.worktrees
    commit, known = _applied_commit(gstore, receipt, branch)
    if commit is None:
        return None
    row: dict[str, Any] = {"key": receipt.key, "status": receipt.status, "known": known, "commit": commit,
                           "branch": name, "paths": []}
    c = gstore.repo.get(commit)
    base_tree = str(c.parents[0].tree_id) if isinstance(c, pygit2.Commit) and c.parents else None
    on_branch = branch.history.reaches(commit)
    for path, want in sorted(_paths(gstore, receipt, commit).items()):
        head = _entry(gstore, tip_tree, path)
        item: dict[str, Any] = {"path": path}
        if not on_branch:
            item["state"] = "gone"
        elif head == want:
            item["state"] = "unchanged"
        else:
            assert tip is not None
            item["state"] = "reverted" if head == _entry(gstore, base_tree, path) else "changed"
            last = _last_change(gstore, tip, commit, path)
            if last is not None:
                item.update(_who(last, keys))
                if item.get("key") is not None and item["key"] in keys.compensators.get(receipt.key, ()):
                    item["state"], item["compensated_by"] = COMPENSATED, item["key"]
        dirty = [w for w in worktrees if not worktree_files_match(gstore, w, {path: head})]
        if dirty:
            item["dirty"] = dirty
            if item["state"] == "unchanged":
                item["state"] = "dirty"
        row["paths"].append(item)
    states = {p["state"] for p in row["paths"]}
    row["state"] = next((s for s in (*DRIFTED, COMPENSATED) if s in states), "unchanged")
    return row


def drift(rstore: ReceiptStore, stores: dict[str, GitStore] | None = None) -> DriftReport:
    """Every applied receipt of ``rstore`` against its branch and worktrees (module docstring)."""
    stores = stores if stores is not None else {}
    branches: dict[tuple[str, str], _Branch] = {}
    report = DriftReport()
    scanned = list(rstore.scan())
    keys = _known_keys(rstore, [i.receipt for i in scanned if i.receipt is not None])
    for item in scanned:
        receipt = item.receipt
        if receipt is None:
            report.skipped.append({"path": item.path, "kind": UNCHECKED,
                                   "reason": "corrupt receipt ('oncepatch verify' names it)"})
            continue
        if receipt.tool != TOOL:
            if receipt.status == "committed":
                report.skipped.append({"key": receipt.key, "kind": NO_GIT_OUTPUTS,
                                       "reason": f"tool '{receipt.tool}' has no git outputs"})
            continue
        try:
            named = receipt.extra.get("remote")  # remote mode: the identity's repo is the remote's URL
            where = named.get("local") if isinstance(named, dict) and named.get("local") else receipt.args.get("repo")
            gstore = open_store(str(where), stores)
            row = _one(gstore, receipt, keys, branches)
        except (OncepatchError, pygit2.GitError, KeyError, ValueError) as exc:
            report.skipped.append({"key": receipt.key, "kind": UNCHECKED, "reason": f"{type(exc).__name__}: {exc}"})
            continue
        if row is not None:
            report.receipts.append(row)
    report.receipts.sort(key=lambda r: r["key"])
    return report

"""The inverse of a commit (``oncepatch revert``): its patch, and whether it still applies on a branch head.

* :func:`inverse_patch` — the diff from a commit's tree back to its parent's
  (git's own text, binary hunks included), a function of the commit alone: a
  retry computes the same bytes, so the compensating call has one identity;
* :func:`revert_conflicts` — the paths a revert onto ``head`` would conflict
  on: a three-way merge of the trees with the commit as the base, the branch
  head as ours and the commit's parent as theirs, as ``git revert`` does
  (libgit2's ``merge_trees``).  Nothing is written.
"""

from __future__ import annotations

import pygit2

from cas.errors import GitStoreError
from cas.objects import GitStore

__all__ = ["inverse_patch", "revert_conflicts"]


def _commit_and_parent(gstore: GitStore, commit: str) -> tuple[pygit2.Commit, pygit2.Tree]:
    try:
        c = gstore.repo[commit].peel(pygit2.Commit)
    except (KeyError, ValueError, pygit2.GitError) as exc:
        raise GitStoreError(f"commit {commit[:12]} is not in the repository: {exc}") from exc
    if len(c.parents) > 1:
        raise GitStoreError(f"commit {commit[:12]} is a merge: oncepatch makes none, and reverts none")
    if not c.parents:
        raise GitStoreError(f"commit {commit[:12]} is a root commit: oncepatch makes none, and reverts none")
    return c, c.parents[0].tree


def inverse_patch(gstore: GitStore, commit: str) -> bytes:
    """The patch that undoes ``commit`` (from its tree to its parent's), as ``git diff --binary`` writes it.

    Raises:
        GitStoreError: the commit is missing or a merge.
    """
    c, parent_tree = _commit_and_parent(gstore, commit)
    diff = c.tree.diff_to_tree(parent_tree, flags=pygit2.enums.DiffOption.SHOW_BINARY)
    return (diff.patch or "").encode("utf-8", "surrogateescape")


def revert_conflicts(gstore: GitStore, commit: str, head: str) -> list[str]:
    """The paths where undoing ``commit`` on ``head`` conflicts with later changes (``[]``: it applies).

    Raises:
        GitStoreError: a commit is missing or a merge.
    """
    c, parent_tree = _commit_and_parent(gstore, commit)
    try:
        ours = gstore.repo[head].peel(pygit2.Tree)
    except (KeyError, ValueError, pygit2.GitError) as exc:
        raise GitStoreError(f"branch head {head[:12]} cannot be read: {exc}") from exc
    index = gstore.repo.merge_trees(c.tree, ours, parent_tree)
    if not index.conflicts:
        return []
    paths: set[str] = set()
    for entries in index.conflicts:
        paths.update(e.path for e in entries if e is not None)
    return sorted(paths)

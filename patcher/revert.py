"""Compensation for a git change (``oncepatch revert KEY --key NEW_KEY``; docs/LIFECYCLE.md, "revert").

Undoing a change is not a rollback: :func:`revert` applies the inverse of
``KEY``'s commit diff (:func:`cas.revert.inverse_patch`: a function of that
commit alone, so a retry sends the same patch) through the one apply path
(:func:`patcher.protocol.apply`) under ``NEW_KEY``, strict, with
``compensates: KEY`` in the args, after a three-way merge
(:func:`cas.revert.revert_conflicts`) found no later change to the same
lines.  The undo goes where the change went, or nowhere: the rules for the
repository, the remote and the branch are in docs/LIFECYCLE.md, "revert".
"""

from __future__ import annotations

import os
from typing import Any

from cas.errors import GitStoreError, UsageError, clip
from cas.gitdir import GitLayout, discover
from cas.objects import open_store
from cas.revert import inverse_patch, revert_conflicts
from receipts.errors import ReceiptNotFound
from receipts.identity import MAX_KEY_LEN
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore
from patcher.args import TOOL, normalise_branch, repository_path
from patcher.errors import Conflict
from patcher.outcome import ApplyResult
from patcher.protocol import Caller, apply, store_root_for
from patcher.remote_mode import resolve_remote

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
        raise ReceiptNotFound(f"no receipt for key '{clip(key)}': nothing to revert", key=new_key,
                              details={"compensates": clip(key, MAX_KEY_LEN)})
    if original.tool != TOOL or not original.commit or original.status != "committed":
        raise UsageError(f"key '{key}' is not a committed git change (tool '{original.tool}', status "
                         f"'{original.status}'): nothing to revert", key=new_key)
    if original.extra.get("already_applied"):
        raise UsageError(f"key '{key}' made no commit of its own (its edits were already on the branch at "
                         f"{original.commit[:12]}): nothing of it to revert", key=new_key)
    remote = _same_repository(layout, rstore, original, new_key)
    branch = str(original.args.get("branch") or "")
    gstore = open_store(layout.workdir or layout.git_dir, stores)
    try:
        patch = inverse_patch(gstore, original.commit)
        if rstore.read(new_key) is None:  # a first attempt; a retry replays or conflicts by its receipt
            ref = normalise_branch(branch, layout)
            if remote is not None:  # remote mode moves no local branch: the remote's, as last fetched
                ref = f"refs/remotes/{remote}/{ref[len('refs/heads/'):]}"
            head = gstore.resolve(ref)
            if head is None or not gstore.is_ancestor(original.commit, head):
                raise UsageError(f"cannot revert key '{original.key}': its commit {original.commit[:12]} is not on "
                                 f"{ref} (reset or rebased away{', or not fetched yet' if remote else ''}): "
                                 "nothing was done", key=new_key,
                                 details={"compensates": original.key, "commit": original.commit, "ref": ref})
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
                 remote=remote, _stores=stores)


def _store_home(rstore: ReceiptStore) -> str | None:
    """The git common dir a store lives in (the default ``<git-common-dir>/oncepatch``), else ``None``."""
    parent = os.path.realpath(os.path.dirname(rstore.root))
    if os.path.isfile(os.path.join(parent, "HEAD")) and os.path.isdir(os.path.join(parent, "objects")):
        return parent
    return None


def _same_repository(layout: GitLayout, rstore: ReceiptStore, original: Any, new_key: str) -> str | None:
    """The remote the compensation goes through (``None``: a local call); refuse another repository.

    Raises:
        UsageError: ``layout`` is not the repository ``original`` changed, a
            remote-mode original names no remote (or one that names another URL
            today), or a local-mode original meets a repository that now claims
            its keys on a remote (``oncepatch.remote``): nothing was done.
    """
    recorded = original.args.get("repo")
    named = original.extra.get("remote")
    remote_name = named.get("name") if isinstance(named, dict) else None
    if named is not None and not (isinstance(remote_name, str) and remote_name):
        raise UsageError(f"cannot revert key '{original.key}': its receipt claims it on a remote but names none "
                         "(its 'remote' field): nothing was done", key=new_key, details={"compensates": original.key})
    # The repository the original changed: the one the store lives in (the default store, moved or
    # copied with its repository, as the git adapter settles it), else the clone a remote-mode call
    # ran in, else the one its identity names.
    where = named.get("local") if isinstance(named, dict) else recorded
    theirs = _store_home(rstore)
    if theirs is not None:
        where = theirs
    elif isinstance(where, str) and where:
        try:
            theirs = discover(where).common_dir
        except Exception:  # (gone, moved, not a repository any more): not provably the same one
            theirs = None
    if theirs is None or os.path.realpath(theirs) != os.path.realpath(layout.common_dir):
        raise UsageError(f"cannot revert key '{original.key}' here: it changed the repository at '{where}', and "
                         f"'{repository_path(layout)}' is another one (git dir '{layout.common_dir}'): run revert "
                         "with --repo naming that repository; nothing was done", key=new_key,
                         details={"compensates": original.key, "repo": where})
    now = resolve_remote(layout, remote_name)  # remote_name None: oncepatch.remote of the config, if any
    if named is None:
        if now is None:
            return None
        raise UsageError(f"cannot revert key '{original.key}': its change was local, and this repository now claims "
                         f"keys on remote '{now.name}' (oncepatch.remote): unset it to revert the local change; "
                         "nothing was done", key=new_key, details={"compensates": original.key, "remote": now.name})
    if now is None or now.url != recorded:
        raise UsageError(f"cannot revert key '{original.key}': it was claimed on '{recorded}', and remote "
                         f"'{remote_name}' names '{now.url if now else None}' today: nothing was done",
                         key=new_key, details={"compensates": original.key, "remote": remote_name})
    return remote_name

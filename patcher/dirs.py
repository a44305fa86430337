"""Directory targets (``--dir PATH``): the git adapter on a bare object database, plus generations.

A directory target is a bare repository ``PATH.oncepatch/objects.git`` whose
``HEAD`` is ``refs/heads/generations`` and whose config names the folder
(``oncepatch.dir``).  A call to it *is* a git call (:mod:`patcher.execute`):
the same parsing, matching, staging, receipts, compare-and-swap on the
branch, key ref and recovery.  What is the directory's own is one step after
the branch moved (:func:`sync`: materialise the branch's tip as a generation
and switch ``PATH`` to it, :mod:`cas.generations`), run by the apply after its
worktrees' materialise step and by the git adapter's ``settle`` (so ``recover``
finishes a moved branch whose symlink was not switched), and one refusal
before anything is written (:func:`refuse_outside_edits`).  docs/DIRECTORIES.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import pygit2

from cas.crash import crash_point
from cas.errors import SHOWN_PATH_CHARS, GitStoreError, UsageError, clip
from cas.generations import (BRANCH, HOME_SUFFIX, LAYOUT_CONFIG, DirLayout, build, current_tree, foreign_entry,
                             digest_mismatches, generation_folders, is_real_folder, layout_of, leftovers, outside_edits,
                             remove_generation, remove_tree, switch, switch_lock, syncfs)
from cas.objects import GitStore, open_store
from receipts.identity import key_hash
from receipts.receipt import Receipt
from receipts.store import ReceiptStore
from patcher.errors import DirtyPath

__all__ = ["CONFIG", "target_of", "objects_of", "adoption_refusal", "adopt", "sync", "unfinished_switch",
           "refuse_outside_edits", "verify_dir", "generations", "rollback_patch", "prune_generations", "repair_leftovers"]

#: The git config key of a directory target's object database: the folder it manages.
CONFIG = "oncepatch.dir"

_targets: dict[str, DirLayout | None] = {}  # common dir -> its layout, or None (a plain repository)


def target_of(gstore: GitStore) -> DirLayout | None:
    """The directory target ``gstore`` is the object database of, or ``None`` for a plain repository."""
    key = gstore.common_dir
    if key not in _targets:
        try:
            value = gstore.repo.config[CONFIG]
        except (KeyError, pygit2.GitError):
            value = None
        _targets[key] = layout_of(str(value)) if value and gstore.repo.is_bare else None
    return _targets[key]


def objects_of(path: str) -> str:
    """The object database of the directory target ``path`` (what ``--dir`` hands to ``--repo``).

    Raises:
        UsageError: ``path`` was never adopted (``oncepatch init --dir``).
    """
    layout = layout_of(path)
    if not os.path.isdir(layout.objects):
        raise UsageError(f"'{clip(path, SHOWN_PATH_CHARS)}' is not a directory target: adopt it first with "
                         f"'oncepatch init --dir {clip(path, SHOWN_PATH_CHARS)}'")
    return layout.objects


# -- adopting a folder ---------------------------------------------------------------------------


def _tree_of_folder(repo: pygit2.Repository, folder: str) -> pygit2.Oid:
    tb = repo.TreeBuilder()
    with os.scandir(folder) as it:
        for entry in sorted(it, key=lambda e: e.name):
            full = os.path.join(folder, entry.name)
            if entry.is_symlink():
                tb.insert(entry.name, repo.create_blob(os.fsencode(os.readlink(full))), pygit2.enums.FileMode.LINK)
            elif entry.is_dir():
                sub = _tree_of_folder(repo, full)
                if len(repo[sub].peel(pygit2.Tree)):  # an empty folder is left out: git trees hold none
                    tb.insert(entry.name, sub, pygit2.enums.FileMode.TREE)
            elif entry.is_file():
                mode = (pygit2.enums.FileMode.BLOB_EXECUTABLE if os.stat(full).st_mode & 0o100
                        else pygit2.enums.FileMode.BLOB)
                tb.insert(entry.name, repo.create_blob_fromdisk(full), mode)
            else:
                raise UsageError(f"'{full}' is neither a file, a folder nor a symlink: a directory target "
                                 f"cannot hold it")
    return tb.write()


def _is_git_dir(folder: str) -> bool:
    """``folder`` is a git directory itself (``HEAD``, ``objects/`` and ``refs/``: a ``.git`` or a bare one)."""
    return (os.path.lexists(os.path.join(folder, "HEAD")) and os.path.isdir(os.path.join(folder, "objects"))
            and os.path.isdir(os.path.join(folder, "refs")))


def _is_store(folder: str) -> bool:
    """``folder`` is an oncepatch receipt store (``locks/`` beside ``receipts/`` or ``events.jsonl``)."""
    return os.path.isdir(os.path.join(folder, "locks")) and (
        os.path.isdir(os.path.join(folder, "receipts")) or os.path.lexists(os.path.join(folder, "events.jsonl")))


def _is_target_home(folder: str) -> bool:
    """``folder`` is a directory target's ``PATH.oncepatch`` (its object database inside)."""
    return folder.endswith(HOME_SUFFIX) and os.path.isdir(os.path.join(folder, "objects.git"))


def _what_it_is(folder: str) -> str | None:
    if os.path.basename(folder) == ".git" or _is_git_dir(folder):
        return "a git directory"
    if _is_store(folder):
        return "an oncepatch receipt store"
    if _is_target_home(folder):
        return "a directory target's own folder"
    return None


def adoption_refusal(path: str) -> str | None:
    """Why the folder ``path`` must not be adopted by ``init --dir``, or ``None``; reads only.

    Refused: ``/``, the home folder or a folder holding it; a folder that is,
    lies inside, or holds anywhere below a git directory (a ``.git`` entry of
    any kind, or a folder with ``HEAD``, ``objects/`` and ``refs/``), an
    oncepatch receipt store, or a directory target's ``PATH.oncepatch``.
    Adopting one would move it aside and put a read-only symlink in its place
    (git, a store or a target would then be written through a generation).
    Symlinks below are not followed (they are kept as links, not entered).
    """
    real = os.path.realpath(path)
    home = os.path.realpath(os.path.expanduser("~"))
    if real == "/":
        return "it is the root folder"
    if real == home or home.startswith(real.rstrip("/") + "/"):
        return "it is or holds the home folder"
    folder = real
    while True:
        what = _what_it_is(folder)
        if what is not None:
            return f"it is {what}" if folder == real else f"it lies inside {what} ('{folder}')"
        up = os.path.dirname(folder)
        if up == folder:
            break
        folder = up
    stack = [real]
    while stack:
        here = stack.pop()
        with os.scandir(here) as it:
            for entry in it:
                full = os.path.join(here, entry.name)
                if entry.name == ".git":
                    return f"it holds a git directory ('{full}')"
                if entry.is_dir(follow_symlinks=False):
                    what = _what_it_is(full)
                    if what is not None:
                        return f"it holds {what} ('{full}')"
                    stack.append(full)
    return None


def adopt(path: str, *, lock_timeout: float = 30.0, share_folders: bool = False) -> dict[str, Any]:
    """Adopt the folder ``path`` as generation one (``oncepatch init --dir``); return what was made.

    The folder's files become the first commit of ``refs/heads/generations``
    in a new bare object database; the generation is built; the original
    folder is moved to ``PATH.oncepatch/adopted`` (kept, never deleted) and
    ``PATH`` becomes the symlink.  Run again after a crash, it finishes.
    ``share_folders``: the shared layout (:mod:`cas.tree_folders`), recorded
    as ``oncepatch.layout = shared`` in the object database's config.

    A failure before the folder is moved aside (a fifo in it, a file it
    cannot read, the disk) removes ``PATH.oncepatch`` when this call made it:
    nothing is left changed.

    Raises:
        UsageError: ``path`` is no folder, or is a target already, or :func:`adoption_refusal`
            names why it must not be adopted (nothing is changed).
    """
    layout = layout_of(path)
    adopted_before = is_real_folder(layout.objects) and not is_real_folder(layout.path)
    if adopted_before:
        # A target already (or a crash between moving the folder aside and making the symlink): finish.
        gstore = open_store(layout.objects, None)
        if gstore.resolve(BRANCH) is not None:
            sync(gstore, layout, lock_timeout)
            return {"path": layout.path, "home": layout.home, "tree": current_tree(layout),
                    "commit": gstore.resolve(BRANCH), "adopted": False, "layout": _layout_name(layout)}
    if not is_real_folder(layout.path):
        raise UsageError(f"'{path}' is not a folder: 'oncepatch init --dir' adopts an existing folder")
    why = adoption_refusal(layout.path)
    if why is not None:
        raise UsageError(f"cannot adopt '{path}' as a directory target: {why}")
    if os.path.lexists(layout.home) and not is_real_folder(layout.home):
        raise UsageError(f"cannot adopt '{path}' as a directory target: '{layout.home}' is there and is no folder")
    made_home = not os.path.lexists(layout.home)
    if share_folders:
        layout = DirLayout(layout.path, shared=True)
    try:
        return _adopt(layout, lock_timeout, share_folders)
    except BaseException:
        if made_home and is_real_folder(layout.path):  # not moved aside yet: undo everything this call made
            remove_tree(layout.home)
        raise


def _adopt(layout: DirLayout, lock_timeout: float, share_folders: bool) -> dict[str, Any]:
    os.makedirs(layout.home, exist_ok=True)
    repo = pygit2.init_repository(layout.objects, bare=True, initial_head="generations")
    repo.config[CONFIG] = layout.path
    if share_folders:
        repo.config[LAYOUT_CONFIG] = "shared"
    tree_id = _tree_of_folder(repo, layout.path)
    gstore = open_store(layout.objects, None)
    gstore.read_identities()
    sig = gstore.default_signature("committer")
    author = gstore.default_signature("author")
    previous = gstore.resolve(BRANCH)
    parents = [] if previous is None else [previous]
    commit = repo.create_commit(None, pygit2.Signature(author.name, author.email),
                                pygit2.Signature(sig.name, sig.email),
                                f"oncepatch: adopt '{os.path.basename(layout.path)}' as generation one\n",
                                tree_id, parents)
    syncfs(layout.objects)  # (libgit2 wrote them without fsync: the ref must not name lost objects)
    repo.references.create(BRANCH, commit, force=True)
    with switch_lock(layout, lock_timeout):
        build(repo, layout, str(tree_id), None)
        aside = os.path.join(layout.home, "adopted")
        n = 1
        while os.path.lexists(aside):  # (adopted again after a crash before the symlink: the first kept)
            n += 1
            aside = os.path.join(layout.home, f"adopted-{n}")
        os.rename(layout.path, aside)
        switch(layout, str(tree_id))
    return {"path": layout.path, "home": layout.home, "tree": str(tree_id), "commit": str(commit), "adopted": True,
            "layout": _layout_name(layout)}


def _layout_name(layout: DirLayout) -> str:
    return "shared" if layout.shared else "whole"


# -- the step after the move --------------------------------------------------------------------


def sync(gstore: GitStore, layout: DirLayout, lock_timeout: float, warnings: list[str] | None = None) -> list[str]:
    """Bring ``PATH`` to the branch's tip: build its generation if missing, then switch; return what was done.

    ``warnings``: what a person should know is appended (and returned with the
    rest): entries of the generation shown that were changed outside
    oncepatch after the apply's check, whose edits the new generation does
    not carry (it holds the tree's bytes; the edit stays in the old one).

    The tip, not a call's own candidate: a later call that landed first is
    not rolled back.  Under ``switch.lock``, so switches follow the branch's
    order.  Crash point ``after-generation``: built, not switched.

    Raises:
        GitStoreError: the lock stayed held, or the disk failed (nothing switched).
    """
    try:
        with switch_lock(layout, lock_timeout):
            tip = gstore.resolve(BRANCH)
            if tip is None:
                return []
            tree = gstore.commit_tree(tip)
            current = current_tree(layout)
            if current == tree and is_real_folder(layout.generation(tree)) and os.path.lexists(
                    os.path.join(layout.manifests, tree)):
                # Shown already.  Its content is not compared here: an edit to the generation
                # in use is the refusal's and verify's to report, not this step's to hide.
                return []
            repo = pygit2.Repository(layout.objects)
            moved: list[str] = []
            replaced: list[str] = []
            built = build(repo, layout, tree, current, moved_aside=moved, replaced=replaced)
            crash_point("after-generation")
            switch(layout, tree)
    except (OSError, TimeoutError) as exc:
        raise GitStoreError(f"cannot switch '{layout.path}' to the branch's tip: {exc}") from exc
    edits = [f"'{p}' of generation {(current or '')[:12]} was changed outside oncepatch during the call: generation "
             f"{tree[:12]} holds the tree's bytes, the edit stays in generation {(current or '')[:12]}'s folder "
             f"until gc" for p in sorted(replaced)]
    if warnings is not None:
        warnings.extend(edits)
    return [f"moved '{m}' aside: it was under generation {tree[:12]}'s name and is not what oncepatch built"
            for m in moved] + edits + [f"{'built and ' if built else ''}switched '{layout.path}' to generation "
                                       f"{tree[:12]}"]


def unfinished_switch(gstore: GitStore, layout: DirLayout) -> list[str]:
    """Why ``PATH`` is not at the branch's tip (a switch left undone, its generation's folder gone), or ``[]``.

    Read-only: what :func:`sync` would do (``watch`` flags it; ``recover --dir`` does it).
    """
    tip = gstore.resolve(BRANCH)
    if tip is None:
        return []
    tree = gstore.commit_tree(tip)
    shows = current_tree(layout)
    if shows == tree and is_real_folder(layout.generation(tree)):
        return []
    what = ("no generation" if shows is None else f"generation {shows[:12]}, whose folder is gone"
            if shows == tree else f"generation {shows[:12]}")
    return [f"'{layout.path}' shows {what}; the branch's tip is generation {tree[:12]}: run "
            f"'oncepatch recover --dir {layout.path}'"]


def refuse_outside_edits(gstore: GitStore, paths: Iterable[str] | None = None) -> None:
    """Refuse a call on a directory target whose current generation was written to outside oncepatch.

    ``paths``: the paths the call touches.  A whole generation (the default
    layout) is compared whole; a shared one only in the folders those paths
    run through (:func:`cas.tree_folders.outside_edits`: what the build links
    from), so the check costs the change, not the folder.

    Raises:
        DirtyPath: a path of the current generation differs from what was built
            (exit 4, not retryable: a retry would meet it again; nothing written).
    """
    layout = target_of(gstore)
    if layout is None:
        return
    tree = current_tree(layout)
    if tree is None:
        what = foreign_entry(layout)
        if what is not None:
            raise UsageError(f"'{layout.path}' was replaced by {what}: it is no longer the directory target")
        return  # never switched yet (a crash during init): the sync after the move makes it
    gen = layout.generation(tree)
    if os.path.lexists(gen) and not is_real_folder(gen):
        raise DirtyPath(f"generation {tree[:12]}, which '{layout.path}' shows, is not a folder oncepatch built "
                        f"(a symlink or a file was put in its place): 'oncepatch recover --dir {layout.path}' "
                        f"moves it aside and builds it again", retryable=False, next_action="recover",
                        details={"reason": "generation_replaced", "generation": tree})
    edited = outside_edits(layout, tree, None if paths is None else list(paths))
    if edited == ["(no folder)"]:
        raise DirtyPath(f"the folder of generation {tree[:12]}, which '{layout.path}' shows, is gone: "
                        f"'oncepatch recover --dir {layout.path}' builds it again", retryable=False,
                        next_action="recover", details={"reason": "generation_missing", "generation": tree})
    if edited:
        raise DirtyPath(
            f"'{edited[0]}' in '{layout.path}' (generation {tree[:12]}) was changed outside oncepatch"
            f"{f' (and {len(edited) - 1} more)' if len(edited) > 1 else ''}: no receipt describes that content; "
            f"'oncepatch verify --dir {layout.path}' lists the paths; undo the edits, or make them a patch",
            retryable=False, next_action="fix_input",
            details={"paths": edited[:100], "reason": "edited_outside", "generation": tree})


def verify_dir(path: str) -> list[str]:
    """``verify --dir``: what is wrong with the directory target (the symlink, the current generation's bytes)."""
    layout = layout_of(path)
    gstore = open_store(layout.objects, None)
    problems: list[str] = []
    tip = gstore.resolve(BRANCH)
    tree = current_tree(layout)
    if tip is None:
        return [f"'{BRANCH}' does not exist in '{layout.objects}'"]
    if tree is None:
        return [f"'{layout.path}' is not a symlink to one of its generations"]
    if not is_real_folder(layout.generation(tree)):
        if os.path.lexists(layout.generation(tree)):
            return [f"generation {tree[:12]} is not a folder oncepatch built (a symlink or a file is in its place): "
                    f"'oncepatch recover --dir {layout.path}' moves it aside and builds it again"]
        return [f"generation {tree[:12]}'s folder is gone: 'oncepatch recover --dir {layout.path}' builds it again"]
    if tree != gstore.commit_tree(tip):
        problems.append(f"'{layout.path}' shows generation {tree[:12]}, the branch's tip is "
                        f"{gstore.commit_tree(tip)[:12]}: run 'oncepatch recover --dir {layout.path}'")
    repo = pygit2.Repository(layout.objects)
    for p in digest_mismatches(repo, layout, tree):
        problems.append(f"'{p}' in generation {tree[:12]} differs from the tree (changed outside oncepatch)")
    for p in outside_edits(layout, tree):
        if p.endswith("/") or p == "(no manifest)":  # (a file's edit is named by the byte comparison above)
            problems.append(f"'{p}' in generation {tree[:12]} was changed outside oncepatch")
    return problems


def repair_leftovers(path: str, *, dry_run: bool) -> list[str]:
    """``recover --dir``: finish a moved branch whose symlink was not switched; remove dead builds' leftovers."""
    layout = layout_of(path)
    notes = [f"removed '{p}' left by a crashed call" for p in leftovers(layout, remove=not dry_run)]
    if dry_run:
        gstore = open_store(layout.objects, None)
        tip = gstore.resolve(BRANCH)
        if tip is not None and current_tree(layout) != gstore.commit_tree(tip):
            notes.append(f"would switch '{layout.path}' to generation {gstore.commit_tree(tip)[:12]}")
        return notes + _repair_shared(layout, dry_run=True)
    return notes + sync(open_store(layout.objects, None), layout, 30.0) + _repair_shared(layout, dry_run=False)


def _repair_shared(layout: DirLayout, *, dry_run: bool) -> list[str]:
    """The shared layout: build again the tree folders the current generation links to and that are gone."""
    tree = current_tree(layout)
    if not layout.shared or tree is None or not is_real_folder(layout.generation(tree)):
        return []
    from cas.tree_folders import repair

    repo = pygit2.Repository(layout.objects)
    if dry_run:
        found = repair(repo, layout, tree, dry_run=True)
    else:
        with switch_lock(layout, 30.0):
            found = repair(repo, layout, tree)
    verb = "would build" if dry_run else "built"
    return [f"{verb} again tree folder {t[:12]} of generation {tree[:12]}: it was gone or not what oncepatch built"
            for t in found]


# -- history, rollback, retention ---------------------------------------------------------------


def _keys_by_hash(rstore: ReceiptStore) -> dict[str, str]:
    out: dict[str, str] = {}
    for stored in rstore.scan():
        receipt = getattr(stored, "receipt", None)
        if receipt is not None:
            out[key_hash(receipt.key)] = receipt.key
    return out


def generations(path: str, rstore: ReceiptStore) -> list[dict[str, Any]]:
    """The branch's commits, newest first: generation (tree), commit, key, when, current, materialised."""
    layout = layout_of(path)
    repo = pygit2.Repository(layout.objects)
    tip = repo.references.get(BRANCH)
    if tip is None:
        return []
    keys = _keys_by_hash(rstore)
    current = current_tree(layout)
    folders = set(generation_folders(layout))
    out: list[dict[str, Any]] = []
    marked = False
    for commit in repo.walk(tip.target, pygit2.enums.SortMode.TOPOLOGICAL):
        h = next((line.split(":", 1)[1].strip() for line in commit.message.splitlines()
                  if line.startswith("Oncepatch-Key:")), None)
        tree = str(commit.tree_id)
        is_current = not marked and tree == current
        marked = marked or is_current
        out.append({"generation": tree, "commit": str(commit.id), "key": keys.get(h or "", None) if h else None,
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(commit.commit_time)),
                    "subject": commit.message.split("\n", 1)[0], "current": is_current,
                    "materialised": tree in folders})
    return out


def rollback_patch(path: str, to: str, *, base: str | None = None) -> tuple[bytes, str]:
    """The patch that turns the branch's tip (or commit ``base``) into generation ``to`` (a git diff, binary
    included), and ``to``'s full id.

    Raises:
        UsageError: ``to`` names no generation (tree) of the branch's history.
    """
    layout = layout_of(path)
    repo = pygit2.Repository(layout.objects)
    tip = repo.references.get(BRANCH)
    if tip is None:
        raise UsageError(f"'{path}' has no generation yet")
    found = None
    for commit in repo.walk(tip.target, pygit2.enums.SortMode.TOPOLOGICAL):
        if str(commit.tree_id).startswith(to.lower()) or str(commit.id).startswith(to.lower()):
            found = str(commit.tree_id)
            break
    if found is None or len(to) < 4:
        raise UsageError(f"'{to}' names no generation of '{path}': 'oncepatch log --dir {path}' lists them")
    head_tree = repo[base if base is not None else tip.target].peel(pygit2.Tree)
    diff = head_tree.diff_to_tree(repo[found].peel(pygit2.Tree), flags=pygit2.enums.DiffOption.SHOW_BINARY)
    return (diff.patch or "").encode("utf-8", "surrogateescape"), found


def prune_generations(path: str, rstore: ReceiptStore, *, dry_run: bool = False,
                      kept: Iterable[Receipt] | None = None) -> list[str]:
    """Remove the generation folders nothing needs; return their trees.

    Kept: the current one (the symlink's), the branch tip's, the one each
    remaining receipt made (its ``tree``: while the receipt stays, its
    generation stays materialised), and those of live calls (a ``prepared`` or
    ``unknown`` receipt's base and candidate trees).  ``kept``: the receipts
    that remain (``gc --policy``: those its plan keeps; a dry run's removals are
    not gone yet); ``None``: every receipt of the store.  A removed folder is
    only a materialisation: its content stays in the object database, and a
    rollback to it builds it again.  ``.tmp-`` builds of gone processes are
    removed as well (not listed).
    """
    layout = layout_of(path)
    gstore = open_store(layout.objects, None)
    named: set[str | None] = set()
    remaining = kept if kept is not None else (s.receipt for s in rstore.scan() if s.receipt is not None)
    for receipt in remaining:
        named.add(receipt.tree)
        if receipt.status not in ("prepared", "unknown"):
            continue
        for commit in ((receipt.base or {}).get("commit"), receipt.candidate):
            if commit:
                try:
                    named.add(gstore.commit_tree(commit))
                except Exception:  # noqa: BLE001 - a candidate never written: no folder of it
                    pass

    def unneeded() -> list[str]:
        keep = named | {current_tree(layout)}
        tip = gstore.resolve(BRANCH)
        if tip is not None:
            keep.add(gstore.commit_tree(tip))
        if layout.shared:  # a tree folder stays while a kept generation reaches it through a link
            from cas.tree_folders import reachable

            keep |= reachable(pygit2.Repository(layout.objects), layout, (t for t in keep if t))
        return [t for t in generation_folders(layout) if t not in keep]

    if dry_run:
        return unneeded()
    with switch_lock(layout, 30.0):
        # Under the lock: no build links from a folder being removed, the symlink does not move,
        # and the tip read here is the one the next switch goes to (a call that landed since the
        # receipts were read keeps its generation).
        doomed = unneeded()
        for tree in doomed:
            remove_generation(layout, tree)
    leftovers(layout, remove=True)
    return doomed

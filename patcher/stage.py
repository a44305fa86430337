"""Staging: turn parsed file edits into new objects on top of a base commit.

:func:`plan_stage` reads only the blobs the edits touch and applies them (the
format's ``apply_file``, default :func:`patcher.matching.apply_hunks`);
:func:`write_stage` writes the new blobs, trees and the candidate commit.
Nothing here moves a ref: a crash leaves only unreferenced objects.  The rules
per operation (an ``add`` never overwrites, a ``delete`` of a missing path is
never "already applied", ...) are docs/FORMATS.md, "Operations"; binary edits
are checked against ``old_blob``/``new_blob`` as ``git apply`` checks them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from cas.objects import GitStore, TreeEntry
from cas.hashing import git_blob_oid
from patcher.budget import work_budget
from patcher.formats.binary import InflateBudget, apply_delta, delta_result_size
from patcher.case_paths import refuse_case_collisions
from patcher.errors import ContextNotFound, PartiallyApplied, PatchError, UnsafePath, UnsupportedPatch
from patcher.formats import FileApplier, get_format
from patcher.matching import apply_hunks
from patcher.model import MODE_FILE, MODE_LINK, FileEdit, Patch
from patcher.paths import verify_path

__all__ = ["Staged", "StagePlan", "plan_stage", "write_stage", "stage", "touched_paths"]

_MODE_TREE = 0o040000
_MODE_GITLINK = 0o160000


@dataclass(frozen=True, slots=True)
class Staged:
    base_commit: str | None
    base_tree: str | None
    tree: str
    changes: dict[str, TreeEntry | None]
    outputs: tuple[dict[str, Any], ...]
    grades: dict[str, tuple[str, ...]] = field(default_factory=dict)
    already_applied: bool = False


@dataclass(frozen=True, slots=True)
class StagePlan:
    """What the patch does to ``base_commit``, computed without writing anything."""

    base_commit: str | None
    base_tree: str | None
    blobs: tuple[tuple[str, bytes, int, dict[str, Any]], ...]
    deletes: tuple[str, ...]
    outputs: tuple[dict[str, Any], ...]
    grades: dict[str, tuple[str, ...]]
    already_applied: bool


def touched_paths(patch: Patch) -> list[str]:
    seen: dict[str, None] = {}
    for edit in patch.edits:
        for p in edit.touched:
            seen.setdefault(p, None)
    return list(seen)


def _lookup(store: GitStore, tree: str | None, path: str, deleted: set[str]) -> TreeEntry | None:
    if tree is None:
        return None
    found = store.lookup_path(tree, path)
    if found.blocked_by is not None:
        if found.blocked_mode == _MODE_GITLINK:
            raise UnsafePath(f"refusing to write '{path}': '{found.blocked_by}' is a submodule (a repository of its "
                             f"own): apply the change in that repository",
                             details={"path": path, "reason": "in_submodule", "submodule": found.blocked_by})
        if found.blocked_mode == MODE_LINK and found.blocked_by not in deleted:
            raise UnsafePath(f"refusing to write '{path}': '{found.blocked_by}' is a symlink in the tree",
                             details={"path": path, "reason": "through_symlink", "symlink": found.blocked_by})
        if found.blocked_by not in deleted:
            raise ContextNotFound(f"cannot write '{path}': '{found.blocked_by}' is a file, not a folder",
                                  details={"path": path, "blocked_by": found.blocked_by})
        return None  # a file or a symlink giving way to a folder: the patch deletes it (git's typechange)
    if found.entry is not None and found.entry.mode == _MODE_GITLINK:
        raise UnsafePath(f"refusing to change '{path}': it is a submodule, and oncepatch does not change submodules",
                         details={"path": path, "reason": "submodule", "submodule": path})
    if found.entry is not None and found.entry.mode == _MODE_TREE:
        if all(f"{path}/{sub}" in deleted for sub in store.list_files(found.entry.oid)):
            return None  # a folder giving way to a file: every file in it is deleted by the patch
        raise ContextNotFound(f"'{path}' is a folder, not a file", details={"path": path})
    return found.entry


def _creates(edit: FileEdit) -> bool:
    """A text edit of one hunk that adds lines to an empty old side at line 0 (unified diffs)."""
    return (edit.binary is None and edit.content is None and edit.new_path is None and len(edit.hunks) == 1
            and not edit.hunks[0].old_lines and edit.hunks[0].old_start == 0 and bool(edit.hunks[0].new_lines))


def _is_blob(oid: str, named: str | None) -> bool:
    """Whether object ``oid`` is the one ``named`` (a full or abbreviated oid) names."""
    return named is not None and len(named) >= 4 and oid.startswith(named)


def _binary_result(store: GitStore, edit: FileEdit, old: bytes) -> bytes:
    """The new bytes of a binary edit, checked against the patch's new blob."""
    if edit.binary == "delta":
        assert edit.delta is not None
        content = apply_delta(old, edit.delta, edit.target)
    elif edit.binary == "blob":
        assert edit.new_blob is not None
        if not store.has_object(edit.new_blob):
            raise UnsupportedPatch(f"binary file '{edit.target}' changed, but the patch carries no data and this "
                                   f"repository does not have its new blob {edit.new_blob}: make the patch with "
                                   f"'git diff --binary'",
                                   details={"path": edit.target, "blob": edit.new_blob, "reason": "binary"})
        content = store.read_blob(edit.new_blob)
    else:
        content = edit.content if edit.content is not None else b""
    if edit.new_blob is not None:
        got = git_blob_oid(content)
        if not got.startswith(edit.new_blob):
            raise ContextNotFound(f"binary patch for '{edit.target}' gives blob {got}, the patch says {edit.new_blob}",
                                  details={"path": edit.target, "blob": got, "expected_blob": edit.new_blob})
    return content


def _apply_binary(store: GitStore, edit: FileEdit, current: TreeEntry) -> tuple[bytes, int, bool]:
    """New content, new mode, already-applied flag of a binary modify/rename/copy of ``current``."""
    mode = edit.new_mode or current.mode
    old = store.read_blob(current.oid)
    if _is_blob(current.oid, edit.new_blob) and not _is_blob(current.oid, edit.old_blob):
        return old, mode, mode == current.mode
    if edit.old_blob is not None and not _is_blob(current.oid, edit.old_blob):
        if edit.binary == "literal" and edit.content == old:
            return old, mode, mode == current.mode
        raise ContextNotFound(f"'{edit.path}' is blob {current.oid}, the binary patch was made against {edit.old_blob}",
                              details={"path": edit.path, "blob": current.oid, "expected_blob": edit.old_blob})
    content = _binary_result(store, edit, old)
    return content, mode, content == old and mode == current.mode


def _copy_present(store: GitStore, edit: FileEdit, target: TreeEntry, source: TreeEntry | None,
                  preimages: dict[str, str], applier: FileApplier) -> bool:
    """Whether the existing target of a copy already holds the copy (applied before).

    The copy's own ``index`` line names its result; a whole copy (no hunks) is
    the source's old content, which another edit of the patch may name; else
    the copy is made again from the source as it is.
    """
    if edit.new_blob is not None:
        return _is_blob(target.oid, edit.new_blob) and edit.new_mode in (None, target.mode)
    if not edit.hunks and edit.binary is None and edit.path in preimages:
        return _is_blob(target.oid, preimages[edit.path]) and edit.new_mode in (None, target.mode)
    if source is None:
        return False
    try:
        content, mode, _g, _same = _apply_one(store, edit, source, applier)
    except PatchError:
        return False
    return target.mode == mode and store.read_blob(target.oid) == content


def _rename_present(store: GitStore, edit: FileEdit, target: TreeEntry, sources: dict[str, str],
                    applier: FileApplier) -> bool:
    """Whether the existing target of a rename whose source is gone already holds the rename's result.

    A rename that edits content proves it by that edit (its hunks' new side, its
    whole new content, its binary result).  A pure rename carries no content: only
    a blob id the patch names for the source (the rename's own ``index`` line, or
    another edit's, as a copy from the same source has) proves the target is what
    was moved; any other file at the target is someone else's, and the rename is
    refused, never "already applied" (docs/FORMATS.md, "Operations").
    """
    if edit.new_mode is not None and edit.new_mode != target.mode:
        return False
    if not edit.hunks and edit.content is None and edit.binary is None:
        named = edit.new_blob or edit.old_blob or sources.get(edit.path)
        return named is not None and _is_blob(target.oid, named)
    return _apply_one(store, _as_modify(edit), target, applier)[3]


def _apply_one(store: GitStore, edit: FileEdit, current: TreeEntry | None,
               applier: FileApplier = apply_hunks) -> tuple[bytes, int, tuple[str, ...], bool]:
    """New content, new mode, per-hunk grades, already-applied flag for a modify/rename/copy/add."""
    if edit.op == "add" and edit.binary is not None:
        content = _binary_result(store, edit, b"")
        edit = replace(edit, content=content)
    if edit.op == "add":
        content = edit.content if edit.content is not None else b""
        mode = edit.new_mode or MODE_FILE
        if current is not None:
            if store.read_blob(current.oid) == content and current.mode == mode:
                return content, mode, (), True
            raise ContextNotFound(f"cannot add '{edit.path}': it already exists", details={"path": edit.path})
        return content, mode, (), False
    if current is None:
        raise ContextNotFound(f"cannot change '{edit.path}': it does not exist", details={"path": edit.path})
    if edit.old_mode is not None and edit.old_mode != current.mode and edit.new_mode != current.mode:
        raise ContextNotFound(f"'{edit.path}' has mode {current.mode:o}, the patch expects {edit.old_mode:o}",
                              details={"path": edit.path, "mode": oct(current.mode),
                                       "expected_mode": oct(edit.old_mode)})
    if edit.binary is not None:
        content, mode, done = _apply_binary(store, edit, current)
        return content, mode, (), done
    old = store.read_blob(current.oid)
    mode = edit.new_mode or current.mode
    if edit.hunks:
        applied = applier(old, edit.hunks, path=edit.path)
        return applied.content, mode, applied.grades, applied.already_applied
    if edit.content is not None:
        done = edit.content == old and mode == current.mode
        if edit.old_blob is not None and not done and not _is_blob(current.oid, edit.old_blob):
            # A type change (git's delete and add of one path): the old side must be what was deleted.
            raise ContextNotFound(f"'{edit.path}' is blob {current.oid}, the patch replaces {edit.old_blob}",
                                  details={"path": edit.path, "blob": current.oid, "expected_blob": edit.old_blob})
        return edit.content, mode, (), done
    # A mode change alone (or a pure rename).
    return old, mode, (), mode == current.mode and edit.op != "rename"


def stage(store: GitStore, base_commit: str | None, patch: Patch, message: str) -> tuple[Staged, str | None]:
    """Plan and write in one go (see :func:`plan_stage` and :func:`write_stage`)."""
    return write_stage(store, plan_stage(store, base_commit, patch), message, patch)


def plan_stage(store: GitStore, base_commit: str | None, patch: Patch) -> StagePlan:
    """Apply ``patch`` to ``base_commit`` in memory; nothing is written.

    All the patch's files are matched under one work budget (:mod:`patcher.budget`).

    Raises:
        ContextNotFound, AmbiguousMatch, PartiallyApplied: the patch does not
            apply to this base.
        UnsafePath: a path through a symlink or into a submodule, an entry
            git refuses with its mode (:func:`patcher.paths.verify_path`:
            ``.gitmodules`` as a symlink, ...), or one differing only in case
            from another where ``core.ignorecase`` is set (:mod:`patcher.case_paths`).
        TooLarge: matching it would cost more than the call's work budget.
    """
    # A delta's result is held as a whole new blob: the patch's deltas together, like its
    # literals, may make at most ONCEPATCH_MAX_BINARY_BYTES (checked before applying any).
    results = InflateBudget()
    for edit in patch.edits:
        if edit.binary == "delta" and edit.delta is not None:
            results.take(delta_result_size(edit.delta), edit.target or edit.path, None, held=True)
    with work_budget():
        plan = _plan_stage(store, base_commit, patch)
    if not plan.already_applied:
        refuse_case_collisions(store, plan.base_tree, plan.outputs, plan.deletes)
    return plan


def _plan_stage(store: GitStore, base_commit: str | None, patch: Patch) -> StagePlan:
    base_tree = store.commit_tree(base_commit) if base_commit else None
    fmt = get_format(patch.format)
    applier: FileApplier = fmt.apply_file if fmt is not None and fmt.apply_file is not None else apply_hunks
    writes_create = fmt is not None and fmt.writes_create
    deleted = {e.path for e in patch.edits if e.op in ("delete", "rename")}
    changes: dict[str, TreeEntry | None] = {}
    outputs: list[dict[str, Any]] = []
    grades: dict[str, tuple[str, ...]] = {}
    present: list[str] = []
    missing: list[str] = []
    blobs: list[tuple[str, bytes, int, dict[str, Any]]] = []
    # What the patch says a path held before it (a copy reads its source's old content).
    preimages = {e.path: e.old_blob for e in patch.edits if e.op != "add" and e.op != "copy" and e.old_blob}
    # What the patch says a source held, copies' index lines included (a pure rename's only proof).
    sources = {**{e.path: e.old_blob for e in patch.edits if e.op == "copy" and e.old_blob}, **preimages}
    for edit in patch.edits:
        current = _lookup(store, base_tree, edit.path, deleted)
        if edit.op == "add" and edit.path in deleted:
            current = None  # deleted (or moved away) by another edit of this patch, and added anew
        if writes_create and current is not None and current.mode == MODE_LINK and edit.op != "delete":
            # Whole-file writes carry no link mode: writing one over a symlink would set
            # the link's target to the content (anywhere, '/etc/passwd' included).
            raise UnsafePath(f"refusing to write '{edit.path}': it is a symlink, and whole-file writes do not "
                             f"write symlinks (delete it first, in its own call)",
                             details={"path": edit.path, "reason": "symlink"})
        if edit.op == "modify" and current is None and writes_create and edit.content is not None:
            edit = replace(edit, op="add")
        elif edit.op == "modify" and _creates(edit) and (
                current is None or store.read_blob(current.oid) == b"".join(edit.hunks[0].new_lines)):
            # '--- a/new' / '+++ b/new' / '@@ -0,0 +1,n @@' (no /dev/null, as agents write a new
            # file): git apply creates the file when it is missing, so does this; a file that
            # already holds exactly those lines is that file, created before (already applied).
            edit = replace(edit, op="add", content=b"".join(edit.hunks[0].new_lines), hunks=())
        if edit.op == "delete":
            if current is None:
                raise ContextNotFound(f"cannot delete '{edit.path}': it does not exist", details={"path": edit.path})
            if edit.old_blob is not None and not _is_blob(current.oid, edit.old_blob):
                # The index line names what is deleted: with no hunks (an empty file's
                # delete, 'git diff --irreversible-delete', binary) the only check there is.
                raise ContextNotFound(f"cannot delete '{edit.path}': it is blob {current.oid}, the patch deletes "
                                      f"{edit.old_blob}",
                                      details={"path": edit.path, "blob": current.oid, "expected_blob": edit.old_blob})
            if edit.hunks:
                applied = apply_hunks(store.read_blob(current.oid), edit.hunks, path=edit.path)
                if applied.content != b"":
                    raise ContextNotFound(f"cannot delete '{edit.path}': its content differs from the patch",
                                          details={"path": edit.path})
            changes[edit.path] = None
            outputs.append({"path": edit.path, "op": "delete", "sha256": None, "blob": None, "mode": None})
            missing.append(edit.path)
            continue
        if edit.op == "copy":
            target_now = _lookup(store, base_tree, edit.target, deleted)
            if target_now is not None and edit.target not in deleted:
                if _copy_present(store, edit, target_now, current, preimages, applier):
                    present.append(edit.target)
                    continue
                raise ContextNotFound(f"cannot copy '{edit.path}' to '{edit.target}': the target exists",
                                      details={"path": edit.target})
            if current is None:
                raise ContextNotFound(f"cannot copy '{edit.path}': it does not exist", details={"path": edit.path})
        elif edit.op == "rename":
            target_now = _lookup(store, base_tree, edit.target, deleted)
            if current is None and target_now is not None:
                if _rename_present(store, edit, target_now, sources, applier):
                    present.append(edit.path)
                    continue
                raise ContextNotFound(f"cannot rename '{edit.path}' to '{edit.target}': '{edit.path}' does not exist "
                                      f"and nothing in the patch proves '{edit.target}' is the rename's result",
                                      details={"path": edit.path, "target": edit.target})
            if target_now is not None and edit.target not in deleted:
                raise ContextNotFound(f"cannot rename '{edit.path}' to '{edit.target}': the target exists",
                                      details={"path": edit.target})
        content, mode, g, done = _apply_one(store, edit, current, applier)
        # The mode is known here (a rename or a modify keeps a symlink's): git refuses
        # '.gitmodules' and its kin as symlinks, already present or not.
        verify_path(edit.target, mode)
        if g:
            grades[edit.target] = g
        if done and edit.op not in ("rename", "copy"):
            present.append(edit.path)
            continue
        missing.append(edit.target if edit.op == "copy" else edit.path)
        if edit.op == "rename":
            changes[edit.path] = None
        out: dict[str, Any] = {"path": edit.target, "op": "add" if edit.op == "copy" else edit.op,
                               "sha256": hashlib.sha256(content).hexdigest(), "blob": None, "mode": mode}
        if edit.op in ("rename", "copy"):
            out["from"] = edit.path
        outputs.append(out)
        blobs.append((edit.target, content, mode, out))
    if present and missing:
        raise PartiallyApplied(f"patch is partially applied: {len(present)} of {len(present) + len(missing)} file "
                               f"edits are already present", details={"present": present, "missing": missing})
    return StagePlan(base_commit, base_tree, tuple(blobs), tuple(p for p, e in changes.items() if e is None),
                     tuple(outputs), grades, not missing)


def write_stage(store: GitStore, plan: StagePlan, message: str, patch: Patch) -> tuple[Staged, str | None]:
    """Write the plan's blobs, trees and candidate commit (immutable objects only: no ref moves).

    The candidate is ``None`` when every edit is already present in the base
    (``Staged.already_applied``): nothing is written.
    """
    base_commit, base_tree = plan.base_commit, plan.base_tree
    if plan.already_applied:
        outputs_present = tuple(_present_outputs(store, base_tree, patch))
        return Staged(base_commit, base_tree, base_tree or "", {}, outputs_present, plan.grades, True), None
    changes: dict[str, TreeEntry | None] = {p: None for p in plan.deletes}
    outputs: list[dict[str, Any]] = []
    for path, content, mode, out in plan.blobs:
        oid = store.write_blob(content)
        changes[path] = TreeEntry(oid, mode)
        outputs.append({**out, "blob": oid})
    written = {path for path, _c, _m, _o in plan.blobs}
    # A path deleted and written anew by another edit is one output: what it holds now.
    outputs += [o for o in plan.outputs if o["op"] == "delete" and o["path"] not in written]
    order = {o["path"]: i for i, o in enumerate(plan.outputs)}
    outputs.sort(key=lambda o: order.get(o["path"], 0))
    tree = store.edit_tree(base_tree, changes)
    candidate = store.create_commit(tree, [base_commit] if base_commit else [], message)
    return Staged(base_commit, base_tree, tree, changes, tuple(outputs), plan.grades, False), candidate


def _as_modify(edit: FileEdit) -> FileEdit:
    return FileEdit(op="modify", path=edit.target, hunks=edit.hunks, content=edit.content,
                    new_mode=edit.new_mode, binary=edit.binary, delta=edit.delta, old_blob=edit.old_blob,
                    new_blob=edit.new_blob)


def _present_outputs(store: GitStore, tree: str | None, patch: Patch) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    written = {e.target for e in patch.edits if e.op != "delete"}
    for edit in patch.edits:
        if edit.op == "delete":
            if edit.path in written:
                continue  # deleted and written anew: its output is the new content
            out.append({"path": edit.path, "op": "delete", "sha256": None, "blob": None, "mode": None})
            continue
        found = store.lookup_path(tree, edit.target).entry if tree else None
        if found is None:
            continue
        data = store.read_blob(found.oid)
        doc = {"path": edit.target, "op": "add" if edit.op == "copy" else edit.op,
               "sha256": hashlib.sha256(data).hexdigest(), "blob": found.oid, "mode": found.mode}
        if edit.op == "copy":
            doc["from"] = edit.path
        out.append(doc)
    return out

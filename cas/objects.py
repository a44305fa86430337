"""The content-addressed store over git's object database (pygit2).

With :mod:`cas.refs` (its refs half), :mod:`cas.worktree` and
:mod:`cas.signature`, the only module that imports pygit2; libgit2's bare
``GitError`` is translated in these, once, into :mod:`cas.errors`.

What it offers the apply protocol:

* reading: resolve a ref, look up a path in a tree (reporting a symlink met
  on the way), read a blob;
* writing immutable objects: blobs, trees rebuilt along the changed paths
  only (:meth:`GitStore.edit_tree`: cost grows with the change, never with the
  repository), commits with trailers;
* refs: reading, the branch's compare-and-swap and the create-only key ref,
  from :class:`cas.refs.RefUpdates` (its half of :class:`GitStore`).

Objects are hashed here (the id is known before anything is written) and
*staged*; :meth:`GitStore.flush_objects` writes them as loose objects through
libgit2's object database, as git's own writers do: a new object is a new
file, an existing one is freshened (its mtime, which ``git gc``'s prune grace
period reads).  oncepatch never packs, merges or deletes anything in
``objects/``: maintenance is git's.  Anything that reads through libgit2 or
moves a ref writes the staged objects first.  The objects a call wrote are
kept at hand until it ends, so that a ref move can check, under the ref's
lock, that they still exist, and write them again if a ``git gc
--prune=now`` removed them meanwhile (:meth:`GitStore.ensure_objects`).

Durability: ``enable_fsync_gitdir`` is switched on when the first store opens,
so libgit2 fsyncs every ref and reflog it writes (and their folders); a
call's new objects are made durable together by :mod:`cas.loose_objects`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import pygit2

from cas.durable import DurableBatch

from cas.gitdir import common_dir_of, core_worktree, read_gitfile
from cas.errors import GitStoreError, ObjectsMissing, UsageError
from cas.loose_objects import NewObjects, TmpObjdirGone, enable_fsync, open_repository, stage_new, write_new
from cas.signature import Signature, git_identity, signature_line
from cas.refs import KEY_REF_PREFIX, RefUpdates

T = TypeVar("T")

__all__ = ["GitStore", "TreeEntry", "PathLookup", "Signature", "KEY_REF_PREFIX", "open_store"]

_TREE_MODE = 0o40000
_OBJECT_TYPES = {b"commit": 1, b"tree": 2, b"blob": 3}


def _canon_mode(mode: int) -> int:
    """git's canonical tree-entry mode (``canon_mode``): old 100664-style modes become 100644."""
    kind = mode & 0o170000
    if kind == 0o100000:
        return 0o100755 if mode & 0o111 else 0o100644
    if kind in (0o040000, 0o120000, 0o160000):
        return kind
    return mode


def _oid(hex_or_oid: str | pygit2.Oid) -> pygit2.Oid:
    """A full hex id as an ``Oid``: looked up directly, not as a prefix (libgit2's slow path)."""
    return hex_or_oid if isinstance(hex_or_oid, pygit2.Oid) else pygit2.Oid(hex=hex_or_oid)


def _parse_tree(raw: bytes) -> dict[bytes, tuple[int, bytes]]:
    """``{name: (mode, raw oid)}`` of a tree's raw bytes."""
    out: dict[bytes, tuple[int, bytes]] = {}
    i, n = 0, len(raw)
    while i < n:
        sp = raw.index(b" ", i)
        nul = raw.index(b"\0", sp)
        out[raw[sp + 1:nul]] = (_canon_mode(int(raw[i:sp], 8)), raw[nul + 1:nul + 21])
        i = nul + 21
    return out


@dataclass(frozen=True, slots=True)
class TreeEntry:
    oid: str
    mode: int


@dataclass(frozen=True, slots=True)
class PathLookup:
    """Result of looking a path up in a tree.

    ``entry`` is the entry at the path (``None``: absent).  ``blocked_by`` names
    a leading component that is not a folder (a symlink or a file): the path
    cannot exist under it, and writing there would go through it.
    """

    entry: TreeEntry | None
    blocked_by: str | None = None
    blocked_mode: int | None = None


class GitStore(RefUpdates):
    """An open repository.  Long-lived callers keep one per repository."""

    def __init__(self, path: str) -> None:
        enable_fsync()
        try:
            self.repo = open_repository(path)
        except (pygit2.GitError, KeyError) as exc:
            why = str(exc)
            if isinstance(exc, KeyError) or "not found" in why.lower():
                raise UsageError(f"not a git repository: '{path}'") from exc
            # A repository libgit2 refuses (an object format or extension it does not know).
            setting = " (extensions.objectFormat, from 'git init --object-format')" if "object format" in why else ""
            raise UsageError(f"cannot open the git repository '{path}': {why}{setting} "
                             "(not supported by libgit2, the git library oncepatch uses)") from exc
        self.git_dir = os.path.realpath(self.repo.path)
        self.common_dir = common_dir_of(self.git_dir)
        self._worktrees: dict[str, pygit2.Repository] = {}
        self._main_workdir: tuple[str | None] | None = None
        # Objects staged by this store and not yet written: {hex id: (header, bytes)}.
        self._pending: dict[str, tuple[bytes, bytes | memoryview]] = {}
        # The objects this call wrote, kept until it ends: checked (and written again if
        # gone) under the ref's lock before the ref moves (ensure_objects).
        self._written: dict[str, tuple[bytes, bytes | memoryview]] = {}
        self._recent: dict[str, bytes] = {}
        # The trees and commits of this store's last durable batch, {hex id: (kind, body)}: the
        # next call's base is usually the last call's commit, read back here without libgit2.
        self._made: dict[str, tuple[bytes, bytes]] = {}
        self._made_entries: dict[str, dict[bytes, tuple[int, bytes]]] = {}  # those trees parsed, once
        self._packs = _packs_stamp(self.common_dir)  # objects/pack as the object database was opened
        self._signature: dict[str, Signature] = {}  # by kind: author, committer
        self._config_snapshot: pygit2.Config | None = None  # shared by both identities as a call reads them
        self._reading_identities = False
        self._init_refs()

    @property
    def main_workdir(self) -> str | None:
        """The main worktree, when this store was opened from it (``None``: bare, or opened from a linked one).

        libgit2 found it as git does: the folder of the ``.git`` file it was
        opened through, or ``core.worktree`` — where the git dir's own
        location says nothing (``--separate-git-dir``, submodules).
        """
        if self._main_workdir is None:
            self._main_workdir = (self._find_main_workdir(),)  # an open repository's worktree does not move
        return self._main_workdir[0]

    def _find_main_workdir(self) -> str | None:
        if self.git_dir != self.common_dir or not self.repo.workdir:
            return None
        workdir = os.path.realpath(self.repo.workdir)
        if os.path.join(workdir, ".git") == self.git_dir or core_worktree(self.git_dir) == workdir:
            return workdir
        # A git dir of another name (--separate-git-dir) opened at itself: libgit2 takes
        # the folder above it for the worktree, which it is not.  Only a '.git' file
        # there naming this git dir says so.
        return workdir if read_gitfile(os.path.join(workdir, ".git")) == self.git_dir else None

    def worktree_repo(self, workdir: str) -> pygit2.Repository:
        """The repository opened at a worktree (its attributes, filters, git dir), kept open while this store is.

        Raises:
            GitStoreError: ``workdir`` is not a worktree libgit2 can open.
        """
        real = os.path.realpath(workdir)
        found = self._worktrees.get(real)
        if found is None:
            if self.repo.workdir and os.path.realpath(self.repo.workdir) == real:
                found = self.repo
            else:
                try:
                    found = pygit2.Repository(real)
                except (pygit2.GitError, KeyError) as exc:
                    raise GitStoreError(f"cannot open worktree '{workdir}': {exc}") from exc
            self._worktrees[real] = found
        return found

    # -- reading ------------------------------------------------------------------

    def _write_staged_first(self) -> None:
        """Reads through libgit2 see only written objects: write the staged ones first."""
        if self._pending:
            self.flush_objects()

    def commit_tree(self, commit_oid: str) -> str:
        made = self._made.get(commit_oid)
        if made is not None and made[0] == b"commit":
            return made[1][5:45].decode()  # b"tree <hex>\n..."
        self._write_staged_first()
        try:
            return str(self.repo[_oid(commit_oid)].peel(pygit2.Commit).tree_id)
        except (KeyError, ValueError, pygit2.GitError) as exc:
            raise GitStoreError(f"cannot read commit '{commit_oid}': {exc}") from exc

    def has_object(self, oid: str) -> bool:
        self._write_staged_first()
        try:
            return pygit2.Oid(hex=oid) in self.repo.odb
        except ValueError:
            return False

    def lookup_path(self, tree_oid: str, path: str) -> PathLookup:
        """Walk ``path`` down from ``tree_oid`` without reading anything off the path."""
        parts = path.split("/")
        if tree_oid in self._made and "" not in parts:  # ("a/", "a//b", "": libgit2's answers)
            return self._lookup_made(tree_oid, parts)
        return self._lookup_git(tree_oid, path)

    def _lookup_git(self, tree_oid: str, path: str) -> PathLookup:
        self._write_staged_first()
        tree = self.repo[_oid(tree_oid)]
        if "/" in path:
            # Usual case first: libgit2 walks the whole path in one call.
            try:
                found = tree[path]  # type: ignore[index]
            except KeyError:
                pass  # absent, or blocked by a file or symlink on the way: walk to tell which
            else:
                return PathLookup(TreeEntry(str(found.id), int(found.filemode)))
        parts = path.split("/")
        walked: list[str] = []
        for i, part in enumerate(parts):
            try:
                entry = tree[part]  # type: ignore[index]
            except KeyError:
                return PathLookup(None)
            if i == len(parts) - 1:
                return PathLookup(TreeEntry(str(entry.id), int(entry.filemode)))
            walked.append(part)
            if int(entry.filemode) != pygit2.enums.FileMode.TREE:
                return PathLookup(None, "/".join(walked), int(entry.filemode))
            tree = self.repo[entry.id]
        return PathLookup(None)

    def _keep_made(self, made: dict[str, tuple[bytes, bytes]]) -> None:
        self._made, self._made_entries = made, {}

    def forget_made(self) -> None:
        """Answer from the repository only: what the last batch wrote may have been pruned since.

        The apply protocol asks only about commits a branch reaches; a
        verification asks whether an object exists at all.
        """
        self._keep_made({})

    def _made_tree(self, oid: str) -> dict[bytes, tuple[int, bytes]] | None:
        """The entries of a tree the last batch wrote, parsed once (shared: not to be changed); else ``None``."""
        entries = self._made_entries.get(oid)
        if entries is None:
            made = self._made.get(oid)
            if made is None or made[0] != b"tree":
                return None
            entries = self._made_entries[oid] = _parse_tree(made[1])
        return entries

    def _lookup_made(self, tree_oid: str, parts: list[str]) -> PathLookup:
        """:meth:`lookup_path` from a tree of the last batch: walked here while the trees are ours."""
        for i, part in enumerate(parts):
            entries = self._made_tree(tree_oid)
            if entries is None:  # below the batch's trees: libgit2 walks on, the path named from the top
                found = self._lookup_git(tree_oid, "/".join(parts[i:]))
                if found.blocked_by is not None and i:
                    found = PathLookup(None, "/".join(parts[:i]) + "/" + found.blocked_by, found.blocked_mode)
                return found
            entry = entries.get(part.encode("utf-8", "surrogateescape"))
            if entry is None:
                return PathLookup(None)
            mode, raw = entry
            if i == len(parts) - 1:
                return PathLookup(TreeEntry(raw.hex(), mode))
            if mode != _TREE_MODE:
                return PathLookup(None, "/".join(parts[:i + 1]), mode)
            tree_oid = raw.hex()
        return PathLookup(None)

    def lookup_file(self, tree_oid: str | None, path: str) -> TreeEntry | None:
        """The entry at ``path`` if it is a file or symlink; ``None`` if absent or a folder."""
        if tree_oid is None:
            return None
        entry = self.lookup_path(tree_oid, path).entry
        if entry is None or entry.mode == pygit2.enums.FileMode.TREE:
            return None
        return entry

    def list_files(self, tree_oid: str) -> list[str]:
        """Every non-folder path below ``tree_oid``, relative to it (reads that subtree only)."""
        self._write_staged_first()
        out: list[str] = []
        stack: list[tuple[str, str]] = [("", tree_oid)]
        while stack:
            prefix, oid = stack.pop()
            for entry in self.repo[_oid(oid)]:  # type: ignore[attr-defined]
                name = f"{prefix}{entry.name}"
                if int(entry.filemode) == pygit2.enums.FileMode.TREE:
                    stack.append((name + "/", str(entry.id)))
                else:
                    out.append(name)
        return out

    def read_blob(self, oid: str) -> bytes:
        recent = self._recent.get(oid)
        if recent is not None:
            return recent  # this call wrote it: the bytes it was made from
        self._write_staged_first()
        try:
            # Through the object database: looking the object up first (then
            # read_raw) held a second inflated copy, 3× a big blob at the peak.
            return bytes(self.repo.odb.read(_oid(oid))[1])
        except (KeyError, ValueError, pygit2.GitError) as exc:
            if isinstance(exc, KeyError) and self._partial_clone():
                raise UsageError(f"blob '{oid}' is not in this partial clone: fetch it first "
                                 "(e.g. 'git fetch', or check the branch out), then retry",
                                 details={"blob": oid, "reason": "partial_clone"}) from exc
            raise GitStoreError(f"cannot read blob '{oid}': {exc}") from exc

    def config_bool(self, name: str, default: bool = False) -> bool:
        """A boolean setting of the repository's configuration (``default`` where unset or unreadable)."""
        try:
            return bool(self.repo.config.get_bool(name))
        except (KeyError, pygit2.GitError, ValueError):
            return default

    def folder_entries(self, tree_oid: str, folder: str) -> dict[str, tuple[str, int]] | None:
        """The entries of ``folder`` (``""``: the root) in ``tree_oid``: name -> (oid, mode); ``None``: no folder."""
        self._write_staged_first()
        tree = self.repo[_oid(tree_oid)]
        if folder:
            try:
                entry = tree[folder]  # type: ignore[index]
            except KeyError:
                return None
            if int(entry.filemode) != pygit2.enums.FileMode.TREE:
                return None
            tree = self.repo[entry.id]
        return {e.name: (str(e.id), int(e.filemode)) for e in tree}  # type: ignore[attr-defined]

    def _partial_clone(self) -> bool:
        """Whether objects may be missing by design (``extensions.partialClone``, a promisor remote)."""
        try:
            cfg = self.repo.config
            return "extensions.partialclone" in cfg or any(
                e.name.endswith(".promisor") and e.value == "true" for e in cfg)
        except (pygit2.GitError, ValueError):
            return False

    # -- writing immutable objects ------------------------------------------------

    def write_blob(self, data: bytes) -> str:
        """Stage a blob of ``data``; return its id (written by :meth:`flush_objects`)."""
        header = b"blob %d\0" % len(data)
        h = hashlib.sha1(header)
        h.update(data)
        oid = h.hexdigest()
        self._stage_object(oid, header, data)
        return oid

    def edit_tree(self, base_tree: str | None, changes: Mapping[str, TreeEntry | None]) -> str:
        """A new tree: ``base_tree`` with each path set to its entry (``None`` removes it).

        Only the trees on the changed paths are read and rewritten.  A folder
        left empty disappears (git stores no empty trees).  The trees are staged,
        not yet written (see :meth:`flush_objects`).
        """
        try:
            oid = self._edit(base_tree, {tuple(p.split("/")): e for p, e in changes.items()})
        except (KeyError, ValueError, pygit2.GitError) as exc:
            raise GitStoreError(f"cannot write tree: {exc}") from exc
        if oid is None:
            return self._write_tree({})
        return oid

    def _tree_entries(self, oid: str) -> dict[bytes, tuple[int, bytes]]:
        """``{name: (mode, raw oid)}`` of a tree: a dict of the caller's own (:meth:`_edit` changes it)."""
        made = self._made_tree(oid)
        return dict(made) if made is not None else _parse_tree(self._raw(oid, b"tree"))

    def _raw(self, oid: str, kind: bytes) -> bytes:
        staged = self._pending.get(oid)
        if staged is not None:
            return bytes(staged[1])
        otype, data = self.repo.odb.read(_oid(oid))
        if otype != _OBJECT_TYPES[kind]:
            raise GitStoreError(f"object '{oid}' is not a {kind.decode()}")
        return bytes(data)

    def _edit(self, tree_oid: str | None, changes: dict[tuple[str, ...], TreeEntry | None]) -> str | None:
        entries = self._tree_entries(tree_oid) if tree_oid else {}
        here: dict[bytes, TreeEntry | None] = {}
        below: dict[bytes, dict[tuple[str, ...], TreeEntry | None]] = {}
        for parts, entry in changes.items():
            name = parts[0].encode("utf-8", "surrogateescape")
            if len(parts) == 1:
                here[name] = entry
            else:
                below.setdefault(name, {})[parts[1:]] = entry
        # A name may be both a file and a folder in one change (a file giving way
        # to a folder, or back): the side that survives is the one with content.
        for name, sub in below.items():
            if here.get(name) is not None:
                continue  # a file replaces the folder: its contents go with it
            existing = entries.get(name)
            sub_oid = existing[1].hex() if existing is not None and existing[0] == _TREE_MODE else None
            new_sub = self._edit(sub_oid, sub)
            if new_sub is None:
                entries.pop(name, None)
            else:
                entries[name] = (_TREE_MODE, bytes.fromhex(new_sub))
        for name, entry in here.items():
            if entry is None:
                if name in below:
                    continue  # the file gave way to a folder, written above
                entries.pop(name, None)
            else:
                entries[name] = (_canon_mode(entry.mode), bytes.fromhex(entry.oid))
        if not entries:
            return None
        return self._write_tree(entries)

    def _write_tree(self, entries: dict[bytes, tuple[int, bytes]]) -> str:
        # git's order: names compared bytewise, a folder's name as if it ended in '/'.
        items = sorted(entries.items(), key=lambda kv: kv[0] + b"/" if kv[1][0] == _TREE_MODE else kv[0])
        body = b"".join(b"%o %s\0%s" % (mode, name, oid) for name, (mode, oid) in items)
        header = b"tree %d\0" % len(body)
        oid = hashlib.sha1(header + body).hexdigest()
        self._stage_object(oid, header, body)
        return oid

    def _stage_object(self, oid: str, header: bytes, data: bytes | memoryview) -> None:
        if oid not in self._pending:
            self._pending[oid] = (header, data)

    def flush_objects(self) -> None:
        """Write every staged object as a loose object through libgit2, durable when this returns.

        An object the repository has already is freshened, not written again
        (libgit2's ``git_odb_write``); the new ones are synced together, with
        their fan-out folders (:func:`cas.loose_objects.write_new`).

        Raises:
            GitStoreError: libgit2 could not write an object, or ``objects/`` could not be synced.
        """
        if not self._pending:
            return
        self._write_all(self.repo.odb, self._pending)
        self._flushed()

    def flush_objects_with(self, step: Callable[[DurableBatch | None], T]) -> T:
        """Write the staged objects durably in one batch with what ``step(batch)`` writes in ``batch``; return its result.

        The objects are written by libgit2 into the temporary object folder
        and joined to the batch (:func:`cas.loose_objects.stage_new`): synced
        in its first round, renamed before its files, their folders synced in
        its last round.  ``step`` commits the batch (the ``prepared`` receipt
        that names the objects).  It gets ``None`` when there is nothing new to
        write, or when the temporary folder was removed under the batch (a
        ``git prune --expire=now``; nothing of the batch was renamed): then the
        objects are written on their own first (:meth:`flush_objects`).

        Raises:
            GitStoreError: libgit2 could not write an object, or a folder could not be opened.
            whatever ``step`` raises.
        """
        part: NewObjects | None = None
        if self._pending:
            try:
                part = stage_new(self.repo.odb, os.path.join(self.common_dir, "objects"), self._pending)
            except TmpObjdirGone:
                part = None
        if part is None:
            self.flush_objects()
            return step(None)
        try:
            batch = DurableBatch()
            batch.join(part)
            try:
                return step(batch)
            except Exception:
                if not part.gone():
                    raise
        finally:
            part.close()
            if part.placed:
                self._flushed()
        # Race guarded: 'git prune --expire=now' (unsafe beside writers, git says) removed the
        # temporary folder before the objects were placed: nothing of the batch was renamed.
        self.flush_objects()
        return step(None)

    def _flushed(self) -> None:
        """The staged objects are written: kept at hand for this call, no longer pending."""
        # Blobs stay at hand until the call ends (forget_recent): materialising a
        # worktree reads them back, and a 100 MiB blob would be inflated again
        # beside the bytes it was made from.
        self._recent.update({oid: data for oid, (header, data) in self._pending.items()
                             if isinstance(data, bytes) and header.startswith(b"blob ")})
        made = {oid: (header[:header.index(b" ")], bytes(data)) for oid, (header, data) in self._pending.items()
                if header.startswith((b"tree ", b"commit "))}
        self._written.update(self._pending)
        self._pending.clear()
        self._keep_made(made)

    def _write_all(self, odb: pygit2.Odb, todo: Mapping[str, tuple[bytes, bytes | memoryview]]) -> None:
        write_new(odb, os.path.join(self.common_dir, "objects"), todo)

    def ensure_objects(self, ref: str, new: str) -> None:
        """Make sure ``new`` and every object this call wrote exist, writing the missing ones again.

        Called under ``ref``'s lock, just before it moves to ``new`` (as
        ``git update-ref`` refuses to point a ref at a missing object): a ``git
        gc --prune=now`` or ``git prune --expire=now`` since the objects were
        written may have removed them, unreferenced as they were.  Loose files
        are looked at directly; anything else through a freshly opened object
        database (an open one may still map a pack git has removed since).

        Raises:
            ObjectsMissing: an object is still missing (one this call never
                wrote, or written again and gone again): the ref must not move.
            GitStoreError: the object database could not be read or written.
        """
        self.flush_objects()
        objects = os.path.join(self.common_dir, "objects")
        wanted = dict.fromkeys([new, *self._written])
        unsure = [oid for oid in wanted if not os.path.isfile(os.path.join(objects, oid[:2], oid[2:]))]
        if not unsure:
            return
        try:
            odb = pygit2.Odb(objects)
            missing = [oid for oid in unsure if _oid(oid) not in odb]
            if missing and all(oid in self._written for oid in missing):
                self._write_all(odb, {oid: self._written[oid] for oid in missing})  # re-staged
                odb = pygit2.Odb(objects)
                missing = [oid for oid in missing if _oid(oid) not in odb]
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot check the objects of ref '{ref}': {exc}") from exc
        if missing:
            raise ObjectsMissing(ref, missing)
        # The packs libgit2 had mapped may be gone since: later reads start afresh.
        self.reopen_objects()

    def reopen_objects(self) -> None:
        """Open the object database afresh (worktrees' repositories are opened again when asked for).

        Raises:
            GitStoreError: libgit2 cannot open it.
        """
        packs = _packs_stamp(self.common_dir)
        try:
            self.repo.set_odb(pygit2.Odb(os.path.join(self.common_dir, "objects")))
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot open the object database: {exc}") from exc
        self._packs = packs
        self._worktrees = {}

    def packs_changed(self) -> bool:
        """Whether ``objects/pack`` changed since the object database was opened (a pack added or removed)."""
        return _packs_stamp(self.common_dir) != self._packs

    def discard_pending(self) -> None:
        """Forget staged objects that were never written (a call that stopped before preparing).

        Called as each call starts (which reads the identities afresh with
        :meth:`read_identities`: a long-lived caller sees configuration changes).
        """
        self._pending.clear()
        self._written.clear()
        self._recent = {}
        self._sync_failure = None

    def forget_recent(self) -> None:
        """Drop the objects this call wrote and kept at hand (the call is over)."""
        self._recent = {}
        self._written.clear()

    def default_signature(self, kind: str = "committer") -> Signature:
        """The ``author`` or ``committer`` identity (:func:`git_identity`), read once per call (:meth:`discard_pending`).

        Raises:
            ValueError: ``GIT_<KIND>_DATE`` is in a form git's documentation does not name.
        """
        sig = self._signature.get(kind)
        if sig is None:
            snapshot = self._config_snapshot

            def config(name: str) -> str | None:
                nonlocal snapshot
                try:
                    if snapshot is None:
                        # One snapshot for the lookups (each lookup in the live configuration
                        # stats every config file again): this identity's, or both of a call's.
                        snapshot = self._config_snapshot = self.repo.config.snapshot()
                    value = snapshot[name]
                except (KeyError, pygit2.GitError):
                    return None
                return str(value) if value else None

            try:
                sig = self._signature[kind] = git_identity(kind, config, os.environ)
            finally:
                if not self._reading_identities:
                    self._config_snapshot = None
        return sig

    def read_identities(self) -> None:
        """Read the author and committer identities afresh (as a call starts), from one configuration snapshot.

        Raises:
            ValueError: a ``GIT_<KIND>_DATE`` in a form :func:`parse_git_date` refuses, or a
                name or email libgit2 refuses.
        """
        self._signature = {}
        self._config_snapshot = None
        self._reading_identities = True
        try:
            for kind in ("author", "committer"):
                try:
                    signature_line(self.default_signature(kind))  # what libgit2 would refuse, refused now
                except pygit2.GitError as exc:
                    raise ValueError(f"{kind}: {exc}") from None
        finally:
            self._reading_identities = False
            self._config_snapshot = None

    def create_commit(self, tree: str, parents: list[str], message: str, author: Signature | None = None) -> str:
        """Stage a commit of ``tree`` (author and committer as git reads them, now unless set); return its id.

        Raises:
            GitStoreError: an identity libgit2 refuses, or a ``GIT_<KIND>_DATE`` it cannot read.
        """
        now = int(time.time())
        try:
            author_line = signature_line(author or self.default_signature("author"), now)
            committer_line = signature_line(self.default_signature("committer"), now)
        except (ValueError, pygit2.GitError) as exc:
            raise GitStoreError(f"cannot write commit: {exc}") from exc
        body = b"tree %s\n" % tree.encode()
        body += b"".join(b"parent %s\n" % p.encode() for p in parents)
        body += b"author %s\ncommitter %s\n\n%s" % (author_line, committer_line, message.encode("utf-8"))
        header = b"commit %d\0" % len(body)
        oid = hashlib.sha1(header + body).hexdigest()
        self._stage_object(oid, header, body)
        return oid

    def is_ancestor(self, ancestor: str, tip: str) -> bool:
        """``ancestor`` is ``tip`` or reachable from it."""
        self._write_staged_first()
        if ancestor == tip:
            return True
        try:
            return bool(self.repo.descendant_of(pygit2.Oid(hex=tip), pygit2.Oid(hex=ancestor)))
        except (KeyError, pygit2.GitError):
            return False


def open_store(repo_path: str, stores: dict[str, GitStore] | None) -> GitStore:
    """An open :class:`GitStore` of ``repo_path``, reused from ``stores`` (a long-lived caller's cache) when given."""
    if stores is None:
        return GitStore(repo_path)
    found = stores.get(repo_path)
    if found is None:
        found = stores[repo_path] = GitStore(repo_path)
    elif found.packs_changed():
        # git's maintenance removed or replaced packs since the last call: libgit2 keeps the
        # packs it listed, and one whose file is gone fails every read that finds an object
        # in its index ("invalid packfile"), call after call, where a new process starts afresh.
        found.reopen_objects()
    return found


def _packs_stamp(common_dir: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(common_dir, "objects", "pack"))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns

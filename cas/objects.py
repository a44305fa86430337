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

Objects are hashed and serialised here, in Python (blobs, trees, commits are
simple formats), and *staged*: held until the protocol writes them, in the same
:class:`cas.durable.DurableBatch` as the receipt that names them — all synced
in one round instead of one fsync per object and one per folder, one after
another.  A call's objects go into one pack (:mod:`cas.packs`: two files in
one folder, whatever the number of objects); a lone object, or one too big to
hold twice, is written loose.  Anything that reads through libgit2 or moves a
ref writes the staged objects first (:meth:`GitStore.flush_objects`).

Durability: ``enable_fsync_gitdir`` is switched on when the first store opens,
so libgit2 fsyncs the refs and reflogs it writes (a branch it moves when
:mod:`cas.loose_refs` leaves it to libgit2) and any object it writes itself.
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pygit2

from cas.durable import DurableBatch, write_all
from cas.gitdir import common_dir_of, core_worktree, read_gitfile
from cas.errors import GitStoreError, UsageError
from cas import packs
from cas.signature import Signature, git_identity, signature_line
from cas.refs import KEY_REF_PREFIX, RefUpdates

__all__ = ["GitStore", "TreeEntry", "PathLookup", "Signature", "KEY_REF_PREFIX"]

_FSYNC_ON = False
_TREE_MODE = 0o40000
_OBJECT_TYPES = {b"commit": 1, b"tree": 2, b"blob": 3}
#: zlib level of loose objects: git's default ``core.looseCompression`` (best speed).
_LOOSE_LEVEL = 1
_CHUNK = 1 << 20
#: The object database is reopened once this many packs it may hold open are gone (descriptors, disk space).
_REOPEN_AFTER = 32


def _canon_mode(mode: int) -> int:
    """git's canonical tree-entry mode (``canon_mode``): old 100664-style modes become 100644."""
    kind = mode & 0o170000
    if kind == 0o100000:
        return 0o100755 if mode & 0o111 else 0o100644
    if kind in (0o040000, 0o120000, 0o160000):
        return kind
    return mode


def _deflate_writer(header: bytes, data: bytes | memoryview) -> Callable[[int], None]:
    """Writes a loose object's zlib stream to an fd, a chunk at a time (a big blob is never copied whole)."""
    def write(fd: int) -> None:
        if len(header) + len(data) <= packs.DEFLATE_SMALL:
            write_all(fd, packs.deflate(header + data, _LOOSE_LEVEL))
            return
        z = zlib.compressobj(_LOOSE_LEVEL)
        view = memoryview(data)
        write_all(fd, z.compress(header))
        for start in range(0, len(view), _CHUNK):
            out = z.compress(view[start:start + _CHUNK])
            if out:
                write_all(fd, out)
        write_all(fd, z.flush())
    return write


def _oid(hex_or_oid: str | pygit2.Oid) -> pygit2.Oid:
    """A full hex id as an ``Oid``: looked up directly, not as a prefix (libgit2's slow path)."""
    return hex_or_oid if isinstance(hex_or_oid, pygit2.Oid) else pygit2.Oid(hex=hex_or_oid)


def _enable_fsync() -> None:
    global _FSYNC_ON
    if not _FSYNC_ON:
        pygit2.settings.enable_fsync_gitdir(True)
        _FSYNC_ON = True


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
        _enable_fsync()
        try:
            self.repo = pygit2.Repository(path)
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
        self._recent: dict[str, bytes] = {}
        # The trees and commits of this store's last durable batch, {hex id: (kind, body)}: the
        # next call's base is usually the last call's commit, read back here without libgit2.
        self._made: dict[str, tuple[bytes, bytes]] = {}
        self._made_entries: dict[str, dict[bytes, tuple[int, bytes]]] = {}  # those trees parsed, once
        self._backends: list[pygit2.OdbBackend] | None = None
        self._pack_names: frozenset[str] | None = None  # the idx files last seen in objects/pack
        self._unmergeable: set[str] = set()  # small packs a merge may not copy (read once)
        self._pack_sizes: dict[str, tuple[int, int] | None] = {}  # cas.packs.small_packs's cache
        # The entries of the small packs this store built, by stem: a merge copies them
        # without reading the files back and checking them (a pack's name is its checksum).
        self._built: dict[str, list[tuple[bytes, bytes, int]]] = {}
        self._swept: dict[str, Any] = {}  # cas.packs.sweep's memory of the retired list
        self._packs_gone = 0  # packs removed since the object database was opened
        self._signature: dict[str, Signature] = {}  # by kind: author, committer
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
        """Stage a blob of ``data``; return its id (written by :meth:`add_pending_to`)."""
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
        not yet written (see :meth:`add_pending_to`).
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

    def add_pending_to(self, batch: DurableBatch) -> None:
        """Queue every staged object in ``batch``; they count as written after its commit.

        Two or more go into one pack (:mod:`cas.packs`), which may also take in
        small packs found beside it: noted once the batch is durable, they are
        removed by a later call (:func:`cas.packs.sweep`).
        A single object, or one bigger than :data:`cas.packs.OBJECT_MAX`
        (streamed, never held twice), is written loose, unless the repository
        already has it (one already loose is synced with the batch).  The tmp
        files follow git's ``tmp_obj_`` / ``tmp_pack_`` / ``tmp_idx_`` naming,
        which ``git prune`` removes if a crash leaves one.
        """
        objects = os.path.join(self.common_dir, "objects")
        # Blobs stay at hand until the call ends (forget_recent): materialising a
        # worktree reads them back, and a 100 MiB blob would be inflated again
        # beside the bytes it was made from.
        self._recent = {oid: data for oid, (header, data) in self._pending.items()
                        if isinstance(data, bytes) and header.startswith(b"blob ")}
        made = {oid: (header[:header.index(b" ")], bytes(data)) for oid, (header, data) in self._pending.items()
                if header.startswith((b"tree ", b"commit "))}
        if made:
            batch.when_durable(lambda: self._keep_made(made))
        pack_dir = os.path.join(objects, "pack")
        listing = self._forget_removed_packs(pack_dir)
        loose: list[tuple[str, bytes, bytes | memoryview]] = []
        packable: list[tuple[str, bytes, bytes | memoryview]] = []
        in_packs = fresh = False
        for oid, (header, data) in self._pending.items():
            known = self._known(oid)
            if known and not fresh:
                # Trusted only as the folder is now: a pack libgit2 still holds open may
                # have been removed since (git gc --prune=now of unreferenced objects).
                self.reopen_objects()
                known, fresh = self._known(oid), True
            if not known:
                (packable if len(data) <= packs.OBJECT_MAX else loose).append((oid, header, data))
            elif os.path.exists(os.path.join(objects, oid[:2], oid[2:])):
                loose.append((oid, header, data))  # synced with the batch, as it is
            else:
                in_packs = True
        self._pending.clear()
        if in_packs:
            # A pack is trusted for an object it holds: its folder is synced with this
            # batch (it may be the pack of an earlier batch whose last round failed).
            batch.sync_first([pack_dir])
        if len(packable) >= 2 and sum(len(data) for _o, _h, data in packable) <= packs.PACK_BYTES_MAX:
            self._add_pack(batch, pack_dir, packable, listing)
        else:
            loose += packable
        for oid, header, data in loose:
            path = os.path.join(objects, oid[:2], oid[2:])
            # Folders as git and libgit2 make them: 0777 less the umask (a shared
            # repository's umask keeps them group-writable).
            batch.add(path, writer=_deflate_writer(header, data), mode=0o444, content_addressed=True,
                      tmp_prefix="tmp_obj_", dir_mode=0o777)

    def _add_pack(self, batch: DurableBatch, pack_dir: str, objects: list[tuple[str, bytes, bytes | memoryview]],
                  listing: frozenset[str]) -> None:
        builder = packs.PackBuilder()
        for oid, header, data in objects:
            builder.add_object(oid, header, data)
        merged: list[packs.SmallPack] = []
        retired_list = os.path.join(self.common_dir, "objects", "info", "oncepatch-retired")
        if self._pack_names is not None and len(self._pack_names) < packs.MERGE_TRIGGER - 1:
            candidates = []  # too few packs of any size for a merge: not even looked at
        else:
            if self._unmergeable and self._pack_names is not None:  # forget the ones gone since
                self._unmergeable &= {os.path.join(pack_dir, n[:-4]) for n in self._pack_names}
            # Noted as merged before (waiting), or removed just now (still in the listing): not again.
            removed: set[str] = set()
            taken = packs.sweep(pack_dir, retired_list, time.time(), self._swept, removed) | removed
            candidates = [p for p in packs.small_packs(pack_dir, listing, self._pack_sizes)
                          if p.stem not in self._unmergeable and p.stem not in taken]
        if self._built:  # forget the ones gone since (merged by another process, or never written)
            for gone in [stem for stem in self._built if os.path.basename(stem) + ".idx" not in listing]:
                del self._built[gone]
        for pack in packs.choose_merge(len(builder), candidates):
            entries = self._built.pop(pack.stem, None) or packs.read_entries(pack.stem)
            if entries is None:
                self._unmergeable.add(pack.stem)  # gone, or not one a merge may copy: left as it is
                continue
            for oid_raw, entry, crc in entries:
                builder.add_entry(oid_raw, entry, crc)
            merged.append(pack)
        checksum, pack_bytes, idx_bytes = builder.build()
        stem = os.path.join(pack_dir, f"pack-{checksum}")
        if self._pack_names is not None:  # libgit2 may open it: its removal must be noticed too
            self._pack_names |= {f"pack-{checksum}.idx"}
        # The new pack may be one of those merged (same objects, same name): never removed.
        merged = [p for p in merged if p.stem != stem]
        if len(builder) <= packs.SMALL_MAX and len(pack_bytes) <= packs.MERGE_BYTES_MAX:
            self._built[stem] = builder.entries()
        # The pack before its idx: readers find packs by their idx.
        batch.add(stem + ".pack", pack_bytes, mode=0o444, content_addressed=True, tmp_prefix="tmp_pack_",
                  dir_mode=0o777)
        batch.add(stem + ".idx", idx_bytes, mode=0o444, content_addressed=True, tmp_prefix="tmp_idx_",
                  dir_mode=0o777)
        if merged:
            batch.when_durable(lambda: packs.retire(retired_list, merged, time.time()))

    def _forget_removed_packs(self, pack_dir: str) -> frozenset[str]:
        """Reopen the object database once :data:`_REOPEN_AFTER` packs it may hold open were removed.

        libgit2 keeps every pack it has read open and mapped until its database
        is reopened: a long-lived store would hold every removed pack's
        descriptor and disk space.  (A hit it answers from such a pack is
        checked after a reopen anyway: see :meth:`add_pending_to`.)  Returns the
        folder's listing, for the merge to choose from.
        """
        try:
            listing = frozenset(os.listdir(pack_dir))
        except OSError:
            listing = frozenset()
        names = frozenset(n for n in listing if n.endswith(".idx"))
        if self._pack_names is not None:
            self._packs_gone += len(self._pack_names - names)
            if self._packs_gone >= _REOPEN_AFTER:
                self.reopen_objects()
        self._pack_names = names
        return listing

    def reopen_objects(self) -> None:
        """Open the object database afresh (worktrees' repositories are opened again when asked for)."""
        try:
            self.repo.set_odb(pygit2.Odb(os.path.join(self.common_dir, "objects")))
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot open the object database: {exc}") from exc
        self._backends = None
        self._worktrees = {}
        self._packs_gone = 0

    def _known(self, oid: str) -> bool:
        """Whether a backend of the object database has ``oid`` *as last listed*.

        Asked of each backend, not of the database: a miss there (the usual case
        for a new object) makes libgit2 rescan the pack folder.  A pack another
        process added since is not seen, and a second copy of an object is harmless.
        """
        if self._backends is None:
            self._backends = list(self.repo.odb.backends)
        try:
            found = _oid(oid)
            return any(backend.exists(found) for backend in self._backends)
        except (ValueError, pygit2.GitError):
            return False

    def flush_objects(self) -> None:
        """Write every staged object durably now (before anything outside this store reads them)."""
        if not self._pending:
            return
        batch = DurableBatch()
        self.add_pending_to(batch)
        batch.commit()

    def discard_pending(self) -> None:
        """Forget staged objects that were never written (a call that stopped before preparing).

        Called as each call starts (which reads the identities afresh with
        :meth:`read_identities`: a long-lived caller sees configuration changes).
        """
        self._pending.clear()
        self._recent = {}
        self._sync_failure = None
        self.drop_ref_content()

    def forget_recent(self) -> None:
        """Drop the blobs the last :meth:`add_pending_to` kept at hand (the call is over)."""
        self._recent = {}

    def default_signature(self, kind: str = "committer") -> Signature:
        """The ``author`` or ``committer`` identity (:func:`git_identity`), read once per call (:meth:`discard_pending`).

        Raises:
            ValueError: ``GIT_<KIND>_DATE`` is in a form git's documentation does not name.
        """
        sig = self._signature.get(kind)
        if sig is None:
            cfg: pygit2.Config | None = None

            def config(name: str) -> str | None:
                nonlocal cfg
                try:
                    if cfg is None:
                        # One snapshot for this identity's lookups: each lookup in the live
                        # configuration stats every config file again (up to four lookups).
                        cfg = self.repo.config.snapshot()
                    value = cfg[name]
                except (KeyError, pygit2.GitError):
                    return None
                return str(value) if value else None

            sig = self._signature[kind] = git_identity(kind, config, os.environ)
        return sig

    def read_identities(self) -> None:
        """Read the author and committer identities afresh (as a call starts).

        Raises:
            ValueError: a ``GIT_<KIND>_DATE`` in a form :func:`parse_git_date` refuses, or a
                name or email libgit2 refuses.
        """
        self._signature = {}
        for kind in ("author", "committer"):
            try:
                signature_line(self.default_signature(kind))  # what libgit2 would refuse, refused now
            except pygit2.GitError as exc:
                raise ValueError(f"{kind}: {exc}") from None

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


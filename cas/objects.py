"""The content-addressed store over git's object database (pygit2).

The only module besides :mod:`cas.worktree` that imports pygit2; libgit2's bare
``GitError`` is translated here, once, into :mod:`cas.errors`.

What it offers the apply protocol:

* reading: resolve a ref, look up a path in a tree (reporting a symlink met
  on the way), read a blob;
* writing immutable objects: blobs, trees rebuilt along the changed paths
  only (:meth:`GitStore.edit_tree`: cost grows with the change, never with the
  repository), commits with trailers;
* :meth:`GitStore.compare_and_swap`: one reference transaction — git's
  ``.lock`` protocol on the branch, the value re-read *under the lock*, checked
  against the expected old value, then set (with a reflog entry);
* :meth:`GitStore.create_key_ref`: the create-only ``refs/oncepatch/keys/<h>``.

Durability: ``enable_fsync_gitdir`` is switched on when the first store opens,
so libgit2 fsyncs loose objects, their folders, refs and reflogs.

Why the key ref is not in the branch's transaction: libgit2 commits a
transaction's refs one lock-file rename at a time, so a crash between them can
leave either one alone.  The branch moves first and the key ref follows; a key
ref therefore always proves that the branch moved, and a branch move without
its key ref is found by recovery through reachability and the reflog.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pygit2

from cas.gitdir import common_dir_of
from cas.errors import GitStoreError, RefLockedError, RefMovedError, RefUpdateUnknown, UsageError

__all__ = ["GitStore", "TreeEntry", "PathLookup", "Signature", "KEY_REF_PREFIX"]

KEY_REF_PREFIX = "refs/oncepatch/keys/"
_FSYNC_ON = False


def _oid(hex_or_oid: str | pygit2.Oid) -> pygit2.Oid:
    """A full hex id as an ``Oid``: looked up directly, not as a prefix (libgit2's slow path)."""
    return hex_or_oid if isinstance(hex_or_oid, pygit2.Oid) else pygit2.Oid(hex=hex_or_oid)


def _enable_fsync() -> None:
    global _FSYNC_ON
    if not _FSYNC_ON:
        pygit2.settings.enable_fsync_gitdir(True)
        _FSYNC_ON = True


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


@dataclass(frozen=True, slots=True)
class Signature:
    name: str
    email: str


class GitStore:
    """An open repository.  Long-lived callers keep one per repository."""

    def __init__(self, path: str) -> None:
        _enable_fsync()
        try:
            self.repo = pygit2.Repository(path)
        except (pygit2.GitError, KeyError) as exc:
            raise UsageError(f"not a git repository: '{path}'") from exc
        self.git_dir = os.path.realpath(self.repo.path)
        self.common_dir = common_dir_of(self.git_dir)

    # -- reading ------------------------------------------------------------------

    def resolve(self, ref: str) -> str | None:
        """The oid a ref points at now (peeled through symbolic refs), ``None`` if absent."""
        try:
            r = self.repo.references.get(ref)
        except (pygit2.GitError, ValueError) as exc:
            raise GitStoreError(f"cannot read ref '{ref}': {exc}") from exc
        if r is None:
            return None
        try:
            return str(r.resolve().target)
        except (pygit2.GitError, KeyError):
            return None

    def commit_tree(self, commit_oid: str) -> str:
        try:
            return str(self.repo[_oid(commit_oid)].peel(pygit2.Commit).tree_id)
        except (KeyError, ValueError, pygit2.GitError) as exc:
            raise GitStoreError(f"cannot read commit '{commit_oid}': {exc}") from exc

    def has_object(self, oid: str) -> bool:
        try:
            return pygit2.Oid(hex=oid) in self.repo.odb
        except ValueError:
            return False

    def lookup_path(self, tree_oid: str, path: str) -> PathLookup:
        """Walk ``path`` down from ``tree_oid`` without reading anything off the path."""
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
        try:
            return bytes(self.repo[_oid(oid)].read_raw())
        except (KeyError, ValueError, pygit2.GitError) as exc:
            raise GitStoreError(f"cannot read blob '{oid}': {exc}") from exc

    # -- writing immutable objects ------------------------------------------------

    def write_blob(self, data: bytes) -> str:
        try:
            return str(self.repo.create_blob(data))
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot write blob: {exc}") from exc

    def edit_tree(self, base_tree: str | None, changes: Mapping[str, TreeEntry | None]) -> str:
        """A new tree: ``base_tree`` with each path set to its entry (``None`` removes it).

        Only the trees on the changed paths are read and rewritten.  A folder
        left empty disappears (git stores no empty trees).
        """
        try:
            oid = self._edit(base_tree, {tuple(p.split("/")): e for p, e in changes.items()})
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot write tree: {exc}") from exc
        if oid is None:
            return str(self.repo.TreeBuilder().write())
        return oid

    def _edit(self, tree_oid: str | None, changes: dict[tuple[str, ...], TreeEntry | None]) -> str | None:
        builder = self.repo.TreeBuilder(tree_oid) if tree_oid else self.repo.TreeBuilder()
        here: dict[str, TreeEntry | None] = {}
        below: dict[str, dict[tuple[str, ...], TreeEntry | None]] = {}
        for parts, entry in changes.items():
            if len(parts) == 1:
                here[parts[0]] = entry
            else:
                below.setdefault(parts[0], {})[parts[1:]] = entry
        # A name may be both a file and a folder in one change (a file giving way
        # to a folder, or back): the side that survives is the one with content.
        for name, sub in below.items():
            if here.get(name) is not None:
                continue  # a file replaces the folder: its contents go with it
            existing = builder.get(name)
            sub_oid = None
            if existing is not None and int(existing.filemode) == pygit2.enums.FileMode.TREE:
                sub_oid = str(existing.id)
            new_sub = self._edit(sub_oid, sub)
            if new_sub is None:
                if builder.get(name) is not None:
                    builder.remove(name)
            else:
                builder.insert(name, pygit2.Oid(hex=new_sub), pygit2.enums.FileMode.TREE)
        for name, entry in here.items():
            if entry is None:
                if name in below:
                    continue  # the file gave way to a folder, written above
                if builder.get(name) is not None:
                    builder.remove(name)
            else:
                builder.insert(name, pygit2.Oid(hex=entry.oid), entry.mode)
        if len(builder) == 0:
            return None
        return str(builder.write())

    def default_signature(self) -> Signature:
        try:
            sig = self.repo.default_signature
            return Signature(sig.name, sig.email)
        except (KeyError, pygit2.GitError):
            return Signature("oncepatch", "oncepatch@localhost")

    def create_commit(self, tree: str, parents: list[str], message: str, author: Signature | None = None) -> str:
        sig = author or self.default_signature()
        s = pygit2.Signature(sig.name, sig.email)
        try:
            return str(
                self.repo.create_commit(None, s, s, message, pygit2.Oid(hex=tree), [pygit2.Oid(hex=p) for p in parents])
            )
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot write commit: {exc}") from exc

    # -- refs ---------------------------------------------------------------------

    def _lock_path(self, ref: str) -> str:
        folder = self.common_dir if ref.startswith("refs/") else self.git_dir
        return os.path.join(folder, ref + ".lock")

    def compare_and_swap(self, ref: str, expected: str | None, new: str, message: str,
                         *, lock_timeout: float = 1.0, precondition: Callable[[], None] | None = None) -> None:
        """Move ``ref`` from ``expected`` to ``new`` atomically, or not at all.

        A held ``<ref>.lock`` is waited for up to ``lock_timeout`` seconds (git
        holds its ref locks for milliseconds; like git's
        ``core.filesRefLockTimeout``), then reported.

        ``precondition`` runs while ``<ref>.lock`` is held, after the compare and
        before the swap; whatever it raises aborts the transaction (the ref is
        not moved, the lock is released) and propagates.  The apply protocol
        checks its fencing token there, so that check and the move are one step.

        Raises:
            RefLockedError: ``<ref>.lock`` stayed held (a live git, or a stale lock).
            RefMovedError: under the lock, the ref is not at ``expected``.
            RefUpdateUnknown: the commit of the transaction failed; the ref may have moved.
        """
        deadline = time.monotonic() + lock_timeout
        delay = 0.001
        while True:
            try:
                self._compare_and_swap_once(ref, expected, new, message, precondition)
                return
            except RefLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def _compare_and_swap_once(self, ref: str, expected: str | None, new: str, message: str,
                               precondition: Callable[[], None] | None) -> None:
        committing = False
        try:
            with self.repo.transaction() as txn:
                try:
                    txn.lock_ref(ref)
                except pygit2.GitError as exc:
                    raise RefLockedError(self._lock_path(ref)) from exc
                actual = self.resolve(ref)  # re-read under the lock: the compare of the CAS
                if actual != expected:
                    raise RefMovedError(ref, actual, expected)
                if precondition is not None:
                    # Race: a check made before taking the lock can be stale by the time
                    # the ref moves (a paused owner whose key was taken over meanwhile).
                    precondition()
                txn.set_target(ref, pygit2.Oid(hex=new), message=message)
                committing = True  # the context manager commits on a clean exit
        except pygit2.GitError as exc:
            if not committing:
                raise GitStoreError(f"cannot update ref '{ref}': {exc}") from exc
            # The rename of <ref>.lock may have happened before the failure
            # (libgit2 fsyncs the folder after renaming): only a query can tell.
            raise RefUpdateUnknown(f"update of ref '{ref}' failed after locking: {exc}") from exc

    def create_key_ref(self, ref: str, target: str, message: str) -> bool:
        """Create ``ref`` → ``target`` if it does not exist; ``False`` if it already points there.

        Raises:
            RefMovedError: it exists and points elsewhere.
        """
        current = self.resolve(ref)
        if current == target:
            return False
        if current is not None:
            raise RefMovedError(ref, current, None)
        # libgit2 logs refs outside refs/heads only when their reflog exists: make it,
        # so the key ref gets its reflog entry (DESIGN.md section 4, step 5).
        log = os.path.join(self.common_dir, "logs", ref)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "ab"):
            pass
        try:
            self.repo.create_reference_direct(ref, pygit2.Oid(hex=target), False, message=message)
        except pygit2.AlreadyExistsError:
            current = self.resolve(ref)
            if current != target:
                raise RefMovedError(ref, current, None) from None
            return False
        except (pygit2.GitError, OSError) as exc:
            # libgit2 reports a held '<ref>.lock' as GitError or, through pygit2, OSError.
            raise RefLockedError(self._lock_path(ref)) from exc
        return True

    def is_ancestor(self, ancestor: str, tip: str) -> bool:
        """``ancestor`` is ``tip`` or reachable from it."""
        if ancestor == tip:
            return True
        try:
            return bool(self.repo.descendant_of(pygit2.Oid(hex=tip), pygit2.Oid(hex=ancestor)))
        except (KeyError, pygit2.GitError):
            return False

    def reflog_names(self, ref: str, oid: str) -> bool:
        """Whether the reflog of ``ref`` ever recorded ``oid`` as a new value."""
        path = os.path.join(self.common_dir, "logs", ref)
        try:
            with open(path, "rb") as fh:
                needle = oid.encode()
                for line in fh:
                    parts = line.split(b" ", 2)
                    if len(parts) >= 2 and parts[1] == needle:
                        return True
        except FileNotFoundError:
            return False
        return False

"""A directory target's generations on disk (docs/DIRECTORIES.md): build, switch, scan, prune.

A folder ``PATH`` managed by oncepatch is a symlink to one immutable
*generation*: the checked-out tree of a commit of a bare object database
beside it, named by the tree's hash::

    PATH -> PATH.oncepatch/generations/<tree>     (a relative symlink)
    PATH.oncepatch/objects.git/                   the bare object database, branch refs/heads/generations
    PATH.oncepatch/generations/<tree>/            one folder per generation, read-only
    PATH.oncepatch/manifests/<tree>               lstat of every entry of that folder as built
    PATH.oncepatch/switch.lock                    held while a generation is built and switched to

Calling sequence of :func:`build` then :func:`switch` (the steps of
:func:`patcher.dirs.sync`):

1. the new tree is materialised under ``generations/.tmp-<tree>-<pid>-<rand>/``:
   a path the trees' diff leaves unchanged is hard-linked from the source
   generation (its manifest entry kept: a link changes no recorded field);
   a changed one is written from its blob (mode 0444, or 0555 when executable);
   the written files and every folder are fsynced (beyond 256 of them, the
   file system is synced once instead: ``syncfs``), then the folders made 0555;
2. the manifest is written durably, then the folder is renamed to
   ``generations/<tree>`` and ``generations/`` fsynced (a crash before leaves
   a ``.tmp-`` folder no reader ever sees, removed by ``recover``);
3. crash point ``after-generation``;
4. a new symlink ``.<name>.oncepatch-link-<pid>-<rand>`` is made beside
   ``PATH`` and renamed over it (``os.replace``, one atomic ``rename``), and
   the parent folder fsynced.

A reader that resolves ``PATH`` once sees one generation, whole.

That is the *whole* layout, the default.  The *shared* one (``init --dir
--share-folders``, ``oncepatch.layout = shared`` in the object database's
config, :attr:`DirLayout.shared`) keeps a folder per git tree under
``trees/`` and links unchanged sub-folders: :mod:`cas.tree_folders`, to
which :func:`build`, :func:`outside_edits` and :func:`digest_mismatches`
hand over; switching, scanning, quarantine and removal are the same.

The manifest records ``(inode, size, mtime_ns, mode)`` and not ``ctime``:
linking a file into the next generation changes its ctime, a write or a
chmod changes what is recorded.  :func:`outside_edits` compares the
current generation with its manifest (lstat only); :func:`digest_mismatches`
reads every byte and compares with the tree (``verify``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import orjson
import pygit2

from cas.crash import crash_point
from cas.folder_ops import (QUARANTINE, compare_folder, is_real_folder, quarantine_entry, read_file_bytes, remove_tree,
                            syncfs, tree_files)
from cas.durable import fsync_dir, write_all, write_durable
from cas.errors import UsageError
from cas.pids import gone as pid_gone

__all__ = ["DirLayout", "layout_of", "current_tree", "foreign_entry", "build", "switch", "outside_edits", "digest_mismatches",
           "generation_folders", "remove_generation", "switch_lock", "leftovers", "tree_files", "syncfs", "BRANCH",
           "HOME_SUFFIX", "QUARANTINE", "is_real_folder", "trusted_generation", "quarantine", "compare_folder",
           "remove_tree", "LAYOUT_CONFIG"]

BRANCH = "refs/heads/generations"
HOME_SUFFIX = ".oncepatch"
_TMP = ".tmp-"
_HEX40 = re.compile(r"[0-9a-f]{40}")
_LINK_MARK = ".oncepatch-link-"


@dataclass(frozen=True, slots=True)
class DirLayout:
    """Where a directory target's parts live (module docstring)."""

    path: str  # PATH, absolute, as given (not resolved: it is the symlink)
    #: The shared layout (``init --dir --share-folders``, :mod:`cas.tree_folders`): one folder per git tree.
    shared: bool = False

    @property
    def home(self) -> str:
        return self.path + HOME_SUFFIX

    @property
    def folder_name(self) -> str:
        """``generations`` (one whole folder per generation) or ``trees`` (the shared layout)."""
        return "trees" if self.shared else "generations"

    @property
    def objects(self) -> str:
        return os.path.join(self.home, "objects.git")

    @property
    def generations(self) -> str:
        """The folder holding the generations (``trees/`` in the shared layout: every tree's folder)."""
        return os.path.join(self.home, self.folder_name)

    @property
    def manifests(self) -> str:
        return os.path.join(self.home, "manifests")

    def generation(self, tree: str) -> str:
        return os.path.join(self.generations, tree)

    def link_target(self, tree: str) -> str:
        """The symlink's text: relative to PATH's folder, so the pair can be moved together."""
        return os.path.join(os.path.basename(self.home), self.folder_name, tree)


#: The object database's config key naming the layout: ``shared`` (``init --dir --share-folders``), else whole.
LAYOUT_CONFIG = "oncepatch.layout"


def layout_of(path: str) -> DirLayout:
    """The layout of the directory target ``path`` (absolute, trailing slashes dropped; a symlink kept).

    Shared or not as its object database's config says (``oncepatch.layout``).
    """
    if not path:
        raise UsageError("--dir needs a folder, not an empty path")
    parent, name = os.path.split(os.path.abspath(path).rstrip("/") or "/")
    if not name:
        raise UsageError(f"'{path}' cannot be a directory target (it has no name)")
    found = DirLayout(os.path.join(os.path.realpath(parent), name))
    config = os.path.join(found.objects, "config")
    if os.path.lexists(config):
        try:
            shared = pygit2.Config(config)[LAYOUT_CONFIG] == "shared"
        except (KeyError, pygit2.GitError, OSError):
            shared = False
        if shared:
            return DirLayout(found.path, shared=True)
    return found


def current_tree(layout: DirLayout) -> str | None:
    """The tree ``PATH`` points at now, or ``None`` (no symlink, or not to one of its generations)."""
    try:
        target = os.readlink(layout.path)
    except OSError:
        return None
    head, name = os.path.split(target)
    if head != os.path.join(os.path.basename(layout.home), layout.folder_name) or not _HEX40.fullmatch(name):
        return None
    return name


def foreign_entry(layout: DirLayout) -> str | None:
    """What ``PATH`` is when it is there but no symlink to one of its generations (``"a file"``, ...), or ``None``.

    ``None`` also when ``PATH`` is missing: the moment between ``init``'s two
    renames, which the next switch finishes.
    """
    try:
        st = os.lstat(layout.path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        return None if current_tree(layout) is not None else f"a symlink to '{os.readlink(layout.path)}'"
    if stat.S_ISDIR(st.st_mode):
        return "a real folder"
    return "a file" if stat.S_ISREG(st.st_mode) else "a special file"


# -- the lock ---------------------------------------------------------------------------------


@contextlib.contextmanager
def switch_lock(layout: DirLayout, timeout: float) -> Iterator[None]:
    """Hold ``switch.lock`` (an flock: dropped by the kernel when its holder dies).

    Raises:
        TimeoutError: still held by another process after ``timeout`` seconds.
    """
    fd = os.open(os.path.join(layout.home, "switch.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"'{layout.home}/switch.lock' is held by another process") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)


# -- building a generation ------------------------------------------------------------------

_Entry = tuple[int, int, int, int]  # inode, size, mtime_ns, mode


def _stat_entry(st: os.stat_result) -> _Entry:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


def _read_manifest(layout: DirLayout, tree: str) -> dict[str, _Entry] | None:
    try:
        with open(os.path.join(layout.manifests, tree), "rb") as fh:
            raw = orjson.loads(fh.read())
    except (OSError, orjson.JSONDecodeError):
        return None
    return {path: (e[0], e[1], e[2], e[3]) for path, e in raw.items()}


def trusted_generation(layout: DirLayout, tree: str) -> bool:
    """``generations/<tree>`` is what a build made: a real folder (not a symlink), with a manifest it matches.

    An entry under a generation's name is not trusted for being there: a
    symlink planted there would make ``PATH`` show another folder's content,
    a folder planted under a tree's name (predictable from a patch) content
    no receipt describes.  The check is :func:`outside_edits` (``lstat`` of
    every entry against the manifest), so its cost grows with the folder.
    """
    return is_real_folder(layout.generation(tree)) and not outside_edits(layout, tree)


def quarantine(layout: DirLayout, tree: str) -> str | None:
    """Move the entry ``generations/<tree>`` aside, unread and undeleted; return where (``None``: nothing there).

    :func:`cas.folder_ops.quarantine_entry`: the new name,
    ``generations/.quarantine-<tree>-<pid>-<rand>``, is never pointed at,
    never linked from, and never removed by ``gc`` or ``recover``: it is
    evidence for its owner to look at (docs/DIRECTORIES.md).
    """
    return quarantine_entry(layout.generations, tree)


def build(repo: pygit2.Repository, layout: DirLayout, tree: str, source: str | None,
          moved_aside: list[str] | None = None, replaced: list[str] | None = None) -> bool:
    """Materialise ``tree`` as ``generations/<tree>`` (steps 1 and 2 of the module docstring); ``False`` if there.

    An entry already under the final name is kept only when
    :func:`trusted_generation`; anything else (a symlink, a folder with no
    manifest or that differs from it) is moved aside by :func:`quarantine`
    (its new path appended to ``moved_aside``) and the generation built anew.

    ``source``: the generation unchanged files are hard-linked from (the current
    one), used only when it is a real folder with a manifest; its sub-folders
    are opened one name at a time with ``O_NOFOLLOW``, so no link is made
    from outside it.  What changed is the trees' diff (libgit2: unchanged
    subtrees are skipped by their ids); every other path of the source's
    manifest is a hard link, keeping its manifest entry.  With no source (or
    no manifest of it) every file is written.  ``replaced``: the paths whose
    source entry was no longer as built when linked (changed outside
    oncepatch since the apply's check) are appended; they are written from
    the tree.

    Raises:
        UsageError: the tree holds a submodule (a commit entry), which a folder cannot hold.
        OSError: the disk's failure; the ``.tmp-`` folder is removed.
    """
    if layout.shared:
        from cas import tree_folders

        return tree_folders.build(repo, layout, tree, source, moved_aside, replaced)
    final = layout.generation(tree)
    if os.path.lexists(final):
        if trusted_generation(layout, tree):
            return False  # content-addressed: built, renamed there complete, and unchanged since
        aside = quarantine(layout, tree)
        if aside is not None and moved_aside is not None:
            moved_aside.append(aside)
    os.makedirs(layout.generations, exist_ok=True)
    os.makedirs(layout.manifests, exist_ok=True)
    tmp = os.path.join(layout.generations, f"{_TMP}{tree}-{os.getpid()}-{os.urandom(4).hex()}")
    src_dir = layout.generation(source) if source else None
    src_manifest = _read_manifest(layout, source) if source and src_dir and is_real_folder(src_dir) else None
    if source is None or src_dir is None or src_manifest is None:
        linked: dict[str, _Entry] = {}
        todo = tree_files(repo, tree)
    else:
        linked, todo = _delta(repo, source, tree, src_manifest)
    target = repo[tree].peel(pygit2.Tree)
    manifest: dict[str, _Entry] = {}
    folders: set[str] = {tmp}
    try:
        os.mkdir(tmp, 0o755)

        def parent_of(dst: str) -> None:
            folder = os.path.dirname(dst)
            if folder in folders:
                return
            os.makedirs(folder, 0o755, exist_ok=True)
            while folder not in folders:
                folders.add(folder)
                folder = os.path.dirname(folder)

        if linked:
            assert src_dir is not None
            gone, changed = _link_all(src_dir, tmp, linked, parent_of)
            if replaced is not None:
                replaced.extend(changed)
            for path in gone + changed:
                found = target[path]  # removed or replaced in the source by hand: written from the tree instead
                todo[path] = (str(found.id), int(found.filemode))
                del linked[path]
            manifest.update(linked)
        for path, (blob, mode) in todo.items():
            dst = os.path.join(tmp, path)
            parent_of(dst)
            manifest[path] = _write(repo, dst, blob, mode, path)
        if len(todo) + len(folders) > _SYNC_EACH_UP_TO:
            syncfs(tmp)  # one sync of the file system beats thousands of fsyncs (an adopted folder)
        else:
            for path, (_blob, mode) in todo.items():
                if mode != pygit2.enums.FileMode.LINK:  # (a symlink is synced with its folder; no fd opens one)
                    _fsync_file(os.path.join(tmp, path))
            for folder in folders:
                fsync_dir(folder)
        for folder in sorted(folders, key=len, reverse=True):
            os.chmod(folder, 0o555)
        write_durable(os.path.join(layout.manifests, tree), orjson.dumps(manifest), mode=0o444)
        os.rename(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise
    fsync_dir(layout.generations)
    return True


def _link_all(src_dir: str, dst_dir: str, paths: dict[str, _Entry], parent_of: Callable[[str], None]
              ) -> tuple[list[str], list[str]]:
    """Hard-link ``paths`` from ``src_dir`` into ``dst_dir``; return those the source no longer has, and those
    it no longer has as built (a link whose ``lstat`` is not its manifest entry, removed again: the entry
    changed since the apply's check).  Both are for the caller to write from the tree.

    Folder by folder through directory descriptors (``linkat``: no path walk
    per file), the folders on a few threads (the system calls release the GIL).
    """
    by_folder: dict[str, list[str]] = {}
    for path in paths:
        folder, _, name = path.rpartition("/")
        by_folder.setdefault(folder, []).append(name)
    for folder in by_folder:
        parent_of(os.path.join(dst_dir, folder, "x"))  # the folders are made here, in order, on this thread
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
    src_fd = os.open(src_dir, flags)  # (a symlink put in the source's place is refused here)

    def open_source(folder: str) -> int:
        """The source's sub-folder ``folder``, each name opened with ``O_NOFOLLOW``: a symlink inside is refused."""
        fd = os.dup(src_fd)
        for name in folder.split("/") if folder else []:
            try:
                sub = os.open(name, flags, dir_fd=fd)
            finally:
                os.close(fd)
            fd = sub
        return fd

    def link_folder(item: tuple[str, list[str]]) -> tuple[list[str], list[str]]:
        folder, names = item
        try:
            sfd = open_source(folder)
        except OSError as exc:
            paths_here = [f"{folder}/{name}" if folder else name for name in names]
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):  # gone: written from the tree
                return paths_here, []
            if exc.errno == errno.ELOOP:  # a symlink put in its place
                return [], paths_here
            raise
        try:
            dfd = os.open(os.path.join(dst_dir, folder), flags)
            try:
                gone: list[str] = []
                changed: list[str] = []
                for name in names:
                    path = f"{folder}/{name}" if folder else name
                    try:
                        os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        gone.append(path)
                        continue
                    except PermissionError:  # (EPERM: a folder put in the file's place)
                        changed.append(path)
                        continue
                    # The apply's check ran before this link: an entry put in the source's place since (a
                    # fifo, another file's inode) must not enter the new generation.  The link is that
                    # entry's inode, so its lstat is what was linked.
                    if list(_stat_entry(os.stat(name, dir_fd=dfd, follow_symlinks=False))) != list(paths[path]):
                        os.unlink(name, dir_fd=dfd)
                        changed.append(path)
                return gone, changed
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    items = list(by_folder.items())
    try:
        if len(items) < 8:
            results = [link_folder(item) for item in items]
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=4) as pool:
                results = list(pool.map(link_folder, items))
        return [p for g, _c in results for p in g], [p for _g, c in results for p in c]
    finally:
        os.close(src_fd)


def _delta(repo: pygit2.Repository, source: str, tree: str, src_manifest: dict[str, _Entry]
           ) -> tuple[dict[str, _Entry], dict[str, tuple[str, int]]]:
    """(paths kept from the source with their manifest entries, paths to write with their blob and mode)."""
    diff = repo[source].peel(pygit2.Tree).diff_to_tree(repo[tree].peel(pygit2.Tree))
    changed: set[str] = set()
    todo: dict[str, tuple[str, int]] = {}
    for delta in diff.deltas:
        changed.add(delta.old_file.path)
        changed.add(delta.new_file.path)
        if delta.status != pygit2.enums.DeltaStatus.DELETED:
            todo[delta.new_file.path] = (str(delta.new_file.id), int(delta.new_file.mode))
    linked = {p: e for p, e in src_manifest.items() if p not in changed}
    return linked, todo


def _write(repo: pygit2.Repository, dst: str, blob: str, mode: int, path: str) -> _Entry:
    """One file of a generation written from its blob (a symlink made from its target)."""
    data = repo[blob].peel(pygit2.Blob).data
    if mode == pygit2.enums.FileMode.LINK:
        os.symlink(os.fsdecode(data), dst)
        return _stat_entry(os.lstat(dst))
    if mode not in (pygit2.enums.FileMode.BLOB, pygit2.enums.FileMode.BLOB_EXECUTABLE):
        raise UsageError(f"'{path}' is a submodule (mode {mode:o}): a directory target holds only files and symlinks")
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, data)
        os.fchmod(fd, 0o555 if mode == pygit2.enums.FileMode.BLOB_EXECUTABLE else 0o444)
        return _stat_entry(os.fstat(fd))  # (synced by build, with the rest)
    finally:
        os.close(fd)


#: Up to this many new files and folders a build fsyncs one by one; beyond, it syncs the file system once.
_SYNC_EACH_UP_TO = 256


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def switch(layout: DirLayout, tree: str) -> None:
    """Point ``PATH`` at ``generations/<tree>``: a new symlink renamed over it (step 4), then its folder synced.

    Raises:
        UsageError: ``PATH`` is a real folder (not adopted: ``oncepatch init --dir``), or a file or
            a symlink that is not to one of its generations (:func:`foreign_entry`): nothing is replaced.
    """
    parent, name = os.path.split(layout.path)
    if is_real_folder(layout.path):
        raise UsageError(f"'{layout.path}' is a folder, not a directory target: adopt it first with "
                         f"'oncepatch init --dir {layout.path}'")
    what = foreign_entry(layout)
    if what is not None:
        # Renaming the link over it would delete what a person put there (a file, their own link).
        raise UsageError(f"'{layout.path}' was replaced by {what}: it is no longer the directory target; "
                         f"move it away, then run 'oncepatch recover --dir {layout.path}'")
    tmp = os.path.join(parent, f".{name}{_LINK_MARK}{os.getpid()}-{os.urandom(4).hex()}")
    os.symlink(layout.link_target(tree), tmp)
    try:
        os.replace(tmp, layout.path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


# -- edits outside oncepatch ------------------------------------------------------------------


def outside_edits(layout: DirLayout, tree: str, paths: Iterable[str] | None = None) -> list[str]:
    """Paths of generation ``tree`` that differ from its manifest (changed, added, removed), sorted; lstat only.

    A generation with no manifest (built by another version, or its manifest
    lost) is reported as ``"(no manifest)"``, one whose folder is gone as
    ``"(no folder)"`` (``recover`` builds it again).

    ``paths`` (the shared layout only; :func:`cas.tree_folders.outside_edits`):
    compare only the folders those paths run through.  A whole generation is
    compared whole, whatever ``paths`` says.

    Every entry is stat'ed relative to its folder's descriptor (``fstatat``, as
    the build links: no path walk per file) and compared with the manifest's
    lists as parsed (:func:`compare_folder`); a path the manifest lists and the
    walk did not meet is reported, never looked up by its path.  (Threads were
    measured and dropped: the comparison holds the GIL, and it is most of the
    cost; docs/BENCHMARKS.md, "Issue 28".)
    """
    if layout.shared:
        from cas import tree_folders

        return tree_folders.outside_edits(layout, tree, paths)
    try:
        with open(os.path.join(layout.manifests, tree), "rb") as fh:
            manifest = orjson.loads(fh.read())
    except (OSError, orjson.JSONDecodeError):
        return ["(no manifest)"]
    found = compare_folder(layout.generation(tree), manifest)
    return ["(no folder)"] if found is None else found


def _walk(root: str, unreadable: list[str]) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below ``root`` (symlinks not followed); a sub-folder that cannot be listed goes to ``unreadable``."""
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(os.path.join(root, rel) if rel else root)
        except OSError:
            if not rel:
                raise
            unreadable.append(rel)  # (made 0000 by hand: it differs; what it holds is not read)
            continue
        with it:
            for entry in it:
                path = rel + entry.name
                st = entry.stat(follow_symlinks=False)
                yield path, st
                if stat.S_ISDIR(st.st_mode):
                    stack.append(path + "/")


def digest_mismatches(repo: pygit2.Repository, layout: DirLayout, tree: str) -> list[str]:
    """Paths of generation ``tree`` whose bytes or mode differ from the tree, or that one has and not the other."""
    if layout.shared:
        from cas import tree_folders

        return tree_folders.digest_mismatches(repo, layout, tree)
    want = tree_files(repo, tree)
    root = layout.generation(tree)
    bad: list[str] = []
    seen: set[str] = set()
    unreadable: list[str] = []
    for path, st in _walk(root, unreadable):
        if stat.S_ISDIR(st.st_mode):
            continue
        seen.add(path)
        entry = want.get(path)
        if entry is None:
            bad.append(path)
            continue
        full = os.path.join(root, path)
        if stat.S_ISLNK(st.st_mode):
            ok = entry[1] == pygit2.enums.FileMode.LINK and str(pygit2.hash(os.fsencode(os.readlink(full)))) == entry[0]
        else:
            try:
                data = read_file_bytes(full)
            except PermissionError:  # made 0000 by hand: it differs
                bad.append(path)
                continue
            if data is None:  # a fifo or a device where a file was: it differs, and is never waited on
                bad.append(path)
                continue
            executable = bool(st.st_mode & 0o100)
            mode = pygit2.enums.FileMode.BLOB_EXECUTABLE if executable else pygit2.enums.FileMode.BLOB
            ok = str(pygit2.hash(data)) == entry[0] and mode == entry[1]
        if not ok:
            bad.append(path)
    under = tuple(unreadable)
    bad += [p for p in want if p not in seen and not p.startswith(under)]  # (named by their folder)
    return sorted(bad + unreadable)


# -- retention and leftovers ----------------------------------------------------------------


def generation_folders(layout: DirLayout) -> list[str]:
    """The trees whose generation folder exists (complete ones: ``.tmp-`` folders are not listed)."""
    try:
        names = os.listdir(layout.generations)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if _HEX40.fullmatch(n))


def remove_generation(layout: DirLayout, tree: str) -> None:
    """Remove generation ``tree``: renamed to a ``.tmp-`` name first (never seen half removed), then its manifest.

    A symlink found under the generation's name (planted: oncepatch makes
    none there) is renamed and unlinked like a folder, never followed.
    """
    doomed = os.path.join(layout.generations, f"{_TMP}{tree}-{os.getpid()}-{os.urandom(4).hex()}")
    os.rename(layout.generation(tree), doomed)
    fsync_dir(layout.generations)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(layout.manifests, tree))
    remove_tree(doomed)


def leftovers(layout: DirLayout, *, remove: bool) -> list[str]:
    """``.tmp-`` generation folders and link tmp files of processes that are gone (removed when ``remove``)."""
    found: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(layout.generations):
            if name.startswith(_TMP):
                pid = name[len(_TMP) + 41:].split("-", 1)[0]
                if pid.isdigit() and pid_gone(int(pid)):
                    found.append(os.path.join(layout.generations, name))
    parent, base = os.path.split(layout.path)
    prefix = f".{base}{_LINK_MARK}"
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(parent):
            pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
            if pid.isdigit() and pid_gone(int(pid)):
                found.append(os.path.join(parent, name))
    if remove:
        for path in found:
            remove_tree(path)  # (a symlink unlinked, never followed)
    return found

"""A directory target's shared layout: one read-only folder per git tree, unchanged sub-folders shared by symlinks.

Chosen once, by ``oncepatch init --dir PATH --share-folders`` (recorded as
``oncepatch.layout = shared`` in the object database's config;
docs/DIRECTORIES.md, "Sharing folders")::

    PATH -> PATH.oncepatch/trees/<root>        a relative symlink: the current generation
    PATH.oncepatch/trees/<oid>/                one folder per git tree, read-only, never changed once named
    PATH.oncepatch/manifests/<oid>             {"self": [inode, mtime_ns, mode], "climb": n,
                                                "files": {rel: [inode, size, mtime_ns, mode]}, "links": {rel: oid}}

Inside a tree's folder each file is a hard link or written from its blob
(0444, 0555 when executable), and each sub-folder is either *shared* -- a
relative symlink ``name -> ../<sub>`` (one more ``../`` per level of
nesting) to its own tree's folder, the same folder in every generation that
holds that tree -- or *inline*, a real folder, when a symlink of the content
inside it climbs out of it with ``..``: the kernel resolves ``..``
physically, so from a shared folder it would reach ``trees/``.  A content
symlink that climbs after it descended (``x/../y``) makes the whole
generation inline (it may pass through any folder).  ``climb`` is how far
above its folder the content's relative symlinks reach (0: shareable).

Calling sequence of :func:`build` (then :func:`cas.generations.switch`):

1. each tree the new root needs and ``trees/`` lacks is made under
   ``trees/.tmp-<oid>-<pid>-<rand>/``, children before parents: an entry the
   source generation holds at the same path with the same id (a file, a
   content symlink, a shared sub-folder's link at the same depth) is
   hard-linked from the source's folder (opened one name at a time with
   ``O_NOFOLLOW``) and keeps its manifest entry; anything else is written, or
   made as a link to its tree's folder (built first if missing);
2. the folders are made 0555; the written files, the new folders and each
   manifest's tmp file (its ``self``: the folder's own lstat, after the
   chmod) are fsynced at once (beyond 256 files and folders, the file system
   is synced once: ``syncfs``), then the manifests renamed into place;
3. each folder is renamed to ``trees/<oid>``, children first, and
   ``manifests/`` and ``trees/`` fsynced at once.  A crash before leaves ``.tmp-`` folders (``recover`` removes
   them) and perhaps complete tree folders no generation points at (``gc``).

A new generation therefore costs the entries of the folders on the changed
paths (one ``link`` or ``symlink`` each), not the files of the folder.  A
tree folder found under its name is shared as is when it is a real folder
whose own lstat is its manifest's ``self`` (a cheap proof: an entry added,
removed or renamed in it, or a chmod of it, changes that; a write into one of
its files does not -- :func:`outside_edits` without ``paths``, as ``verify``
runs it, compares every entry).  Anything else under a tree's name is moved
aside (:func:`cas.folder_ops.quarantine_entry`) and the folder built again.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pygit2

from cas.durable import DurableBatch, write_all
from cas.errors import UsageError
from cas.folder_ops import (compare_folder, is_real_folder, quarantine_entry, read_file_bytes, remove_tree, syncfs,
                            tree_files)

__all__ = ["build", "repair", "outside_edits", "digest_mismatches", "reachable", "read_manifest", "reusable"]

_TMP = ".tmp-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
#: The climb of a tree holding a symlink that climbs after it descended: never shared, nor anything above it.
_ANYWHERE = 1 << 30
#: Up to this many new files and folders a build fsyncs one by one; beyond, it syncs the file system once.
_SYNC_EACH_UP_TO = 256
_TREE, _LINK = pygit2.enums.FileMode.TREE, pygit2.enums.FileMode.LINK
_BLOB, _EXEC = pygit2.enums.FileMode.BLOB, pygit2.enums.FileMode.BLOB_EXECUTABLE


def _trees(layout: Any) -> str:
    return str(layout.generations)  # (``trees/`` for a shared layout: cas.generations.DirLayout)


def _entry(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode]


def _self(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_mtime_ns, st.st_mode]


def read_manifest(layout: Any, oid: str) -> dict[str, Any] | None:
    """The manifest of ``trees/<oid>`` as parsed, or ``None`` (missing, torn, or not this layout's shape)."""
    try:
        with open(os.path.join(layout.manifests, oid), "rb") as fh:
            raw = orjson.loads(fh.read())
    except (OSError, orjson.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), t) for k, t in
                                            (("self", list), ("climb", int), ("files", dict), ("links", dict))):
        return None
    return raw


def reusable(layout: Any, oid: str, manifest: dict[str, Any] | None = None) -> bool:
    """``trees/<oid>`` may be shared as built: a real folder whose own lstat is its manifest's ``self``."""
    m = manifest if manifest is not None else read_manifest(layout, oid)
    if m is None:
        return False
    try:
        st = os.lstat(os.path.join(_trees(layout), oid))
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _self(st) == m["self"]


def link_climb(target: bytes) -> int:
    """How far above its own folder the relative symlink ``target`` reaches (``_ANYWHERE``: ``..`` after a name)."""
    text = os.fsdecode(target)
    if text.startswith("/"):
        return 0
    level = low = 0
    named = False
    for part in text.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if named:
                return _ANYWHERE
            level -= 1
            low = min(low, level)
        else:
            named = True
            level += 1
    return -low


class _InlineAll(Exception):
    """A symlink that climbs after it descended: build the generation again with every sub-folder inline."""


@dataclass(slots=True)
class _Source:
    """Where the source generation holds a folder: ``trees/<folder>/<rel>``, its tree, its folder's manifest."""

    folder: str
    rel: str  # "" or "a/b/"
    depth: int  # levels of ``rel`` below the tree's folder
    tree: pygit2.Tree
    manifest: dict[str, Any]


class _Builder:
    def __init__(self, repo: pygit2.Repository, layout: Any, inline_all: bool) -> None:
        self.repo, self.layout, self.inline_all = repo, layout, inline_all
        self.trees = _trees(layout)
        self.trees_fd: int | None = None
        self.climbs: dict[str, int] = {}
        self.ready: set[str] = set()  # tree folders there (reused) or made by this build
        self.made: list[tuple[str, str, dict[str, Any]]] = []  # (oid, tmp, manifest) children first
        self.tmps: list[str] = []
        self.written: list[str] = []
        self.folders: list[str] = []
        self.moved_aside: list[str] = []
        self.replaced: list[str] = []  # paths of the source not as built when linked (written from the tree)

    # -- what can be shared

    def climb(self, oid: str) -> int:
        if oid not in self.climbs:
            m = read_manifest(self.layout, oid)
            if m is not None and reusable(self.layout, oid, m):
                c = int(m["climb"])
            else:
                c = 0
                for e in self.repo[oid].peel(pygit2.Tree):
                    if e.filemode == _TREE:
                        c = max(c, self.climb(str(e.id)) - 1)
                    elif e.filemode == _LINK:
                        c = max(c, link_climb(self.repo[e.id].peel(pygit2.Blob).data))
            self.climbs[oid] = c
        return self.climbs[oid]

    def shared(self, oid: str) -> bool:
        if self.inline_all:
            return False
        c = self.climb(oid)
        if c >= _ANYWHERE:
            raise _InlineAll
        return c == 0

    # -- the source generation

    def source_child(self, src: _Source | None, name: str) -> _Source | None:
        if src is None or name not in src.tree:
            return None
        old = src.tree[name]
        if old.filemode != _TREE:
            return None
        sub = self.repo[old.id].peel(pygit2.Tree)
        linked = src.manifest["links"].get(src.rel + name)
        if linked is None:
            return _Source(src.folder, f"{src.rel}{name}/", src.depth + 1, sub, src.manifest)
        m = read_manifest(self.layout, linked)
        return None if m is None else _Source(linked, "", 0, sub, m)

    def open_source(self, src: _Source | None) -> int | None:
        """``trees/<folder>/<rel>`` opened one name at a time with ``O_NOFOLLOW``; ``None`` if not a real folder."""
        if src is None:
            return None
        fd = None
        try:
            fd = os.open(self.trees, _DIR_FLAGS)
            for name in [src.folder] + [p for p in src.rel.split("/") if p]:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = sub
            return fd
        except OSError:
            if fd is not None:
                os.close(fd)
            return None

    # -- making folders

    def ensure(self, oid: str, src: _Source | None) -> None:
        """``trees/<oid>`` there: reused when :func:`reusable`, else built (a planted entry moved aside first)."""
        if oid in self.ready:
            return
        final = os.path.join(self.trees, oid)
        if os.path.lexists(final):
            if reusable(self.layout, oid):
                self.ready.add(oid)
                return
            aside = quarantine_entry(self.trees, oid)
            if aside is not None:
                self.moved_aside.append(aside)
        self.make(oid, src)

    def make(self, oid: str, src: _Source | None) -> None:
        tmp = os.path.join(self.trees, f"{_TMP}{oid}-{os.getpid()}-{os.urandom(4).hex()}")
        os.mkdir(tmp, 0o700)
        self.tmps.append(tmp)
        files: dict[str, list[int]] = {}
        links: dict[str, str] = {}
        c = self.fill(tmp, "", self.repo[oid].peel(pygit2.Tree), 0, src, files, links)
        if c >= _ANYWHERE and not self.inline_all:
            raise _InlineAll
        self.folders.append(tmp)
        self.ready.add(oid)
        self.climbs[oid] = c
        self.made.append((oid, tmp, {"climb": c, "files": files, "links": links}))

    def fill(self, top: str, rel: str, tree: pygit2.Tree, depth: int, src: _Source | None,
             files: dict[str, list[int]], links: dict[str, str]) -> int:
        """Fill ``top/rel`` with ``tree``'s entries; return the tree's climb."""
        here = os.path.join(top, rel) if rel else top
        dfd = os.open(here, _DIR_FLAGS)
        sfd = self.open_source(src)
        climb = 0
        try:
            for entry in tree:
                name, eid, mode = str(entry.name), str(entry.id), int(entry.filemode)
                path = rel + name
                old = src.tree[name] if src is not None and name in src.tree else None
                same = old is not None and str(old.id) == eid and int(old.filemode) == mode
                srel = (src.rel + name) if src is not None else ""
                known = src.manifest["files"].get(srel) if src is not None and same else None
                if mode == _TREE:
                    if known is not None and src is not None and src.manifest["links"].get(srel) == eid \
                            and not self.inline_all and self.is_folder(eid):
                        # Shared in the source: the folder is that tree's; its link is reused at the same depth.
                        self.ready.add(eid)
                        links[path] = eid
                        if depth == src.depth and sfd is not None and self.link(sfd, dfd, name, known, path):
                            files[path] = known
                        else:
                            files[path] = self.share_link(dfd, name, eid, depth)
                        continue
                    if self.shared(eid):
                        self.ensure(eid, self.source_child(src, name))
                        links[path] = eid
                        files[path] = self.share_link(dfd, name, eid, depth)
                        continue
                    os.mkdir(name, 0o700, dir_fd=dfd)
                    self.folders.append(os.path.join(here, name))
                    c = self.fill(top, path + "/", self.repo[eid].peel(pygit2.Tree), depth + 1,
                                  self.source_child(src, name), files, links)
                    climb = max(climb, c - 1)
                    continue
                if mode == _LINK:
                    climb = max(climb, link_climb(self.repo[eid].peel(pygit2.Blob).data))
                if known is not None and src is not None and sfd is not None \
                        and srel not in src.manifest["links"] and self.link(sfd, dfd, name, known, path):
                    files[path] = known  # (a write into it since shows against the source's entry)
                    continue
                files[path] = self.write(dfd, here, name, eid, mode, path)
        finally:
            os.close(dfd)
            if sfd is not None:
                os.close(sfd)
        return climb

    def is_folder(self, oid: str) -> bool:
        """``trees/<oid>`` is a real folder (``fstatat`` in ``trees/``'s descriptor: no path walk, no link followed)."""
        if self.trees_fd is None:
            self.trees_fd = os.open(self.trees, _DIR_FLAGS)
        try:
            return stat.S_ISDIR(os.stat(oid, dir_fd=self.trees_fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def close(self) -> None:
        if self.trees_fd is not None:
            os.close(self.trees_fd)
            self.trees_fd = None

    def link(self, sfd: int, dfd: int, name: str, known: list[int], path: str) -> bool:
        linked = _link(sfd, dfd, name, known)
        if linked is None:
            self.replaced.append(path)
        return bool(linked)

    def share_link(self, dfd: int, name: str, oid: str, depth: int) -> list[int]:
        os.symlink("../" * (depth + 1) + oid, name, dir_fd=dfd)
        return _entry(os.stat(name, dir_fd=dfd, follow_symlinks=False))

    def write(self, dfd: int, here: str, name: str, blob: str, mode: int, path: str) -> list[int]:
        data = self.repo[blob].peel(pygit2.Blob).data
        if mode == _LINK:
            os.symlink(os.fsdecode(data), name, dir_fd=dfd)
            return _entry(os.stat(name, dir_fd=dfd, follow_symlinks=False))
        if mode not in (_BLOB, _EXEC):
            raise UsageError(f"'{path}' is a submodule (mode {mode:o}): a directory target holds only files and "
                             f"symlinks")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            write_all(fd, data)
            os.fchmod(fd, 0o555 if mode == _EXEC else 0o444)
            self.written.append(os.path.join(here, name))
            return _entry(os.fstat(fd))
        finally:
            os.close(fd)

    # -- making it durable and named

    def finish(self) -> None:
        """Steps 2 and 3: two rounds of concurrent syncs (:class:`cas.durable.DurableBatch`), the renames between."""
        for folder in sorted(self.folders, key=len, reverse=True):
            os.chmod(folder, 0o555)
        batch = DurableBatch()
        for oid, tmp, manifest in self.made:
            manifest["self"] = _self(os.lstat(tmp))  # (after the chmod; a rename in trees/ keeps the mtime)
            batch.add(os.path.join(self.layout.manifests, oid), orjson.dumps(manifest), mode=0o444)
        if len(self.written) + len(self.folders) > _SYNC_EACH_UP_TO:
            syncfs(self.trees)  # one sync of the file system beats thousands of fsyncs (an adoption)
        else:
            batch.sync_first(self.written + self.folders)  # with the manifests' tmp files, in one round

        def rename_all() -> list[str]:
            for oid, tmp, _manifest in self.made:  # children first: a named folder's links name named folders
                os.rename(tmp, os.path.join(self.trees, oid))
            return [self.trees]

        batch.commit(after_renames=rename_all)


def _link(sfd: int, dfd: int, name: str, known: list[int]) -> bool | None:
    """Hard-link ``name`` from the source's folder: ``True``; ``False`` when it is gone; ``None`` when it is no
    longer ``known`` (the link removed again).

    The apply's check ran before: an entry put in the source's place since (a
    fifo, another file's inode) must not enter the new folder.  The link is that
    entry's inode, so its ``lstat`` is what was linked.
    """
    try:
        os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except PermissionError:  # (EPERM: a folder put in the file's place)
        return None
    if _entry(os.stat(name, dir_fd=dfd, follow_symlinks=False)) != list(known):
        os.unlink(name, dir_fd=dfd)
        return None
    return True


def _source(repo: pygit2.Repository, layout: Any, source: str | None) -> _Source | None:
    if source is None:
        return None
    m = read_manifest(layout, source)
    if m is None:
        return None
    try:
        return _Source(source, "", 0, repo[source].peel(pygit2.Tree), m)
    except (KeyError, ValueError):
        return None


def build(repo: pygit2.Repository, layout: Any, tree: str, source: str | None,
          moved_aside: list[str] | None = None, replaced: list[str] | None = None) -> bool:
    """Materialise generation ``tree`` as ``trees/<tree>`` (module docstring); ``False`` if it is there already.

    A root found under its name is taken as built when it is a real folder
    whose entries match its manifest (``lstat`` of each: not of its shared
    sub-folders' files, which the cheap proof covers); anything else is moved
    aside.  ``source``: the generation shown now (what unchanged entries are
    linked from).  ``replaced``: the paths whose source entry was no longer
    as built when linked (changed outside oncepatch since the apply's check)
    are appended; they are written from the tree.

    Raises:
        UsageError: the tree holds a submodule.
        OSError: the disk's failure; every ``.tmp-`` folder of this build is removed.
    """
    final = os.path.join(_trees(layout), tree)
    if os.path.lexists(final):
        m = read_manifest(layout, tree)
        if is_real_folder(final) and m is not None and not _compare(final, m["files"]):
            return False
        aside = quarantine_entry(_trees(layout), tree)
        if aside is not None and moved_aside is not None:
            moved_aside.append(aside)
    os.makedirs(_trees(layout), exist_ok=True)
    os.makedirs(layout.manifests, exist_ok=True)
    for inline_all in (False, True):
        b = _Builder(repo, layout, inline_all)
        try:
            b.make(tree, _source(repo, layout, source))
            b.finish()
        except _InlineAll:
            _remove_all(b.tmps)
            continue
        except BaseException:
            _remove_all(b.tmps)
            raise
        finally:
            b.close()
        if moved_aside is not None:
            moved_aside.extend(b.moved_aside)
        if replaced is not None:
            replaced.extend(b.replaced)
        return True
    raise AssertionError("unreachable: an inline build raises no _InlineAll")


def repair(repo: pygit2.Repository, layout: Any, root: str, *, dry_run: bool = False) -> list[str]:
    """Build again each tree folder generation ``root`` reaches that is gone, no real folder, or has no manifest.

    The root's own folder is :func:`build`'s; this follows its manifests'
    links (``recover --dir``: a shared folder removed by hand leaves links
    that name nothing).  An entry under such a tree's name is moved aside;
    the folder is built from the objects.  Returns the trees (to build, with
    ``dry_run``).  The caller holds ``switch.lock``.

    Raises:
        OSError: the disk's failure; the ``.tmp-`` folders of this repair are removed.
    """
    b = _Builder(repo, layout, False)
    missing: list[str] = []
    try:
        seen: set[str] = set()
        todo = [str(v) for v in (read_manifest(layout, root) or {}).get("links", {}).values()]
        while todo:
            oid = todo.pop()
            if oid in seen:
                continue
            seen.add(oid)
            m = read_manifest(layout, oid)
            if m is not None and b.is_folder(oid):
                todo += [str(v) for v in m["links"].values()]
                continue
            missing.append(oid)
            if not dry_run:
                b.ensure(oid, None)
        if b.made:
            b.finish()
    except BaseException:
        _remove_all(b.tmps)
        raise
    finally:
        b.close()
    return sorted(missing)


def _remove_all(tmps: Iterable[str]) -> None:
    for tmp in tmps:
        remove_tree(tmp)


# -- checking ---------------------------------------------------------------------------------


def _compare(root: str, files: dict[str, Any]) -> list[str] | None:
    """Entries of the folder ``root`` (inline folders walked, links not followed) that differ from ``files``."""
    return compare_folder(root, files)


def _folders(layout: Any, root: str, paths: Iterable[str] | None,
             read: Callable[[str], dict[str, Any] | None]) -> Iterator[tuple[str, str]]:
    """(tree oid, its path in the generation) of each tree folder to check: every one reached, or those on ``paths``.

    ``read``: a manifest by its tree (read once per call, whatever the number of paths).
    """
    seen: set[str] = set()
    if paths is None:
        todo = [(root, "")]
        while todo:
            oid, prefix = todo.pop()
            if oid in seen:
                continue
            seen.add(oid)
            yield oid, prefix
            m = read(oid)
            for rel, sub in (m or {}).get("links", {}).items():
                todo.append((sub, f"{prefix}{rel}/"))
        return
    yield root, ""
    seen.add(root)
    folders = {os.path.dirname(os.path.normpath(p)) for p in paths}  # (paths the patch layer checked: no "..")
    for folder in sorted(folders):
        oid, prefix, rel = root, "", ""
        for part in folder.split("/") if folder else []:
            m = read(oid)
            sub = (m or {}).get("links", {}).get(rel + part)
            if sub is None:
                rel += part + "/"
                continue
            oid, prefix, rel = sub, f"{prefix}{rel}{part}/", ""
            if oid not in seen:
                seen.add(oid)
                yield oid, prefix


def outside_edits(layout: Any, root: str, paths: Iterable[str] | None = None) -> list[str]:
    """Paths of generation ``root`` that differ from the manifests of the folders holding them; sorted, lstat only.

    ``paths``: only the tree folders on those paths (the root's, and each
    shared folder a path runs through) are compared: what an apply that
    changes them links from.  ``None``: every folder the generation reaches.
    ``"(no manifest)"`` / ``"(no folder)"`` as in :func:`cas.generations.outside_edits`; a shared
    sub-folder with neither is reported by its path with a trailing ``/``.
    """
    cache: dict[str, dict[str, Any] | None] = {}

    def read(oid: str) -> dict[str, Any] | None:
        if oid not in cache:
            cache[oid] = read_manifest(layout, oid)
        return cache[oid]

    if read(root) is None:
        return ["(no manifest)"]
    if not is_real_folder(os.path.join(_trees(layout), root)):
        return ["(no folder)"]
    out: list[str] = []
    for oid, prefix in _folders(layout, root, paths, read):
        m = read(oid)
        found = None if m is None else _compare(os.path.join(_trees(layout), oid), m["files"])
        if found is None:
            out.append(prefix or "(no manifest)")
            continue
        out += [prefix + p for p in found]
    return sorted(out)


def digest_mismatches(repo: pygit2.Repository, layout: Any, root: str) -> list[str]:
    """Paths of generation ``root`` whose bytes, mode or place differ from the tree (read as a reader reads it).

    A shared sub-folder's link must say exactly ``../<oid>`` at its depth and
    name the tree git has there; it is then entered by its name under
    ``trees/`` (``O_NOFOLLOW``), never by following the link.
    """
    want = tree_files(repo, root)
    bad: list[str] = []
    seen: set[str] = set()
    cut: list[str] = []
    trees = _trees(layout)
    expected_dirs = _tree_dirs(repo, root)
    todo: list[tuple[str, str]] = [(os.path.join(trees, root), "")]
    while todo:
        folder, prefix = todo.pop()
        try:
            entries = _scan(folder)
        except OSError:
            bad.append(prefix or "/")
            continue
        for rel, st in entries:
            path = prefix + rel
            full = os.path.join(folder, rel)
            if stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode) and path in expected_dirs:
                text = os.readlink(full)
                oid = expected_dirs[path]
                if text == "../" * (rel.count("/") + 1) + oid and is_real_folder(os.path.join(trees, oid)):
                    todo.append((os.path.join(trees, oid), path + "/"))
                else:
                    bad.append(path + "/")
                    cut.append(path + "/")
                continue
            seen.add(path)
            entry = want.get(path)
            if entry is None:
                bad.append(path)
                continue
            if stat.S_ISLNK(st.st_mode):
                ok = entry[1] == _LINK and str(pygit2.hash(os.fsencode(os.readlink(full)))) == entry[0]
            else:
                try:
                    data = read_file_bytes(full)
                except PermissionError:  # made 0000 by hand: it differs
                    bad.append(path)
                    continue
                mode = _EXEC if st.st_mode & 0o100 else _BLOB
                # (None: a fifo or a device where a file was; it differs, and is never waited on)
                ok = data is not None and str(pygit2.hash(data)) == entry[0] and mode == entry[1]
            if not ok:
                bad.append(path)
    gone = [p for p in want if p not in seen]
    if cut:
        under = tuple(cut)
        gone = [p for p in gone if not p.startswith(under)]  # (named by their folder's bad link)
    return sorted(set(bad + gone))


def _tree_dirs(repo: pygit2.Repository, root: str) -> dict[str, str]:
    """Every sub-folder of ``root`` by path: its tree's id."""
    out: dict[str, str] = {}

    def walk(t: pygit2.Tree, prefix: str) -> None:
        for e in t:
            if e.filemode == _TREE:
                out[prefix + str(e.name)] = str(e.id)
                walk(repo[e.id].peel(pygit2.Tree), f"{prefix}{e.name}/")

    walk(repo[root].peel(pygit2.Tree), "")
    return out


def _scan(root: str) -> list[tuple[str, os.stat_result]]:
    """Every entry below ``root`` (real folders walked, symlinks not followed): (path relative to it, lstat)."""
    out: list[tuple[str, os.stat_result]] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                out.append((rel + entry.name, st))
                if stat.S_ISDIR(st.st_mode):
                    stack.append(rel + entry.name + "/")
    return out


# -- retention --------------------------------------------------------------------------------


def reachable(repo: pygit2.Repository, layout: Any, roots: Iterable[str]) -> set[str]:
    """Every tree folder a generation of ``roots`` may reach: the roots and all their subtrees (by git), and
    every link their manifests record (what was built, should it differ)."""
    out: set[str] = set()
    todo = [r for r in roots if r]
    while todo:
        oid = todo.pop()
        if oid in out:
            continue
        out.add(oid)
        with contextlib.suppress(KeyError, ValueError):
            todo += [str(e.id) for e in repo[oid].peel(pygit2.Tree) if e.filemode == _TREE]
        m = read_manifest(layout, oid)
        if m is not None:
            todo += [str(v) for v in m["links"].values()]
    return out

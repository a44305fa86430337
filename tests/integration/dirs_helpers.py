"""Helpers of the directory target tests (docs/DIRECTORIES.md): folders, patches, generation views."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from conftest import git

__all__ = ["write_tree", "patch_between", "read_view", "view_of_folder", "tree_views", "snapshot_dir", "snapshot_tree",
           "tree_of"]


def write_tree(folder: Path, files: dict[str, str | bytes]) -> None:
    for rel, data in files.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)


def patch_between(scratch: Path, before: dict[str, str | bytes], after: dict[str, str | bytes]) -> bytes:
    """``git diff --full-index --binary -M`` from ``before`` to ``after`` (made in a scratch repository)."""
    scratch.mkdir(parents=True)
    git(scratch, "init", "-q")
    write_tree(scratch, before)
    git(scratch, "add", "-A")
    git(scratch, "commit", "-qm", "before")
    for p in scratch.rglob("*"):
        if p.is_file() and ".git" not in p.parts:
            p.unlink()
    write_tree(scratch, after)
    git(scratch, "add", "-A")
    return git(scratch, "diff", "--cached", "--full-index", "--binary", "-M").encode("utf-8", "surrogateescape")


def read_view(dir_fd: int) -> dict[str, str]:
    """Every file under ``dir_fd`` (a folder opened once) by path: its sha256; read relative to the descriptor.

    Sub-folders are entered through symlinks (a shared layout's are links to their trees' folders), as a
    reader that follows links reads.
    """
    out: dict[str, str] = {}
    for root, _dirs, files, rootfd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=True):
        for name in files:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=rootfd)
            try:
                chunks = []
                while True:
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
            finally:
                os.close(fd)
            out[os.path.normpath(os.path.join(root, name))] = hashlib.sha256(b"".join(chunks)).hexdigest()
    return out


def view_of_folder(path: Path | str) -> dict[str, str]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return read_view(fd)
    finally:
        os.close(fd)


def tree_views(objects: Path, ref: str = "refs/heads/generations") -> dict[str, dict[str, str]]:
    """Every tree of ``ref``'s history: ``{tree: {path: sha256}}`` (what a reader may see)."""
    out: dict[str, dict[str, str]] = {}
    for line in git(objects, "log", "--format=%T", ref).split():
        if line in out:
            continue
        view: dict[str, str] = {}
        for entry in git(objects, "ls-tree", "-r", "-z", line).split("\0"):
            if not entry:
                continue
            meta, path = entry.split("\t", 1)
            blob = meta.split()[2]
            data = __import__("subprocess").run(["git", "cat-file", "blob", blob], cwd=objects, capture_output=True,
                                                check=True).stdout
            view[path] = hashlib.sha256(data).hexdigest()
        out[line] = view
    return out


def tree_of(objects: Path, ref: str = "refs/heads/generations") -> str:
    return git(objects, "rev-parse", f"{ref}^{{tree}}").strip()


def snapshot_dir(path: Path) -> dict[str, object]:
    """Everything a refusal must leave as it was: the symlink, every file of the home (bytes, mode), refs."""
    home = Path(str(path) + ".oncepatch")
    files: dict[str, object] = {"link": os.readlink(path)}
    for p in sorted(home.rglob("*")):
        st = p.lstat()
        rel = str(p.relative_to(home))
        if stat.S_ISREG(st.st_mode):
            files[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(st.st_mode), st.st_mtime_ns)
        else:
            files[rel] = stat.S_IFMT(st.st_mode)
    return files


def snapshot_tree(root: Path, *, mtimes: bool = True) -> dict[str, object]:
    """Every entry under ``root``, itself included: type, mode, bytes or link text, and (``mtimes``) the
    mtime of each file and sub-folder; nothing followed."""
    out: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            p = os.path.join(folder, name)
            st = os.lstat(p)
            rel = os.path.normpath(os.path.relpath(p, root))
            when = st.st_mtime_ns if mtimes and name != "." else 0
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", st.st_mode, st.st_mtime_ns if mtimes else 0,
                            hashlib.sha256(Path(p).read_bytes()).hexdigest())
            else:
                out[rel] = (stat.S_IFMT(st.st_mode), st.st_mode, when)
    return out

"""Locating a repository's folders without libgit2 (stdlib only).

The replay and ``status`` paths must not import pygit2, yet they need the
default store (``<git-common-dir>/oncepatch``) and the checked-out branch.
This module reads git's on-disk layout directly: a ``.git`` folder, or a
``.git`` file (``gitdir: <path>``) for linked worktrees and submodules, whose
``commondir`` file names the shared folder.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from cas.errors import SHOWN_PATH_CHARS, UsageError, clip

__all__ = ["GitLayout", "config_section", "discover", "read_head", "common_dir_of", "worktrees_on", "read_gitfile", "core_worktree",
           "main_worktree_of", "all_worktrees", "resolve_symbolic", "MainWorktreeUnknown", "worktrees_rebasing"]

#: How many symbolic refs are followed (git's own limit is 5).
_MAX_SYMREF_DEPTH = 5


class MainWorktreeUnknown(UsageError):
    """The branch is checked out in a main worktree whose folder cannot be found (exit 2)."""


@dataclass(frozen=True, slots=True)
class GitLayout:
    """``workdir`` is ``None`` for a bare repository; paths are absolute and real."""

    workdir: str | None
    git_dir: str
    common_dir: str


def _text(path: str, limit: int = -1) -> str:
    """The file's text (git's files hold bytes: undecodable ones kept), stripped.

    Raises:
        OSError: it cannot be read.
    """
    # os.read rather than a buffered file object: git's small files are read several times a
    # call (HEAD, a branch's ref, commondir, config), and the object's set-up (fstat, isatty,
    # seek) cost more syscalls than the read itself.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        left = limit
        while left != 0:
            chunk = os.read(fd, 65536 if left < 0 else left)
            if not chunk:
                break
            chunks.append(chunk)
            if left > 0:
                left -= len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "surrogateescape").strip()


def read_gitfile(path: str) -> str | None:
    """The git dir a ``.git`` file (``gitdir: <path>``) names, real and absolute; ``None`` if not one."""
    try:
        text = _text(path, 4096)
    except OSError:
        return None
    if not text.startswith("gitdir:"):
        return None
    return os.path.realpath(os.path.join(os.path.dirname(path), text[len("gitdir:"):].strip()))


def _is_git_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "HEAD")) and (
        os.path.isdir(os.path.join(path, "objects")) or os.path.isfile(os.path.join(path, "commondir")))


def common_dir_of(git_dir: str) -> str:
    try:
        return os.path.realpath(os.path.join(git_dir, _text(os.path.join(git_dir, "commondir"))))
    except FileNotFoundError:
        return git_dir


def discover(path: str) -> GitLayout:
    """Find the repository containing ``path`` (walking up, as git does).

    Raises:
        UsageError: no repository there.
    """
    start = os.path.realpath(path)
    if not os.path.isdir(start):
        raise UsageError(f"not a folder: '{clip(path, SHOWN_PATH_CHARS)}'")
    cur = start
    while True:
        dotgit = os.path.join(cur, ".git")
        if os.path.isdir(dotgit) and _is_git_dir(dotgit):
            git_dir = os.path.realpath(dotgit)
            # A '.git' folder set bare (a "bare repository with worktrees" kept as '.git'):
            # git sees no worktree above it, and neither does oncepatch.
            return GitLayout(None if _is_bare(_core(git_dir)) else cur, git_dir, common_dir_of(git_dir))
        if os.path.isfile(dotgit):
            target = read_gitfile(dotgit)
            if target and _is_git_dir(target):
                return GitLayout(cur, target, common_dir_of(target))
        if _is_git_dir(cur) and os.path.basename(cur) != ".git":
            # A bare repository (or we were handed a git dir directly).
            return GitLayout(None, cur, common_dir_of(cur))
        parent = os.path.dirname(cur)
        if parent == cur:
            raise UsageError(f"not a git repository (or any parent): '{clip(path, SHOWN_PATH_CHARS)}'")
        cur = parent


def read_head(git_dir: str) -> str | None:
    """The ref HEAD points at (``refs/heads/x``), or ``None`` when detached.

    A HEAD that is a symlink to ``refs/...`` (``core.preferSymlinkRefs``) names
    that ref, as git reads it, or the branch a ``ref:`` line in it names.
    """
    head = os.path.join(git_dir, "HEAD")
    with contextlib.suppress(OSError):
        target = os.readlink(head)
        if target.startswith("refs/"):
            text = _text(head, 4096)
            return text[4:].strip() if text.startswith("ref:") else target
    text = _text(head)
    return text[4:].strip() if text.startswith("ref:") else None


def resolve_symbolic(common_dir: str, ref: str) -> str:
    """``ref`` with the symbolic branch refs it names followed (``refs/heads/master`` → ``refs/heads/main``).

    A branch alias is a loose ref file holding ``ref: <target>``; git's
    commands move the target through it.  A chain longer than git's limit,
    or one that leaves ``refs/heads/``, ends where it is.
    """
    for _ in range(_MAX_SYMREF_DEPTH):
        try:
            text = _text(os.path.join(common_dir, *ref.split("/")), 4096)
        except (OSError, ValueError):
            return ref
        target = text[len("ref:"):].strip()
        if not text.startswith("ref:") or not target.startswith("refs/heads/"):
            return ref
        ref = target
    return ref


def worktrees_on(common_dir: str, ref: str, main: str | None = None, *, strict: bool = False
                 ) -> list[tuple[str, str]]:
    """``(workdir, git_dir)`` of every worktree whose HEAD is the symbolic ref ``ref``.

    The main worktree (unless bare) is ``main`` when the caller opened the
    repository from there (a ``.git`` file of ``--separate-git-dir`` or of a
    submodule), else as :func:`main_worktree_of` finds it.  A worktree whose
    HEAD cannot be read is not on ``ref``; with ``strict`` only one with no
    HEAD file is not, and any other error (EIO, EACCES) is raised: recovery
    must not read "cannot tell" as "not checked out here".

    Raises:
        MainWorktreeUnknown: the main worktree has ``ref`` checked out and cannot be found.
        OSError: ``strict``, and a HEAD could not be read.
    """
    found: list[tuple[str, str]] = []
    core = _core(common_dir) if _head_names(common_dir, common_dir, ref, strict) else None
    if core is not None and not _is_bare(core):
        workdir = main or _main_workdir(common_dir, core)
        if workdir is None:
            # It has the branch checked out, somewhere no path here leads to: moving the
            # branch would leave its index a staged revert of the commit.
            raise MainWorktreeUnknown(
                f"'{ref}' is checked out in the main worktree of '{common_dir}', which cannot be found from "
                f"here (a --separate-git-dir repository): run from that worktree (--repo <worktree>)",
                details={"reason": "main_worktree_unknown"})
        if os.path.isdir(workdir):
            found.append((workdir, common_dir))
    found += [(workdir, gd) for workdir, gd in _linked_worktrees(common_dir)
              if _head_names(gd, common_dir, ref, strict)]
    return found


def worktrees_rebasing(common_dir: str, ref: str) -> list[str]:
    """The worktrees (their git dirs) in the middle of a rebase or a bisect of the branch ``ref``.

    git counts such a branch as checked out there (``branch_checked_out``:
    ``git branch -f`` and ``git fetch`` refuse to move it): HEAD is detached
    meanwhile, and the rebase's last step moves the branch only from where it
    found it.  Read from git's own state files: ``rebase-merge/head-name``,
    ``rebase-apply/head-name`` (the full ref), ``BISECT_START`` (the branch's
    short name).
    """
    short = ref.removeprefix("refs/heads/")
    found = []
    for git_dir in [common_dir, *(gd for _workdir, gd in _linked_worktrees(common_dir))]:
        for name, want in (("rebase-merge/head-name", ref), ("rebase-apply/head-name", ref), ("BISECT_START", short)):
            try:
                named = _text(os.path.join(git_dir, name), 4096).strip()
            except (OSError, ValueError):
                continue
            if named == want or resolve_symbolic(common_dir, named) == ref:
                found.append(git_dir)
                break
    return found


def _linked_worktrees(common_dir: str) -> list[tuple[str, str]]:
    """``(workdir, git_dir)`` of the linked worktrees listed under ``worktrees/`` whose folder exists."""
    wt_root = os.path.join(common_dir, "worktrees")
    try:
        names = sorted(os.listdir(wt_root))
    except OSError:
        return []
    found = []
    for name in names:
        gd = os.path.join(wt_root, name)
        try:
            dotgit = _text(os.path.join(gd, "gitdir"))
        except OSError:
            continue
        workdir = os.path.dirname(os.path.realpath(os.path.join(gd, dotgit)))
        if os.path.isdir(workdir):
            found.append((workdir, os.path.realpath(gd)))
    return found


def main_worktree_of(common_dir: str) -> str | None:
    """The main worktree's folder of the repository whose common git dir is ``common_dir``, as git finds it.

    ``core.worktree`` when set (git sets it for submodules), else the folder
    above a common dir named ``.git``; ``None`` when bare or not found from
    here (a ``--separate-git-dir`` one from a linked worktree, as for ``git worktree list``).
    """
    core = _core(common_dir)
    return None if _is_bare(core) else _main_workdir(common_dir, core)


def _main_workdir(common_dir: str, core: dict[str, str]) -> str | None:
    workdir = core_worktree(common_dir, core)
    if workdir is None and os.path.basename(common_dir) == ".git":
        workdir = os.path.dirname(common_dir)
    return workdir


def all_worktrees(common_dir: str) -> list[str]:
    """The real folders of the repository's worktrees that exist: its main one (when found), then the linked ones."""
    main = main_worktree_of(common_dir)
    found = [main] if main is not None and os.path.isdir(main) else []
    return found + [workdir for workdir, _gd in _linked_worktrees(common_dir)]


def _head_names(git_dir: str, common_dir: str, ref: str, strict: bool = False) -> bool:
    """Whether the HEAD of ``git_dir`` is ``ref``, directly or through branch aliases (``strict``: see
    :func:`worktrees_on`)."""
    try:
        head = read_head(git_dir)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        if strict:
            raise
        return False
    return head is not None and (head == ref or resolve_symbolic(common_dir, head) == ref)


def _is_bare(core: dict[str, str]) -> bool:
    """``core.bare`` true in ``[core]`` settings read by :func:`_core` (git's boolean spellings)."""
    return core.get("bare", "").lower() in ("true", "yes", "on", "1")


def _core(git_dir: str) -> dict[str, str]:
    """The ``[core]`` settings of the repository's own config file (:func:`config_section`)."""
    return config_section(git_dir, "core")


def config_section(git_dir: str, wanted: str) -> dict[str, str]:
    """The settings of ``[wanted]`` in the repository's own config file (names lowercased; the last one wins).

    Read without git (a few hundred bytes): no includes, no subsections.
    """
    try:
        text = _text(os.path.join(git_dir, "config"))
    except OSError:
        return {}
    section = ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line[1:line.find("]")].strip().lower() if "]" in line else ""
            continue
        name, eq, rest = line.partition("=")
        if section == wanted and eq:
            found[name.strip().lower()] = rest.strip().strip('"')
    return found


def core_worktree(git_dir: str, core: dict[str, str] | None = None) -> str | None:
    """``core.worktree`` of the repository's own config (relative to the git dir), if set."""
    value = (core if core is not None else _core(git_dir)).get("worktree")
    return os.path.realpath(os.path.join(git_dir, os.path.expanduser(value))) if value else None

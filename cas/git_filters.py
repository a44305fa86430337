"""Conversions between a blob and its working file that only git itself reproduces.

libgit2 converts line endings (``text``, ``eol``, ``core.autocrlf``) as git
does, and :mod:`cas.worktree` uses it for those.  Three attributes it does
not reproduce: ``filter=<driver>`` (git-lfs among them: git runs the
driver's commands, libgit2 none), ``working-tree-encoding`` (libgit2 has no
such conversion) and ``ident`` (libgit2 expands ``$Id$`` only in a blob it
reads itself, so a file written from a blob's bytes kept ``$Id$`` and a
checked-out file looked changed).  For a path with any of them git is asked:
``git cat-file --filters`` for a blob's working bytes, ``git hash-object``
for a working file's blob id (the clean side git's status compares).  Where
git cannot be run, the callers keep libgit2's answer.
"""

from __future__ import annotations

import os
import subprocess

import pygit2

from cas.hashing import git_blob_oid

__all__ = ["GIT_ONLY_ATTRIBUTES", "needs_git", "git_output", "smudged_by_git", "blob_id_by_git", "cleaned_oid",
           "apply_filters"]

#: The attributes whose conversion only git reproduces (module docstring).
GIT_ONLY_ATTRIBUTES = ("filter", "working-tree-encoding", "ident")
#: Variables that would point git at another repository, index or object store than ``workdir``'s.
_LOCATION_VARS = frozenset({"GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                            "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_COMMON_DIR", "GIT_NAMESPACE",
                            "GIT_PREFIX", "GIT_CEILING_DIRECTORIES", "GIT_DISCOVERY_ACROSS_FILESYSTEM"})
_CLEAN_REPOS: dict[str, pygit2.Repository] = {}


def needs_git(repo: pygit2.Repository, path: str) -> bool:
    """Whether an attribute of :data:`GIT_ONLY_ATTRIBUTES` is set for ``path`` in ``repo``'s worktree."""
    try:
        return any(repo.get_attr(path, name) not in (None, False) for name in GIT_ONLY_ATTRIBUTES)
    except (pygit2.GitError, ValueError):
        return False


def git_output(workdir: str, *args: str) -> bytes | None:
    """``git args`` in ``workdir``: its output, or ``None`` when it failed.

    Without the variables that locate a repository (a hook's ``GIT_DIR``, say);
    the others stay: ``GIT_CONFIG_*`` may be where a filter driver is configured.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LOCATION_VARS}
    try:
        res = subprocess.run(["git", *args], cwd=workdir, env=env, capture_output=True, check=False, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def smudged_by_git(workdir: str, path: str, oid: str) -> bytes | None:
    """The bytes git writes into ``workdir`` at ``path`` for blob ``oid`` (``None``: git could not say)."""
    return git_output(workdir, "cat-file", "--filters", f"--path={path}", oid)


def blob_id_by_git(workdir: str, path: str) -> str | None:
    """The blob id git gives the working file ``path`` of ``workdir`` (``None``: git could not say)."""
    out = git_output(workdir, "hash-object", "--", path)
    return None if out is None else out.strip().decode("ascii", "replace")


def cleaned_oid(workdir: str, path: str, data: bytes) -> str:
    """The blob id git gives ``data``, the file of ``workdir`` at ``path``: its clean filters applied.

    The worktree's repository is kept open (a few racily clean entries of one
    index are asked in a row).
    """
    try:
        repo = _CLEAN_REPOS.get(workdir)
        if repo is None:
            if len(_CLEAN_REPOS) > 8:
                _CLEAN_REPOS.clear()
            repo = _CLEAN_REPOS[workdir] = pygit2.Repository(workdir)
        filters = repo.load_filter_list(path, pygit2.enums.FilterMode.TO_ODB)
        converted = data if filters is None else apply_filters(filters, data)
    except (pygit2.GitError, KeyError, ValueError):
        converted = data
    if converted is None:  # NUL bytes, which pygit2 would cut: git hashes the file
        return blob_id_by_git(workdir, path) or git_blob_oid(data)
    return git_blob_oid(converted)


def apply_filters(filters: pygit2.filter.FilterList, data: bytes) -> bytes | None:
    """libgit2's filters applied to ``data``; ``None`` for data holding a NUL byte (git's to convert).

    pygit2's ``FilterList.apply_to_buffer`` reads its result as a C string: a
    binary file under ``text`` came back cut at its first NUL byte.  libgit2's
    own filters add no NUL byte, so a result of data without one is whole.
    """
    return None if b"\0" in data else filters.apply_to_buffer(data)

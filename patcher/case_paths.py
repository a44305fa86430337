"""Paths that differ only in case, in a repository whose file system ignores case (``core.ignorecase``).

git sets ``core.ignorecase = true`` where the file system of a worktree
folds case (macOS, Windows, a case-folding folder on Linux), and a
repository copied from one keeps it.  There ``README`` and ``readme`` are one
file: a commit holding both cannot be checked out (one overwrites the other,
and git then shows it modified).  ``git apply --index`` does not look: it
adds ``readme`` beside a tracked ``README`` (and ``Src/x.py`` beside a
tracked ``src/``), and on a file system that folds case it writes over the
tracked file.  oncepatch refuses such a patch before anything is written
(``unsafe_path``, ``reason: case_collision``, exit 4), on a checked-out branch
and on one that is not alike: the setting describes the repository, and the
commit would be the same (docs/DECISIONS.md, "Paths differing only in case").

A path collides when one of its folders or its file name, folded
(:func:`fold`), equals a different name that stays in the tree: a tracked
entry the patch does not delete or move away, or another path the patch adds.
Renaming a file to another case of its own name is no collision (the old
name goes).  With ``core.ignorecase`` unset or false nothing is checked:
on a case-sensitive file system both names are distinct files, as git keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cas.objects import GitStore
from patcher.errors import UnsafePath

__all__ = ["fold", "case_collisions", "refuse_case_collisions"]

#: ``folder -> {name: still in the tree after the patch}`` of the base tree (``None``: no such folder).
Lister = Callable[[str], "dict[str, bool] | None"]


def fold(name: str) -> str:
    """The name as a file system that ignores case compares it (Unicode simple lower case, no expansion)."""
    return name.lower()


def case_collisions(new_paths: Iterable[str], listing: Lister) -> list[tuple[str, str]]:
    """``(new path, the path it collides with)`` for each added path that differs only in case from another.

    ``listing(folder)`` gives the base tree's entries of ``folder`` and whether
    each stays after the patch; it is asked only along the new paths.
    """
    found: list[tuple[str, str]] = []
    seen: dict[str, str] = {}  # folded prefix of a new path -> the prefix as written
    for path in new_paths:
        parts = path.split("/")
        in_base = True
        for i, part in enumerate(parts):
            prefix = "/".join(parts[: i + 1])
            other = seen.setdefault(fold(prefix), prefix)
            if other != prefix:
                found.append((path, other))
                break
            if not in_base:
                continue
            entries = listing("/".join(parts[:i]))
            if entries is None:
                in_base = False
                continue
            clash = next((n for n, stays in entries.items() if stays and n != part and fold(n) == fold(part)), None)
            if clash is not None:
                found.append((path, "/".join([*parts[:i], clash])))
                break
            in_base = part in entries
    return found


def refuse_case_collisions(store: GitStore, base_tree: str | None, outputs: Iterable[dict[str, object]],
                           deletes: Iterable[str]) -> None:
    """Refuse a plan adding a path that differs only in case from one that stays, where ``core.ignorecase`` is set.

    Raises:
        UnsafePath: ``reason: case_collision``; nothing was written.
    """
    new_paths = [str(o["path"]) for o in outputs if o.get("op") in ("add", "rename")]
    if not new_paths or not store.config_bool("core.ignorecase"):
        return
    gone = set(deletes)

    def stays(path: str, oid: str, mode: int) -> bool:
        if mode != 0o040000:
            return path not in gone
        return any(f"{path}/{sub}" not in gone for sub in store.list_files(oid))

    def listing(folder: str) -> dict[str, bool] | None:
        entries = None if base_tree is None else store.folder_entries(base_tree, folder)
        if entries is None:
            return None
        return {name: stays(f"{folder}/{name}" if folder else name, oid, mode)
                for name, (oid, mode) in entries.items()}

    found = case_collisions(new_paths, listing)
    if found:
        path, other = found[0]
        raise UnsafePath(
            f"refusing to add '{path}': it differs only in case from '{other}', and core.ignorecase is true "
            f"(a file system that ignores case holds one file for both)",
            details={"path": path, "reason": "case_collision", "collides_with": other,
                     "paths": [p for p, _ in found]})

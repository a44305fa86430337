"""Path-safety checks for the paths a patch touches (pure: no I/O).

A patch may only name paths *inside* the repository's working tree and never
git's own files.  :func:`check_path` accepts a path and returns its normal
form, or raises :class:`~patcher.errors.UnsafePath` (``details`` =
``{"path": <as given>, "reason": <short text>}``).  Refused:

* the empty path (also ``.``, which normalises to nothing);
* a name that is not UTF-8 (its bytes arrive as surrogates): receipts and
  error envelopes are JSON text (the message shows such a byte as ``\\xe9``);
* control characters ``\\x00``-``\\x1f`` (NUL included);
* absolute paths: a leading ``/``, a leading ``\\`` (UNC ``\\\\host``), or a
  Windows drive prefix ``C:`` (also ``C:x``, drive-relative);
* any backslash: it is a separator on Windows, so ``a\\..\\b`` could escape;
* a trailing ``/`` (a directory, not a file);
* an empty component (``a//b``): refused rather than normalised, since no tool
  emits it and it usually means a path was glued together wrongly;
* a ``..`` component;
* a component that is git's directory under any spelling git itself refuses
  (``verify_path`` with ``core.protectNTFS``/``core.protectHFS``): ``.git`` in
  any case, followed by any run of spaces and dots, or by ``:`` (an NTFS
  stream, ``.git::$INDEX_ALLOCATION``); the NTFS short name ``git~1``;
  ``.git`` with HFS+-ignorable code points (zero-width joiners, ...) inside.

``.`` components are removed (``./a/./b`` → ``a/b``); nothing else is
rewritten.  :func:`check_paths` checks a whole patch's paths together: no
duplicates, and no path that is a leading directory of another (``a`` and
``a/b`` cannot both be files) unless the patch removes it.

Whether a path runs through a symlink in the target tree needs the tree and is
checked by the apply protocol, not here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from patcher.errors import UnsafePath

__all__ = ["check_path", "check_paths"]

_CONTROL = re.compile(r"[\x00-\x1f]")
_DRIVE = re.compile(r"^[A-Za-z]:")
# NTFS: '.git' or 'git~1' (any case) then only spaces/dots, then the end or ':'.
_NTFS_DOTGIT = re.compile(r"^(?:\.git|git~1)[ .]*(?::.*)?$", re.IGNORECASE | re.DOTALL)
# Code points HFS+ ignores when comparing names (git's is_hfs_dotgit list).
_HFS_IGNORABLE = dict.fromkeys(
    [0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF]
)


def _show(path: str) -> str:
    """The path for a message: non-printable characters escaped so the message stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in path)


def _refuse(path: str, reason: str, **extra: str) -> UnsafePath:
    return UnsafePath(
        f"unsafe path '{_show(path)}': {reason}",
        details={"path": path, "reason": reason, **extra},
    )


def _is_git_dir(component: str) -> bool:
    if _NTFS_DOTGIT.match(component):
        return True
    return component.translate(_HFS_IGNORABLE).casefold() == ".git"


def check_path(path: str) -> str:
    """Return ``path`` as a normalised POSIX path relative to the repository root.

    Raises:
        UnsafePath: for any of the forms listed in the module docstring.
    """
    if path == "":
        raise _refuse(path, "empty path")
    if not path.isascii():
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            # Bytes that are not UTF-8 (a Latin-1 name) arrive as surrogates; receipts and
            # the error envelope are JSON text, which cannot hold them.
            try:
                shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            except UnicodeEncodeError:  # a lone surrogate that stands for no byte ("\ud800" in JSON)
                shown = path.encode("utf-8", "backslashreplace").decode("ascii")
            raise _refuse(shown, "not UTF-8") from None
    if _CONTROL.search(path):
        raise _refuse(path, "control character in path")
    if path.startswith(("/", "\\")) or _DRIVE.match(path):
        raise _refuse(path, "absolute path")
    if "\\" in path:
        raise _refuse(path, "backslash in path")
    if path.endswith("/"):
        raise _refuse(path, "trailing slash")
    parts: list[str] = []
    for component in path.split("/"):
        if component == "":
            raise _refuse(path, "empty path component")
        if component == ".":
            continue
        if component == "..":
            raise _refuse(path, "'..' component")
        if _is_git_dir(component):
            raise _refuse(path, "'.git' component")
        parts.append(component)
    if not parts:
        raise _refuse(path, "empty path")
    return "/".join(parts)


def check_paths(paths: Iterable[str], *, removed: Iterable[str] = ()) -> None:
    """Check every path (as :func:`check_path`) and the set of them together.

    ``removed`` names those of ``paths`` that the patch takes away (deletes,
    rename sources): only paths that remain files afterwards may not nest, so
    a file may become a folder (delete ``x``, add ``x/y``) and back.

    Raises:
        UnsafePath: a path is unsafe; two paths normalise to the same path
            (reason ``duplicate path``); or of two paths that both remain, one
            is a leading directory of the other (``details["conflicts_with"]``
            names the deeper one).
    """
    seen: dict[str, str] = {}
    for raw in paths:
        norm = check_path(raw)
        if norm in seen:
            raise _refuse(raw, "duplicate path")
        seen[norm] = raw
    gone = {check_path(raw) for raw in removed}
    for norm, raw in seen.items():
        if norm in gone:
            continue
        parent, sep, _ = norm.rpartition("/")
        while sep:
            if parent in seen and parent not in gone:
                raise _refuse(
                    seen[parent],
                    f"is both a file and the directory of '{_show(norm)}'",
                    conflicts_with=raw,
                )
            parent, sep, _ = parent.rpartition("/")

"""Path-safety checks for the paths a patch touches (pure: no I/O).

A patch may only name paths *inside* the working tree and never git's own
files; what is refused is listed in docs/SECURITY.md (path escapes, ``.git``
under every spelling git refuses, git's own files as symlinks).  The
matching follows git's ``is_hfs_dot*`` (``utf8.c``), ``is_ntfs_dot*``
(``path.c``) and ``verify_path``/``verify_dotfile`` (``read-cache.c``, with
``core.protectNTFS`` and ``core.protectHFS`` on whatever the platform) rule
for rule, each tried at the start of every component.  ``.`` components are
removed; nothing else is rewritten.  An empty component (``a//b``) is refused,
not normalised: no tool emits it, and it usually means a path was glued
together wrongly.  Whether a path runs through a symlink in the target tree
needs the tree and is checked by the apply protocol, not here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from patcher.errors import UnsafePath

__all__ = ["check_path", "check_paths", "verify_path"]

_CONTROL = re.compile(r"[\x00-\x1f]")
_DRIVE = re.compile(r"^[A-Za-z]:")
#: The longest file name (NAME_MAX) and relative path (PATH_MAX less its terminator) a checkout can write
#: on Linux: git takes longer ones into a tree, but no worktree can hold them (ENAMETOOLONG).
_NAME_MAX = 255
_PATH_MAX = 4095
#: The most components a path may have: the tree edit and the folders a checkout makes go one call
#: deeper per folder, so a deeper path (up to 2048 fit in PATH_MAX) would end in a RecursionError.
_MAX_DEPTH = 512
# Code points HFS+ ignores when comparing names (git's next_hfs_char).
_HFS_IGNORABLE = frozenset([0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF])
_MODE_LINK = 0o120000
# ASCII case only: git folds with tolower() on ASCII needles (no Unicode case folding:
# 'ſ' is not 's' to git, so '.gitmoduleſ' is an ordinary name).
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
#: The files git reads from the working tree that may not be symlinks: (name without the
#: dot, the NTFS short-name prefix git derives from its hash: path.c's is_ntfs_dot_str calls).
_LINK_REFUSED = (("gitmodules", "gi7eba"), ("gitattributes", "gi7d29"), ("gitignore", "gi250a"),
                 ("mailmap", "maba30"))


def _lower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


def _is_hfs_dot(rest: str, needle: str) -> bool:
    """git's ``is_hfs_dot_generic``: ``rest`` starts with ``.<needle>`` (ignorables skipped), then ``/`` or the end."""
    chars = (c for c in rest if ord(c) not in _HFS_IGNORABLE)
    if next(chars, "") != ".":
        return False
    for want in needle:
        c = next(chars, "")
        if not c.isascii() or _lower(c) != want:  # ('' is ASCII, and never equal)
            return False
    return next(chars, "/") == "/"


def _only_spaces_and_periods(rest: str, start: int) -> bool:
    """The tail of git's ``is_ntfs_dot_generic``: from ``start`` only spaces and dots, up to the end or a ``:``."""
    for c in rest[start:]:
        if c == ":":
            return True
        if c not in " .":
            return False
    return True


def _is_ntfs_dotgit(rest: str) -> bool:
    """git's ``is_ntfs_dotgit``: ``.git`` or ``git~1``, then only spaces and dots up to a separator, ``:`` or the end."""
    if _lower(rest[:4]) == ".git":
        tail = rest[4:]
    elif _lower(rest[:3]) == "git" and rest[3:5] == "~1":
        tail = rest[5:]
    else:
        return False
    for c in tail:
        if c in "\\/:":
            return True
        if c not in ". ":
            return False
    return True


def _is_ntfs_dot(rest: str, name: str, short_prefix: str) -> bool:
    """git's ``is_ntfs_dot_generic``: ``.<name>``, its short name ``<name[:6]>~1..4``, or a fall-back short name."""
    if rest[:1] == "." and _lower(rest[1:1 + len(name)]) == name:
        return _only_spaces_and_periods(rest, len(name) + 1)
    if _lower(rest[:6]) == name[:6] and rest[6:7] == "~" and rest[7:8] in ("1", "2", "3", "4"):
        return _only_spaces_and_periods(rest, 8)
    # A fall-back short name: up to six characters of the hashed prefix, '~', a digit 1-9, digits.
    saw_tilde = False
    i = 0
    while i < 8:
        if i >= len(rest):
            return False
        c = rest[i]
        if saw_tilde:
            if not "0" <= c <= "9":
                return False
        elif c == "~":
            i += 1
            if i >= len(rest) or not "1" <= rest[i] <= "9":
                return False
            saw_tilde = True
        elif i >= 6 or not c.isascii() or _lower(c) != short_prefix[i]:
            return False
        i += 1
    return _only_spaces_and_periods(rest, 8)


def _rest(components: list[str], n: int) -> str:
    """What git's checks see of the rest of the path from component ``n``: it, and ``/`` when more follow.

    Every check stops at the separator, so the components after it never matter
    (and the cost stays linear in the path's length).
    """
    return components[n] + "/" if n + 1 < len(components) else components[n]


def _names_git_dir(rest: str) -> bool:
    """Whether the component starting ``rest`` (the rest of the path) is git's directory to git."""
    if rest[:1] not in (".", "g", "G") and rest.isascii():
        # Every spelling below starts with '.' or 'git' once HFS+'s ignorable code points
        # (never ASCII) are skipped: the common case, decided without trying each.
        return False
    return (_is_hfs_dot(rest, "git") or _is_ntfs_dotgit(rest)
            or (_lower(rest[:4]) == ".git" and rest[4:5] in ("", "/")))  # verify_dotfile


def _link_refused(rest: str) -> str | None:
    """The git file (``.gitmodules``, ...) the component starting ``rest`` names, if git refuses it as a symlink."""
    for name, short in _LINK_REFUSED:
        if _is_hfs_dot(rest, name) or _is_ntfs_dot(rest, name, short):
            return "." + name
    return None


def _show(path: str) -> str:
    """The path for a message: non-printable characters escaped so the message stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in path)


def _refuse(path: str, reason: str, **extra: str) -> UnsafePath:
    return UnsafePath(f"unsafe path '{_show(path)}': {reason}", details={"path": path, "reason": reason, **extra})


def check_path(path: str) -> str:
    """Return ``path`` as a normalised POSIX path relative to the repository root.

    Raises:
        UnsafePath: for any of the forms docs/SECURITY.md lists.
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
    components = path.split("/")
    for n, component in enumerate(components):
        if component == "":
            raise _refuse(path, "empty path component")
        if component == ".":
            continue
        if component == "..":
            raise _refuse(path, "'..' component")
        if _names_git_dir(_rest(components, n)):
            raise _refuse(path, "'.git' component")
        if len(component) > _NAME_MAX // 4 and len(component.encode("utf-8")) > _NAME_MAX:
            raise _refuse(path, f"path component longer than {_NAME_MAX} bytes")
        parts.append(component)
    if not parts:
        raise _refuse(path, "empty path")
    return "/".join(parts)


def verify_path(path: str, mode: int) -> str:
    """:func:`check_path`, and git's refusal of its own files as symlinks (``mode`` ``0o120000``).

    ``mode``: the git mode of the entry the patch leaves at ``path``.

    Raises:
        UnsafePath: as :func:`check_path`; or a symlink that git would read as
            ``.gitmodules``, ``.gitattributes``, ``.gitignore`` or ``.mailmap``
            (reason ``'<name>' as a symlink``).
    """
    norm = check_path(path)
    if mode & 0o170000 == _MODE_LINK:
        components = norm.split("/")
        for n in range(len(components)):
            name = _link_refused(_rest(components, n))
            if name is not None:
                raise _refuse(path, f"'{name}' as a symlink")
    return norm


def check_paths(paths: Iterable[str], *, removed: Iterable[str] = ()) -> None:
    """Check every path (as :func:`check_path`) and the set of them together.

    ``removed`` names those of ``paths`` that the patch takes away (deletes,
    rename sources): only paths that remain files afterwards may not nest, so
    a file may become a folder (delete ``x``, add ``x/y``) and back.

    Raises:
        UnsafePath: a path is unsafe, longer than a checkout can write or deeper than the tree edit
            goes (512 components); two paths normalise to the same path
            (reason ``duplicate path``); or of two paths that both remain, one
            is a leading directory of the other (``details["conflicts_with"]``
            names the deeper one).
    """
    seen: dict[str, str] = {}
    for raw in paths:
        norm = check_path(raw)
        if norm in seen:
            raise _refuse(raw, "duplicate path")
        if len(norm) > _PATH_MAX // 4 and len(norm.encode("utf-8")) > _PATH_MAX:
            raise _refuse(raw, f"path longer than {_PATH_MAX} bytes")
        if norm.count("/") >= _MAX_DEPTH:
            raise _refuse(raw, f"path deeper than {_MAX_DEPTH} components")
        seen[norm] = raw
    gone = {check_path(raw) for raw in removed}
    for norm, raw in seen.items():
        if norm in gone:
            continue
        parent, sep, _ = norm.rpartition("/")
        while sep:
            if parent in seen and parent not in gone:
                raise _refuse(seen[parent], f"is both a file and the directory of '{_show(norm)}'", conflicts_with=raw)
            parent, sep, _ = parent.rpartition("/")

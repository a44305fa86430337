"""The ``apply_patch`` tool's schema: normalising a call's arguments (no pygit2).

Normalised args are what the identity hashes (docs/DESIGN.md section 2; each
field's rule: docs/DECISIONS.md, "Normalised args of `apply_patch`").  A
``message`` git would not keep, or one forging oncepatch's own trailers, is
refused (:func:`check_message`; docs/SECURITY.md).  ``TOOL_VERSION`` names the
tool's semantics, not the package release: a new one gives every call a new
identity, so it changes only when the same args would produce another effect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from cas.errors import UsageError, clip
from cas.gitdir import GitLayout, discover, main_worktree_of, read_head, resolve_symbolic
from cas.hashing import sha256_hex
from receipts.environ import env_int
from patcher.errors import TooLarge
from patcher.formats import BUILTIN_NAMES, known_format
from patcher.remote_mode import Remote, resolve_remote

__all__ = ["TOOL", "TOOL_VERSION", "MAX_PATCH_BYTES", "CallArgs", "check_message", "check_types", "normalise_args",
           "normalise_branch", "repository_path"]

TOOL = "apply_patch"
TOOL_VERSION = "1"
MAX_PATCH_BYTES = env_int("ONCEPATCH_MAX_PATCH_BYTES", 64 << 20)

#: What ``git check-ref-format`` refuses in a branch name, as a pattern (for reference and the
#: tests; :func:`bad_branch_name` checks it without ``re``, which a replay never imports):
BAD_REF_PATTERN = r"(^|/)\.|\.\.|[\x00-\x20~^:?*\[\\\x7f]|@\{|\.lock(/|$)|/$|//|^$"
_BAD_CHARS = frozenset(map(chr, range(0x21))) | frozenset("~^:?*[\\\x7f")


#: The Python API's arguments by what each must be (:func:`check_types`).
_TEXT = frozenset({"key", "branch", "contract_sha256", "check", "message", "common_dir", "remote", "compensates",
                   "server", "format"})
_PATHS = frozenset({"repo", "store", "dir"})
_FLAGS = frozenset({"strict", "dry_run"})
_SECONDS = frozenset({"lock_timeout", "check_timeout", "tmp_age", "grace"})
#: Those that may not be None.
_REQUIRED = frozenset({"format", "strict", "dry_run", "lock_timeout", "check_timeout", "tmp_age", "grace"})


def check_types(required: frozenset[str] = frozenset(), /, **given: object) -> None:
    """Refuse an argument of the Python API whose type no call can mean, naming it (nothing read or written yet).

    Without it, a ``branch`` given as a number failed deep inside as an internal
    error, and through a server it became the branch ``"3"``; a ``strict``
    given as ``"no"`` was true.  ``None`` is allowed where the argument has a
    default of None, unless ``required`` names it.

    Raises:
        UsageError: ``'<name>' must be <what>, not <type>``.
    """
    for name, value in given.items():
        if value is None and name not in _REQUIRED and name not in required:
            continue
        if name in _TEXT:
            ok, what = isinstance(value, str), "a string"
        elif name in _PATHS:
            ok, what = isinstance(value, str) or (isinstance(value, os.PathLike)
                                                  and isinstance(os.fspath(value), str)), "a path (str or os.PathLike)"
        elif name in _FLAGS:
            ok, what = isinstance(value, bool), "True or False"
        elif name in _SECONDS:
            ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number of seconds"
        else:
            raise AssertionError(f"check_types: no rule for {name!r}")
        if not ok:
            raise UsageError(f"'{name}' must be {what}, not {type(value).__name__}",
                             details={"argument": name})


#: The longest ref name git can write: its lock file ``<part>.lock`` within NAME_MAX (255), the
#: whole within PATH_MAX (4096).  A longer one cannot exist as a branch git made.
_MAX_REF_PART = 250
_MAX_REF_BYTES = 4096


def _unnameable(ref: str) -> bool:
    data = ref.encode("utf-8", "surrogateescape")
    return len(data) > _MAX_REF_BYTES or any(len(part) > _MAX_REF_PART for part in data.split(b"/"))


def bad_branch_name(name: str) -> bool:
    """Whether :data:`BAD_REF_PATTERN` finds anything in ``name`` (a branch name without ``refs/heads/``).

    (The pattern's ``$`` also matches before a final newline, which is refused as a control anyway.)
    """
    return (not name or name.startswith(".") or name.endswith(("/", ".lock")) or "/." in name or ".." in name
            or "@{" in name or ".lock/" in name or "//" in name or not _BAD_CHARS.isdisjoint(name))


#: Control characters a commit message may not hold: C0 but tab and newline, DEL, C1.
_MESSAGE_CONTROLS = frozenset(map(chr, [*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]))
#: The trailers oncepatch writes under every message (any case: git matches trailer keys so).
_OWN_TRAILER = "oncepatch-"


def check_message(message: object) -> str | None:
    """``message`` if a commit may carry it (``None`` or empty: the default subject).

    Raises:
        UsageError: not a string; a control character other than newline and
            tab; a blank first line; a line starting ``Oncepatch-`` (any case, after any blanks).
    """
    if message is None:
        return None
    if not isinstance(message, str):
        raise UsageError(f"the message must be text, not {type(message).__name__}")
    if not _MESSAGE_CONTROLS.isdisjoint(message):
        at = next(i for i, c in enumerate(message) if c in _MESSAGE_CONTROLS)
        raise UsageError(f"the message holds a control character ({message[at]!r} at character {at}): "
                         "only newline and tab are allowed",
                         details={"reason": "control_character", "at": at})
    if message and not message.split("\n", 1)[0].strip(" \t"):
        # git strips blank lines and refuses what is left empty; libgit2 would write a blank subject.
        raise UsageError("the message's first line is blank: give a subject, or leave out --message for "
                         "the default one", details={"reason": "blank_subject"})
    for n, line in enumerate(message.split("\n"), 1):
        if line.lstrip(" \t").lower().startswith(_OWN_TRAILER):
            raise UsageError(f"the message's line {n} starts with 'Oncepatch-': oncepatch writes its own "
                             "trailers (Oncepatch-Call, Oncepatch-Key) and no message may forge them",
                             details={"reason": "own_trailer", "line": n})
    return message


@dataclass(frozen=True, slots=True)
class CallArgs:
    layout: GitLayout
    repo: str  # the repository, as the identity names it (:func:`repository_path`)
    where: str  # the folder the call found it from (its worktree, or git dir): where it is opened
    branch: str
    patch: bytes
    patch_sha256: str
    format: str
    check: str | None
    message: str | None
    #: The key this call compensates (``oncepatch revert``); only then part of the args (and the identity).
    compensates: str | None = None
    #: Remote mode (docs/REMOTE.md): the key is claimed on this remote; ``repo`` is its URL.
    remote: Remote | None = None

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"repo": self.repo, "branch": self.branch, "patch_sha256": self.patch_sha256,
                               "format": self.format, "check": self.check, "message": self.message}
        if self.compensates is not None:
            doc["compensates"] = self.compensates
        return doc


def normalise_branch(branch: str | None, layout: GitLayout) -> str:
    """Full ref name of the target branch.

    Raises:
        UsageError: detached HEAD without a branch, or an invalid branch name.
    """
    if branch is None or branch == "HEAD":  # HEAD: the branch it names, as git reads it
        head = read_head(layout.git_dir)
        if head is None:
            raise UsageError("HEAD is detached: name the branch with --branch")
        branch = head
    if not branch.startswith("refs/"):
        branch = "refs/heads/" + branch
    if not branch.startswith("refs/heads/") or bad_branch_name(branch[len("refs/heads/"):]):
        raise UsageError(f"not a valid branch name: '{clip(branch)}'")
    if _unnameable(branch):
        raise UsageError(f"not a valid branch name: '{clip(branch)}': longer than a ref file's name can be "
                         f"({_MAX_REF_PART} bytes a part, {_MAX_REF_BYTES} in all)")
    # A branch alias (refs/heads/master -> refs/heads/main) names the branch it points at:
    # moved, the alias would be overwritten and the branch left behind.
    return resolve_symbolic(layout.common_dir, branch)


def repository_path(layout: GitLayout) -> str:
    """The repository a call names, whichever of its worktrees it came from.

    A linked worktree (its git dir is not the common one) names its
    repository's main worktree, found as git finds it (:func:`cas.gitdir.main_worktree_of`),
    or the common git dir when that has none (bare) or none can be found (a
    ``--separate-git-dir`` repository).  Any other call names the folder it
    found, as before: the identities of calls from a main worktree, a bare
    repository or a submodule do not change.
    """
    if layout.git_dir == layout.common_dir:
        return layout.workdir or layout.git_dir
    return main_worktree_of(layout.common_dir) or layout.common_dir


def normalise_args(repo: str, patch: str | bytes, *, branch: str | None, format: str, check: str | None,
                   message: str | None, detect: Any, remote: str | None = None) -> CallArgs:
    """Normalise one call's arguments; ``detect(bytes) -> str`` resolves ``auto``.

    Raises:
        UsageError: no repository, bad branch, unknown format, a message
            :func:`check_message` refuses.
        TooLarge: the patch is over :data:`MAX_PATCH_BYTES`.
    """
    message = check_message(message)
    if not isinstance(patch, (str, bytes, bytearray, memoryview)):
        # bytes(5) would be five NUL bytes, bytes(None) a TypeError outside the error tree.
        raise UsageError(f"the patch must be its content as str or bytes, not {type(patch).__name__}")
    try:
        data = patch.encode("utf-8", "surrogateescape") if isinstance(patch, str) else bytes(patch)
    except UnicodeEncodeError as exc:  # a lone surrogate other than an escaped byte
        raise UsageError(f"the patch is not valid Unicode text (at character {exc.start}): "
                         f"pass it as bytes, or as text without lone surrogates") from None
    if len(data) > MAX_PATCH_BYTES:
        raise TooLarge(f"patch is {len(data)} bytes, over the limit of {MAX_PATCH_BYTES}",
                       details={"size": len(data), "limit": MAX_PATCH_BYTES})
    if not known_format(format):
        raise UsageError(f"unknown patch format '{clip(format)}': use auto, {', '.join(BUILTIN_NAMES)}")
    layout = discover(repo)
    fmt = detect(data) if format == "auto" else format
    claimed_on = resolve_remote(layout, remote)
    return CallArgs(layout=layout, repo=claimed_on.url if claimed_on else repository_path(layout),
                    where=layout.workdir or layout.git_dir, branch=normalise_branch(branch, layout), patch=data,
                    patch_sha256=sha256_hex(data), format=fmt, check=check, message=message, remote=claimed_on)

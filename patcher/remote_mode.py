"""Remote mode's face: which git remote a call claims its key on (docs/REMOTE.md).

``apply --remote NAME`` (or ``oncepatch.remote`` in the repository's own
config) makes the call claim its key on that remote, not in this clone: one
atomic push moves the remote's branch, creates the key ref and records the
receipt there (:mod:`patcher.remote_push` does it).  This module only names
the remote, and is on the path of every call: it reads the repository's
config file itself (no pygit2, no git process) and spawns ``git config`` only
for a call that does name a remote.

Not to be confused with :mod:`patcher.remote`, the client of an ``oncepatch
serve`` server.
"""

from __future__ import annotations

from dataclasses import dataclass

from cas.errors import UsageError, clip
from cas.gitdir import GitLayout, config_section

__all__ = ["Remote", "configured_remote", "resolve_remote"]


@dataclass(frozen=True, slots=True)
class Remote:
    """A git remote of the clone: its ``name`` (fetched from and pushed to) and ``url``.

    The ``url`` is what the call's identity names as its repository: every
    machine that names the remote by the same URL makes the same call.
    """

    name: str
    url: str


def configured_remote(layout: GitLayout) -> str | None:
    """``oncepatch.remote`` of the repository's own config file, if set (the last one wins).

    Read without git: a call that names no remote pays one read of a small file.
    """
    value = config_section(layout.common_dir, "oncepatch").get("remote", "")
    return value.split("#", 1)[0].split(";", 1)[0].strip().strip('"') or None  # (an inline comment dropped)


def resolve_remote(layout: GitLayout, name: str | None) -> Remote | None:
    """The remote a call names (``name``, else ``oncepatch.remote``), with its URL; ``None``: a local call.

    Raises:
        UsageError: the name is not a remote of this clone (it has no URL).
    """
    if name is None:
        name = configured_remote(layout)
        if name is None:
            return None
    if not name or name.startswith("-") or any(c in name for c in "\0\n\r\t :"):
        raise UsageError(f"not a remote name: '{clip(name)}'")
    # Deferred: every call (a replay too) comes through this module; only one naming a remote spawns git.
    import subprocess

    try:
        res = subprocess.run(["git", "--git-dir", layout.common_dir, "config", "--get", f"remote.{name}.url"],
                             capture_output=True, check=False)
    except OSError as exc:  # a name of megabytes: E2BIG
        raise UsageError(f"not a remote name: '{clip(name)}' ({exc.strerror or exc})",
                         details={"remote": clip(name)}) from None
    url = res.stdout.decode("utf-8", "surrogateescape").strip()
    if res.returncode != 0 or not url:
        raise UsageError(f"remote '{clip(name)}' is not configured in this repository (no remote.{clip(name)}.url): "
                         f"add it with 'git remote add {clip(name)} URL'", details={"remote": clip(name)})
    return Remote(name, url)

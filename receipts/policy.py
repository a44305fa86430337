"""Who may call what: the policy, asked before the key's look-up (authorize, then idempotency).

The file is ``$ONCEPATCH_POLICY``, else ``<store>/policy.toml`` (TOML, read
with ``tomllib``).  Without one every call is allowed.  The broker (``oncepatch
serve``) asks it of each caller by ``SO_PEERCRED``; without the broker the
same file is a guard-rail the calling process applies to itself: it stops an
agent that goes through oncepatch, not a process that can write the
repository directly (docs/SECURITY.md)::

    schema = "oncepatch.policy/1"
    deny_paths = [".github/workflows/**", ".git*"]   # no rule allows these

    [[allow]]
    users = ["agent", 1001]          # user names or uids      } neither: anyone
    groups = ["agents"]              # group names or gids     }
    repos = ["/srv/repos/*"]         # the repository's real path (or, in remote mode, the remote's URL); default: any
    branches = ["agent/*"]           # short names or full refs; default: any
    paths = ["src/**", "tests/**"]   # every touched path within one; default: any
    deny_paths = ["**/secrets/**"]   # none within any
    formats = ["unified", "apply_patch"]
    max_patch_bytes = 1048576
    max_files = 50

A call is allowed when some ``[[allow]]`` rule names its caller and allows
all of it, and no path the patch names (a copy's source too) is in the
top-level ``deny_paths``.  Path
patterns are git's ignore-file globs: ``*`` and ``?`` stay within a folder,
``**`` crosses folders, a pattern without a slash matches a name at any
depth, and a pattern matching a folder matches everything in it.  Unknown
keys are refused (a misspelt ``deny_path`` must not pass silently): a
policy that cannot be read refuses every call (a usage error).

A refusal is :class:`~receipts.errors.Forbidden` (exit 4, ``forbidden``,
final, not retryable); nothing is written but one ``forbidden`` ledger event
naming the caller and what it asked (:func:`authorize`).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cas.errors import DurableWriteError, UsageError
from receipts.errors import Forbidden, InProgress, SigningKeyMissing
from receipts.receipt import now_iso

TYPE_CHECKING = False
if TYPE_CHECKING:
    from receipts.store import ReceiptStore

__all__ = ["POLICY_SCHEMA", "POLICY_FILE", "POLICY_ENV", "Caller", "Request", "Rule", "Policy", "policy_path",
           "load_policy", "authorize", "may_read"]

POLICY_SCHEMA = "oncepatch.policy/1"
POLICY_FILE = "policy.toml"
POLICY_ENV = "ONCEPATCH_POLICY"


# -- who calls, and what --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Caller:
    """A calling process's user and groups (the broker's ``SO_PEERCRED``, or this process's own)."""

    uid: int
    gid: int
    groups: frozenset[int] = frozenset()
    user: str = ""
    group_names: frozenset[str] = frozenset()
    pid: int = 0
    #: True when the kernel vouched for it (a server's peer, ``SO_PEERCRED``), False for a process's own view
    peer: bool = False

    @classmethod
    def of(cls, uid: int, gid: int, groups: frozenset[int] | None = None, *, pid: int = 0,
           peer: bool = False) -> Caller:
        """The caller ``uid``/``gid``, with its groups (``None``: from the system's databases) and names."""
        try:
            user = pwd.getpwuid(uid).pw_name
            if groups is None:
                groups = frozenset(os.getgrouplist(user, gid))
        except KeyError:
            user = ""
        groups = groups if groups is not None else frozenset({gid})
        names = set()
        for g in groups | {gid}:
            try:
                names.add(grp.getgrgid(g).gr_name)
            except KeyError:
                pass
        return cls(uid, gid, groups | {gid}, user, frozenset(names), pid, peer)

    @classmethod
    def current(cls) -> Caller:
        """This process (the in-process guard-rail)."""
        return cls.of(os.getuid(), os.getgid())

    def to_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "gid": self.gid, "user": self.user or None}

    def shown(self) -> str:
        return f"user '{self.user}' (uid {self.uid})" if self.user else f"uid {self.uid}"


@dataclass(frozen=True, slots=True)
class Request:
    """What a call asks, as the policy judges it; ``paths=None``: not known yet (judged without them)."""

    tool: str
    repo: str
    branch: str
    format: str
    patch_bytes: int
    paths: tuple[str, ...] | None = None
    key: str | None = None
    patch_sha256: str | None = None
    #: Remote mode (docs/REMOTE.md): the URL of the remote the key is claimed on; ``repo`` stays the local one.
    remote: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"tool": self.tool, "repo": self.repo, "branch": self.branch, "format": self.format,
                               "patch_bytes": self.patch_bytes, "key": self.key, "patch_sha256": self.patch_sha256}
        if self.remote is not None:
            doc["remote"] = self.remote
        if self.paths is not None:
            doc["paths"] = list(self.paths)
        return doc


def may_read(caller: Caller, path: str) -> bool:
    """Whether ``caller`` could read the folder ``path`` itself: search on each folder on its way, read
    and search on it (its nearest existing folder, if it is not made yet), by their mode bits.

    A broker answers a caller only about a store the caller could read without it: it
    must not read, for a caller, what the file system keeps from that caller.  Mode bits
    only (an ACL that grants more is not honoured: refused, never the other way round).
    """
    if caller.uid == 0:
        return True
    parts = os.path.realpath(path).split("/")[1:]
    while parts and not os.path.exists("/" + "/".join(parts)):
        parts.pop()
    for n in range(len(parts) + 1):
        try:
            st = os.stat("/" + "/".join(parts[:n]))
        except OSError:
            return False
        if st.st_uid == caller.uid:
            bits = st.st_mode >> 6
        elif st.st_gid == caller.gid or st.st_gid in caller.groups:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        need = 0o5 if n == len(parts) else 0o1
        if bits & need != need:
            return False
    return True


# -- patterns -------------------------------------------------------------------------------------


def _translate(pattern: str) -> str:
    """A git ignore-file glob as a regular expression over a whole path (module docstring)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


@dataclass(frozen=True, slots=True)
class PathPattern:
    text: str
    regex: re.Pattern[str]

    @classmethod
    def parse(cls, text: str) -> PathPattern:
        body = text.strip("/")
        anywhere = "/" not in text.rstrip("/")  # a leading slash, or one inside, anchors at the root
        return cls(text, re.compile(("(?:.*/)?" if anywhere else "") + _translate(body)))

    def matches(self, path: str) -> bool:
        """Whether ``path`` or a folder it lies in matches."""
        parts = path.split("/")
        return any(self.regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1))


def _first(patterns: Sequence[PathPattern], path: str) -> PathPattern | None:
    return next((p for p in patterns if p.matches(path)), None)


def _branch_regex(text: str) -> re.Pattern[str]:
    return re.compile(_translate(text if text.startswith("refs/") else "refs/heads/" + text))


# -- the policy -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    number: int
    users: frozenset[str] | None = None  # names and uids as text
    groups: frozenset[str] | None = None
    repos: tuple[re.Pattern[str], ...] | None = None
    branches: tuple[re.Pattern[str], ...] | None = None
    paths: tuple[PathPattern, ...] | None = None
    deny_paths: tuple[PathPattern, ...] = ()
    formats: frozenset[str] | None = None
    max_patch_bytes: int | None = None
    max_files: int | None = None

    def names(self, caller: Caller) -> bool:
        if self.users is None and self.groups is None:
            return True
        return bool((self.users or frozenset()) & {str(caller.uid), caller.user}
                    or (self.groups or frozenset()) & ({str(g) for g in caller.groups} | caller.group_names))

    def refusal(self, request: Request) -> str | None:
        """Why this rule does not allow ``request`` (``None``: it does)."""
        if self.repos is not None and not any(r.fullmatch(request.repo) or (request.remote is not None
                                                  and r.fullmatch(request.remote)) for r in self.repos):
            remote = f" (remote '{request.remote}')" if request.remote is not None else ""
            return f"repository '{request.repo}'{remote} is not one rule {self.number} allows"
        if self.branches is not None and not any(b.fullmatch(request.branch) for b in self.branches):
            return f"branch '{request.branch}' is not one rule {self.number} allows"
        if self.formats is not None and request.format not in self.formats:
            return f"format '{request.format}' is not one rule {self.number} allows"
        if self.max_patch_bytes is not None and request.patch_bytes > self.max_patch_bytes:
            return f"the patch is {request.patch_bytes} bytes, over rule {self.number}'s {self.max_patch_bytes}"
        if request.paths is None:
            return None
        if self.max_files is not None and len(request.paths) > self.max_files:
            return f"the patch touches {len(request.paths)} files, over rule {self.number}'s {self.max_files}"
        for path in request.paths:
            denied = _first(self.deny_paths, path)
            if denied is not None:
                return f"'{path}' is denied by rule {self.number} ('{denied.text}')"
            if self.paths is not None and _first(self.paths, path) is None:
                return f"'{path}' is outside the paths rule {self.number} allows"
        return None


@dataclass(frozen=True, slots=True)
class Policy:
    path: str
    rules: tuple[Rule, ...]
    deny_paths: tuple[PathPattern, ...] = field(default=())

    def refusal(self, caller: Caller, request: Request) -> str | None:
        """Why ``caller`` may not make ``request`` (``None``: allowed); pure."""
        for path in request.paths or ():
            denied = _first(self.deny_paths, path)
            if denied is not None:
                return f"'{path}' is denied by the policy ('{denied.text}')"
        reasons = [rule.refusal(request) for rule in self.rules if rule.names(caller)]
        if not reasons:
            return f"no rule of the policy names {caller.shown()}"
        if any(r is None for r in reasons):
            return None
        return reasons[0]


_RULE_KEYS = {"users", "groups", "repos", "branches", "paths", "deny_paths", "formats", "max_patch_bytes",
              "max_files"}


def _bad(path: str, why: str) -> UsageError:
    return UsageError(f"cannot read the policy '{path}': {why}; every call is refused until it is fixed",
                      details={"policy": path})


def _strings(path: str, where: str, value: object, *, ints: bool = False) -> list[str]:
    ok = (str, int) if ints else (str,)
    if not isinstance(value, list) or not all(isinstance(v, ok) and not isinstance(v, bool) for v in value):
        raise _bad(path, f"{where} must be a list of {'names or ids' if ints else 'strings'}")
    return [str(v) for v in value]


def _limit(path: str, where: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(path, f"{where} must be a whole number of at least 0")
    return value


#: A remote's URL (``scheme://...``, or scp-like ``[user@]host:path``), not a path on this machine.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://|[^/:]+:(?!/)")


def _repo_pattern(text: str) -> str:
    """A ``repos`` pattern as matched: a URL as written, a path made absolute."""
    return text if _URL.match(text) else os.path.abspath(text)


def _rule(path: str, n: int, doc: object) -> Rule:
    if not isinstance(doc, dict):
        raise _bad(path, f"allow rule {n} is not a table")
    unknown = sorted(set(doc) - _RULE_KEYS)
    if unknown:
        raise _bad(path, f"allow rule {n} has unknown keys: {', '.join(unknown)}")

    def opt(name: str, ints: bool = False) -> list[str] | None:
        return _strings(path, f"allow rule {n}'s {name}", doc[name], ints=ints) if name in doc else None

    users, groups, repos, branches = opt("users", True), opt("groups", True), opt("repos"), opt("branches")
    paths, formats = opt("paths"), opt("formats")
    return Rule(
        n,
        users=None if users is None else frozenset(users),
        groups=None if groups is None else frozenset(groups),
        repos=None if repos is None else tuple(re.compile(_translate(_repo_pattern(r))) for r in repos),
        branches=None if branches is None else tuple(_branch_regex(b) for b in branches),
        paths=None if paths is None else tuple(PathPattern.parse(p) for p in paths),
        deny_paths=tuple(PathPattern.parse(p) for p in opt("deny_paths") or ()),
        formats=None if formats is None else frozenset(formats),
        max_patch_bytes=_limit(path, f"allow rule {n}'s max_patch_bytes", doc["max_patch_bytes"])
        if "max_patch_bytes" in doc else None,
        max_files=_limit(path, f"allow rule {n}'s max_files", doc["max_files"]) if "max_files" in doc else None,
    )


def parse_policy(path: str, text: str) -> Policy:
    """The policy in ``text`` (read from ``path``), checked.

    Raises:
        UsageError: not TOML, another schema, an unknown key, a value of the wrong type.
    """
    # Deferred: only a store with a policy parses one (tomllib costs a call without one 2.6 ms, measured).
    import tomllib

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _bad(path, f"not TOML ({exc})") from None
    if doc.get("schema") != POLICY_SCHEMA:
        raise _bad(path, f"schema must be '{POLICY_SCHEMA}'")
    unknown = sorted(set(doc) - {"schema", "deny_paths", "allow"})
    if unknown:
        raise _bad(path, f"unknown keys: {', '.join(unknown)}")
    allow = doc.get("allow", [])
    if not isinstance(allow, list):
        raise _bad(path, "allow must be an array of tables ([[allow]])")
    deny = tuple(PathPattern.parse(p) for p in _strings(path, "deny_paths", doc.get("deny_paths", [])))
    return Policy(path, tuple(_rule(path, n, r) for n, r in enumerate(allow, 1)), deny)


def policy_path(store_root: str) -> str:
    """The policy in force for the store: ``$ONCEPATCH_POLICY``, else the store's ``policy.toml``."""
    return os.environ.get(POLICY_ENV) or os.path.join(store_root, POLICY_FILE)


def load_policy(store_root: str) -> Policy | None:
    """The store's policy (``None``: no file, every call allowed).

    Raises:
        UsageError: the file named by ``$ONCEPATCH_POLICY`` is missing, or a policy cannot be read or parsed.
    """
    path = policy_path(store_root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.environ.get(POLICY_ENV):
            raise _bad(path, f"no such file (named by ${POLICY_ENV})") from None
        return None
    except OSError as exc:
        raise _bad(path, exc.strerror or str(exc)) from None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(1 << 20)
    try:
        return parse_policy(path, data.decode("utf-8"))
    except UnicodeDecodeError:
        raise _bad(path, "not UTF-8") from None


def authorize(store: ReceiptStore, caller: Caller, request: Request, policy: Policy | None = None) -> None:
    """Refuse ``request`` unless the store's policy (or ``policy``) allows ``caller`` it.

    Runs before the key's look-up.  A refusal appends one ``forbidden`` event
    to the ledger (the caller, the request, the reason) and writes nothing
    else; a ledger that cannot be written leaves the refusal standing (its
    envelope then says it was not noted).

    Raises:
        Forbidden: refused (exit 4, final, not retryable).
        UsageError: the policy cannot be read (every call refused).
    """
    if policy is None:
        policy = load_policy(store.root)
        if policy is None:
            return
    reason = policy.refusal(caller, request)
    if reason is None:
        return
    details: dict[str, Any] = {"reason": reason, "caller": caller.to_json(), "policy": policy.path}
    try:
        store.ledger.append({"event": "forbidden", "at": now_iso(), "caller": caller.to_json(),
                             "request": request.to_json(), "reason": reason})
    except (OSError, DurableWriteError, InProgress, SigningKeyMissing) as exc:
        details["not_noted"] = f"the refusal was not noted in the ledger ({exc})"
    raise Forbidden(f"forbidden by the policy: {reason}", key=request.key, details=details)

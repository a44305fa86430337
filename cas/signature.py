"""Author and committer identities as git reads and writes them.

:func:`git_identity` finds an identity where git looks (``GIT_<KIND>_NAME``,
``_EMAIL``, ``_DATE``, then the configuration, then git's guesses from the
account and the host) and refuses, with git's advice, where ``git commit``
would (:class:`IdentityUnknown`); :func:`signature_line` writes it as a
commit or reflog line, after libgit2's own checks (``pygit2.Signature``),
so that a name git would refuse is refused before anything is written.
"""

from __future__ import annotations

import datetime
import email.utils
import os
import pwd
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pygit2

__all__ = ["IDENTITY_ADVICE", "IdentityUnknown", "Signature", "default_email", "git_clean", "git_identity",
           "guessed_identity", "local_offset", "parse_git_date", "signature_line"]


@dataclass(frozen=True, slots=True)
class Signature:
    name: str
    email: str
    #: (seconds since the epoch, offset from UTC in minutes); ``None``: the moment it is written.
    when: tuple[int, int] | None = None


def local_offset(t: int) -> int:
    """The local time zone's offset from UTC at ``t``, in minutes."""
    return time.localtime(t).tm_gmtoff // 60


# git reads a bare number as seconds since the epoch only from nine digits on, or after "@".
_RAW_DATE = re.compile(r"(?:@([0-9]+)|([0-9]{9,}))(?:\s+([+-])([0-9]{2}):?([0-9]{2}))?")
#: What git strips from both ends of a name or email (``crud()`` in git's ident.c).
_CRUD = "".join(chr(c) for c in range(33)) + ".,:;<>\"\\'"


def git_clean(text: str) -> str:
    """A name or email as git writes it: crud stripped from both ends, ``<``, ``>`` and newlines dropped."""
    return text.strip(_CRUD).replace("\n", "").replace("<", "").replace(">", "")


def parse_git_date(text: str) -> tuple[int, int]:
    """``GIT_AUTHOR_DATE`` / ``GIT_COMMITTER_DATE`` as (seconds, offset in minutes).

    The forms git documents for them: ``[@]<seconds> <+hhmm>``, RFC 2822, ISO
    8601 (without a zone: local time).  git's "approxidate" forms (``3 days
    ago``) are refused rather than guessed.

    Raises:
        ValueError: none of those forms.
    """
    t = text.strip()
    m = _RAW_DATE.fullmatch(t)
    if m:
        secs = int(m.group(1) or m.group(2))
        if m.group(3) is None:
            return secs, local_offset(secs)
        hours, minutes = int(m.group(4)), int(m.group(5))
        if hours > 14 or minutes >= 60:
            raise ValueError(f"cannot read the date {text!r}: no time zone is {m.group(3)}{m.group(4)}{m.group(5)}")
        minutes += hours * 60
        return secs, -minutes if m.group(3) == "-" else minutes
    try:
        # An RFC 2822 date without a zone (or with -0000) comes back naive: git takes it as local time.
        dt = email.utils.parsedate_to_datetime(t)
    except (TypeError, ValueError):
        try:
            dt = datetime.datetime.fromisoformat(t)
        except ValueError:
            raise ValueError(f"cannot read the date {text!r}: give '<seconds> <+hhmm>', RFC 2822 or ISO 8601") \
                from None
    if dt.tzinfo is None:
        dt = dt.astimezone()  # local time
    offset = dt.utcoffset()
    return int(dt.timestamp()), int(offset.total_seconds()) // 60 if offset is not None else 0


#: git's advice when it cannot tell who commits (``ident_env_hint()`` in git's ident.c), word for word.
IDENTITY_ADVICE = (
    "\n\n*** Please tell me who you are.\n\nRun\n\n"
    "  git config --global user.email \"you@example.com\"\n"
    "  git config --global user.name \"Your Name\"\n\n"
    "to set your account's default identity.\n"
    "Omit --global to set the identity only in this repository.\n\n"
)


class IdentityUnknown(ValueError):
    """git would refuse to commit: no name or email configured, and none it could detect (git's own message)."""

    def __init__(self, kind: str, reason: str, name: str | None = None, email: str | None = None) -> None:
        self.kind = kind
        self.reason = reason
        self.name = name  # what was found, if anything
        self.email = email
        super().__init__(f"{kind.capitalize()} identity unknown{IDENTITY_ADVICE}{reason}")

    @property
    def guess(self) -> Signature:
        """What git would write in a reflog instead (:func:`guessed_identity`)."""
        return guessed_identity(self.name, self.email)


def _account() -> tuple[str, str] | None:
    """(user name, name from the GECOS field) of this process's account, as git's ``copy_gecos()`` reads it."""
    try:
        pw = pwd.getpwuid(os.getuid())
    except KeyError:
        return None
    gecos = (pw.pw_gecos or "").split(",", 1)[0]
    return pw.pw_name, gecos.replace("&", pw.pw_name[:1].upper() + pw.pw_name[1:]).strip()


def _host_domain() -> str | None:
    """This host's name with a domain, as git's ``add_domainname()`` finds it; ``None`` if it has none."""
    try:
        host = socket.gethostname()
    except OSError:
        return None
    if "." in host:
        return host
    try:
        infos = socket.getaddrinfo(host, None, flags=socket.AI_CANONNAME)
    except (OSError, UnicodeError):
        return None
    canon = infos[0][3] if infos else ""
    return canon if "." in canon else None


def default_email() -> tuple[str, bool]:
    """git's guessed email, ``<user>@<host>``, and whether git calls it bogus (no domain: ``.(none)``)."""
    account = _account()
    user = account[0] if account else "unknown"
    domain = _host_domain()
    return (f"{user}@{domain}", account is None) if domain else (f"{user}@{socket.gethostname()}.(none)", True)


def git_identity(kind: str, config: Callable[[str], str | None], env: Mapping[str, str]) -> Signature:
    """The ``author`` or ``committer`` identity as ``git commit`` reads it (git's strict mode).

    ``GIT_<KIND>_NAME`` / ``_EMAIL`` / ``_DATE``, then ``<kind>.name`` /
    ``.email``, then ``user.name`` / ``.email`` (the email then ``$EMAIL``),
    each cleaned as git cleans it; one empty once cleaned is passed over.
    What is still missing git guesses, and so does this (the account's name,
    ``<user>@<host>`` when the host has a domain); where git would refuse,
    this refuses with git's advice: an identity is never invented.

    Raises:
        IdentityUnknown: git would refuse to commit for want of a name or email.
        ValueError: ``GIT_<KIND>_DATE`` is set in a form :func:`parse_git_date` refuses.
    """
    up = kind.upper()

    def first(*values: str | None) -> str | None:
        for value in values:
            cleaned = git_clean(value) if value else ""
            if cleaned:
                return cleaned
        return None

    config_only = (config("user.useConfigOnly") or "").strip().lower() in ("true", "yes", "on", "1")
    name = first(env.get(f"GIT_{up}_NAME"), config(f"{kind}.name"), config("user.name"))
    email = first(env.get(f"GIT_{up}_EMAIL"), config(f"{kind}.email"), config("user.email"))
    if email is None and config_only:
        raise IdentityUnknown(kind, "no email was given and auto-detection is disabled", name)
    email = email or first(env.get("EMAIL"))
    if email is None:
        guessed, bogus = default_email()
        if bogus:
            raise IdentityUnknown(kind, f"unable to auto-detect email address (got '{guessed}')", name, guessed)
        email = guessed
    if name is None:
        if config_only:
            raise IdentityUnknown(kind, "no name was given and auto-detection is disabled", None, email)
        account = _account()
        if account is None:
            raise IdentityUnknown(kind, "unable to auto-detect name (got 'unknown')", None, email)
        name = first(account[1])
        if name is None:
            raise IdentityUnknown(kind, f"empty ident name (for <{email}>) not allowed", None, email)
    date = env.get(f"GIT_{up}_DATE")
    try:
        when = parse_git_date(date) if date else None
    except ValueError as exc:
        raise ValueError(f"GIT_{up}_DATE: {exc}") from None
    return Signature(name, email, when)


def guessed_identity(name: str | None = None, email: str | None = None) -> Signature:
    """What git writes where it does not insist on an identity (a reflog line): git's guesses, ``.(none)`` and all.

    Never used for a commit: :func:`git_identity` refuses there.
    """
    account = _account()
    return Signature(name or (account[1] or account[0] if account else "unknown"), email or default_email()[0])


def signature_line(sig: Signature, now: int | None = None) -> bytes:
    """``Name <email> <seconds> <+hhmm>`` as git writes it in commits and reflogs.

    The time is the signature's own, else ``now`` (or the current second) in
    the local time zone; pygit2's ``Signature`` applies libgit2's checks.

    Raises:
        ValueError, pygit2.GitError: a name or email libgit2 refuses.
    """
    name, email = git_clean(sig.name), git_clean(sig.email)
    if sig.when is not None:
        s = pygit2.Signature(name, email, sig.when[0], sig.when[1])
    else:
        t = int(time.time()) if now is None else now
        s = pygit2.Signature(name, email, t, local_offset(t))
    offset = s.offset
    return b"%s <%s> %d %c%02d%02d" % (s.raw_name, s.raw_email, s.time, b"-"[0] if offset < 0 else b"+"[0],
                                      abs(offset) // 60, abs(offset) % 60)

"""The retention policy of ``oncepatch gc`` (pure): what may go, what must stay, what is redacted.

A TOML file (read with ``tomllib``); its tables and rules: docs/LIFECYCLE.md,
"The policy".  Unknown keys are refused (a misspelt ``older_than_day`` must
not widen what goes): :class:`cas.errors.UsageError`, exit 2, nothing changed.
Only free-text bodies may be redacted (:data:`REDACTABLE`): what the engine,
verify, replay, drift or recovery read from a receipt would make a committed
receipt unreadable or break a link.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from cas.errors import SHOWN_PATH_CHARS, UsageError, clip

__all__ = ["RetentionPolicy", "RemoveRule", "RedactRule", "parse_retention", "load_retention", "REDACTABLE",
           "SCHEMA"]

SCHEMA = "oncepatch.retention/1"
#: The states a policy may let go: settled ones (``prepared``/``unknown`` wait for recovery or a person).
REMOVABLE_STATES = ("committed", "rejected")
#: Redactable fields: free text no reader of a receipt decides on (the commit message, the check command,
#: the error's message, a tool's result); every other arg is read by the engine, verify, replay or drift.
REDACTABLE = ("args.message", "args.check", "error.message", "result")
_DAY = 86400.0
#: The longest age a policy may name: a hundred years. Past it a float of seconds loses whole days, and
#: ``inf`` or a TOML integer beyond a float's range would overflow where the age is compared or shown.
_MAX_DAYS = 36500


@dataclass(frozen=True, slots=True)
class RemoveRule:
    older_than: float = 0.0  # seconds
    states: tuple[str, ...] = REMOVABLE_STATES
    key_prefixes: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RedactRule:
    older_than: float = 0.0
    fields: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    path: str
    remove: RemoveRule | None = None
    keep_prefixes: tuple[str, ...] = ()
    ledger_seconds: float | None = None
    ledger_events: int | None = None
    redact: RedactRule | None = None
    archive_dir: str = "archives"
    extra: dict[str, Any] = field(default_factory=dict)

    def archive_folder(self, store_root: str) -> str:
        """The archive folder's path: ``archive_dir`` (relative, checked by :func:`parse_retention`) under the root."""
        return os.path.join(store_root, self.archive_dir)


def _bad(path: str, why: str) -> UsageError:
    shown = clip(path, SHOWN_PATH_CHARS)
    return UsageError(f"cannot use the retention policy '{shown}': {why}", details={"policy": shown})


def _table(path: str, doc: dict[str, Any], name: str, known: set[str]) -> dict[str, Any] | None:
    value = doc.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(path, f"'{name}' must be a table")
    unknown = sorted(set(value) - known)
    if unknown:
        raise _bad(path, f"unknown key '{name}.{unknown[0]}' (known: {', '.join(sorted(known))})")
    return value


def _days(path: str, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= _MAX_DAYS:
        raise _bad(path, f"'{where}' must be a number of days from 0 to {_MAX_DAYS}")
    return float(value) * _DAY


def _strings(path: str, where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _bad(path, f"'{where}' must be a list of non-empty strings")
    return tuple(value)


def parse_retention(path: str, text: str) -> RetentionPolicy:
    """Parse a retention policy's TOML text.

    Raises:
        UsageError: not TOML, an unknown key or table, a value of the wrong type or range.
    """
    import tomllib  # deferred: only gc reads one

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _bad(path, f"not TOML ({exc})") from None
    unknown = sorted(set(doc) - {"schema", "remove", "keep", "redact", "archive"})
    if unknown:
        raise _bad(path, f"unknown key '{unknown[0]}' (known: schema, remove, keep, redact, archive)")
    if doc.get("schema", SCHEMA) != SCHEMA:
        raise _bad(path, f"unknown schema {doc.get('schema')!r} (this oncepatch reads '{SCHEMA}')")
    remove = None
    if (t := _table(path, doc, "remove", {"older_than_days", "states", "key_prefixes", "tools"})) is not None:
        states = _strings(path, "remove.states", t.get("states", list(REMOVABLE_STATES)))
        for s in states:
            if s not in REMOVABLE_STATES:
                raise _bad(path, f"'remove.states' may name only {' and '.join(REMOVABLE_STATES)}, not '{s}' "
                                 "(an unsettled receipt never goes: recover or resolve it first)")
        remove = RemoveRule(_days(path, "remove.older_than_days", t.get("older_than_days", 0)), states,
                            _strings(path, "remove.key_prefixes", t.get("key_prefixes", [])),
                            _strings(path, "remove.tools", t.get("tools", [])))
    keep = _table(path, doc, "keep", {"key_prefixes", "ledger_days", "ledger_events"}) or {}
    ledger_events = keep.get("ledger_events")
    if ledger_events is not None and (isinstance(ledger_events, bool) or not isinstance(ledger_events, int)
                                      or ledger_events < 0):
        raise _bad(path, "'keep.ledger_events' must be a whole number, 0 or more")
    redact = None
    if (t := _table(path, doc, "redact", {"older_than_days", "fields"})) is not None:
        fields = _strings(path, "redact.fields", t.get("fields", []))
        for f in fields:
            if f not in REDACTABLE:
                raise _bad(path, f"'redact.fields' names '{f}': only free text may be redacted "
                                 f"({', '.join(REDACTABLE)}); the rest is read to verify, replay or link a receipt")
        redact = RedactRule(_days(path, "redact.older_than_days", t.get("older_than_days", 0)), fields)
    archive = _table(path, doc, "archive", {"dir"}) or {}
    archive_dir = archive.get("dir", "archives")
    if not isinstance(archive_dir, str) or not archive_dir:
        raise _bad(path, "'archive.dir' must be a path")
    parts = archive_dir.replace("\\", "/").split("/")
    if os.path.isabs(archive_dir) or archive_dir.startswith(("/", "\\")) or ".." in parts or "\0" in archive_dir:
        raise _bad(path, f"'archive.dir' is '{archive_dir}': it must be a folder under the store root "
                         "(relative, without '..'): an archive holds whole receipts")
    archive_dir = "/".join(p for p in parts if p not in ("", ".")) or "archives"
    return RetentionPolicy(
        path=path, remove=remove,
        keep_prefixes=_strings(path, "keep.key_prefixes", keep.get("key_prefixes", [])),
        ledger_seconds=_days(path, "keep.ledger_days", keep["ledger_days"]) if "ledger_days" in keep else None,
        ledger_events=ledger_events, redact=redact, archive_dir=archive_dir)


def load_retention(path: str) -> RetentionPolicy:
    """Read and parse the policy file ``path``.

    Raises:
        UsageError: it cannot be read, or :func:`parse_retention` refuses it.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 20)
    except OSError as exc:
        raise _bad(path, exc.strerror or str(exc)) from None
    try:
        return parse_retention(path, data.decode("utf-8"))
    except UnicodeDecodeError:
        raise _bad(path, "not UTF-8") from None

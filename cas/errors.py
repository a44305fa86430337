"""The one exception tree of oncepatch, rooted here because ``cas`` is the lowest layer.

::

    OncepatchError                      envelope fields + exit code
    ├── CasError                        cas: bytes at rest, git object store
    │   ├── DurableWriteError           a durable write or append failed (OSError inside)
    │   ├── RefLockedError              a ref or index ``.lock`` is held (maybe stale)
    │   ├── RefMovedError               compare-and-swap lost: ref is not at the expected oid
    │   ├── RefUpdateUnknown            the ref transaction failed after it may have landed
    │   ├── ObjectsMissing              under the ref lock, an object the move needs is gone
    │   ├── UnsafeWorktreePath          a worktree path runs through a symlink
    │   └── GitStoreError               any other libgit2 failure, translated once
    ├── receipts.errors.ReceiptError    identity, receipts, locks, ledger
    └── patcher.errors.PatchError       parsing, matching, the apply protocol

Every error carries the fields of the CLI's error envelope (docs/DESIGN.md section 6):
``type``, ``message``, ``retryable``, ``effect_status``, ``key``, ``next_action``,
plus ``exit_code`` and free-form ``details`` (merged into the envelope's error
object).  The message is built from the attributes by the raiser; it follows
git's style: lowercase, no trailing period, subjects in quotes.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

__all__ = ["EffectStatus", "NextAction", "OncepatchError", "CasError", "DurableWriteError", "RefLockedError",
           "RefMovedError", "RefUpdateUnknown", "ObjectsMissing", "UnsafeWorktreePath", "GitStoreError", "UsageError",
           "InternalError", "EXIT_OK", "EXIT_INTERNAL", "EXIT_USAGE", "EXIT_CONFLICT", "EXIT_REJECTED",
           "EXIT_IN_PROGRESS", "EXIT_VERIFY", "EXIT_DRIFTED", "SHOWN_CHARS", "SHOWN_PATH_CHARS", "clip"]

EffectStatus = Literal["not_started", "not_applied", "applied", "unknown"]
NextAction = Literal["fix_input", "new_key", "retry", "query_before_retry", "recover", "none"]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_CONFLICT = 3
EXIT_REJECTED = 4
EXIT_IN_PROGRESS = 5
EXIT_VERIFY = 6
#: ``drift``: a receipt's change is no longer as it wrote it; ``replay``: a decision differs from the ledger's.
EXIT_DRIFTED = 7

#: How much of a value a caller gave (a key, a branch, a format, a hash) an error quotes: an agent may
#: send megabytes, and an error that echoes them whole costs every log and context it lands in.
SHOWN_CHARS = 80
#: The same for a path: one longer than PATH_MAX names no file, and a real one is needed whole.
SHOWN_PATH_CHARS = 4096
#: The longest key an envelope's ``key`` holds whole: ``receipts.identity.MAX_KEY_LEN`` (a longer
#: one is refused, and shown as :func:`clip` shows it).
_KEY_CHARS = 512


def clip(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error quotes it: whole up to ``limit`` characters, else its first ``limit``
    and its size (``'kkkk... (10485760 bytes)'``)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text.encode('utf-8', 'surrogatepass'))} bytes)"


class OncepatchError(Exception):
    """Root of every error oncepatch raises on purpose.

    Subclasses set the class defaults; a raiser may override any of them.
    """

    type: ClassVar[str] = "internal"
    exit_code: ClassVar[int] = EXIT_INTERNAL
    default_retryable: ClassVar[bool] = False
    default_effect_status: ClassVar[EffectStatus] = "not_started"
    default_next_action: ClassVar[NextAction] = "none"

    def __init__(self, message: str, *, retryable: bool | None = None, effect_status: EffectStatus | None = None,
                 key: str | None = None, next_action: NextAction | None = None,
                 details: dict[str, Any] | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable
        self.effect_status: EffectStatus = self.default_effect_status if effect_status is None else effect_status
        self.key = key
        self.next_action: NextAction = self.default_next_action if next_action is None else next_action
        self.details: dict[str, Any] = dict(details or {})
        self._type = error_type

    @property
    def error_type(self) -> str:
        return self._type or self.type

    def envelope(self) -> dict[str, Any]:
        """The ``error`` object of the CLI envelope (details merged after the fixed fields)."""
        key = self.key if not isinstance(self.key, str) or len(self.key) <= _KEY_CHARS else clip(self.key)
        err: dict[str, Any] = {"type": self.error_type, "message": self.message, "retryable": self.retryable,
                               "effect_status": self.effect_status, "key": key, "next_action": self.next_action}
        return err | {name: value for name, value in self.details.items() if name not in err}

    def with_key(self, key: str) -> OncepatchError:
        if self.key is None:
            self.key = key
        return self


def _defaults(details: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    """``details`` with ``fields`` added where it has none of its own."""
    given = dict(details or {})
    return given | {name: value for name, value in fields.items() if name not in given}


class UsageError(OncepatchError):
    """Bad command line or unreadable input (exit 2)."""

    type = "usage"
    exit_code = EXIT_USAGE
    default_next_action = "fix_input"


class InternalError(OncepatchError):
    default_effect_status = "unknown"
    default_next_action = "query_before_retry"


class CasError(OncepatchError):
    """Base of the ``cas`` package's errors."""


class DurableWriteError(CasError):
    """A durable write or append failed; the target is unchanged and no tmp file remains."""

    default_retryable = True
    default_next_action = "retry"

    def __init__(self, path: str, cause: OSError, **kw: Any) -> None:
        super().__init__(f"cannot write '{path}': {cause.strerror or cause}", **kw)
        self.path = path
        self.cause = cause
        self.target: object = None  # what failed to sync, as given to fsync_all (a path or a descriptor)
        self.failed: list[object] = []  # from fsync_all: everything in its round that failed to sync


class RefLockedError(CasError):
    """A ``.lock`` file of git's lock protocol is held: by a live git, or left stale by a dead one."""

    type = "in_progress"
    exit_code = EXIT_IN_PROGRESS
    default_retryable = True
    default_next_action = "retry"

    def __init__(self, lock_path: str, **kw: Any) -> None:
        super().__init__(f"cannot lock '{lock_path}': file exists; another git process may be running "
                         f"(if none is, check with 'fuser {lock_path}' and remove the file by hand)",
                         details=_defaults(kw.pop("details", None), lock_path=lock_path), **kw)
        self.lock_path = lock_path


class RefMovedError(CasError):
    """Compare-and-swap lost: the ref is not where the caller expected it."""

    type = "conflict"
    exit_code = EXIT_REJECTED
    default_retryable = True
    default_effect_status = "not_applied"
    default_next_action = "retry"

    def __init__(self, ref: str, actual: str | None, expected: str | None, **kw: Any) -> None:
        super().__init__(f"cannot lock ref '{ref}': is at {(actual or 'nothing')[:12]} "
                         f"but expected {(expected or 'nothing')[:12]}", **kw)
        self.ref = ref
        self.actual = actual
        self.expected = expected


class RefUpdateUnknown(CasError):
    """The ref transaction failed at a point where the update may already be visible."""

    type = "unknown"
    exit_code = EXIT_IN_PROGRESS
    default_effect_status = "unknown"
    default_next_action = "recover"


class ObjectsMissing(CasError):
    """Under the ref's lock, objects the new value needs are gone and could not be written again.

    (A ``git gc --prune=now`` or ``git prune --expire=now`` beside the call.)
    Nothing moved: like ``git update-ref``, the ref is never pointed at a
    missing object.
    """

    type = "objects_missing"
    exit_code = EXIT_REJECTED
    default_retryable = True
    default_effect_status = "not_applied"
    default_next_action = "retry"

    def __init__(self, ref: str, missing: list[str], **kw: Any) -> None:
        super().__init__(f"cannot update ref '{ref}': {len(missing)} object(s) it needs are missing "
                         f"(first {missing[0][:12]}); nothing was moved",
                         details=_defaults(kw.pop("details", None), missing=missing), **kw)
        self.ref = ref
        self.missing = missing


class UnsafeWorktreePath(CasError):
    type = "unsafe_path"
    exit_code = EXIT_REJECTED
    default_effect_status = "not_started"
    default_next_action = "fix_input"


class GitStoreError(CasError):
    """A libgit2 failure, translated once at the ``cas`` boundary."""

    default_effect_status = "unknown"
    default_next_action = "query_before_retry"

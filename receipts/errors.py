"""Errors of the ``receipts`` package (a branch of the tree drawn in ``cas.errors``).

::

    ReceiptError(OncepatchError)
    ├── CanonicalJsonError     value outside the canonical-JSON profile    exit 2 invalid_args
    ├── InvalidKey             unusable idempotency key                   exit 2 usage
    ├── IdempotencyConflict    same key, different tool/version/args      exit 3 idempotency_conflict
    ├── InProgress             key lock still held at the timeout         exit 5 in_progress
    ├── StillUnknown           outcome cannot be told; needs recover      exit 5 unknown
    ├── NotResolvable          resolve refused: final, or adapter disagrees exit 2 not_resolvable
    ├── AmbiguousCallId        a call_id that several keys' receipts share exit 2 ambiguous_call_id
    ├── FencedOff              a newer attempt owns the key               exit 5 in_progress
    ├── CorruptReceipt         receipt fails verification on read         exit 6 corrupt_receipt
    ├── CorruptLedger          event ledger line unreadable               exit 6 corrupt_receipt
    ├── ReadFailed             a transient read error (EIO, EINTR, ...)   exit 5 io_error, retryable
    ├── RecoveryFailed         recover stopped by an I/O error; run again  exit 5 io_error, retryable
    ├── ReceiptNotFound        no receipt for a key                       exit 2 not_found
    ├── SigningKeyMissing      a signed store's active key not readable here exit 2 usage
    ├── Forbidden              the policy refuses the caller this call    exit 4 forbidden
    └── (receipts.effects)     generic effects:
        ├── EffectRejected     provably not done (tool said so, or before sending)  exit 4
        │   └── InvalidEffectArgs   args refused before sending, not retryable     exit 4
        └── EffectUnknown(StillUnknown)  failed after sending: outcome unknown     exit 5
"""

from __future__ import annotations

import errno
from typing import Any


from cas.errors import (
    EXIT_CONFLICT,
    EXIT_IN_PROGRESS,
    EXIT_REJECTED,
    EXIT_USAGE,
    EXIT_VERIFY,
    OncepatchError,
)

__all__ = [
    "UNREACHABLE", "NotChecked", "only_unreachable",
    "TRANSIENT_ERRNOS",
    "ReceiptError",
    "CanonicalJsonError",
    "InvalidKey",
    "IdempotencyConflict",
    "InProgress",
    "StillUnknown",
    "NotResolvable",
    "AmbiguousCallId",
    "FencedOff",
    "CorruptReceipt",
    "CorruptLedger",
    "ReadFailed",
    "RecoveryFailed",
    "ReceiptNotFound",
    "SigningKeyMissing",
    "Forbidden",
]


class ReceiptError(OncepatchError):
    type = "internal"


class CanonicalJsonError(ReceiptError):
    type = "invalid_args"
    exit_code = EXIT_USAGE
    default_next_action = "fix_input"


class InvalidKey(ReceiptError):
    type = "usage"
    exit_code = EXIT_USAGE
    default_next_action = "fix_input"


class IdempotencyConflict(ReceiptError):
    type = "idempotency_conflict"
    exit_code = EXIT_CONFLICT
    default_effect_status = "not_started"
    default_next_action = "new_key"  # the key already stands for another change


class InProgress(ReceiptError):
    type = "in_progress"
    exit_code = EXIT_IN_PROGRESS
    default_retryable = True
    default_effect_status = "unknown"
    default_next_action = "query_before_retry"


class StillUnknown(ReceiptError):
    type = "unknown"
    exit_code = EXIT_IN_PROGRESS
    default_effect_status = "unknown"
    default_next_action = "recover"


class NotResolvable(ReceiptError):
    """``resolve`` refused: the receipt is final, or its adapter knows better than the claim."""

    type = "not_resolvable"
    exit_code = EXIT_USAGE
    default_effect_status = "unknown"
    default_next_action = "none"


class AmbiguousCallId(ReceiptError):
    """A call_id given where a key was expected names the receipts of several keys."""

    type = "ambiguous_call_id"
    exit_code = EXIT_USAGE
    default_next_action = "fix_input"


class FencedOff(ReceiptError):
    type = "in_progress"
    exit_code = EXIT_IN_PROGRESS
    default_effect_status = "unknown"
    default_next_action = "query_before_retry"


class CorruptReceipt(ReceiptError):
    type = "corrupt_receipt"
    exit_code = EXIT_VERIFY
    default_effect_status = "unknown"
    default_next_action = "recover"

    def __init__(self, path: str, reason: str, **kw: Any) -> None:
        details = dict(kw.pop("details", None) or {})
        details.setdefault("path", path)
        details.setdefault("reason", reason)
        super().__init__(f"corrupt receipt '{path}': {reason}", details=details, **kw)
        self.path = path
        self.reason = reason


class CorruptLedger(ReceiptError):
    type = "corrupt_receipt"
    exit_code = EXIT_VERIFY
    default_effect_status = "unknown"
    default_next_action = "none"


#: Read errors that may pass (a retry may read the file): reported as :class:`ReadFailed`, never as corruption.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EINTR, errno.ENOMEM, errno.EAGAIN, errno.ENFILE,
                              errno.EMFILE, errno.ENOBUFS})


class ReadFailed(ReceiptError):
    """A store file could not be read for a reason that may pass (EIO, EINTR, ENOMEM, EAGAIN, ...).

    Not evidence of a changed store: the same call again may read it.  The
    effect is ``unknown`` to this read (it may come after the call's own
    effect); a retry with the same key is the safe way to learn it.
    """

    type = "io_error"
    exit_code = EXIT_IN_PROGRESS
    default_retryable = True
    default_effect_status = "unknown"
    default_next_action = "retry"

    def __init__(self, path: str, cause: OSError, **kw: Any) -> None:
        details = dict(kw.pop("details", None) or {})
        details.setdefault("path", path)
        details.setdefault("errno", cause.errno)
        super().__init__(f"cannot read '{path}' now ({cause.strerror or cause}): retry", details=details, **kw)
        self.path = path


class RecoveryFailed(ReceiptError):
    """``recover`` stopped part way by an I/O error (EIO, ENOSPC, EACCES, ...); running it again finishes the job.

    ``effect_status`` is ``not_started`` when it had written nothing yet, else
    ``unknown`` (what it finished is in ``details["done"]``; the step under
    way may be half done, which the next run settles).
    """

    type = "io_error"
    exit_code = EXIT_IN_PROGRESS
    default_retryable = True

    def __init__(self, cause: BaseException, *, wrote: bool, done: dict[str, Any] | None = None) -> None:
        path = getattr(cause, "filename", None) or getattr(cause, "path", None)
        errno_ = getattr(cause, "errno", None) or getattr(getattr(cause, "cause", None), "errno", None)
        what = getattr(cause, "message", None) or (
            f"{getattr(cause, 'strerror', None) or cause}{f' on {str(path)!r}' if path else ''}")
        details: dict[str, Any] = {"path": None if path is None else str(path), "errno": errno_}
        if done is not None:
            details["done"] = done
        super().__init__(
            f"recover stopped: {what}; "
            + ("it changed nothing" if not wrote else "what it finished is in 'done', the step under way may be half done")
            + ": run 'oncepatch recover' again",
            effect_status="unknown" if wrote else "not_started", next_action="recover" if wrote else "retry",
            details=details)


class ReceiptNotFound(ReceiptError):
    type = "not_found"
    exit_code = EXIT_USAGE
    default_next_action = "fix_input"


class SigningKeyMissing(ReceiptError):
    """A signed store's active private key cannot be read by this process (lost, or another user's).

    Refused before anything is written; ``oncepatch keys rotate`` replaces a lost key.
    """

    type = "usage"
    exit_code = EXIT_USAGE
    default_next_action = "none"


class Forbidden(ReceiptError):
    """The policy (:mod:`receipts.policy`) does not allow this caller this call.

    Final and not retryable: the same call is refused again until the policy
    changes.  Nothing was written but the ledger's ``forbidden`` event.
    """

    type = "forbidden"
    exit_code = EXIT_REJECTED
    default_effect_status = "not_started"
    default_next_action = "none"


#: How a verifier's reason starts when what it checks against (a git remote) could not be reached:
#: not a contradiction but a check not made (the CLI's exit 5, not 6; docs/REMOTE.md).
UNREACHABLE = "unreachable: "


def only_unreachable(problems: list[str]) -> bool:
    """Whether every one of a verifier's ``problems`` is a check not made (:data:`UNREACHABLE`), none a contradiction."""
    return bool(problems) and all(p.startswith(UNREACHABLE) for p in problems)


class NotChecked(ReceiptError):
    """A committed receipt that could not be checked now (its git remote out of reach): nothing found wrong.

    ``status`` answers this instead of ``corrupt_receipt``: the same question
    again, once the remote can be reached, gets the receipt.
    """

    type = "io_error"
    exit_code = EXIT_IN_PROGRESS
    default_retryable = True
    default_effect_status = "unknown"
    default_next_action = "retry"

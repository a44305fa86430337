"""Errors of the ``patcher`` package (a branch of the tree drawn in ``cas.errors``).

::

    PatchError(OncepatchError)
    ├── ParseError            malformed patch                       exit 4 parse_error
    ├── UnsafePath            absolute, '..', .git, NUL, symlinked   exit 4 unsafe_path
    ├── TooLarge              patch or file over the size limit      exit 4 too_large
    ├── ContextNotFound       a hunk's context is not in the file    exit 4 context_not_found
    ├── AmbiguousMatch        a hunk matches in several places       exit 4 ambiguous_match
    ├── PartiallyApplied      some hunks already present, some not   exit 4 partially_applied
    ├── IndentationMismatch   a loose match, lines off by unlike     exit 4 indentation_mismatch
    │                         indentation (or tabs against spaces)
    ├── InexactMatch          --strict, and a hunk matched loosely   exit 4 inexact_match
    ├── DirtyPath             touched path has uncommitted changes   exit 4 dirty_path
    ├── Conflict              branch moved; edit no longer applies   exit 4 conflict
    ├── CheckFailed           --check command failed                 exit 4 check_failed
    └── UnsupportedPatch      e.g. submodules, binary without data   exit 4 parse_error

All of them are rejections that happen before anything is written (effect
``not_started``) unless the raiser says otherwise.
"""

from __future__ import annotations

from typing import ClassVar

from cas.errors import EXIT_REJECTED, EffectStatus, NextAction, OncepatchError

__all__ = [
    "PatchError",
    "ParseError",
    "UnsafePath",
    "TooLarge",
    "ContextNotFound",
    "AmbiguousMatch",
    "PartiallyApplied",
    "IndentationMismatch",
    "InexactMatch",
    "DirtyPath",
    "Conflict",
    "CheckFailed",
    "UnsupportedPatch",
]


class PatchError(OncepatchError):
    type = "internal"
    exit_code = EXIT_REJECTED
    default_retryable = False
    default_effect_status: ClassVar[EffectStatus] = "not_started"
    default_next_action: ClassVar[NextAction] = "fix_input"


class ParseError(PatchError):
    type = "parse_error"


class UnsupportedPatch(PatchError):
    type = "parse_error"


class UnsafePath(PatchError):
    type = "unsafe_path"


class TooLarge(PatchError):
    type = "too_large"


class ContextNotFound(PatchError):
    type = "context_not_found"


class AmbiguousMatch(PatchError):
    type = "ambiguous_match"


class PartiallyApplied(PatchError):
    type = "partially_applied"


class IndentationMismatch(PatchError):
    """A hunk matched only ignoring indentation, and its lines are not all off by one same indentation."""

    type = "indentation_mismatch"


class InexactMatch(PatchError):
    """``strict``: a hunk matched only at a grade below ``exact``."""

    type = "inexact_match"


class DirtyPath(PatchError):
    type = "dirty_path"
    default_retryable = True
    default_next_action = "retry"


class Conflict(PatchError):
    type = "conflict"
    default_retryable = True
    default_effect_status = "not_applied"
    default_next_action = "retry"


class CheckFailed(PatchError):
    type = "check_failed"
    default_retryable = False
    default_effect_status = "not_applied"

"""What a call of ``apply_patch`` answers: its result, its replay, its errors rebuilt or translated.

Shared by the replay (:mod:`patcher.protocol`) and the execution
(:mod:`patcher.execute`), which imports nothing from the protocol's face.
"""

from __future__ import annotations

import errno
import sys
from dataclasses import dataclass
from typing import Any

from cas.errors import EffectStatus, InternalError, NextAction, OncepatchError
from receipts.engine import Call
from receipts.receipt import Receipt
from patcher.errors import (AmbiguousMatch, CheckFailed, Conflict, ContextNotFound, DirtyPath, IndentationMismatch,
                            InexactMatch, ParseError, PartiallyApplied, TooLarge, UnsafePath)
from patcher.grades import grade_warnings

__all__ = ["ApplyResult", "replay_final", "foreign_error", "KEY_REF_PREFIX", "REJECTIONS"]

KEY_REF_PREFIX = "refs/oncepatch/keys/"

#: The error classes a stored rejection of ``apply_patch`` is rebuilt as, by type (else :class:`PatchError`).
REJECTIONS: tuple[type[OncepatchError], ...] = (ParseError, UnsafePath, TooLarge, ContextNotFound, AmbiguousMatch,
                                                PartiallyApplied, DirtyPath, Conflict, CheckFailed,
                                                IndentationMismatch, InexactMatch)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    key: str
    call_id: str
    status: str
    replayed: bool
    commit: str | None
    tree: str | None
    outputs: tuple[dict[str, Any], ...]
    receipt: str
    already_applied: bool = False
    warnings: tuple[str, ...] = ()
    error: dict[str, Any] | None = None
    grades: dict[str, list[str]] | None = None  # per touched file, the grade each hunk matched at
    remote: dict[str, Any] | None = None  # remote mode: name, url, restages (docs/REMOTE.md)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "ok": True,
            "key": self.key,
            "call_id": self.call_id,
            "status": self.status,
            "replayed": self.replayed,
            "commit": self.commit,
            "tree": self.tree,
            "outputs": list(self.outputs),
            "receipt": self.receipt,
        }
        if self.already_applied:
            doc["already_applied"] = True
        if self.grades:
            doc["grades"] = {path: list(g) for path, g in self.grades.items()}
        if self.warnings:
            doc["warnings"] = list(self.warnings)
        if self.remote is not None:
            doc["remote"] = dict(self.remote)
        return doc


def foreign_error(exc: BaseException, *, effect_status: EffectStatus, key: str | None,
                  next_action: NextAction | None = None) -> OncepatchError:
    """A foreign error (the OS's, libgit2's, a bug's) as one of the tree, saying what is known of the effect.

    Translated once, at the boundary of the public API (:func:`apply`,
    :class:`patcher.api.Client`): no raw ``OSError`` reaches a caller.  The
    caller says the ``effect_status`` (it knows how far the call went); an
    I/O failure (``OSError``, libgit2's ``GitError``) is retryable, a bug is not.
    """
    pygit2 = sys.modules.get("pygit2")
    io = isinstance(exc, OSError) or (pygit2 is not None and isinstance(exc, pygit2.GitError))
    if next_action is None:
        done = effect_status in ("not_started", "not_applied")
        next_action = ("retry" if io else "none") if done else "query_before_retry"
    details: dict[str, Any] = {"cause": type(exc).__name__}
    if isinstance(exc, OSError):
        if exc.errno is not None:
            details["errno"] = errno.errorcode.get(exc.errno, str(exc.errno))
        if isinstance(exc.filename, str):
            details["path"] = exc.filename
    text = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
    where = f" on '{exc.filename}'" if isinstance(exc, OSError) and isinstance(exc.filename, str) else ""
    return InternalError(f"{'i/o error' if io else type(exc).__name__}{where}: {text}", retryable=io,
                         effect_status=effect_status, key=key, next_action=next_action, details=details)


def replay_final(call: Call, receipt: Receipt) -> ApplyResult:
    """The stored outcome of a final receipt (:meth:`receipts.engine.Call.replay`); nothing is re-executed.

    Raises:
        PatchError: the stored rejection, as an error of its type.
    """
    warnings = call.replay(receipt)
    grades = receipt.extra.get("grades") or None
    if grades and any(g != "exact" for per_hunk in grades.values() for g in per_hunk):
        warnings = (*grade_warnings(grades), *warnings)
    return ApplyResult(
        key=receipt.key,
        call_id=receipt.call_id,
        status=receipt.status,
        replayed=True,
        commit=receipt.commit,
        tree=receipt.tree,
        outputs=receipt.outputs,
        receipt=call.path,
        already_applied=bool(receipt.extra.get("already_applied")),
        warnings=warnings,
        grades=grades,
    )

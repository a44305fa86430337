"""The protocol engine: one call of a tool under one key, effectively once (docs/DESIGN.md sections 3 and 4).

Every tool goes through it: ``apply_patch`` (:mod:`patcher.execute`) exactly
as ``file_write`` and ``command`` (:mod:`receipts.effects`).  So there is one
lookup and replay, one conflict check, one owner record, one fencing rule, one
error rebuilt from a stored envelope, and one way to settle a dead owner's
call.  A tool brings only its effect (what it stages and executes) and its
adapter (:mod:`receipts.adapter`: ``query`` the world after a crash).

A :class:`Call`, step by step::

    call = Call(store, adapter, identity, key)
    final = call.lookup()                 # 1. without the lock: a final receipt is replayed
    if final is not None:
        return call.replay(final)
    with call.claimed(timeout) as final:  # 2. the key's lock; read again; conflict check;
        if final is not None:             #    a dead owner's prepared/unknown call settled
            return call.replay(final)     #    through adapter.query (settle); final: replay
        call.prepare(**fields)            # 3. `prepared`: the next fencing token, this owner
        call.fence()                      # 4. still ours?  then execute the effect
        call.commit(**fields)             # 5. `committed`; or call.reject() / call.unknown()

Each write appends its event to the ledger (:meth:`ReceiptStore.record`).

**Fencing, the one rule.**  Once this attempt wrote ``prepared``, its effect
runs and every later write of it happens only while the receipt on disk is
still this attempt's own: its ``prepared`` receipt with its token (or a write
of its own that failed half way).  Another process writes that file only after
taking the key over — with the next token (a lost key lock: a stopped process,
a lock file removed by hand, NFS) or by settling this attempt through the
adapter's ``query`` (``recover``, the next call), which keeps the token and
changes the status.  Either way this attempt is fenced off
(:class:`~receipts.errors.FencedOff`) and writes nothing more.

Test seams: ``ONCEPATCH_CRASH_AT`` (:mod:`cas.crash`) and ``ONCEPATCH_PAUSE_AT``
(:func:`pause_point`: the process stops itself with SIGSTOP, so a test can
break its key lock and take the key over before sending SIGCONT).  The engine's
own points: ``after-prepare`` (crash and pause) and ``before-finalise`` (pause,
before the final fence).

This module is on the replay path of a cold CLI process: it imports nothing
a replay does not need (no typing at run time, no pygit2).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping

from cas.crash import PAUSE_ENV, crash_hook, crash_point, pause_point
from cas.durable import DurableBatch
from cas.errors import EXIT_REJECTED, DurableWriteError, OncepatchError
from receipts.errors import (CorruptLedger, CorruptReceipt, FencedOff, IdempotencyConflict, InProgress,
                             SigningKeyMissing, StillUnknown)
from receipts.identity import check_key, compute_args_sha256, compute_call_id
from receipts.receipt import Receipt, now_iso
from receipts.retired import last_attempt
from receipts.states import needs_resolution
from receipts.store import ReceiptStore

TYPE_CHECKING = False  # typing is not imported at run time (start-up: docs/DECISIONS.md)
if TYPE_CHECKING:
    from typing import Any
    from cas.errors import EffectStatus
    from receipts.adapter import EffectAdapter, QueryResult
    from receipts.states import Status

__all__ = ["Call", "PAUSE_ENV", "pause_point", "owner_record", "check_same_intent", "error_from_envelope",
           "settle", "after_effect"]



# -- the owner record ------------------------------------------------------------------------

#: (pid, start time) of this process, read from /proc once per process (a forked child reads its own).
_STARTED: tuple[int, str | None] | None = None


def _proc_start_time() -> str | None:
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return None


def owner_record() -> dict[str, Any]:
    """Who writes a receipt: host, pid, the pid's start time (a reused pid is another process), since when."""
    global _STARTED
    pid = os.getpid()
    if _STARTED is None or _STARTED[0] != pid:
        _STARTED = (pid, _proc_start_time())
    return {"host": os.uname().nodename, "pid": pid, "start_time": _STARTED[1], "since": now_iso()}


# -- conflict, error rebuild -----------------------------------------------------------------


def _differences(old: Mapping[str, Any], new: Mapping[str, Any] | None) -> list[str]:
    """What differs between two identities: ``tool``, ``tool_version``, ``args.<name>`` (sorted)."""
    if new is None:
        return []
    out = [name for name in ("tool", "tool_version") if old.get(name) != new.get(name)]
    a, b = old.get("args"), new.get("args")
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out += [f"args.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    elif a != b:
        out.append("args")
    return out


def check_same_intent(existing: Receipt, args_sha: str, key: str, identity: Mapping[str, Any] | None = None) -> None:
    """Refuse a key whose receipt was written for another call.

    The error names what differs (``differs``: ``tool``, ``tool_version``,
    ``args.<name>``) when the new call's ``identity`` is given, and its
    ``next_action`` is ``new_key``: the key already stands for another change.

    Raises:
        IdempotencyConflict: the tool, its version or the args differ.
    """
    if existing.args_sha256 != args_sha:
        differs = _differences(existing.identity, identity)
        what = ", ".join(differs) if differs else "tool, version or args"
        raise IdempotencyConflict(
            f"key '{key}' was used for a different call ({what} differ{'s' if len(differs) == 1 else ''}); "
            f"the key stands for its first call's change: give this change a new key",
            key=key,
            details={"existing_call_id": existing.call_id, "existing_status": existing.status,
                     "existing_tool": existing.tool, "differs": differs},
        )


_ENVELOPE_FIELDS = frozenset({"type", "message", "retryable", "effect_status", "key", "next_action"})


def error_from_envelope(err: Mapping[str, Any], key: str | None, classes: Mapping[str, type[OncepatchError]],
                        default: type[OncepatchError], *, replayed: bool = True) -> OncepatchError:
    """A stored rejection rebuilt as an error of its type (``classes``, else ``default``), same envelope.

    The envelope's extra fields become details, with ``replayed: true`` (``replayed=False``: an
    answer passed on as it came, e.g. a server's, :mod:`patcher.remote`).
    """
    etype = str(err.get("type") or "rejected")
    details = {k: v for k, v in err.items() if k not in _ENVELOPE_FIELDS}
    if replayed:
        details["replayed"] = True
    return classes.get(etype, default)(
        str(err.get("message") or "rejected"),
        retryable=bool(err.get("retryable", False)),
        effect_status=err.get("effect_status") or "not_applied",
        key=key,
        next_action=err.get("next_action") or "none",
        details=details,
        error_type=etype,
    )


def after_effect(exc: Exception, key: str, effect_status: EffectStatus = "applied") -> OncepatchError:
    """The error a call ends with when it fails once its effect ran (``applied``) or may have (``unknown``).

    Its envelope says so, with ``next_action: recover`` — never
    ``not_started`` nor ``retry`` (docs/DESIGN.md section 6): the effect is
    there, or may be, and only its record is missing.  A foreign error (the
    OS's, libgit2's, a bug's) becomes :class:`StillUnknown` with its text, and
    so does a rejection (exit 4 says "nothing was done"); any other keeps its
    type.
    """
    if isinstance(exc, OncepatchError) and exc.exit_code != EXIT_REJECTED:
        err = exc
    else:
        text = exc.message if isinstance(exc, OncepatchError) else f"{type(exc).__name__}: {exc}"
        said = "happened" if effect_status == "applied" else "may have happened"
        err = StillUnknown(f"the effect of key '{key}' {said}, but the call failed after it: {text}; "
                           f"run 'oncepatch recover' to record it", key=key)
        if isinstance(exc, OncepatchError):
            err.details = {**exc.details, "cause": exc.envelope()}
    err.effect_status, err.next_action, err.retryable = effect_status, "recover", False
    return err.with_key(key)


# -- settling a dead owner's call ------------------------------------------------------------


def settle(store: ReceiptStore, receipt: Receipt, adapter: EffectAdapter, result: QueryResult | None = None,
           *, note: str | None = None, takeover: bool = False) -> Receipt:
    """Settle one ``prepared``/``unknown`` receipt through the adapter's ``query``; the caller holds the key's lock.

    ``applied`` → ``committed`` (then the adapter's ``settle`` follow-up);
    ``not_applied`` → ``rejected``, retryable; ``unknown`` → ``unknown``.
    The token is kept: the attempt that wrote the receipt is fenced off.
    ``note``: a person resolved it (``oncepatch resolve``) with the adapter's
    agreement; the ledger event is ``resolved`` with the note, not ``recovered``.
    ``takeover``: the key's next call settles it to take the key over (the
    event says ``takeover: true``; ``oncepatch stats`` counts lease takeovers by it).

    Raises:
        StillUnknown: the adapter cannot tell; the receipt is written ``unknown``.
    """
    if result is None:
        result = adapter.query(receipt)
    crash_point("recover-after-resolve")
    hook = crash_hook("recover-before-receipt-replace")
    notes = [str(n) for n in result.fields.get("notes", [])]
    if result.status == "applied":
        fields = {k: v for k, v in result.fields.items() if k in ("commit", "tree", "outputs", "result")}
        new = receipt.evolve(status="committed", error=None, retryable=None,
                             extra={**receipt.extra, "recovered": result.reason}, **fields)
        try:
            notes += adapter.settle(new)
        except (OncepatchError, OSError) as exc:  # an I/O error too: the effect stands, its follow-up waits
            warning = f"follow-up not done: {exc.message if isinstance(exc, OncepatchError) else exc.strerror or exc}"
            notes.append(warning)
            # A warning, as apply leaves one: the next recover settles it again.
            new = new.evolve(extra={**new.extra, "warnings": [*new.extra.get("warnings", []), warning]})
        if notes:
            new = new.evolve(extra={**new.extra, "recovery_notes": notes})
        _record_settled(store, new, hook, result.reason, note, takeover)
        return new
    if result.status == "not_applied":
        err = {
            "type": "crashed_before_commit",
            "message": "the call stopped before its effect happened; a retry executes it once",
            "retryable": True,
            "effect_status": "not_applied",
            "key": receipt.key,
            "next_action": "retry",
        }
        new = receipt.evolve(status="rejected", retryable=True, error=err,
                             extra={**receipt.extra, "recovered": result.reason,
                                    **({"recovery_notes": notes} if notes else {})})
        _record_settled(store, new, hook, result.reason, note, takeover)
        return new
    if receipt.status != "unknown":
        new = receipt.evolve(status="unknown", extra={**receipt.extra, "unknown_reason": result.reason})
        noted: dict[str, Any] = {"reason": result.reason, **({"takeover": True} if takeover else {})}
        store.record(new, "unknown", **noted)
    raise StillUnknown(
        f"outcome of key '{receipt.key}' cannot be told ({result.reason}): "
        "check by hand, then 'oncepatch resolve KEY --as committed|rejected'",
        key=receipt.key,
    )


def _record_settled(store: ReceiptStore, new: Receipt, hook: Callable[[], None] | None, reason: str,
                    note: str | None, takeover: bool = False) -> None:
    if note is None:
        fields: dict[str, Any] = {"reason": reason, **({"takeover": True} if takeover else {})}
        store.record(new, "recovered", before_replace=hook, **fields)
    else:
        store.record(new, "resolved", before_replace=hook, reason=reason, note=note)


# -- the call ------------------------------------------------------------------------------------


class Call:
    """One call of a tool under a key (the steps in the module docstring); not reusable.

    ``identity``: :func:`receipts.identity.make_identity` of the normalised
    args.  ``adapter`` may be set later, before :meth:`claimed` (a replay
    needs none).  ``errors``: the tool's error classes, by their ``type``, that
    a stored rejection is rebuilt as (``default_error`` for any other type).
    """

    def __init__(self, store: ReceiptStore, adapter: EffectAdapter | None, identity: dict[str, Any],
                 key: str | None = None, *, errors: tuple[type[OncepatchError], ...] = (),
                 default_error: type[OncepatchError] = OncepatchError) -> None:
        self.store = store
        self.adapter = adapter
        self.identity = identity
        self.tool: str = identity["tool"]
        self.tool_version: str = identity["tool_version"]
        self.call_id: str = compute_call_id(identity)  # refuses non-canonical args first
        self.args_sha256 = compute_args_sha256(self.tool, self.tool_version, identity["args"])
        self.key: str = check_key(key) if key is not None else self.call_id
        self.path = store.receipt_path(self.key)
        #: The key's receipt as found before this attempt (by :meth:`lookup`, then under the lock).
        self.previous: Receipt | None = None
        #: This attempt's receipt as last written.
        self.receipt: Receipt | None = None
        self._errors = {cls.type: cls for cls in errors}
        self._default_error = default_error
        self._prepared = False  # this attempt's prepared receipt is written: later writes are fenced
        self._attempted: Receipt | None = None  # the receipt this attempt tried to write last

    @property
    def token(self) -> int:
        """This attempt's fencing token: one more than the key's previous receipt's."""
        if self._prepared and self.receipt is not None:
            return self.receipt.fencing_token
        return (self.previous.fencing_token if self.previous is not None else 0) + 1

    # -- 1, 2: lookup, lock, conflict, settle, replay ---------------------------------------

    def lookup(self) -> Receipt | None:
        """The key's final receipt, read without the lock (a final receipt is immutable), else ``None``.

        Raises:
            IdempotencyConflict: the key's receipt is another call's.
            CorruptReceipt: its file fails verification.
        """
        existing = self.previous = self.store.read(self.key, before_any_effect=True)
        if existing is None:
            return None
        check_same_intent(existing, self.args_sha256, self.key, self.identity)
        return existing if existing.is_final else None

    @contextlib.contextmanager
    def claimed(self, timeout: float) -> Iterator[Receipt | None]:
        """Hold the key's lock; yield its final receipt (to replay), else ``None`` (execute).

        Under the lock the receipt is read again; a ``prepared`` or ``unknown``
        one belongs to a dead owner (a live one would hold the lock): it is
        settled through the adapter first (:func:`settle`).

        Raises:
            InProgress: the lock is still held by another call after ``timeout``.
            IdempotencyConflict: the key's receipt is another call's.
            StillUnknown: a dead owner's call whose outcome the adapter cannot tell.
        """
        self.store.check_can_sign()  # a signed store's writer without its key: refused before the lock
        with self.store.lock(self.key, timeout=timeout):
            existing = self.store.read(self.key)
            if existing is not None:
                check_same_intent(existing, self.args_sha256, self.key, self.identity)
                if needs_resolution(existing.status):
                    assert self.adapter is not None, "an adapter settles a dead owner's call"
                    existing = settle(self.store, existing, self.adapter, takeover=True)
                if not existing.is_final:
                    self._refuse_rolled_back(existing)
            self.previous = existing
            yield existing if existing is not None and existing.is_final else None

    def _refuse_rolled_back(self, receipt: Receipt) -> None:
        """Refuse to run again over a receipt the ledger has seen superseded (an earlier attempt put back).

        A retryable rejection is run again under the next token; were it an
        earlier state put back over the commit that followed it (signed, its
        digest in the ledger), the effect would happen twice.  Read only on
        this path (one pass over the ledger): a new key's call never pays it.

        Raises:
            CorruptReceipt: the ledger records a later attempt of the key (nothing is run).
        """
        last = last_attempt(self.store.ledger.events(), self.key)
        if last > receipt.fencing_token:
            raise CorruptReceipt(self.path, f"rolled back: the ledger records attempt {last} of this key, the "
                                            f"receipt is attempt {receipt.fencing_token}'s ('{receipt.status}')",
                                 key=self.key, next_action="none")

    def replay(self, receipt: Receipt) -> tuple[str, ...]:
        """Note the replay of a final receipt in the ledger; a stored rejection is raised again.

        A store this process may read but not write (another user's, read-only),
        or whose ledger lock another process holds, still replays at once, with a
        warning (returned): the note records nothing a receipt or verify depends on.

        A ``committed`` receipt is answered from only where the world agrees:
        the adapter's ``confirm(receipt)`` (optional; git: the key ref at the
        commit, the commit's trailer, its outputs) lists what contradicts it.
        Anything listed makes it corrupt: nothing is answered from it, and the
        ledger gets no note.

        Raises:
            OncepatchError: the rejection, rebuilt from its envelope (:func:`error_from_envelope`).
            CorruptReceipt: the adapter's world contradicts the committed receipt.
        """
        confirm = getattr(self.adapter, "confirm", None) if receipt.status == "committed" else None
        if confirm is not None:
            problems = confirm(receipt)
            if problems:
                raise CorruptReceipt(self.path, "; ".join(problems), key=receipt.key, next_action="none",
                                     details={"contradicted_by": self.tool})
        warnings: tuple[str, ...] = ()
        try:
            # wait=0: a replay never waits on the ledger lock (a held lock made every replay wait
            # its whole timeout, then answer in_progress); the note is not worth a wait.
            self.store.ledger.append_receipt_event("replayed", receipt, wait=0)
        except InProgress:
            warnings = ("the replay was not noted in the ledger (its lock is held)",)
        except (OSError, DurableWriteError, SigningKeyMissing, CorruptLedger) as exc:  # CorruptLedger: a foreign torn tail, never cut for a note
            warnings = (f"the replay was not noted in the ledger ({exc})",)
        if receipt.status == "rejected":
            raise error_from_envelope(receipt.error or {}, receipt.key, self._errors, self._default_error)
        return warnings

    # -- 3, 4: prepare, fence ---------------------------------------------------------------

    def prepare(self, *, batch: DurableBatch | None = None, **fields: Any) -> Receipt:
        """Write ``prepared`` with the next fencing token (``batch``: files made durable with it)."""
        receipt = self._fresh("prepared", **fields)
        self._record(receipt, "prepared", batch=batch)
        self._prepared = True
        crash_point("after-prepare")
        pause_point("after-prepare")
        return receipt

    @property
    def prepared(self) -> bool:
        """Whether this attempt wrote its ``prepared`` receipt (its effect may run from here on)."""
        return self._prepared

    def fence(self) -> None:
        """The one fencing rule (module docstring); nothing to check before ``prepared`` is written.

        Raises:
            FencedOff: another process took the key over, or settled this attempt.
        """
        if not self._prepared:
            return
        if self.store.unchanged_since_written(self.key):
            return  # the bytes this process wrote last: its own prepared receipt
        current = self.store.read(self.key)
        if current is None:
            return
        token = self.token
        if current.fencing_token != token:
            raise FencedOff(
                f"key '{self.key}' was taken over by attempt {current.fencing_token} (this is attempt {token})",
                key=self.key,
                details={"fencing_token": token, "current_token": current.fencing_token},
            )
        if current.status != "prepared" and not (self._attempted is not None
                                                 and current.digest == self._attempted.digest):
            raise FencedOff(
                f"key '{self.key}' was settled as {current.status} by another process while attempt {token} ran",
                key=self.key,
                details={"fencing_token": token, "current_token": current.fencing_token,
                         "current_status": current.status},
            )

    def update(self, event: str, *, batch: DurableBatch | None = None, **fields: Any) -> Receipt:
        """Rewrite this attempt's ``prepared`` receipt with ``fields`` (fenced), e.g. a re-staged candidate."""
        assert self._prepared and self.receipt is not None
        self.fence()
        receipt = self.receipt.evolve(**fields)
        self._record(receipt, event, batch=batch)
        return receipt

    # -- 5: the outcome --------------------------------------------------------------------

    def commit(self, *, before_replace: Callable[[], None] | None = None,
               add_to_batch: Callable[[DurableBatch], None] | None = None,
               event: Mapping[str, object] | None = None, **fields: Any) -> str:
        """Write ``committed`` (fenced); return the receipt's path.

        Without a ``prepared`` receipt of this attempt (nothing to execute: the
        effect was already there) a new receipt with the next token is written.
        ``add_to_batch``: called after the fence with the batch the receipt is
        written in (files renamed before it).  ``event``: fields of the ledger event.

        Called once the effect ran: whatever fails here (the fence included)
        raises with ``effect_status: applied``, ``next_action: recover``
        (:func:`after_effect`).
        """
        try:
            if self._prepared:
                assert self.receipt is not None
                pause_point("before-finalise")
                self.fence()
                final = self.receipt.evolve(status="committed", error=None, retryable=None, **fields)
            else:
                final = self._fresh("committed", **fields)
            batch = DurableBatch()
            if add_to_batch is not None:
                add_to_batch(batch)
            return self._record(final, "committed", batch=batch, before_replace=before_replace,
                                event_fields=event)
        except Exception as exc:
            err = after_effect(exc, self.key)
            if err is exc:
                raise
            raise err from exc

    def unfinished(self, error: OncepatchError) -> None:
        """Record ``unknown`` with ``error``'s envelope for an attempt that failed once its effect ran, or may have.

        Best effort, and only while the receipt on disk is still this attempt's
        ``prepared`` one: a receipt another process settled meanwhile, or this
        attempt's own final receipt that landed before a later step failed (its
        ledger event, its folder's sync), is left as it is.  A write that fails
        is given up: the ``prepared`` receipt stays, and ``recover`` (or the
        key's next call) settles it through the adapter's query all the same.
        """
        if not self._prepared or self.receipt is None or self.receipt.status != "prepared":
            return  # nothing of this attempt's, or already recorded by it (rejected, unknown)
        if isinstance(error, FencedOff):
            return  # the receipt is another process's now
        try:
            current = self.store.read(self.key)
        except Exception:  # noqa: BLE001 - unreadable now: overwriting blind could undo a receipt that landed
            return
        if current is None or current.digest != self.receipt.digest:
            if current is not None and self._attempted is not None and current.digest == self._attempted.digest:
                self.receipt = current  # this attempt's own final write landed; only what followed it failed
            return
        with contextlib.suppress(Exception):
            self.unknown(error.envelope(), reason=error.error_type)

    def reject(self, envelope: dict[str, Any], **fields: Any) -> Receipt:
        """Write ``rejected`` with the error ``envelope`` (its ``retryable`` says whether a retry may execute)."""
        fields.update(retryable=bool(envelope.get("retryable")), error=envelope)
        if self._prepared:
            assert self.receipt is not None
            self.fence()
            receipt = self.receipt.evolve(status="rejected", **fields)
        else:
            receipt = self._fresh("rejected", **fields)
        self._record(receipt, "rejected")
        return receipt

    def unknown(self, envelope: dict[str, Any], *, reason: str | None = None, **fields: Any) -> Receipt:
        """Write ``unknown``: the effect may have happened and no one can tell yet (never read as failed)."""
        assert self._prepared and self.receipt is not None
        self.fence()
        receipt = self.receipt.evolve(status="unknown", error=envelope, **fields)
        self._record(receipt, "unknown", event_fields={"reason": reason} if reason is not None else None)
        return receipt

    # -- internals --------------------------------------------------------------------------

    def _fresh(self, status: Status, **fields: Any) -> Receipt:
        """A receipt of this call with ``status`` and this attempt's token, owned by this process."""
        now = now_iso()
        previous = self.previous
        return Receipt(key=self.key, call_id=self.call_id, identity=self.identity, args_sha256=self.args_sha256,
                       tool=self.tool, tool_version=self.tool_version, status=status, fencing_token=self.token,
                       owner=owner_record(), created_at=previous.created_at if previous is not None else now,
                       updated_at=now, **fields)

    def _record(self, receipt: Receipt, event: str, *, batch: DurableBatch | None = None,
                before_replace: Callable[[], None] | None = None,
                event_fields: Mapping[str, object] | None = None) -> str:
        self._attempted = receipt
        path = self.store.record(receipt, event, batch=batch, before_replace=before_replace, **(event_fields or {}))
        self.receipt = receipt
        return path

"""The generic effect ledger: any tool's side effect, executed effectively once per key.

The protocol is :mod:`receipts.engine`'s, the one every tool goes through;
this module gives it the shape a tool written in Python needs: :func:`effect`
(a context manager: check ``replayed``, a ``with`` body cannot be skipped),
:func:`perform` and :func:`effectful`.  The sequence, the classification table
of :func:`classify` (``rejected`` only when the effect provably did not happen,
else ``unknown``) and a worked example: docs/EFFECTS.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from cas.crash import crash_point
from cas.errors import EXIT_REJECTED, OncepatchError, UsageError, clip
from receipts.adapter import EffectAdapter, QueryResult
from receipts.canonical import canonical_json
from receipts.engine import Call
from receipts.errors import ReceiptError, ReceiptNotFound, StillUnknown
from receipts.identity import make_identity
from receipts.receipt import Receipt
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore

if TYPE_CHECKING:
    from cas.errors import EffectStatus, NextAction

__all__ = [
    "NoQueryAdapter",
    "EffectCall",
    "EffectResult",
    "EffectRejected",
    "InvalidEffectArgs",
    "EffectUnknown",
    "Classification",
    "classify",
    "result_digest",
    "open_store",
    "effect",
    "perform",
    "effectful",
    "compensate",
    "CRASH_AFTER_EXECUTE",
]

#: Crash point (``ONCEPATCH_CRASH_AT``) between a tool's success and its ``committed`` receipt.
CRASH_AFTER_EXECUTE = "effect-after-execute"


# -- errors ------------------------------------------------------------------------


class EffectRejected(ReceiptError):
    """The tool asserts its effect did not happen (raise it from a tool; exit 4).

    ``retryable`` says whether the same call may be executed again under the
    same key (a rate limit: yes; a refusal of the input: no).
    """

    type = "effect_rejected"
    exit_code = EXIT_REJECTED
    default_retryable = False
    default_effect_status: ClassVar[EffectStatus] = "not_applied"
    default_next_action: ClassVar[NextAction] = "fix_input"

    def __init__(self, message: str, *, retryable: bool | None = None, **kw: Any) -> None:
        if retryable and "next_action" not in kw:
            kw["next_action"] = "retry"
        super().__init__(message, retryable=retryable, **kw)


class InvalidEffectArgs(EffectRejected):
    """A validation error before anything was sent: rejected, never retried under this key."""

    type = "validation_error"
    default_retryable = False
    default_effect_status = "not_started"
    default_next_action = "fix_input"


class EffectUnknown(StillUnknown):
    """The tool failed at a point where its effect may have happened (exit 5).

    Never read as failed: ``query`` it (``oncepatch recover``) or settle it by
    hand (``oncepatch resolve``) before trying again.
    """

    type = "unknown"


# -- classification (pure) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Classification:
    """How a tool's failure is recorded."""

    status: Literal["rejected", "unknown"]
    type: str
    retryable: bool
    effect_status: EffectStatus
    next_action: NextAction


_VALIDATION = (ValueError, TypeError, InvalidEffectArgs)


def classify(exc: BaseException, *, sent: bool) -> Classification:
    """Map a tool's exception to a receipt state (the table in the module docstring).

    ``sent`` is False only inside :meth:`EffectCall.before_send` and
    ``adapter.prepare``: code that promised to send nothing.
    """
    if isinstance(exc, EffectRejected):
        return Classification("rejected", exc.error_type, exc.retryable, exc.effect_status, exc.next_action)
    if not sent:
        if isinstance(exc, _VALIDATION):
            return Classification("rejected", "validation_error", False, "not_started", "fix_input")
        return Classification("rejected", "failed_before_send", True, "not_started", "retry")
    if (isinstance(exc, (TimeoutError, socket.timeout)) or type(exc).__name__ == "TimeoutExpired"
            or isinstance(getattr(exc, "reason", None), TimeoutError)):  # urllib wraps timeouts
        kind = "timeout"
    elif isinstance(exc, (ConnectionError, OSError)):
        kind = "connection_lost"
    else:
        kind = "failed_after_send"
    return Classification("unknown", kind, False, "unknown", "query_before_retry")


def result_digest(result: Mapping[str, Any] | None) -> str | None:
    """sha256 hex of the canonical JSON of a tool's result (``None`` for no result)."""
    if result is None:
        return None
    return hashlib.sha256(canonical_json(dict(result))).hexdigest()


# -- adapters ---------------------------------------------------------------------------


class NoQueryAdapter:
    """The adapter of a tool that cannot tell whether its effect happened: always ``unknown``."""

    def __init__(self, tool: str) -> None:
        self.tool = tool

    def query(self, receipt: Receipt) -> QueryResult:
        return QueryResult("unknown", f"tool '{self.tool}' cannot be queried: resolve it by hand")

    def settle(self, receipt: Receipt) -> list[str]:
        return []


def open_store(store: ReceiptStore | str | os.PathLike[str] | None) -> ReceiptStore:
    """A :class:`ReceiptStore` from an instance, a folder, or ``$ONCEPATCH_STORE``.

    Raises:
        UsageError: none given and ``ONCEPATCH_STORE`` is unset.
    """
    if isinstance(store, ReceiptStore):
        return store
    if store is None:
        env = os.environ.get("ONCEPATCH_STORE")
        if not env:
            raise UsageError("no receipt store: pass store= or set ONCEPATCH_STORE")
        store = env
    return ReceiptStore(os.fspath(store))


# -- the call ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EffectResult:
    """The outcome of one effect call (fresh or replayed)."""

    key: str
    call_id: str
    tool: str
    status: str
    replayed: bool
    result: dict[str, Any] | None
    receipt: str
    fencing_token: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, **asdict(self)}


class EffectCall:
    """One claimed effect: a context manager (see :func:`effect`) over one :class:`receipts.engine.Call`.

    Inside the ``with`` body the key's lock is held and the receipt says
    ``prepared``; :attr:`replayed` is True when the body must not run (the
    stored :attr:`result` is the answer).  Not reusable.
    """

    def __init__(
        self,
        store: ReceiptStore,
        tool: str,
        tool_version: str,
        args: dict[str, Any],
        key: str | None,
        adapter: Any,
        *,
        contract_sha256: str | None,
        attempt: int,
        lock_timeout: float,
    ) -> None:
        self.store = store
        self.tool = tool
        self.tool_version = tool_version
        self.adapter = adapter if adapter is not None else NoQueryAdapter(tool)
        if getattr(self.adapter, "tool", tool) != tool:
            raise UsageError(f"adapter is for tool '{self.adapter.tool}', not '{tool}'")
        identity = make_identity(tool, tool_version, args, contract_sha256=contract_sha256, attempt=attempt)
        self._call = Call(store, self.adapter, identity, key, errors=(EffectRejected, InvalidEffectArgs),
                          default_error=EffectRejected)
        self.identity = identity
        self.call_id: str = self._call.call_id
        self.args_sha256 = self._call.args_sha256
        self.key: str = self._call.key
        self.lock_timeout = lock_timeout
        self.replayed = False
        self.result: dict[str, Any] | None = None
        self.status: str | None = None
        self.receipt_path = self._call.path
        self._receipt: Receipt | None = None
        self._stack: contextlib.ExitStack | None = None
        self._sent = True
        self._unsent: BaseException | None = None
        self._finished = False

    # -- public --------------------------------------------------------------

    @property
    def receipt(self) -> Receipt | None:
        """The receipt as last written or read."""
        return self._receipt

    @property
    def fencing_token(self) -> int:
        return self._receipt.fencing_token if self._receipt is not None else 0

    @property
    def outcome(self) -> EffectResult:
        assert self._receipt is not None and self.status is not None
        return EffectResult(self.key, self.call_id, self.tool, self.status, self.replayed, self.result,
                            self.receipt_path, self._receipt.fencing_token)

    @contextlib.contextmanager
    def before_send(self) -> Iterator[None]:
        """A region that sends nothing: its errors are ``rejected``, not ``unknown``.

        ``ValueError``/``TypeError``/:class:`InvalidEffectArgs` raised here are
        validation errors (not retryable); any other error is retryable.
        """
        if self._finished:
            raise RuntimeError("before_send() after the effect was recorded")
        self._sent = False
        try:
            yield
        except BaseException as exc:
            self._unsent = exc  # classified as raised before sending when it reaches __exit__
            raise
        finally:
            self._sent = True

    def commit(self, result: Mapping[str, Any] | None = None) -> EffectResult:
        """Record ``committed`` with ``result`` (canonical JSON: no floats) and its digest.

        Raises:
            RuntimeError: called on a replayed or already recorded call.
            FencedOff: another process took the key over or settled this attempt
                (only after a lost lock; :mod:`receipts.engine`).
        """
        if self.replayed or self._finished or self._receipt is None:
            raise RuntimeError(f"effect '{self.key}' is already recorded: commit() must not run again")
        self._finished = True
        extra = dict(self._receipt.extra)
        bad: Exception | None = None
        doc: dict[str, Any] | None = None
        try:
            if result is not None and not isinstance(result, Mapping):
                raise TypeError(f"a tool's result must be a mapping or None, not {type(result).__name__}")
            doc = dict(result) if result is not None else None
            extra["result_sha256"] = result_digest(doc)
        except (ReceiptError, TypeError, ValueError) as exc:
            # The effect happened: record that truthfully even if its result cannot be kept.
            bad, doc = exc, None
            extra["result_unrecorded"] = f"{type(exc).__name__}: {exc}"
        self._call.commit(result=doc, extra=extra)
        self._receipt, self.status, self.result = self._call.receipt, "committed", doc
        if bad is not None:
            raise bad
        return self.outcome

    # -- context manager -----------------------------------------------------

    def __enter__(self) -> EffectCall:
        if self._stack is not None:
            raise RuntimeError("an EffectCall is not reusable")
        final = self._call.lookup()
        if final is not None:
            self._replay(final)
            self._stack = contextlib.ExitStack()
            return self
        stack = contextlib.ExitStack()
        try:
            try:
                final = stack.enter_context(self._call.claimed(self.lock_timeout))
            except StillUnknown as exc:
                raise EffectUnknown(exc.message, key=self.key, details={"receipt": self.receipt_path}) from exc
            if final is not None:
                stack.close()
                self._stack = contextlib.ExitStack()
                self._replay(final)
                return self
            self._prepare()
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        assert self._stack is not None
        try:
            if self.replayed:
                return False
            if exc is None:
                if not self._finished:
                    crash_point(CRASH_AFTER_EXECUTE)
                    self.commit(None)
                return False
            if self._finished:
                return False  # recorded already (committed): the error came after the effect
            err = self._record_failure(exc)
            if err is exc or not isinstance(exc, Exception):
                return False  # the tool's own EffectRejected; or KeyboardInterrupt & co. go on as they are
            raise err from exc
        finally:
            self._stack.close()

    # -- internals -----------------------------------------------------------

    def _replay(self, receipt: Receipt) -> None:
        """Return the stored outcome; a stored rejection is raised again, nothing re-executed."""
        self._receipt, self.status, self.replayed = receipt, receipt.status, True
        self._call.replay(receipt)
        self.result = receipt.result

    def _prepare(self) -> None:
        """The adapter's validation (before anything is sent), ``prepared``, then the fence before the body."""
        fields: dict[str, Any] = {}
        prepare = getattr(self.adapter, "prepare", None)
        if prepare is not None:
            try:
                fields = dict(prepare(self.identity["args"]) or {})
            except Exception as exc:
                raise self._record_failure(exc, sent=False) from exc
        self._receipt = self._call.prepare(extra=fields)
        # The body is the effect: it runs only while the key is still this attempt's (a
        # process paused after prepare may have lost its lock to a takeover or a settle).
        self._call.fence()

    def _record_failure(self, exc: BaseException, *, sent: bool | None = None) -> OncepatchError:
        """Write ``rejected``/``unknown`` for ``exc``; return the error to raise."""
        self._finished = True
        if sent is None:
            sent = self._sent and exc is not self._unsent
        c = classify(exc, sent=sent)
        detail = exc.message if isinstance(exc, OncepatchError) else f"{type(exc).__name__}: {exc}"
        err: OncepatchError
        if isinstance(exc, EffectRejected):
            err = exc.with_key(self.key)
        elif c.status == "rejected":
            cls = InvalidEffectArgs if c.type == "validation_error" else EffectRejected
            err = cls(f"tool '{self.tool}' failed before sending: {detail}", retryable=c.retryable,
                      effect_status=c.effect_status, next_action=c.next_action, key=self.key,
                      error_type=c.type)
        else:
            err = EffectUnknown(
                f"tool '{self.tool}' failed after it may have acted ({detail}): its effect is unknown; "
                "query it ('oncepatch recover') or settle it by hand ('oncepatch resolve') before retrying",
                key=self.key, error_type=c.type,
            )
        err.retryable, err.effect_status, err.next_action = c.retryable, c.effect_status, c.next_action
        envelope = err.envelope()  # (its type is c.type in every branch above)
        err.details.setdefault("receipt", self.receipt_path)
        if c.status == "rejected":
            new = self._call.reject(envelope)
        else:
            extra = {**(self._receipt.extra if self._receipt is not None else {}), "unknown_reason": c.type}
            new = self._call.unknown(envelope, reason=c.type, extra=extra)
        self._receipt, self.status = new, new.status
        return err


# -- entry points ------------------------------------------------------------------------


def effect(
    tool: str,
    args: Mapping[str, Any],
    key: str | None = None,
    *,
    adapter: Any = None,
    store: ReceiptStore | str | os.PathLike[str] | None = None,
    tool_version: str = "1",
    contract_sha256: str | None = None,
    attempt: int = 1,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> EffectCall:
    """Claim the effect ``tool(args)`` under ``key``; use the result as a context manager.

    ``args`` must already be normalised by the tool (absolute paths, digests
    instead of large payloads, defaults filled in) and be canonical JSON.

    Raises (on entering):
        IdempotencyConflict: ``key`` was used with other tool, version or args.
        InProgress: another call holds the key past ``lock_timeout``.
        EffectUnknown: an earlier call's outcome is unknown and ``query`` cannot tell.
        EffectRejected / InvalidEffectArgs: the stored rejection (a replay), or
            ``adapter.prepare`` refused the args.
        CanonicalJsonError / InvalidKey / UsageError: unusable args, key or store.
    Raises (on leaving, when the body raised): :class:`EffectRejected`,
    :class:`InvalidEffectArgs` or :class:`EffectUnknown` chained to the body's error.
    """
    return EffectCall(open_store(store), tool, tool_version, dict(args), key, adapter,
                      contract_sha256=contract_sha256, attempt=attempt, lock_timeout=lock_timeout)


def perform(
    tool: str,
    args: Mapping[str, Any],
    fn: Callable[[EffectCall], Mapping[str, Any] | None],
    *,
    key: str | None = None,
    adapter: Any = None,
    store: ReceiptStore | str | os.PathLike[str] | None = None,
    tool_version: str = "1",
    contract_sha256: str | None = None,
    attempt: int = 1,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> EffectResult:
    """Run ``fn(call)`` as the effect once per key; its return value is the recorded result.

    On a replay ``fn`` is not called and the stored result is returned.
    Raises: as :func:`effect`.
    """
    with effect(tool, args, key, adapter=adapter, store=store, tool_version=tool_version,
                contract_sha256=contract_sha256, attempt=attempt, lock_timeout=lock_timeout) as call:
        if call.replayed:
            return call.outcome
        result = fn(call)
        if call.status != "committed":
            crash_point(CRASH_AFTER_EXECUTE)
            call.commit(result)
    return call.outcome


def effectful(
    tool: str,
    *,
    store: ReceiptStore | str | os.PathLike[str] | None = None,
    adapter: Any = None,
    tool_version: str = "1",
    args: Callable[..., Mapping[str, Any]] | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a tool function so each call runs once per ``idempotency_key``.

    The decorated function takes an extra keyword ``idempotency_key`` (default:
    the call_id of its arguments).  Its arguments (bound, defaults applied,
    without a parameter named ``call``) are the identity's args unless
    ``args(**bound)`` normalises them; a parameter named ``call`` receives the
    :class:`EffectCall`.  It returns the tool's result — the stored one on a replay.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        wants_call = "call" in sig.parameters

        @functools.wraps(fn)
        def wrapper(*a: Any, idempotency_key: str | None = None, **kw: Any) -> Any:
            bound = sig.bind_partial(*a, **kw)
            bound.apply_defaults()
            given = {k: v for k, v in bound.arguments.items() if k != "call"}
            call_args = dict(args(**given)) if args is not None else given

            def run(call: EffectCall) -> Any:
                return fn(*a, **kw, call=call) if wants_call else fn(*a, **kw)

            return perform(tool, call_args, run, key=idempotency_key, adapter=adapter, store=store,
                           tool_version=tool_version, lock_timeout=lock_timeout).result

        return wrapper

    return deco


def compensate(
    key: str,
    *,
    new_key: str,
    adapter: Any,
    store: ReceiptStore | str | os.PathLike[str] | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    **inputs: Any,
) -> EffectResult:
    """Undo ``key``'s committed effect with its adapter's compensating action: a new effect under ``new_key``.

    Compensation is not a rollback: it is an effect of its own, with its own
    receipt, which may itself be rejected or go unknown.  An adapter that can
    compensate declares the optional ``compensation(receipt, **inputs) ->
    (args, run)``: the normalised args of the compensating call and the
    function that performs it (as :func:`perform`'s ``fn``).  The args get
    ``compensates: key``, so it is part of the identity: the same ``new_key``
    and ``key`` replay, ``new_key`` with another ``key`` is an idempotency
    conflict; the ledger's events for it carry ``compensates`` too.

    Raises:
        ReceiptNotFound: ``key`` has no receipt.
        UsageError: the adapter declares no compensation, or the receipt is
            not a committed effect of its tool.
        (and as :func:`effect`)
    """
    rstore = open_store(store)
    original = rstore.find(key)
    if original is None:
        raise ReceiptNotFound(f"no receipt for key '{clip(key)}': nothing to compensate", key=new_key)
    declared = getattr(adapter, "compensation", None)
    if declared is None:
        raise UsageError(f"tool '{getattr(adapter, 'tool', '?')}' declares no compensating action", key=new_key)
    if original.tool != getattr(adapter, "tool", None) or original.status != "committed":
        raise UsageError(f"key '{key}' is not a committed '{getattr(adapter, 'tool', '?')}' effect "
                         f"(tool '{original.tool}', status '{original.status}'): nothing to compensate", key=new_key)
    args, run = declared(original, **inputs)
    return perform(original.tool, {**args, "compensates": original.key}, run, key=new_key, adapter=adapter,
                   store=rstore, tool_version=original.tool_version, lock_timeout=lock_timeout)

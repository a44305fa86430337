"""The event ledger: ``events.jsonl``, append-only, hash-chained.

Each line is the canonical JSON of one event object with ``seq`` (1, 2, …)
and ``prev`` (sha256 hex of the previous line's bytes without its newline;
64 zeros for the first line).  Deleting, editing or reordering a line breaks
the chain at that line, which :meth:`Ledger.verify_chain` reports.

Appends happen under ``locks/ledger.lock`` and are fsynced.  A crash during an
append can leave a torn last line (no newline): it is not an event (the
receipt write it follows already happened, durably), so the next append
under the lock truncates it away before writing, and readers skip it.  A
torn line that is a whole event chained onto the line before it (only the
newline was lost) is kept: the next append completes it with its newline.

:meth:`Ledger.torn_tail` tells a torn line of the ledger's *own* (a crash
mid-append: a prefix of an event that chains onto the last full line) from
anything else; only its own is ever repaired (by the next append, or
``recover``).  Anything else is evidence of a ledger changed by hand: no
append cuts it or chains onto it (:class:`~receipts.errors.CorruptLedger`,
exit 6), it is left for a person (``oncepatch quarantine --ledger``,
docs/RECOVERY.md).

In a signed store (:mod:`receipts.signing`) each event carries a
``signature`` over its canonical JSON without it, ``seq`` and ``prev``
included; :meth:`Ledger.verify_chain` reports an event without one, or with
one that does not verify, as it reports a broken chain.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from cas.durable import NotRegularFile, append_durable, open_regular
from cas.hashing import sha256_hex
from receipts import jsonio
from receipts.canonical import canonical_json
from receipts.errors import TRANSIENT_ERRNOS, CorruptLedger, ReadFailed
from receipts.flock import FolderOpener, flocked
from receipts.receipt import SIGNATURE_FIELD, Receipt, now_iso

TYPE_CHECKING = False
if TYPE_CHECKING:
    from receipts.signing import Signing

__all__ = ["Ledger", "LedgerProblem", "TornTail", "GENESIS", "check_chain", "checkpoint_event"]

GENESIS = "0" * 64
_TAIL = 1 << 16
#: A torn line longer than this is no append of ours (an event is a few hundred bytes).
_TORN_MAX = 1 << 20
#: Every event's canonical JSON starts with its first key, ``at`` (keys sorted; none sorts before it).
_EVENT_START = b'{"at":"'


@dataclass(frozen=True, slots=True)
class LedgerProblem:
    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class TornTail:
    """A last line without its newline: ``offset`` is where it starts (the intact prefix's length).

    ``complete``: a whole event chained onto the line before it (only its newline
    is missing).  ``own``: a prefix of an event this ledger could have been
    appending there (see :func:`_own_prefix`): a crash mid-append, repairable.
    """

    offset: int
    data: bytes
    complete: bool
    own: bool


def _field_agrees(data: bytes, name: bytes, value: bytes) -> bool:
    """Whether every ``"name":`` in the torn ``data`` is followed by ``value`` or a prefix of it."""
    start = 0
    while (at := data.find(name, start)) >= 0:
        rest = data[at + len(name):]
        seen = rest[:len(value)]
        if not value.startswith(seen):
            return False
        if len(rest) > len(value) and rest[len(value):len(value) + 1] not in (b",", b"}"):
            return False
        start = at + len(name)
    return True


def _own_prefix(data: bytes, last_seq: int, prev: str) -> bool:
    """Whether the torn ``data`` may be the start of the event appended after seq ``last_seq``.

    An event's canonical JSON starts ``{"at":"``, holds no newline, and its
    ``seq`` and ``prev`` (where the torn bytes reach them) are the next number
    and the digest of the last full line.  Anything else was not written by an append.
    """
    if not data or len(data) > _TORN_MAX or b"\n" in data:
        return False
    if not (_EVENT_START.startswith(data) or data.startswith(_EVENT_START)):
        return False
    return (_field_agrees(data, b'"prev":', b'"' + prev.encode() + b'"')
            and _field_agrees(data, b'"seq":', str(last_seq + 1).encode()))


def _last_line_problem(before: bytes | None, line: bytes, signing: Signing | None) -> str | None:
    """Why ``line``, the ledger's last full line, is no event of its chain (``None``: it is one).

    An append chains only onto an event: an object with the fields every event
    has (``event``, ``seq``, ``prev``) whose ``seq`` and ``prev`` follow
    the line ``before`` it (``None``: the first line, which follows the genesis),
    a checkpoint's ``head`` standing for the lines it replaced, and, in a signed
    store, its signature.  A line added by hand that is JSON but none of this
    (``{"seq":5}``) would otherwise be chained onto: what ``verify`` reports later
    is refused before the call's first write instead.
    """
    obj = jsonio.loads(line)
    if not isinstance(obj, dict):
        return "is not an object"
    seq, prev = obj.get("seq"), obj.get("prev")
    if not (isinstance(obj.get("event"), str) and isinstance(seq, int) and not isinstance(seq, bool)
            and isinstance(prev, str)):
        return "is no event: it lacks 'event', 'seq' or 'prev'"
    want_seq: int | None = 1
    if before is None:
        want_prev = GENESIS
    else:
        try:
            last = jsonio.loads(before)
        except jsonio.JsonError:
            last = None
        head = last.get("head") if isinstance(last, dict) and last.get("event") == "checkpoint" else None
        want_prev = head if isinstance(head, str) else sha256_hex(before)
        last_seq = last.get("seq") if isinstance(last, dict) else None
        want_seq = last_seq + 1 if isinstance(last_seq, int) and not isinstance(last_seq, bool) else None
    first = obj.get("first_seq") if obj.get("event") == "checkpoint" else seq
    if prev != want_prev or (want_seq is not None and first != want_seq):
        return "does not chain onto the line before it"
    if signing is not None and (why := signing.event_problem(obj)) is not None:
        return why
    return None


def _open_ledger(path: str) -> BinaryIO:
    """The ledger file for reading, a regular file (:func:`cas.durable.open_regular`).

    Raises:
        FileNotFoundError: there is none.
        CorruptLedger: anything else is there, or it cannot be read (a permission).
        ReadFailed: a read error that may pass (:data:`receipts.errors.TRANSIENT_ERRNOS`): no evidence.
    """
    try:
        return os.fdopen(open_regular(path), "rb")
    except FileNotFoundError:
        raise
    except NotRegularFile:
        raise CorruptLedger(f"ledger '{path}' is not a regular file") from None
    except OSError as exc:
        if exc.errno in TRANSIENT_ERRNOS:
            raise ReadFailed(path, exc) from None
        raise CorruptLedger(f"ledger '{path}' cannot be read ({exc.strerror})") from None


class Ledger:
    def __init__(self, path: str, lock_path: str, lock_timeout: float = 30.0, *,
                 signing: Signing | None = None, lock_folder: FolderOpener | None = None) -> None:
        self.path = path
        self.lock_path = lock_path
        #: Yields a descriptor of the lock's folder (the store's ``locks/``, reached without
        #: following a symlink: :mod:`receipts.flock`); ``None``: the folder by its path.
        self.lock_folder = lock_folder
        self.lock_timeout = lock_timeout
        #: A signed store's signing: every append is signed, every line checked (module docstring).
        self.signing = signing

    def _tail(self) -> tuple[int, str, int]:
        """(last seq, sha256 of last full line, byte length of the full-line prefix)."""
        try:
            opened = _open_ledger(self.path)
        except FileNotFoundError:
            return 0, GENESIS, 0
        with opened as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(0, size - _TAIL)
            while True:
                fh.seek(start)
                chunk = fh.read(size - start)
                end = chunk.rfind(b"\n")
                if end < 0 and start > 0:
                    start = max(0, start - _TAIL * 4)
                    continue
                if end < 0:
                    return 0, GENESIS, 0
                head = chunk[:end]
                begin = head.rfind(b"\n")
                if begin < 0 and start > 0:
                    start = max(0, start - _TAIL * 4)
                    continue
                line = head[begin + 1:]
                # The line before the last one, whole (what the last one must chain onto).
                before_at = head.rfind(b"\n", 0, begin) if begin >= 0 else -1
                if begin >= 0 and before_at < 0 and start > 0:
                    start = max(0, start - _TAIL * 4)
                    continue
                before = head[before_at + 1:begin] if begin >= 0 else None
                try:
                    seq = int(jsonio.loads(line)["seq"])
                except Exception as exc:
                    raise CorruptLedger(f"ledger '{self.path}': last line is unreadable") from exc
                if (why := _last_line_problem(before, line, self.signing)) is not None:
                    raise CorruptLedger(f"ledger '{self.path}': its last line {why}")
                return seq, sha256_hex(line), start + end + 1

    def torn_tail(self) -> TornTail | None:
        """The ledger's torn last line, if it has one (see :class:`TornTail`).

        Raises:
            CorruptLedger: the last full line is unreadable, or the file cannot be read.
        """
        seq, prev, good_len = self._tail()
        return self._torn_after(seq, prev, good_len)

    def _torn_after(self, seq: int, prev: str, good_len: int) -> TornTail | None:
        try:
            opened = _open_ledger(self.path)
        except FileNotFoundError:
            return None
        with opened as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == good_len:
                return None
            fh.seek(good_len)
            data = fh.read(min(size - good_len, _TORN_MAX + 1))
        complete = False
        try:
            obj = jsonio.loads(data)
        except Exception:  # noqa: BLE001 - not (yet) JSON: a prefix at best
            obj = None
        if isinstance(obj, dict):
            complete = (obj.get("seq") == seq + 1 and obj.get("prev") == prev
                        and canonical_json(obj) == data)
        own = complete or (obj is None and _own_prefix(data, seq, prev))
        return TornTail(good_len, data, complete, own)

    def refuse_foreign_tail(self, **kw: Any) -> None:
        """Raise if the ledger's last line is torn and is no append of ours, or is a whole line that is no
        event (the last line read when it is not torn).

        Raises:
            CorruptLedger: such a tail or last line (``kw``: the error's fields).
        """
        try:
            fd = open_regular(self.path)
        except OSError:
            return  # none, or unreadable: the append itself reports it
        try:
            size = os.fstat(fd).st_size
            whole = size == 0 or os.pread(fd, 1, size - 1) == b"\n"
        finally:
            os.close(fd)
        if size == 0:
            return
        try:
            # A whole last line that is no event (added by hand) fails the append after the call's first
            # receipt write (a `prepared` receipt left behind): refused here, before it.
            if whole:
                self._tail()
                return
            torn = self.torn_tail()
        except CorruptLedger as exc:
            raise CorruptLedger(f"{exc.message}: nothing is appended to it; 'oncepatch recover' reports it, "
                                "'oncepatch quarantine --ledger' moves it aside", next_action="recover",
                                details={"path": self.path}, **kw) from None
        if torn is not None and not torn.own:
            raise self._foreign_tail(**kw)

    def _foreign_tail(self, **kw: Any) -> CorruptLedger:
        return CorruptLedger(f"ledger '{self.path}': its last line is torn and is no event an append could have "
                             "been writing there (changed by hand): nothing is appended to it; 'oncepatch recover' "
                             "reports it, 'oncepatch quarantine --ledger' moves it aside", next_action="recover",
                             details={"path": self.path}, **kw)

    def append(self, event: dict[str, Any], *, sync: bool = True, wait: float | None = None) -> dict[str, Any]:
        """Append ``event`` (seq and prev filled in) durably; return the stored object.

        ``sync=False``: not fsynced here; the caller syncs :attr:`path` before
        relying on the event (a batch's last round).  ``wait``: seconds to wait
        for the ledger lock (default :attr:`lock_timeout`; 0: only if free now).

        Raises:
            InProgress: the ledger lock could not be taken in time.
            DurableWriteError: the append failed.
            CorruptLedger: the last line is torn and no append of ours (:meth:`refuse_foreign_tail`).
            CorruptReceipt: the store's ``locks/`` folder is a symlink (from :attr:`lock_folder`).
            OSError: the lock file cannot be opened (a symlink: ``ELOOP``).
        """
        if self.lock_folder is None:
            os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        with flocked(self.lock_path, self.lock_timeout if wait is None else wait, folder=self.lock_folder):
            seq, prev, good_len = self._tail()
            try:
                size = os.path.getsize(self.path)
            except FileNotFoundError:
                size = 0
            torn = self._torn_after(seq, prev, good_len) if size != good_len else None
            if torn is not None and not torn.own:
                raise self._foreign_tail()
            if torn is not None and torn.complete:
                # A whole event that lost only its newline: complete it, keep the event.
                append_durable(self.path, b"\n")
                seq, prev = seq + 1, sha256_hex(torn.data)
            elif torn is not None:
                # Torn tail from a crash mid-append: not an event; cut it off.
                fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.ftruncate(fd, good_len)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            stored = dict(event)
            stored.pop(SIGNATURE_FIELD, None)
            stored["seq"] = seq + 1
            stored["prev"] = prev
            if self.signing is not None:
                stored[SIGNATURE_FIELD] = self.signing.sign_event(canonical_json(stored))
            append_durable(self.path, canonical_json(stored) + b"\n", sync=sync)
            return stored

    def append_receipt_event(self, event: str, receipt: Receipt, *, sync: bool = True, digest: str | None = None,
                             wait: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append ``event`` for ``receipt``; ``digest``: its digest when the caller has it at hand.

        Raises:
            InProgress, DurableWriteError: as :meth:`append`.
        """
        doc: dict[str, Any] = {
            "event": event,
            "at": now_iso(),
            "key": receipt.key,
            "call_id": receipt.call_id,
            "tool": receipt.tool,
            "status": receipt.status,
            "fencing_token": receipt.fencing_token,
            "commit": receipt.commit,
            "receipt_sha256": digest if digest is not None else receipt.digest,
        }
        if receipt.error is not None:
            # What ``oncepatch stats`` counts by (receipts.stats): the receipt is rewritten later
            # (a retry, a recovery), the event keeps what this write said.
            doc["error_type"] = receipt.error.get("type")
            doc["retryable"] = bool(receipt.retryable)
        compensates = receipt.args.get("compensates")
        if isinstance(compensates, str):
            doc["compensates"] = compensates  # a compensating call (oncepatch revert): counted by stats
        doc.update(fields)
        return self.append(doc, sync=sync, wait=wait)

    def events(self) -> Iterator[dict[str, Any]]:
        """Every complete event, in order (a torn last line is skipped).

        Raises:
            CorruptLedger: a complete line is not a JSON object.
        """
        try:
            fh = _open_ledger(self.path)
        except FileNotFoundError:
            return
        with fh:
            for n, raw in enumerate(fh, 1):
                if not raw.endswith(b"\n"):
                    return
                try:
                    obj = jsonio.loads(raw)
                except jsonio.JsonError as exc:
                    raise CorruptLedger(f"ledger '{self.path}' line {n} is not JSON") from exc
                if not isinstance(obj, dict):
                    raise CorruptLedger(f"ledger '{self.path}' line {n} is not an object")
                yield obj

    def verify_chain(self, each: Callable[[dict[str, Any]], None] | None = None) -> list[LedgerProblem]:
        """Check seq and prev of every line; return the problems (empty: the chain holds).

        ``each`` is given every complete line that is a JSON object, in order
        (one pass for a caller that also reads the events).
        """
        try:
            fh = _open_ledger(self.path)
        except FileNotFoundError:
            return []
        except CorruptLedger as exc:
            return [LedgerProblem(1, exc.message)]
        with fh:
            return check_chain(fh, signing=self.signing, each=each)


def check_chain(lines: Iterable[bytes], *, prev: str = GENESIS, seq: int = 1, signing: Signing | None = None,
                each: Callable[[dict[str, Any]], None] | None = None) -> list[LedgerProblem]:
    """The problems of a run of ledger lines (each with its newline) that starts after ``prev`` at ``seq``.

    A ``checkpoint`` event (``oncepatch gc``'s compaction, :func:`checkpoint_event`)
    stands for the events ``first_seq`` to ``seq`` it replaced: it chains onto
    the line before it, and the line after it chains onto its ``head`` (the
    digest of the last line it replaced).  Its own content is confirmed by a
    later ``compacted`` event naming its digest (``checkpoint_sha256``), which
    chains as any event does.
    """
    problems: list[LedgerProblem] = []
    expected_seq = seq
    unconfirmed: dict[str, int] = {}
    for n, raw in enumerate(lines, 1):
        if not raw.endswith(b"\n"):
            problems.append(LedgerProblem(n, "torn last line (crash during append)"))
            break
        line = raw[:-1]
        try:
            obj = jsonio.loads(line)
        except jsonio.JsonError:
            problems.append(LedgerProblem(n, "not JSON"))
            prev = sha256_hex(line)
            expected_seq += 1
            continue
        if not isinstance(obj, dict):
            problems.append(LedgerProblem(n, "not an object"))
            prev = sha256_hex(line)
            expected_seq += 1
            continue
        try:
            jsonio.refuse_duplicates(line, jsonio.dumps(obj))  # events are written canonical: equal unless edited
        except jsonio.DuplicateMember as exc:
            problems.append(LedgerProblem(n, str(exc)))
        if each is not None:
            each(obj)
        kind = obj.get("event")
        checkpoint = kind == "checkpoint"
        if obj.get("prev") != prev:
            problems.append(LedgerProblem(n, "hash chain broken: prev does not match the line before"))
        elif checkpoint and (why := _checkpoint_problem(obj, expected_seq)) is not None:
            problems.append(LedgerProblem(n, why))
        elif not checkpoint and obj.get("seq") != expected_seq:
            problems.append(LedgerProblem(n, f"seq is {obj.get('seq')!r}, expected {expected_seq}"))
        elif signing is not None and (why := signing.event_problem(obj)) is not None:
            problems.append(LedgerProblem(n, why))
        if checkpoint and isinstance(obj.get("head"), str):
            unconfirmed[sha256_hex(line)] = n
            prev = obj["head"]  # the next line chains onto the last event the checkpoint replaced
        else:
            prev = sha256_hex(line)
            if kind == "compacted":
                unconfirmed.pop(str(obj.get("checkpoint_sha256")), None)
        found = obj.get("seq")
        expected_seq = (found if isinstance(found, int) else expected_seq) + 1
    for line_no in unconfirmed.values():
        problems.append(LedgerProblem(line_no, "checkpoint not confirmed by a later 'compacted' event"))
    return problems


def _checkpoint_problem(obj: dict[str, Any], expected_seq: int) -> str | None:
    first, last, head = obj.get("first_seq"), obj.get("seq"), obj.get("head")
    if first != expected_seq:
        return f"checkpoint starts at seq {first!r}, expected {expected_seq}"
    if not isinstance(last, int) or isinstance(last, bool) or last < expected_seq:
        return f"checkpoint ends at seq {last!r}, before it starts"
    if not isinstance(head, str) or len(head) != 64:
        return "checkpoint has no head digest"
    return None


def checkpoint_event(lines: list[bytes], *, prev: str, first_seq: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The ``checkpoint`` event that replaces ``lines`` (full ledger lines, newlines stripped).

    ``prev``: what the first of them chains onto; ``first_seq``: its seq (a
    checkpoint among them passes on its own first one).  ``seq`` is the last
    line's, ``head`` its digest: the line after the range chains onto it unchanged.
    """
    last = jsonio.loads(lines[-1])
    return {**fields, "event": "checkpoint", "at": now_iso(), "first_seq": first_seq, "seq": last["seq"],
            "prev": prev, "head": sha256_hex(lines[-1]), "events": _replaced(lines)}


def _replaced(lines: list[bytes]) -> int:
    """How many events ``lines`` stand for (an earlier checkpoint counts its own)."""
    total = 0
    for raw in lines:
        obj = jsonio.loads(raw)
        total += int(obj.get("events", 1)) if obj.get("event") == "checkpoint" else 1
    return total

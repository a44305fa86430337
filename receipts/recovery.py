"""Recovery after a crash (docs/DESIGN.md section 5), generic over tools.

:func:`recover` (with ``dry_run``, reports what it would do) queries the
tool's adapter for every ``prepared`` or ``unknown`` receipt whose key lock
can be taken without waiting (a live owner is never touched), then repairs
the ledger and removes leftovers — only names this project creates, only past
an age bound.  What it settles, repairs and removes: docs/RECOVERY.md.

Recovery never launders: a ledger changed by hand, a receipt whose history
the ledger does not name at all, or a committed receipt its adapter finds
contradicted by the world is reported corrupt (exit 6) and nothing of it is
settled, logged or repaired — never "nothing to do".  A crash during
recovery leaves receipts still ``prepared`` or already settled (written
atomically), so running it again finishes the job.  An I/O error (EIO,
ENOSPC, EACCES, ...) settling one receipt leaves it for the next run (reported
``skipped``, exit 5); one anywhere else stops recover with
:class:`receipts.errors.RecoveryFailed` (exit 5), which says whether anything
was written and what was finished.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import filelock
import orjson

from cas.durable import is_own_tmp
from cas.errors import CasError, OncepatchError, UsageError
from receipts.adapter import EffectAdapter
from receipts.engine import settle
from receipts.errors import (CorruptLedger, CorruptReceipt, ReadFailed, RecoveryFailed, StillUnknown,
                             only_unreachable)
from receipts.flock import file_lock
from receipts.identity import key_hash
from receipts.quarantine import quarantined_keys
from receipts.receipt import SIGNATURE_FIELD, Receipt, now_iso, parse_receipt, receipt_doc_bytes, written_as_is
from receipts.signing import Signing
from receipts.states import needs_resolution
from receipts.store import FILE_MISSING, ReceiptStore
from receipts.workers import spawn_pool, split

__all__ = [
    "RecoveryRow",
    "RecoveryReport",
    "recover",
    "receipt_age",
    "DEFAULT_TMP_AGE",
]

#: The reason recover gives for a receipt whose history the ledger does not name (it lost events).
LEDGER_LOST_EVENTS = ("the ledger lacks this receipt's latest state and every earlier event of its key: "
                      "the ledger lost events")

#: Leftovers younger than this may belong to a live writer: left alone.
DEFAULT_TMP_AGE = 600.0

#: What the file system or git may raise part way (an I/O error, a full disk, a permission taken away):
#: never evidence about a receipt, and the next run of recover finishes the job.
IO_ERRORS = (OSError, ReadFailed, CasError)


@dataclass(frozen=True, slots=True)
class RecoveryRow:
    key: str
    call_id: str
    from_: str
    to: str
    reason: str
    commit: str | None
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "call_id": self.call_id, "from": self.from_, "to": self.to,
                "reason": self.reason, "commit": self.commit, "notes": list(self.notes)}


@dataclass(slots=True)
class RecoveryReport:
    dry_run: bool
    rows: list[RecoveryRow] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    ledger_repaired: list[str] = field(default_factory=list)
    scanned: int = 0
    wrote: bool = False  # a step that writes has begun (not in the report: RecoveryFailed's effect_status)

    @property
    def changed(self) -> bool:
        return bool(self.rows or self.removed or self.ledger_repaired)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.corrupt,
            "dry_run": self.dry_run,
            "scanned": self.scanned,
            "changed": self.changed,
            "rows": [r.to_json() for r in self.rows],
            "skipped": self.skipped,
            "corrupt": self.corrupt,
            "removed": self.removed,
            "ledger_repaired": self.ledger_repaired,
        }


def receipt_age(receipt: Receipt, now: float | None = None) -> float:
    """Seconds since the receipt was last written (by its own ``updated_at``)."""
    try:
        ts = _dt.datetime.fromisoformat(receipt.updated_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
    return max(0.0, (now if now is not None else time.time()) - ts)


#: Below this many receipt files workers do not pay for their start (a tie at 10,000, measured).
PARALLEL_MIN = 20000


def recover(
    store: ReceiptStore,
    adapters: Mapping[str, EffectAdapter],
    *,
    dry_run: bool = False,
    tmp_age: float = DEFAULT_TMP_AGE,
    progress: Callable[[int], None] | None = None,
    extra_cleanup: Callable[[ReceiptStore, bool, float], list[str]] | None = None,
    jobs: int = 1,
    parallel_min: int | None = None,
    adapters_factory: str | None = None,
) -> RecoveryReport:
    """Resolve every unresolved receipt and tidy the store (docs/RECOVERY.md).

    With ``jobs > 1``, from ``parallel_min`` receipt files on, worker
    processes take the cheap first look at the files (:func:`_scan_chunk`;
    with ``adapters_factory``, ``"module:function"`` of the store giving the
    adapters, they also ask each settled committed receipt's adapter):
    everything else, every resolution and every write, is done here, in file
    order, from the file read again; the report is the one a single process gives.

    Raises:
        RecoveryFailed: an I/O error outside a single receipt's settling (the
            ledger, the listing, the cleanup); says whether anything was
            written, and what was finished.
    """
    report = RecoveryReport(dry_run=dry_run)
    try:
        _recover(store, adapters, report, dry_run, tmp_age, progress, extra_cleanup, jobs, parallel_min,
                 adapters_factory)
    except IO_ERRORS as exc:
        raise RecoveryFailed(exc, wrote=report.wrote, done=report.to_json()) from exc
    except UsageError as exc:
        if report.wrote:  # a store folder that cannot be opened, met after something was written: not "not started"
            raise RecoveryFailed(exc, wrote=True, done=report.to_json()) from exc
        raise
    return report


def _recover(store: ReceiptStore, adapters: Mapping[str, EffectAdapter], report: RecoveryReport, dry_run: bool,
             tmp_age: float, progress: Callable[[int], None] | None,
             extra_cleanup: Callable[[ReceiptStore, bool, float], list[str]] | None, jobs: int,
             parallel_min: int | None, adapters_factory: str | None) -> RecoveryReport:
    if not _check_ledger(store, report, dry_run):
        return report  # a ledger changed by hand: nothing is settled on it (docs/RECOVERY.md)
    paths = store.receipt_paths()
    if jobs > 1 and len(paths) >= max(1, PARALLEL_MIN if parallel_min is None else parallel_min):
        looks, (ledger_digests, ledger_keys) = _scan_parallel(store, paths, jobs, adapters_factory)
    else:
        looks, (ledger_digests, ledger_keys) = None, _ledger_digests(store)
    now = time.time()
    gaps: list[Receipt] = []
    for i, path in enumerate(paths):
        h = os.path.basename(path)[:-5]
        if looks is not None:
            look = looks[i]
            if look is None:
                continue  # removed since the listing
            if look[0] and look[0] in ledger_digests and (look[3] or not _to_confirm(adapters, look)):
                report.scanned += 1
                _progress(report, progress)
                continue
        data = store.read_raw(path)
        if data is None:
            continue  # removed since the listing
        report.scanned += 1
        _progress(report, progress)
        if looks is None and not isinstance(data, CorruptReceipt):
            look = _settled_digest(data, h, store.signing)
            if look[0] and look[0] in ledger_digests and not _to_confirm(adapters, look):
                continue
        _look_closer(store, adapters, report, dry_run, path, h, data, ledger_digests, ledger_keys, gaps)
    report.corrupt += _missing_receipts(store, paths, ledger_keys)
    _record_gaps(store, report, gaps, dry_run)
    report.removed += _cleanup(store, report, dry_run, tmp_age, now)
    if extra_cleanup is not None:
        report.wrote = report.wrote or not dry_run
        report.removed += extra_cleanup(store, dry_run, tmp_age)
    return report


def _check_ledger(store: ReceiptStore, report: RecoveryReport, dry_run: bool) -> bool:
    """Repair the ledger's own torn last line; ``False`` (reported corrupt) when it was changed by hand.

    A crash mid-append leaves a torn last line that chains onto the intact
    lines before it: not an event (or one that lost only its newline), and
    only the next append repairs it.  verify reports it, so recover makes that
    append itself (else "nothing to do" would leave verify failing until some
    later call).  Anything else -- a chain break, a missing genesis, a torn
    line that is no append of ours -- is evidence: recover settles nothing
    on such a ledger, and a person quarantines it (``oncepatch quarantine --ledger``).
    """
    ledger = store.ledger
    try:
        torn = ledger.torn_tail()
        problems = ledger.verify_chain()
    except CorruptLedger as exc:
        report.corrupt.append({"path": ledger.path, "reason": exc.message})
        return False
    last = len(problems) and problems[-1]
    if torn is not None and last and last.reason.startswith("torn"):
        problems.pop()
    reasons = [f"ledger line {p.line}: {p.reason}" for p in problems]
    if torn is not None and not torn.own:
        reasons.append("its last line is torn, and is no event an append could have been writing there")
    if reasons:
        report.corrupt += [{"path": ledger.path, "reason": r} for r in reasons]
        return False
    if torn is not None:
        report.removed.append(f"{ledger.path} (torn last line)")
        if not dry_run:
            report.wrote = True
            ledger.append({"event": "ledger_repaired", "at": now_iso(),
                           "reason": "last_line_newline" if torn.complete else "torn_last_line"})
    return True


def _record_gaps(store: ReceiptStore, report: RecoveryReport, gaps: list[Receipt], dry_run: bool) -> None:
    """Log the receipts a crash left out of the ledger -- none when the ledger lost events.

    One receipt whose history the ledger does not name shows that the ledger
    lost events: then no gap is filled, since filling the others would make
    the damaged ledger look whole to verify.
    """
    if any(c.get("reason") == LEDGER_LOST_EVENTS for c in report.corrupt):
        report.ledger_repaired.clear()
        return
    if not dry_run and gaps:
        report.wrote = True
        for receipt in gaps:
            store.ledger.append_receipt_event("recovered", receipt, reason="ledger_gap")


def _gap_explained(receipt: Receipt, ledger_keys: set[str]) -> bool:
    """Whether the ledger lacking ``receipt``'s latest state is what a crash leaves.

    A call renames its receipt, then appends its event: a crash in between
    leaves that one state out.  Every earlier write of the key was followed
    by its own append, so the ledger still names the key -- unless the
    receipt is the key's first and only write (token 1, never rewritten).
    A receipt with a history the ledger does not name at all is a ledger
    that lost events (truncated, or replaced): never "repaired" by recording
    the receipt anew.
    """
    if receipt.key in ledger_keys:
        return True
    return receipt.fencing_token == 1 and receipt.created_at == receipt.updated_at


def _progress(report: RecoveryReport, progress: Callable[[int], None] | None) -> None:
    if progress is not None and report.scanned % 10000 == 0:
        progress(report.scanned)


def _ledger_digests(store: ReceiptStore) -> tuple[set[str], set[str]]:
    """The receipt digests the ledger records, and the keys its events name (less quarantined ones:
    no receipt file by a person's choice), in one pass."""
    digests: set[str] = set()
    keys: set[str] = set()

    def each() -> Iterator[dict[str, Any]]:
        for e in store.ledger.events():
            digests.add(str(e.get("receipt_sha256")))
            if isinstance(key := e.get("key"), str):
                keys.add(key)
            yield e

    quarantined = quarantined_keys(each())
    return digests, keys - quarantined


def _missing_receipts(store: ReceiptStore, paths: list[str], keys: set[str]) -> list[dict[str, Any]]:
    """Keys the ledger records receipts of whose receipt file is gone: a store changed by hand (as verify says)."""
    return [{"path": store.receipt_path(k), "key": k, "reason": FILE_MISSING}
            for k in store.missing_files({key_hash(k): k for k in keys}, paths)]


#: The first look at a receipt file: (digest, status, tool, whether its adapter agreed already) of a
#: final receipt its digest shows unedited, else ``("", "", "", False)`` (a closer look).
Look = tuple[str, str, str, bool]
_CLOSER: Look = ("", "", "", False)


def _settled_digest(data: bytes, h: str, signing: Signing | None = None) -> Look:
    """The digest, status and tool of a final receipt that its digest shows unedited: the cheap first look.

    Such a receipt, once the ledger holds its digest, needs nothing from
    recover, unless it is ``committed`` and its tool's adapter can check it
    against the world (:func:`_to_confirm`).  Everything else is verified
    before anything is done with it.  In a signed store (``signing``) the
    digest counts only with its signature.
    """
    try:
        head = orjson.loads(data)
    except orjson.JSONDecodeError:
        return _CLOSER
    if (
        isinstance(head, dict)
        and head.get("status") in ("committed", "rejected")
        and isinstance(head.get("receipt_sha256"), str)
        and not head.get("warnings")
        and written_as_is(head, h)
        and receipt_doc_bytes(head) == data  # as written: no member given twice (parse_receipt's check)
        and (signing is None or signing.receipt_problem(head["receipt_sha256"], head.get(SIGNATURE_FIELD)) is None)
    ):
        return str(head["receipt_sha256"]), str(head["status"]), str(head.get("tool")), False
    return _CLOSER


def _to_confirm(adapters: Mapping[str, EffectAdapter], look: Look) -> bool:
    """Whether a settled receipt is committed and its tool's adapter checks it against the world."""
    return look[1] == "committed" and hasattr(adapters.get(look[2]), "verify_committed")


def _scan_chunk(root: str, paths: list[str], factory: str | None = None) -> list[Look | None]:
    """Worker: :func:`_settled_digest` of each file (``None``: gone).

    With ``factory`` (the adapters, as :func:`recover`'s ``adapters_factory``),
    a settled committed receipt is also asked of its adapter here: one it
    agrees with is marked so, any other gets the closer look.
    """
    store = ReceiptStore(root)
    adapters: Mapping[str, EffectAdapter] = {}
    if factory is not None:
        module, _, func = factory.partition(":")
        adapters = getattr(importlib.import_module(module), func)(store)
    out: list[Look | None] = []
    for path in paths:
        data = store.read_raw(path)
        if data is None:
            out.append(None)
            continue
        if isinstance(data, CorruptReceipt):
            out.append(_CLOSER)
            continue
        h = os.path.basename(path)[:-5]
        look = _settled_digest(data, h, store.signing)
        if factory is not None and look[0] and _to_confirm(adapters, look):
            try:
                agreed = not _contradictions(adapters, store.parse(data, path, h))
            except CorruptReceipt:
                agreed = False
            look = (*look[:3], agreed) if agreed else _CLOSER
        out.append(look)
    return out


def _scan_parallel(store: ReceiptStore, paths: list[str], jobs: int, factory: str | None = None
                   ) -> tuple[list[Look | None], tuple[set[str], set[str]]]:
    """The first look at ``paths`` over ``jobs`` worker processes, and the ledger's digests, read meanwhile."""
    chunks = split(paths, jobs)
    with spawn_pool(len(chunks)) as pool:
        futures = [pool.submit(_scan_chunk, store.root, chunk, factory) for chunk in chunks]
        digests = _ledger_digests(store)
        looks = [look for f in futures for look in f.result()]
    return looks, digests


def _look_closer(store: ReceiptStore, adapters: Mapping[str, EffectAdapter], report: RecoveryReport,
                 dry_run: bool, path: str, h: str, data: bytes | CorruptReceipt, ledger_digests: set[str],
                 ledger_keys: set[str], gaps: list[Receipt]) -> None:
    """One receipt file past the first look: verified, then resolved, settled again, or put in
    ``gaps`` to be logged (:func:`_record_gaps`)."""
    if isinstance(data, CorruptReceipt):
        report.corrupt.append({"path": path, "reason": data.reason})
        return
    try:
        receipt = store.parse(data, path, h)
    except CorruptReceipt as exc:
        report.corrupt.append({"path": path, "reason": exc.reason})
        return
    if receipt.status == "committed":
        problems = _contradictions(adapters, receipt)
        if only_unreachable(problems):
            # Not checked (its git remote out of reach), nothing found wrong: left for the next run.
            report.skipped.append({"key": receipt.key, "reason": f"not checked: {'; '.join(problems)}"})
            return
        if problems:
            # Believed only where the world agrees: nothing of it is settled, logged or repaired.
            report.corrupt.append({"path": path, "key": receipt.key, "reason": "; ".join(problems)})
            return
    if needs_resolution(receipt.status):
        _resolve_one(store, receipt, adapters, report, dry_run)
    elif receipt.status == "committed" and receipt.extra.get("warnings") and not dry_run:
        try:
            _settle_again(store, receipt, adapters, report)
        except IO_ERRORS as exc:
            report.skipped.append(_interrupted(store, receipt, exc))
    if not needs_resolution(receipt.status) and receipt.digest not in ledger_digests:
        if not _gap_explained(receipt, ledger_keys):
            report.corrupt.append({"path": path, "key": receipt.key, "reason": LEDGER_LOST_EVENTS})
            return
        report.ledger_repaired.append(receipt.key)
        gaps.append(receipt)


def _contradictions(adapters: Mapping[str, EffectAdapter], receipt: Receipt) -> list[str]:
    """What the world holds against a committed receipt, by its tool's adapter (``[]``: none, or no adapter).

    A receipt whose follow-up is still to be done (``warnings``: say, its key
    ref was not created) is asked in the cheap form (``confirm``), which does
    without the key ref when the commit is on its branch: settling it again
    creates the ref.
    """
    adapter = adapters.get(receipt.tool)
    check = getattr(adapter, "confirm" if receipt.extra.get("warnings") else "verify_committed", None)
    return [] if check is None else list(check(receipt))


def _resolve_one(store: ReceiptStore, receipt: Receipt, adapters: Mapping[str, EffectAdapter],
                 report: RecoveryReport, dry_run: bool) -> None:
    """Query and settle one receipt; an I/O error leaves it for the next run (``skipped``, saying where it is)."""
    try:
        _resolve_locked(store, receipt, adapters, report, dry_run)
    except (*IO_ERRORS, UsageError) as exc:  # (UsageError: a store folder that cannot be opened now)
        report.skipped.append(_interrupted(store, receipt, exc))


def _interrupted(store: ReceiptStore, receipt: Receipt, exc: BaseException) -> dict[str, Any]:
    """The ``skipped`` entry of a receipt whose settling an I/O error stopped: the error, and its status now."""
    what = exc.message if isinstance(exc, OncepatchError) else (
        f"{exc.strerror or exc}{f' on {str(exc.filename)!r}' if exc.filename else ''}"
        if isinstance(exc, OSError) else str(exc))
    try:
        now = store.read(receipt.key)
        status = f"its receipt is '{now.status}'" if now is not None else "its receipt is gone"
    except (*IO_ERRORS, OncepatchError):
        status = "its receipt cannot be read now"
    return {"key": receipt.key,
            "reason": f"cannot settle now ({what}); {status}: run 'oncepatch recover' again"}


def _resolve_locked(store: ReceiptStore, receipt: Receipt, adapters: Mapping[str, EffectAdapter],
                    report: RecoveryReport, dry_run: bool) -> None:
    adapter = adapters.get(receipt.tool)
    if adapter is None:
        report.skipped.append({"key": receipt.key, "reason": f"no adapter for tool '{receipt.tool}'"})
        return
    lock = store.try_lock(receipt.key)
    if lock is None:
        report.skipped.append({"key": receipt.key, "reason": "locked by a live process"})
        return
    try:
        current = store.read(receipt.key)
        if current is None or not needs_resolution(current.status):
            return
        report.wrote = report.wrote or not dry_run  # the query may put files back
        try:
            result = adapter.query(current)
        except CorruptReceipt as exc:
            # Git contradicts the evidence (a key ref set by hand): nothing is settled from it.
            report.corrupt.append({"path": exc.path, "key": current.key, "reason": exc.reason})
            return
        except OncepatchError as exc:
            # E.g. its repository is gone: this receipt waits; the others are still settled.
            report.skipped.append({"key": current.key, "reason": f"cannot query: {exc.message}"})
            return
        to = {"applied": "committed", "not_applied": "rejected"}.get(result.status, "unknown")
        reason = result.reason
        commit = current.candidate if to == "committed" else None
        if dry_run:
            report.rows.append(RecoveryRow(current.key, current.call_id, current.status, to, reason, commit))
            return
        try:
            new = settle(store, current, adapter, result)
        except StillUnknown:
            if current.status != "unknown":
                report.rows.append(RecoveryRow(current.key, current.call_id, current.status, "unknown", reason, None))
            else:
                report.skipped.append({"key": current.key, "reason": f"still unknown: {reason}"})
            return
        report.rows.append(RecoveryRow(new.key, new.call_id, current.status, new.status, reason, new.commit,
                                       tuple(str(n) for n in new.extra.get("recovery_notes", []))))
    finally:
        lock.release()


def _settle_again(store: ReceiptStore, receipt: Receipt, adapters: Mapping[str, EffectAdapter],
                  report: RecoveryReport) -> None:
    """A committed call whose follow-up failed (e.g. its worktree was locked): settle it now.

    Nothing is rewritten: the adapter brings what is still stale along (git: the
    touched paths that still show the base) and a row reports it; once done, a
    second run finds nothing to do.
    """
    adapter = adapters.get(receipt.tool)
    if adapter is None:
        return
    lock = store.try_lock(receipt.key)
    if lock is None:
        return
    report.wrote = True
    try:
        try:
            notes = adapter.settle(receipt)
        except OncepatchError as exc:
            notes = [f"follow-up not done: {exc.message}"]
        except OSError as exc:
            notes = [f"follow-up not done: {exc.strerror or exc}"]
    finally:
        lock.release()
    if any(n.startswith(("materialised", "created", "follow-up")) for n in notes):
        report.rows.append(RecoveryRow(receipt.key, receipt.call_id, "committed", "committed",
                                       "follow_up_settled", receipt.commit, tuple(notes)))


def _old_enough(path: str, tmp_age: float, now: float, dir_fd: int | None = None) -> bool:
    try:
        return now - os.lstat(path, dir_fd=dir_fd).st_mtime >= tmp_age
    except FileNotFoundError:
        return False


def _cleanup(store: ReceiptStore, report: RecoveryReport, dry_run: bool, tmp_age: float, now: float) -> list[str]:
    removed: list[str] = []
    report.wrote = report.wrote or not dry_run
    # 1. tmp files of the durable-write helper, anywhere in the store: through descriptors
    #    (fwalk follows no symlink, and a folder swapped for one meanwhile is not unlinked through).
    for folder, _dirs, files, dir_fd in os.fwalk(store.root) if os.path.isdir(store.root) else ():
        for name in files:
            if is_own_tmp(name) and _old_enough(name, tmp_age, now, dir_fd):
                removed.append(os.path.join(folder, name))
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
    # 2. lock files of keys with no receipt (``<64 hex>.lock``), past the age bound, taken before removal.
    #    Listed, aged, locked and removed through one descriptor of locks/ (never a symlink).
    try:
        locks = contextlib.ExitStack()
        lfd = locks.enter_context(store.folder_fd(store.locks_dir))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    with locks:
        names = sorted(os.listdir(lfd))
        for name in [n for n in names if n.endswith(".lock") and len(n) == 69]:
            path = os.path.join(store.locks_dir, name)
            if os.path.exists(store.path_for_hash(name[:-5])) or not _old_enough(name, tmp_age, now, lfd):
                continue
            lk = file_lock(path, lambda: contextlib.nullcontext(lfd))  # in the folder listed, not one made since
            try:
                lk.acquire(timeout=0)
            except filelock.Timeout:
                continue
            try:
                removed.append(path)
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=lfd)
            finally:
                lk.release()
    return removed

"""Retention (``oncepatch gc``): plan, archive, redact, remove, compact the ledger.

:func:`plan` decides per receipt (stays, goes, redacted) from the store and
the policy (:mod:`receipts.retention`); :func:`collect` then archives,
removes, redacts, compacts and asks the adapters, in the order of
docs/LIFECYCLE.md, "What a run does, in order" — each step safe to crash
after, the next run finishes it.  A removed key is retired, never new again
(its key ref stays, a tombstone: :mod:`receipts.retired`): run as a first
call it could commit its change a second time after a revert.  Git objects
are never deleted.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cas.crash import crash_point
from cas.durable import fsync_dir, write_durable
from cas.errors import OncepatchError
from cas.hashing import sha256_hex
from receipts import jsonio
from receipts.archive import build_archive, write_archive
from receipts.canonical import canonical_json
from receipts.errors import CorruptLedger
from receipts.flock import flocked
from receipts.identity import key_hash
from receipts.ledger import GENESIS, checkpoint_event
from receipts.receipt import REDACTED_FIELD, SIGNATURE_FIELD, Receipt, now_iso
from receipts.recovery import receipt_age
from receipts.retention import RetentionPolicy
from receipts.retired import RETIRED_FIELD, retired_keys
from receipts.store import ReceiptStore

__all__ = ["GcPlan", "GcReport", "plan", "collect", "redact_receipt"]

#: A hook naming why a receipt must stay (``None``: it need not); another part's own reasons.
MustStay = Callable[[Receipt], "str | None"]


@dataclass(slots=True)
class GcPlan:
    remove: list[Receipt] = field(default_factory=list)
    redact: list[Receipt] = field(default_factory=list)
    kept: list[Receipt] = field(default_factory=list)
    stays: list[dict[str, str]] = field(default_factory=list)  # {key, status, reason} of what a rule keeps
    compact_to: int = 0  # the last seq the compaction replaces (0: none)
    ledger_events: int = 0


@dataclass(slots=True)
class GcReport:
    dry_run: bool
    plan: GcPlan
    removed: list[dict[str, Any]] = field(default_factory=list)
    redacted: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    archive: str | None = None
    archive_sha256: str | None = None
    compacted: dict[str, Any] | None = None
    collected: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {"ok": True, "dry_run": self.dry_run,
                "remove": [_row(r) for r in p.remove], "redact": [_row(r) for r in p.redact],
                "stays": p.stays, "removed": self.removed, "redacted": self.redacted, "skipped": self.skipped,
                "archive": self.archive, "archive_sha256": self.archive_sha256,
                "compact": {"first_seq": 1, "last_seq": p.compact_to} if p.compact_to else None,
                "compacted": self.compacted, "collected": self.collected}


def _row(r: Receipt) -> dict[str, Any]:
    return {"key": r.key, "status": r.status, "tool": r.tool, "updated_at": r.updated_at}


def _lock_held(store: ReceiptStore, key: str, *, probe_only: bool) -> bool:
    """Whether a live call holds ``key``'s lock.  ``probe_only`` (a dry run): no lock file is made."""
    if probe_only and not os.path.exists(store.lock_path(key)):
        return False  # a call makes its lock file before anything else: none, no call
    try:
        lock = store.try_lock(key)
    except OSError:
        return True  # cannot tell: kept
    if lock is None:
        return True
    lock.release()
    return False


def _ledger_lines(store: ReceiptStore) -> list[bytes]:
    """The ledger's full lines without newlines.

    Raises:
        CorruptLedger: its chain is broken or its last line torn: gc changes nothing then.
    """
    problems = store.ledger.verify_chain()
    if problems:
        raise CorruptLedger(f"ledger '{store.ledger.path}' line {problems[0].line}: {problems[0].reason}: "
                            "gc changes nothing in a store that does not verify ('oncepatch verify')",
                            effect_status="not_started")
    try:
        with open(store.ledger.path, "rb") as fh:
            return fh.read().splitlines()
    except FileNotFoundError:
        return []


def _retained_from(events: list[dict[str, Any]], policy: RetentionPolicy, now: float) -> int:
    """The first seq of the ledger range the policy retains (past the last event: none retained)."""
    end = int(events[-1]["seq"]) + 1 if events else 1
    start = end
    if policy.ledger_events is not None and policy.ledger_events > 0:
        start = min(start, int(events[max(0, len(events) - policy.ledger_events)]["seq"]))
    if policy.ledger_seconds is not None:
        for e in events:
            try:
                at = datetime.datetime.fromisoformat(str(e.get("at")).replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
            if now - at <= policy.ledger_seconds:
                start = min(start, int(e["seq"]))
                break
    return start


def _matches_remove(r: Receipt, policy: RetentionPolicy, now: float) -> bool:
    rule = policy.remove
    if rule is None or r.status not in rule.states or receipt_age(r, now) < rule.older_than:
        return False
    if rule.key_prefixes and not r.key.startswith(rule.key_prefixes):
        return False
    return not rule.tools or r.tool in rule.tools


def _needs_redaction(r: Receipt, policy: RetentionPolicy, now: float) -> bool:
    rule = policy.redact
    if rule is None or not r.is_final or receipt_age(r, now) < rule.older_than:
        return False
    done = r.extra.get(REDACTED_FIELD)
    done_fields = done.get("fields", {}) if isinstance(done, dict) else {}
    return any(f not in done_fields and _value(r.to_doc(), f) is not None for f in rule.fields)


def plan(store: ReceiptStore, policy: RetentionPolicy, adapters: Mapping[str, Any], *, now: float | None = None,
         probe_only: bool = False, must_stay: MustStay | None = None) -> GcPlan:
    """Decide what goes, what stays and why, and how far the ledger compacts (module docstring).

    ``must_stay``: another part's reasons to keep a receipt (called for each
    settled receipt the policy would let go).  ``probe_only``: no lock file is made (a dry run).

    Raises:
        CorruptLedger: the ledger does not verify (nothing is planned on a broken store).
    """
    now = time.time() if now is None else now
    lines = _ledger_lines(store)
    events = [jsonio.loads(line) for line in lines]
    result = GcPlan(ledger_events=len(events))
    retained_from = _retained_from(events, policy, now)
    retained_keys = {e["key"] for e in events if isinstance(e.get("key"), str) and int(e["seq"]) >= retained_from}
    have_receipt: set[str] = set()
    for item in store.scan():
        r = item.receipt
        if r is None:
            result.stays.append({"key": item.error.key if item.error is not None and item.error.key else item.key_hash,
                                 "status": "corrupt", "reason": "corrupt: left for a person ('oncepatch doctor')"})
            have_receipt.add(item.key_hash)
            continue
        reason = _why_stays(store, r, policy, retained_keys, adapters, probe_only, must_stay, now)
        if reason is None:
            result.remove.append(r)
            continue
        have_receipt.add(key_hash(r.key))
        result.kept.append(r)
        if reason:
            result.stays.append({"key": r.key, "status": r.status, "reason": reason})
        if r.is_final and _needs_redaction(r, policy, now):
            result.redact.append(r)
    _keep_compensated(result, have_receipt)
    gone = {r.key for r in result.remove} | _removed_keys(events)
    result.compact_to = _compactable(events, have_receipt, gone, retained_from)
    return result


def _keep_compensated(result: GcPlan, have_receipt: set[str]) -> None:
    """A receipt that a staying one compensates (``compensates: KEY``) stays too: the link is evidence."""
    while True:
        named = {str(r.args.get("compensates")) for r in result.kept if r.args.get("compensates")}
        held = [r for r in result.remove if r.key in named]
        if not held:
            return
        for r in held:
            result.remove.remove(r)
            result.kept.append(r)
            have_receipt.add(key_hash(r.key))
            result.stays.append({"key": r.key, "status": r.status,
                                 "reason": "a receipt that stays compensates it (oncepatch revert)"})


def _why_stays(store: ReceiptStore, r: Receipt, policy: RetentionPolicy, retained_keys: set[str],
               adapters: Mapping[str, Any], probe_only: bool, must_stay: MustStay | None, now: float) -> str | None:
    """Why ``r`` stays (``""``: the remove rule does not name it), or ``None``: it goes."""
    if r.status in ("prepared", "unknown"):
        return f"unsettled ({r.status}): 'oncepatch recover' or 'oncepatch resolve' first"
    if not _matches_remove(r, policy, now):
        return ""
    if r.key.startswith(policy.keep_prefixes) and policy.keep_prefixes:
        return "kept by [keep] key_prefixes"
    if r.key in retained_keys:
        return "named by the retained ledger range"
    if _lock_held(store, r.key, probe_only=probe_only):
        return "a live call holds its key lock"
    if must_stay is not None and (why := must_stay(r)) is not None:
        return why
    check_tombstone = getattr(adapters.get(r.tool), "check_tombstone", None)
    if check_tombstone is None and r.status == "committed":
        # Only a key ref outside the store (git's) retires a key: removed, this key would run again.
        return f"tool '{r.tool}' keeps no tombstone outside the store: removed, its key could run again"
    if check_tombstone is not None:
        try:
            check_tombstone(r)
        except OncepatchError as exc:
            return f"its key ref does not stand for it (kept as a tombstone, it must): {exc.message}"
    return None


def _removed_keys(events: list[dict[str, Any]]) -> set[str]:
    """The keys whose last event is ``removed`` (gc removed their receipts)."""
    last: dict[str, str] = {}
    for e in events:
        k = e.get("key")
        if isinstance(k, str):
            last[k] = str(e.get("event"))
    return {k for k, kind in last.items() if kind == "removed"}


def _compactable(events: list[dict[str, Any]], have_receipt: set[str], gone: set[str], retained_from: int) -> int:
    """The last seq of the longest prefix of events whose keys are all ``gone`` (0: none).

    Only a key whose receipt gc removes (or removed) may have its events
    replaced.  One that keeps its receipt keeps its whole history, so
    ``verify`` still finds its digests; one without a receipt for another
    reason (quarantined by a person, a file lost) keeps the events that
    explain it: compaction never hides evidence of a damaged store.
    """
    last = 0
    for e in events:
        seq = int(e["seq"])
        k = e.get("key")
        if seq >= retained_from or (isinstance(k, str) and (k not in gone or key_hash(k) in have_receipt)):
            break
        last = seq
    if last and events and events[0].get("event") == "checkpoint" and int(events[0]["seq"]) == last:
        return 0  # only the checkpoint of an earlier run: nothing new to compact
    return last


# -- doing it ---------------------------------------------------------------------------


def collect(store: ReceiptStore, policy: RetentionPolicy, adapters: Mapping[str, Any], *, dry_run: bool = False,
            now: float | None = None, must_stay: MustStay | None = None) -> GcReport:
    """Plan, then (unless ``dry_run``) archive, remove, redact, compact (module docstring).

    Raises:
        CorruptLedger: the ledger does not verify: nothing changed.
        SigningKeyMissing: a signed store whose private key this process cannot read: nothing changed.
        DurableWriteError: the archive could not be written: nothing removed.
        InProgress: the ledger lock stayed held.
    """
    if not dry_run:
        store.check_can_sign()  # a signed store this process cannot sign for: refused before anything is written
    p = plan(store, policy, adapters, now=now, probe_only=dry_run, must_stay=must_stay)
    report = GcReport(dry_run, p)
    if dry_run:
        report.collected = _collect_unneeded(adapters, p.kept, dry_run=True)
        return report
    lines = _ledger_lines(store)[:p.compact_to]
    if p.remove or lines:
        files: list[tuple[str, str, bytes]] = []
        for r in p.remove:
            raw = store.read_raw(store.receipt_path(r.key))
            if isinstance(raw, bytes):
                files.append((key_hash(r.key), r.key, raw))
        data = build_archive(store.root, files, lines)
        report.archive = write_archive(store, policy.archive_folder(store.root), data)
        report.archive_sha256 = sha256_hex(data)
    for r in p.remove:
        _remove_one(store, r, report)
    for r in p.redact:
        _redact_one(store, r, policy, report)
    if p.compact_to:
        report.compacted = _compact(store, p.compact_to, report)
    report.collected = _collect_unneeded(adapters, p.kept, dry_run=False)
    return report


@contextlib.contextmanager
def _as_planned(store: ReceiptStore, r: Receipt, report: GcReport) -> Iterator[Receipt | None]:
    """The key's receipt under its lock (taken without waiting), if it is still the one planned; else None.

    A key a call took since the plan, or whose receipt changed, is skipped (``report.skipped`` says why).
    """
    lock = store.try_lock(r.key)
    if lock is None:
        report.skipped.append({"key": r.key, "reason": "a call took its key lock since the plan"})
        yield None
        return
    try:
        current = store.read(r.key)
        if current is None or current.digest != r.digest:
            report.skipped.append({"key": r.key, "reason": "its receipt changed since the plan"})
            current = None
        yield current
    finally:
        lock.release()


def _remove_one(store: ReceiptStore, r: Receipt, report: GcReport) -> None:
    with _as_planned(store, r, report) as current:
        if current is None:
            return
        # The event first: a crash after it leaves the receipt and its key ref as they were (every
        # command reads them as before; the next gc removes it); a file gone before its event would
        # read as lost.  The key ref stays: a tombstone, so the key never runs again.
        store.ledger.append({"event": "removed", "at": now_iso(), "key": r.key, "call_id": r.call_id, "tool": r.tool,
                             "status": r.status, "commit": r.commit, "receipt_sha256": r.digest,
                             "bundle_sha256": report.archive_sha256})
        crash_point("gc-after-removed")
        path = store.receipt_path(r.key)
        with store.folder_fd(os.path.dirname(path)) as dfd:
            os.unlink(os.path.basename(path), dir_fd=dfd)
            fsync_dir(dir_fd=dfd)
        report.removed.append({**_row(r), "done": []})


def _value(doc: dict[str, Any], name: str) -> Any:
    if name.startswith("args."):
        args = doc.get("identity", {}).get("args", {})
        return args.get(name[5:]) if isinstance(args, dict) else None
    if name == "error.message":
        return (doc.get("error") or {}).get("message")
    return doc.get("result")


def redact_receipt(r: Receipt, fields: tuple[str, ...]) -> tuple[Receipt, dict[str, str]]:
    """``r`` with the bodies ``fields`` names replaced by their digests (pure); and ``{field: digest}``.

    A digest is the sha256 of the value's canonical JSON; a text becomes
    ``"redacted:sha256:<hex>"``, an object ``{"redacted_sha256": "<hex>"}``.
    call_id and args_sha256 stay as recorded (:mod:`receipts.receipt`).
    """
    doc = r.to_doc()
    done_before = r.extra.get(REDACTED_FIELD)
    done: dict[str, str] = dict(done_before.get("fields", {})) if isinstance(done_before, dict) else {}
    identity = jsonio.loads(jsonio.dumps(r.identity))
    error = dict(r.error) if r.error is not None else None
    result = r.result
    new: dict[str, str] = {}
    for name in fields:
        value = _value(doc, name)
        if value is None or name in done:
            continue
        digest = sha256_hex(canonical_json(value))
        new[name] = digest
        marker: Any = {"redacted_sha256": digest} if isinstance(value, dict) else f"redacted:sha256:{digest}"
        if name.startswith("args."):
            identity["args"][name[5:]] = marker
        elif name == "error.message" and error is not None:
            error["message"] = marker
        else:
            result = marker
    extra = dict(r.extra)
    extra[REDACTED_FIELD] = {"fields": {**done, **new}, "at": now_iso()}
    return r.evolve(identity=identity, error=error, result=result, extra=extra,
                    updated_at=r.updated_at), new


def _redact_one(store: ReceiptStore, r: Receipt, policy: RetentionPolicy, report: GcReport) -> None:
    assert policy.redact is not None
    with _as_planned(store, r, report) as current:
        if current is None:
            return
        new, fields = redact_receipt(current, policy.redact.fields)
        if not fields:
            return
        store.record(new, "redacted", previous_sha256=current.digest, redacted=fields)
        report.redacted.append({**_row(new), "fields": sorted(fields)})


def _compact(store: ReceiptStore, upto: int, report: GcReport) -> dict[str, Any] | None:
    """Replace the events up to seq ``upto`` (less, if a key among them got a receipt since) by a checkpoint."""
    ledger = store.ledger
    with flocked(ledger.lock_path, ledger.lock_timeout):
        with open(ledger.path, "rb") as fh:
            data = fh.read()
        if data and not data.endswith(b"\n"):
            raise CorruptLedger(f"ledger '{ledger.path}' has a torn last line: 'oncepatch recover' first")
        lines = data.splitlines()
        present = {os.path.basename(p)[:-5] for p in store.receipt_paths()}
        parsed = [jsonio.loads(line) for line in lines]
        gone = _removed_keys(parsed)  # as now: a key a call used since the plan is not gone
        count = 0
        for e in parsed:
            k = e.get("key")
            if int(e["seq"]) > upto or (isinstance(k, str) and (k not in gone or key_hash(k) in present)):
                break
            count += 1
        if count == 0 or (count == 1 and jsonio.loads(lines[0]).get("event") == "checkpoint"):
            return None
        first = jsonio.loads(lines[0])
        first_seq = int(first.get("first_seq", first["seq"])) if first.get("event") == "checkpoint" else int(first["seq"])
        cp = checkpoint_event(lines[:count], prev=str(first.get("prev", GENESIS)), first_seq=first_seq,
                              fields={"bundle_sha256": report.archive_sha256,
                                      "bundle": os.path.basename(report.archive or ""),
                                      RETIRED_FIELD: retired_keys(parsed[:count])})
        cp_line = _signed_line(store, cp)
        rest = lines[count:]
        last = jsonio.loads(rest[-1]) if rest else cp
        tail_prev = sha256_hex(rest[-1]) if rest else str(cp["head"])
        confirm = {"event": "compacted", "at": now_iso(), "checkpoint_sha256": sha256_hex(cp_line),
                   "first_seq": first_seq, "last_seq": cp["seq"], "events": cp["events"],
                   "bundle_sha256": report.archive_sha256, "seq": int(last["seq"]) + 1, "prev": tail_prev}
        out = [cp_line, *rest, _signed_line(store, confirm)]
        write_durable(ledger.path, b"".join(line + b"\n" for line in out))
    return {"first_seq": first_seq, "last_seq": cp["seq"], "events": cp["events"],
            "checkpoint_sha256": sha256_hex(cp_line), "head": cp["head"]}


def _signed_line(store: ReceiptStore, event: dict[str, Any]) -> bytes:
    event = {k: v for k, v in event.items() if k != SIGNATURE_FIELD}
    if store.signing is not None:
        event[SIGNATURE_FIELD] = store.signing.sign_event(canonical_json(event))
    return canonical_json(event)


def _collect_unneeded(adapters: Mapping[str, Any], kept: list[Receipt], *, dry_run: bool) -> list[str]:
    """Ask each adapter with ``collect_unneeded(kept, dry_run=...)`` to drop what no kept receipt needs.

    The extension point for adapters that hold state of their own beyond
    refs (e.g. generations of a directory target): ``kept`` is every receipt
    that stays; whatever none of them names may go.
    """
    done: list[str] = []
    for adapter in dict.fromkeys(adapters.values()):
        hook = getattr(adapter, "collect_unneeded", None)
        if hook is not None:
            done += list(hook(kept, dry_run=dry_run))
    return done


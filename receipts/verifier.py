"""``verify``: prove that every receipt matches what it claims (docs/DESIGN.md section 5).

What is checked, and when a ``prepared`` receipt counts as unresolved:
docs/RECOVERY.md, "verify".  The tool's part is its verifier's:
``verify_committed`` for every committed receipt, and optionally
``verify_rejected`` (a remote-mode call the remote claims after all) and
``verify_refs`` (the other direction: what the world holds that the store has
no receipt for, so that a deleted store fails rather than "ok: 0 receipts").
The watcher is never needed for any of this: verify reads the store itself.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from receipts.errors import UNREACHABLE, CorruptReceipt
from receipts.identity import key_hash
from receipts.receipt import Receipt
from receipts.recovery import receipt_age
from receipts.quarantine import quarantines
from receipts.retired import RETIRED_FIELD, note_attempt
from receipts.store import FILE_MISSING, ReceiptStore, StoredReceipt
from receipts.workers import spawn_pool, split

__all__ = ["Failure", "VerifyReport", "CommitVerifier", "verify", "DEFAULT_GRACE", "UNREACHABLE"]

DEFAULT_GRACE = 300.0


class CommitVerifier(Protocol):
    def verify_committed(self, receipt: Receipt) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Failure:
    key: str | None
    path: str | None
    reason: str

    @property
    def unreachable(self) -> bool:
        """Whether this is a check not made (:data:`UNREACHABLE`), rather than a contradiction found."""
        return self.reason.startswith(UNREACHABLE)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"key": self.key, "receipt": self.path, "reason": self.reason}
        if self.unreachable:
            doc["kind"] = "unreachable"
        return doc


@dataclass(slots=True)
class VerifyReport:
    failures: list[Failure] = field(default_factory=list)
    receipts: int = 0
    ledger_events: int = 0
    #: The store's quarantine records (:func:`receipts.quarantine.quarantines`): reported, never ok-silently.
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    #: Keys whose last ledger event is ``quarantined``: no receipt file is expected of them.
    quarantined_keys: set[str] = field(default_factory=set)
    #: The mode proved: ``{"mode": "unsigned"}``, or the signed store's list and keys.
    signatures: dict[str, Any] = field(default_factory=lambda: {"mode": "unsigned"})

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def only_unreachable(self) -> bool:
        """Failures, every one a check not made because a remote could not be reached (none contradicts)."""
        return bool(self.failures) and all(f.unreachable for f in self.failures)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"ok": self.ok, "receipts": self.receipts, "ledger_events": self.ledger_events,
                               "signatures": self.signatures, "failures": [f.to_json() for f in self.failures]}
        if self.quarantined:
            doc["quarantined"] = self.quarantined
        return doc


def verify(
    store: ReceiptStore,
    verifiers: Mapping[str, CommitVerifier],
    *,
    grace: float = DEFAULT_GRACE,
    progress: Callable[[int], None] | None = None,
    jobs: int = 1,
    verifiers_factory: str | None = None,
    parallel_min: int | None = None,
) -> VerifyReport:
    """Verify the whole store (docs/RECOVERY.md, "verify").

    With ``jobs > 1`` and ``verifiers_factory`` (``"module:function"`` taking
    the store and returning the verifiers), the receipt files are split over
    that many worker processes; the ledger is checked here.  Results are the
    same as with one process, in file order.
    """
    report = VerifyReport(quarantined=list(quarantines(store)))
    if store.signing is not None:
        report.signatures = store.signing.describe()
    paths = store.receipt_paths()
    if jobs > 1 and verifiers_factory is not None \
            and len(paths) >= max(1, PARALLEL_MIN if parallel_min is None else parallel_min):
        # The workers start first; the ledger is read here meanwhile.
        return _verify_parallel(store, paths, report, grace, jobs, verifiers_factory, verifiers)
    latest: dict[str, int] = {}
    tokens: dict[str, int] = {}
    digests = _read_ledger(store, report, latest, tokens)
    hashed = _hashed(latest)
    missing = _missing_receipts(store, paths, hashed, report.quarantined_keys)
    position = {p: i for i, p in enumerate(paths)}
    now = time.time()
    found: list[tuple[int, int, Failure]] = []
    unlogged: list[tuple[int, str, str, str, str]] = []
    behind: list[tuple[int, str]] = []
    ordered = _in_call_order(paths, hashed, report.ledger_events)
    del latest, hashed
    summaries: dict[str, Summary] = {}
    for path in ordered:
        item = store.read_stored(path)
        if item is None:
            continue  # removed since the listing
        report.receipts += 1
        if progress is not None and report.receipts % 10000 == 0:
            progress(report.receipts)
        r = item.receipt
        if r is not None:
            summaries[os.path.basename(path)[:-5]] = _summary(r)
            if r.digest not in digests:
                unlogged.append((position[path], path, r.digest, r.key, r.status))
            if tokens.get(r.key, 0) > r.fencing_token:
                behind.append((position[path], path))
        found += [(position[path], 1, f) for f in _check_one(store, item, verifiers, grace, now)]
    return _finish(store, verifiers, report, found, unlogged, missing, summaries, behind, tokens)


def _finish(store: ReceiptStore, verifiers: Mapping[str, CommitVerifier], report: VerifyReport,
            found: list[tuple[int, int, Failure]], unlogged: list[tuple[int, str, str, str, str]],
            missing: list[Failure], summaries: Mapping[str, Summary],
            behind: list[tuple[int, str]], tokens: Mapping[str, int]) -> VerifyReport:
    """Add the failures of the receipts (``found``, by file position), the ledger's and the key refs' to ``report``."""
    found += [(pos, 0, f) for pos, f in _not_in_ledger(store, unlogged)]
    found += [(pos, 0, f) for pos, f in _rolled_back(store, behind, tokens)]
    found.sort(key=lambda t: (t[0], t[1]))  # stable: a receipt's own failures keep their order
    report.failures += [f for _pos, _kind, f in found]
    report.failures += missing
    report.failures += _stray_refs(store, verifiers, summaries, missing, report.quarantined_keys)
    return report


#: What the reverse check (:func:`_stray_refs`) knows of one intact receipt file: tool, status, repository.
Summary = tuple[str, str, "str | None"]


def _summary(r: Receipt) -> Summary:
    repo = r.args.get("repo")
    return r.tool, r.status, repo if isinstance(repo, str) else None


def _stray_refs(store: ReceiptStore, verifiers: Mapping[str, CommitVerifier],
                summaries: Mapping[str, Summary], missing: list[Failure],
                quarantined: Collection[str] = ()) -> list[Failure]:
    """The other direction: what the world holds that the store has no receipt for (git: key refs).

    Asked of each verifier that has ``verify_refs(store, summaries)``
    (``{key hash: (tool, status, repo)}`` of the intact receipt files).  A
    deleted store is a failure, not "ok: 0 receipts".  It returns ``[(key hash,
    where, reason)]``; a key whose receipt file the ledger already misses
    (``missing``) is named once, there; a key a person quarantined
    (``quarantined``: its receipt moved aside, its key ref left) is listed
    with the quarantines, not as a failure.
    """
    reported = {key_hash(f.key) for f in missing if f.key is not None} | {key_hash(k) for k in quarantined}
    out: list[Failure] = []
    for v in dict.fromkeys(verifiers.values()):  # an adapter registered under several names asks once
        check = getattr(v, "verify_refs", None)
        if check is not None:
            out += [Failure(None, where, reason) for h, where, reason in check(store, summaries)
                    if h not in reported]
    return out


def _hashed(latest: dict[str, int]) -> dict[str, tuple[str, int]]:
    """``{key hash: (key, its last event number)}`` of the keys the ledger names."""
    return {key_hash(k): (k, n) for k, n in latest.items()}


def _rolled_back(store: ReceiptStore, behind: list[tuple[int, str]],
                 tokens: Mapping[str, int]) -> list[tuple[int, Failure]]:
    """Receipts of an older attempt than the ledger's last event of their key: an earlier state put back.

    Each attempt of a key writes its receipt with one more fencing token than
    the last, then its events, and a receipt file never goes back to a lower
    token (gc's redaction and a replay's note keep it): a file the ledger has
    seen superseded is a rollback, whatever its signature (a ``rejected``
    receipt of attempt 1 put back over attempt 2's ``committed`` one is
    signed, and its digest is in the ledger).  Read again here: a worker may
    have read the file before the ledger was read.
    """
    out = []
    for pos, path in behind:
        item = store.read_stored(path)
        r = item.receipt if item is not None else None
        if r is None or tokens.get(r.key, 0) <= r.fencing_token:
            continue
        out.append((pos, Failure(r.key, path,
                                 f"rolled back: the ledger records attempt {tokens[r.key]} of this key, the receipt "
                                 f"is attempt {r.fencing_token}'s ('{r.status}'), a state it had before")))
    return out


def _not_in_ledger(store: ReceiptStore, unlogged: list[tuple[int, str, str, str, str]]) -> list[tuple[int, Failure]]:
    """Receipts whose latest state the ledger lacks, less those of calls still running.

    A call renames its receipt, then appends its ledger event, under its key
    lock: read in between (a pre-commit hook beside a running apply), the
    receipt is ahead of the ledger.  So the ledger is read again, and a
    receipt whose key lock is held is a call in progress, not a failure.
    """
    if not unlogged:
        return []
    fresh = _read_ledger(store, VerifyReport())
    out = []
    for pos, path, digest, key, status in unlogged:
        if digest in fresh:
            continue
        try:
            lock = store.try_lock(key)
        except OSError:
            pass  # a read-only store: liveness cannot be told
        else:
            if lock is None:
                continue  # its call is still running
            lock.release()
        out.append((pos, Failure(key, path, f"latest state '{status}' is not in the ledger")))
    return out


def _missing_receipts(store: ReceiptStore, paths: list[str], hashed: dict[str, tuple[str, int]],
                      quarantined: set[str]) -> list[Failure]:
    """Keys the ledger records a receipt of, with no receipt file in the store (one removed).

    (Every ledger event that names a key is a receipt's.)  A key whose last
    event is ``quarantined`` has none by a person's choice: reported with the
    quarantines (:attr:`VerifyReport.quarantined`), not as a failure.
    """
    return [Failure(k, store.receipt_path(k), FILE_MISSING)
            for k in store.missing_files({h: key for h, (key, _seq) in hashed.items() if key not in quarantined},
                                         paths)]


def _in_call_order(paths: list[str], hashed: dict[str, tuple[str, int]], events: int) -> list[str]:
    """``paths`` in the order their calls last wrote the ledger; those it does not name last.

    Verified in this order, receipts made one after another read commits that
    sit side by side in the packs and share delta bases; file order (by key
    hash) jumps across the whole history at every receipt, about twice the git
    reading per receipt.
    """
    def rank(path: str) -> int:
        found = hashed.get(os.path.basename(path)[:-5])
        return events + 1 if found is None else found[1]

    return sorted(paths, key=rank)


#: Below this many receipts a single process is faster than starting workers.
PARALLEL_MIN = 2000


def _check_one(store: ReceiptStore, item: StoredReceipt, verifiers: Mapping[str, CommitVerifier],
               grace: float, now: float) -> list[Failure]:
    """The failures of one receipt file, the ledger aside (:func:`_not_in_ledger`)."""
    if item.receipt is None:
        assert item.error is not None
        return [Failure(item.error.key, item.path, f"corrupt: {item.error.reason}")]
    r = item.receipt
    out: list[Failure] = []
    if r.status == "prepared":
        unresolved = _unresolved_prepared(store, r, grace, now)
        if unresolved is not None:
            out.append(Failure(r.key, item.path, unresolved))
    elif r.status == "unknown":
        out.append(Failure(r.key, item.path, "outcome unknown: resolve it by hand ('oncepatch resolve')"))
    elif r.status == "committed":
        v = verifiers.get(r.tool)
        if v is not None:
            out += [Failure(r.key, item.path, reason) for reason in v.verify_committed(r)]
    elif r.status == "rejected":
        check = getattr(verifiers.get(r.tool), "verify_rejected", None)
        if check is not None:
            out += [Failure(r.key, item.path, reason) for reason in check(r)]
    return out


def _verify_chunk(root: str, paths: list[str], factory: str, grace: float
                  ) -> tuple[list[tuple[str | None, str | None, str]], list[tuple[int, str, str, str, Summary, int]], int]:
    """Worker: verify these receipt files; return failures, (index, digest, ...) of each parsed receipt, files read."""
    module, _, func = factory.partition(":")
    store = ReceiptStore(root)
    verifiers = getattr(importlib.import_module(module), func)(store)
    now = time.time()
    failures: list[tuple[str | None, str | None, str]] = []
    seen: list[tuple[int, str, str, str, Summary, int]] = []  # (index, digest, key, status, summary, token)
    read = 0
    for i, path in enumerate(paths):
        item = store.read_stored(path)
        if item is None:
            continue  # removed since the listing: not counted, as with one process
        read += 1
        if item.receipt is not None:
            r = item.receipt
            seen.append((i, r.digest, r.key, r.status, _summary(r), r.fencing_token))
        failures += [(f.key, f.path, f.reason) for f in _check_one(store, item, verifiers, grace, now)]
    return failures, seen, read


def _read_ledger(store: ReceiptStore, report: VerifyReport,
                 latest: dict[str, int] | None = None, tokens: dict[str, int] | None = None) -> set[str]:
    """Check the ledger's chain into ``report``; return the receipt digests its events name (one pass).

    With ``latest``, also fill it with each key's last event number (the order
    the calls wrote in); with ``tokens``, each key's highest fencing token
    since its receipt was last moved aside (quarantined, removed by gc).
    """
    digests: set[str] = set()

    def each(event: dict[str, Any]) -> None:
        report.ledger_events += 1
        d = event.get("receipt_sha256")
        if isinstance(d, str):
            digests.add(d)
        k = event.get("key")
        if latest is not None and isinstance(k, str):
            latest[k] = report.ledger_events
        retired = event.get(RETIRED_FIELD) if event.get("event") == "checkpoint" else None
        if isinstance(retired, dict):
            # The keys whose ``removed`` events the checkpoint replaced: retired, their refs tombstones.
            report.quarantined_keys.update(k2 for k2 in retired if isinstance(k2, str))
        if tokens is not None:
            note_attempt(tokens, event)
        if isinstance(k, str):
            # A key gc removed (its receipt archived, ``removed``) has no receipt by the policy's
            # choice, as a quarantined one by a person's: neither is a missing file.
            if event.get("event") in ("quarantined", "removed"):
                report.quarantined_keys.add(k)
            else:
                report.quarantined_keys.discard(k)

    for problem in store.ledger.verify_chain(each):
        report.failures.append(Failure(None, store.ledger.path, f"ledger line {problem.line}: {problem.reason}"))
    return digests


def _warm_up(factory: str) -> None:
    """Worker: import the verifiers' module while the parent reads the ledger."""
    importlib.import_module(factory.partition(":")[0])


def _verify_parallel(store: ReceiptStore, paths: list[str], report: VerifyReport,
                     grace: float, jobs: int, factory: str, verifiers: Mapping[str, CommitVerifier]) -> VerifyReport:
    """Verify ``paths`` over ``jobs`` worker processes, each a run of calls made one after another.

    The receipts are handed out in ledger order (:func:`_in_call_order`).
    Failures are reported in file order, as with one process.
    """
    with spawn_pool(jobs) as pool:
        # The workers start and import while the ledger is read here.
        warm = [pool.submit(_warm_up, factory) for _ in range(jobs)]
        latest: dict[str, int] = {}
        tokens: dict[str, int] = {}
        digests = _read_ledger(store, report, latest, tokens)
        hashed = _hashed(latest)
        ordered = _in_call_order(paths, hashed, report.ledger_events)
        missing = _missing_receipts(store, paths, hashed, report.quarantined_keys)
        del latest, hashed  # not held while the workers run
        chunks = split(ordered, jobs)
        futures = [pool.submit(_verify_chunk, store.root, chunk, factory, grace) for chunk in chunks]
        for f in warm:
            f.result()
        results = [f.result() for f in futures]
    position = {p: i for i, p in enumerate(paths)}
    found: list[tuple[int, int, Failure]] = []
    unlogged: list[tuple[int, str, str, str, str]] = []
    behind: list[tuple[int, str]] = []
    summaries: dict[str, Summary] = {}
    for chunk, (failures, seen, read) in zip(chunks, results):
        report.receipts += read
        for i, digest, key, status, summary, token in seen:
            summaries[os.path.basename(chunk[i])[:-5]] = summary
            if digest not in digests:
                unlogged.append((position[chunk[i]], chunk[i], digest, key, status))
            if tokens.get(key, 0) > token:
                behind.append((position[chunk[i]], chunk[i]))
        found += [(position.get(p, len(paths)) if p is not None else len(paths), 1, Failure(k, p, reason))
                  for k, p, reason in failures]
    return _finish(store, verifiers, report, found, unlogged, missing, summaries, behind, tokens)


def _unresolved_prepared(store: ReceiptStore, r: Receipt, grace: float, now: float) -> str | None:
    """Why a ``prepared`` receipt fails verification, or ``None`` while its call may still be running.

    A call holds its key lock from before it writes ``prepared`` until its final
    write, so a free lock means the call is gone: an orphan, whatever its age
    (the pre-commit hook must see it at once).  A held lock is a live call,
    merely slow: a failure only once older than ``grace`` (stuck).
    """
    age = receipt_age(r, now)
    try:
        lock = store.try_lock(r.key)
    except OSError:  # a read-only store: liveness cannot be told, the age alone decides
        if age > grace:
            return f"unresolved prepared receipt, {age:.0f}s old: run 'oncepatch recover'"
        return None
    if lock is None:
        if age > grace:
            return f"prepared {age:.0f}s ago and its call still holds the key lock: stuck? (grace {grace:g}s)"
        return None
    try:
        # Re-read under the lock: the call may have finished between the scan and now.
        current = store.read(r.key)
    except CorruptReceipt:
        return None  # reported by the scan on its next run; this one read it intact
    finally:
        lock.release()
    if current is None or current.status != "prepared" or current.fencing_token != r.fencing_token:
        return None
    return f"unresolved prepared receipt, {age:.0f}s old, its call is gone: run 'oncepatch recover'"

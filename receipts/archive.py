"""gc's archives: a compressed, verifiable bundle of receipts and a ledger range (docs/LIFECYCLE.md, "gc").

A ``.tar.gz`` of ``manifest.json`` (schema ``oncepatch.archive/1``), the
ledger lines of the range and the receipt files, byte for byte: its layout is
docs/LIFECYCLE.md's, "What a run does, in order".  Members are written with
fixed owner and time, so the same content makes the same bytes.
:func:`verify_archive` proves a bundle without unpacking it to disk: every
member's digest, every receipt's own verification, the range's chain from
``prev`` to ``head`` (:func:`receipts.ledger.check_chain`; signatures too
when the store's signing is given), and, given the store's ledger events,
that the store names the bundle (a ``removed``, ``checkpoint`` or
``compacted`` event's ``bundle_sha256``).  A manifest of any other shape is
"not an archive gc wrote"; the bytes read are capped per member and in all
(:data:`_TOTAL_MAX`).  The file is written once, atomically, through a
descriptor of its folder reached from the store root without following a
symlink (:meth:`receipts.store.ReceiptStore.folder_fd`).
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cas.durable import write_durable
from cas.errors import UsageError
from cas.hashing import sha256_hex
from receipts import jsonio
from receipts.errors import CorruptReceipt
from receipts.ledger import GENESIS, check_chain
from receipts.receipt import now_iso, parse_receipt

TYPE_CHECKING = False
if TYPE_CHECKING:
    from receipts.signing import Signing
    from receipts.store import ReceiptStore

__all__ = ["ARCHIVE_SCHEMA", "ArchiveReport", "build_archive", "write_archive", "verify_archive"]

ARCHIVE_SCHEMA = "oncepatch.archive/1"
_MANIFEST = "manifest.json"
_EVENTS = "events.jsonl"
#: The largest archive member read back (a receipt is far smaller; a ledger range of millions of events fits).
_MEMBER_MAX = 1 << 30
#: The most bytes read back from all members together (a hostile archive of many large members is refused).
_TOTAL_MAX = 2 << 30


@dataclass(slots=True)
class ArchiveReport:
    path: str
    sha256: str = ""
    receipts: int = 0
    events: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    head: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "archive": self.path, "sha256": self.sha256, "receipts": self.receipts,
                "events": self.events, "first_seq": self.first_seq, "last_seq": self.last_seq, "head": self.head,
                "failures": self.failures}


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def build_archive(store_root: str, receipts: list[tuple[str, str, bytes]], lines: list[bytes], *,
                  prev: str = GENESIS) -> bytes:
    """The archive's bytes: ``receipts`` as ``(key hash, key, file bytes)``, ``lines`` the ledger range
    (full lines without their newlines) and the digest its first line chains onto."""
    ledger = b"".join(line + b"\n" for line in lines)
    first = jsonio.loads(lines[0]) if lines else None
    last = jsonio.loads(lines[-1]) if lines else None
    manifest = {
        "schema": ARCHIVE_SCHEMA, "created_at": now_iso(), "store": store_root,
        "ledger": {"path": _EVENTS, "sha256": sha256_hex(ledger), "events": len(lines),
                   "first_seq": (first.get("first_seq", first["seq"]) if first is not None else None),
                   "last_seq": last["seq"] if last is not None else None, "prev": prev,
                   "head": sha256_hex(lines[-1]) if lines else None},
        "receipts": [{"path": _receipt_name(h), "key": key, "sha256": sha256_hex(data)}
                     for h, key, data in receipts],
    }
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _member(tar, _MANIFEST, jsonio.dumps_pretty(manifest) + b"\n")
            _member(tar, _EVENTS, ledger)
            for h, _key, data in receipts:
                _member(tar, _receipt_name(h), data)
    return raw.getvalue()


def _receipt_name(h: str) -> str:
    return f"receipts/{h[:2]}/{h}.json"


def write_archive(store: ReceiptStore, folder: str, data: bytes) -> str:
    """Write ``data`` as ``<folder>/gc-<time>-<sha256[:12]>.tar.gz`` atomically; return its path.

    ``folder`` is under the store root; it is made and opened from the root
    without following a symlink (a symlinked folder on the way would put
    whole receipts outside the store).

    Raises:
        UsageError: ``folder`` is not a folder under the store root, or a symlink is on its way: nothing written.
        DurableWriteError: the write failed (nothing is left).
    """
    root = os.path.realpath(store.root)
    if os.path.relpath(os.path.normpath(os.path.join(store.root, folder)), store.root).startswith(".."):
        raise UsageError(f"the archive folder '{folder}' is not under the store root '{root}'")
    stamp = now_iso().replace(":", "").replace("-", "").split(".")[0]
    name = f"gc-{stamp}-{sha256_hex(data)[:12]}.tar.gz"
    try:
        with store.folder_fd(folder, create=True) as dfd:
            write_durable(name, data, mode=0o600, dir_fd=dfd)
    except (CorruptReceipt, NotADirectoryError) as exc:
        raise UsageError(f"the archive folder '{folder}' must be a folder under the store root '{root}', "
                         f"reached without a symlink: {getattr(exc, 'reason', None) or exc}") from None
    return os.path.join(folder, name)


def _members(path: str, report: ArchiveReport) -> dict[str, bytes]:
    """Every regular member's bytes (read in memory, never extracted); anything else is a failure."""
    out: dict[str, bytes] = {}
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        report.sha256 = sha256_hex(data)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            total = 0
            for info in tar:
                if not info.isreg() or info.size > _MEMBER_MAX or info.name in out:
                    report.failures.append(f"member '{info.name}' is not a single regular file of ours")
                    continue
                total += info.size
                if total > _TOTAL_MAX:
                    report.failures.append(f"the members hold more than {_TOTAL_MAX} bytes: not an archive gc wrote")
                    break
                fh2 = tar.extractfile(info)
                out[info.name] = fh2.read() if fh2 is not None else b""
    except (OSError, tarfile.TarError, EOFError, gzip.BadGzipFile) as exc:
        report.failures.append(f"cannot read the archive: {exc}")
    return out


def _manifest_shape(doc: Any) -> str | None:
    """What is wrong with a manifest's shape (``None``: it is one gc writes)."""
    if not isinstance(doc, dict):
        return "the manifest is not an object"
    if doc.get("schema") != ARCHIVE_SCHEMA:
        return f"unknown schema {doc.get('schema')!r}"
    ledger = doc.get("ledger")
    if not isinstance(ledger, dict):
        return "'ledger' is not an object"
    for name, kinds in (("sha256", (str,)), ("prev", (str,)), ("events", (int,)),
                        ("first_seq", (int, type(None))), ("last_seq", (int, type(None))),
                        ("head", (str, type(None)))):
        if not isinstance(ledger.get(name), kinds) or isinstance(ledger.get(name), bool):
            return f"'ledger.{name}' is missing or of the wrong type"
    listed = doc.get("receipts")
    if not isinstance(listed, list):
        return "'receipts' is not a list"
    for item in listed:
        if not (isinstance(item, dict) and isinstance(item.get("path"), str) and isinstance(item.get("sha256"), str)
                and isinstance(item.get("key"), str)):
            return "a 'receipts' entry is not {path, key, sha256}"
    return None


def verify_archive(path: str, *, signing: Signing | None = None,
                   store_events: Iterable[dict[str, Any]] | None = None) -> ArchiveReport:
    """Prove the archive at ``path`` (checks in the module docstring); the report lists every failure.

    ``store_events``: the store's ledger events, given when a store is: the
    bundle's digest must be one a ``removed``, ``checkpoint`` or ``compacted`` event names.
    """
    report = ArchiveReport(path)
    members = _members(path, report)
    if report.failures:
        return report
    try:
        manifest = jsonio.loads(members.pop(_MANIFEST))
    except Exception as exc:  # noqa: BLE001 - any bytes: the archive is not one of ours
        report.failures.append(f"not an archive gc wrote: no readable manifest ({type(exc).__name__}: {exc})")
        return report
    wrong = _manifest_shape(manifest)
    if wrong is not None:
        report.failures.append(f"not an archive gc wrote: {wrong}")
        return report
    ledger_doc, listed = manifest["ledger"], manifest["receipts"]
    if store_events is not None:
        named = {e.get("bundle_sha256") for e in store_events
                 if e.get("event") in ("removed", "checkpoint", "compacted")}
        if report.sha256 not in named:
            report.failures.append(f"the store names no archive of sha256 {report.sha256} (no removed, checkpoint "
                                   "or compacted event): not this store's archive, or changed since")
    events = members.pop(_EVENTS, None)
    if events is None or sha256_hex(events) != ledger_doc.get("sha256"):
        report.failures.append("events.jsonl is missing or does not match its digest in the manifest")
    else:
        lines = events.splitlines(keepends=True)
        report.events = len(lines)
        report.first_seq, report.last_seq, report.head = (ledger_doc.get("first_seq"), ledger_doc.get("last_seq"),
                                                          ledger_doc.get("head"))
        if lines:
            first_seq = ledger_doc.get("first_seq")
            problems = check_chain(lines, prev=str(ledger_doc.get("prev")),
                                   seq=first_seq if isinstance(first_seq, int) else 1, signing=signing)
            report.failures += [f"events.jsonl line {p.line}: {p.reason}" for p in problems
                                if "not confirmed" not in p.reason]  # the confirmation follows in the store
            if sha256_hex(lines[-1].rstrip(b"\n")) != report.head:
                report.failures.append("events.jsonl's last line is not the manifest's head")
    for item in listed:
        name = str(item.get("path"))
        data = members.pop(name, None)
        if data is None or sha256_hex(data) != item.get("sha256"):
            report.failures.append(f"'{name}' is missing or does not match its digest in the manifest")
            continue
        h = os.path.basename(name)[:-5]
        try:
            receipt = parse_receipt(data, path=name, expected_key_hash=h)
            if signing is not None:
                signing.check_receipt(receipt, name)
        except CorruptReceipt as exc:
            report.failures.append(f"'{name}': {exc.reason}")
            continue
        report.receipts += 1
    report.failures += [f"member '{name}' is not in the manifest" for name in members]
    return report

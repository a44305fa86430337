"""gc's archives: a compressed, verifiable bundle of receipts and a ledger range (docs/LIFECYCLE.md, "gc").

A ``.tar.gz`` holding, in this order:

* ``manifest.json`` — schema ``oncepatch.archive/1``: when, the store, every
  member's sha256, and the ledger range (``first_seq``, ``last_seq``, the
  ``prev`` its first line chains onto, the ``head``: the digest of its last line);
* ``events.jsonl`` — the ledger lines of the range, byte for byte;
* ``receipts/<h[:2]>/<h>.json`` — each receipt file, byte for byte (a signed
  store's signatures included).

Members are written with fixed owner and time, so the same content makes the
same bytes.  :func:`verify_archive` proves a bundle without unpacking it to
disk: every member's digest, every receipt's own verification (its key's hash
its name, :func:`receipts.receipt.parse_receipt`), the range's chain from
``prev`` to ``head`` (:func:`receipts.ledger.check_chain`; signatures too
when the store's signing is given).  The file is written once, atomically
(:func:`cas.durable.write_durable`).
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from dataclasses import dataclass, field
from typing import Any

from cas.durable import fsync_dir, make_dirs, write_durable
from cas.hashing import sha256_hex
from receipts import jsonio
from receipts.errors import CorruptReceipt
from receipts.ledger import GENESIS, check_chain
from receipts.receipt import now_iso, parse_receipt

TYPE_CHECKING = False
if TYPE_CHECKING:
    from receipts.signing import Signing

__all__ = ["ARCHIVE_SCHEMA", "ArchiveReport", "build_archive", "write_archive", "verify_archive"]

ARCHIVE_SCHEMA = "oncepatch.archive/1"
_MANIFEST = "manifest.json"
_EVENTS = "events.jsonl"
#: The largest archive member read back (a receipt is far smaller; a ledger range of millions of events fits).
_MEMBER_MAX = 1 << 30


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


def write_archive(folder: str, data: bytes) -> str:
    """Write ``data`` as ``<folder>/gc-<time>-<sha256[:12]>.tar.gz`` atomically; return its path.

    Raises:
        DurableWriteError: the write failed (nothing is left).
    """
    for made in make_dirs(folder):
        fsync_dir(os.path.dirname(made))  # the new folder's entry is durable before the archive in it
    stamp = now_iso().replace(":", "").replace("-", "").split(".")[0]
    path = os.path.join(folder, f"gc-{stamp}-{sha256_hex(data)[:12]}.tar.gz")
    write_durable(path, data, mode=0o600)
    return path


def _members(path: str, report: ArchiveReport) -> dict[str, bytes]:
    """Every regular member's bytes (read in memory, never extracted); anything else is a failure."""
    out: dict[str, bytes] = {}
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        report.sha256 = sha256_hex(data)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for info in tar:
                if not info.isreg() or info.size > _MEMBER_MAX or info.name in out:
                    report.failures.append(f"member '{info.name}' is not a single regular file of ours")
                    continue
                fh2 = tar.extractfile(info)
                out[info.name] = fh2.read() if fh2 is not None else b""
    except (OSError, tarfile.TarError, EOFError, gzip.BadGzipFile) as exc:
        report.failures.append(f"cannot read the archive: {exc}")
    return out


def verify_archive(path: str, *, signing: Signing | None = None) -> ArchiveReport:
    """Prove the archive at ``path`` (checks in the module docstring); the report lists every failure."""
    report = ArchiveReport(path)
    members = _members(path, report)
    if report.failures:
        return report
    try:
        manifest = jsonio.loads(members.pop(_MANIFEST))
        ledger_doc = manifest["ledger"]
        listed = manifest["receipts"]
        if manifest.get("schema") != ARCHIVE_SCHEMA:
            raise ValueError(f"unknown schema {manifest.get('schema')!r}")
    except Exception as exc:  # noqa: BLE001 - any shape: the archive is not one of ours
        report.failures.append(f"no readable manifest ({type(exc).__name__}: {exc})")
        return report
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

"""The forgeries of issue 26's "Why", done as a writer of the store who lacks its key would do them.

Each works on the files alone, as an attacker with ``sh``, ``git`` and a JSON
library would (the digests and the chain recomputed the way oncepatch does):
``tests/integration/test_signing.py`` tries them on a store of the test's own
user, ``tests/integration/test_broker.py`` on a broker's store, as its
agent (refused by the file system) and as a writer without the key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cas.hashing import sha256_hex
from receipts.canonical import canonical_json
from receipts.identity import key_hash

if TYPE_CHECKING:
    from conftest import Repo

__all__ = ["receipt_file", "ledger_lines", "write_rechained", "rewrite_an_event", "reseal", "copy_signature",
           "fabricate"]


def receipt_file(store: Path, key: str) -> Path:
    h = key_hash(key)
    return store / "receipts" / h[:2] / f"{h}.json"


def ledger_lines(store: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (store / "events.jsonl").read_bytes().splitlines()]


def write_rechained(store: Path, events: list[dict[str, Any]]) -> None:
    """Write ``events`` as the ledger, seq and prev recomputed as an append would (signatures left as they are)."""
    prev, out = "0" * 64, b""
    for n, e in enumerate(events, 1):
        e = {**e, "seq": n, "prev": prev}
        line = canonical_json(e)
        prev, out = sha256_hex(line), out + line + b"\n"
    (store / "events.jsonl").write_bytes(out)


def rewrite_an_event(store: Path, key: str) -> int:
    """The ``committed`` event of ``key`` rewritten, the chain recomputed; its index in the ledger."""
    events = ledger_lines(store)
    target = next(i for i, e in enumerate(events) if e.get("key") == key and e["event"] == "committed")
    events[target] = {**events[target], "at": "2020-01-01T00:00:00.000000Z", "note": "nothing happened here"}
    write_rechained(store, events)
    return target


def reseal(store: Path, key: str, **fields: Any) -> None:
    """``key``'s receipt with ``fields`` changed and its ``receipt_sha256`` recomputed (its signature kept);
    the ledger's events that named the old digest name the new one, the chain recomputed."""
    path = receipt_file(store, key)
    doc = json.loads(path.read_text())
    old = doc["receipt_sha256"]
    doc.update(fields)
    body = {k: v for k, v in doc.items() if k not in ("receipt_sha256", "signature")}
    doc["receipt_sha256"] = sha256_hex(canonical_json(body))
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    events = ledger_lines(store)
    write_rechained(store, [{**e, "receipt_sha256": doc["receipt_sha256"]} if e.get("receipt_sha256") == old else e
                            for e in events])


def copy_signature(store: Path, to: str, source: str) -> None:
    """``to``'s receipt carrying the signature of ``source``'s (a valid signature, of another digest)."""
    path = receipt_file(store, to)
    doc = json.loads(path.read_text())
    doc["signature"] = json.loads(receipt_file(store, source).read_text())["signature"]
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def fabricate(repo: Repo, store: Path, forger_store: Path, patch: bytes, key: str = "ghost",
              env: dict[str, str] | None = None) -> str:
    """A key that never ran in ``store``: its commit, a key ref made with ``git update-ref``, its
    receipt and two ledger events, all made in ``forger_store`` and carried over; the commit."""
    from conftest import run_cli  # (the rest of this module runs as the broker test's agent, without pytest)

    r = run_cli("apply", "--repo", str(repo.path), "--store", str(forger_store), "--key", key, "--json", "-",
                input=patch, env=env)
    assert r.code == 0, r.out + r.err
    commit: str = r.json["commit"]
    ref = f"refs/oncepatch/keys/{key_hash(key)}"
    repo.git("update-ref", "-d", ref)
    repo.git("update-ref", ref, commit)
    dst = receipt_file(store, key)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(receipt_file(forger_store, key), dst)
    forged = [e for e in ledger_lines(forger_store) if e.get("key") == key]
    assert [e["event"] for e in forged] == ["prepared", "committed"]
    write_rechained(store, ledger_lines(store) + forged)
    return commit

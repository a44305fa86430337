"""verify split over worker processes gives the same report as one process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from conftest import make_repo
from patcher.cli.recovery import _adapters
from patcher.protocol import apply
from receipts.receipt import Receipt
from receipts.store import ReceiptStore
from receipts.verifier import verify

FACTORY = "patcher.cli.recovery:_adapters"


def _patch(i: int) -> bytes:
    return f"--- /dev/null\n+++ b/f{i}.txt\n@@ -0,0 +1 @@\n+file {i}\n".encode()


def test_parallel_verify_matches_serial(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    for i in range(6):
        apply(str(repo.path), _patch(i), key=f"k{i}")
    store = ReceiptStore(str(repo.store))
    # One receipt whose output digest no longer matches its commit (re-digested, so it parses).
    r = store.read("k3")
    assert r is not None
    bad = dict(r.outputs[0], sha256="0" * 64)
    store.record(r.evolve(outputs=(bad,)), "committed")

    serial = verify(store, _adapters(store))
    parallel = verify(store, _adapters(store), jobs=2, verifiers_factory=FACTORY, parallel_min=1)
    assert serial.receipts == parallel.receipts == 6
    assert not serial.ok and len(serial.failures) == 1 and "sha256" in serial.failures[0].reason
    assert sorted((f.key, f.reason) for f in parallel.failures) == sorted((f.key, f.reason) for f in serial.failures)


def test_parallel_failures_in_file_order_like_serial(tmp_path: Path) -> None:
    """Several failures, one receipt with two, one file corrupt: the same list, in the same order."""
    repo = make_repo(tmp_path / "repo")
    for i in range(10):
        apply(str(repo.path), _patch(i), key=f"k{i}")
    store = ReceiptStore(str(repo.store))
    for k in ("k2", "k7"):
        r = store.read(k)
        assert r is not None
        store.record(r.evolve(outputs=(dict(r.outputs[0], sha256="0" * 64),)), "committed")
    # Re-written without the ledger: not in the ledger, and a wrong path (two failures, one receipt).
    r = store.read("k5")
    assert r is not None
    store.write(r.evolve(outputs=(dict(r.outputs[0], path="nowhere.txt"),)))
    with open(store.receipt_path("k8"), "ab") as fh:
        fh.write(b"torn")

    serial = verify(store, _adapters(store))
    parallel = verify(store, _adapters(store), jobs=3, verifiers_factory=FACTORY, parallel_min=1)
    assert len(serial.failures) == 5
    assert [(f.key, f.path, f.reason) for f in parallel.failures] == \
        [(f.key, f.path, f.reason) for f in serial.failures]
    assert parallel.receipts == serial.receipts == 10


class _Recording:
    def __init__(self, inner: Any, log: str) -> None:
        self.inner, self.log = inner, log

    def verify_committed(self, receipt: Receipt) -> list[str]:
        with open(self.log, "a") as fh:
            fh.write(receipt.key + "\n")
        return list(self.inner.verify_committed(receipt))


def recording_adapters(rstore: Any) -> dict[str, Any]:
    """A verifiers factory that logs, per run handed to a worker, the keys in the order it verifies them.

    (Called once per run: a worker process may be handed both runs.)
    """
    out = _adapters(rstore)
    log = os.path.join(os.environ["OPC_TEST_VERIFY_LOG"], f"{os.getpid()}-{os.urandom(4).hex()}.txt")
    return {tool: _Recording(v, log) if tool == "apply_patch" else v for tool, v in out.items()}


def test_workers_verify_runs_of_calls_in_ledger_order(tmp_path: Path, monkeypatch: Any) -> None:
    """Each run handed to a worker is calls made one after another, oldest first (their commits share packs)."""
    repo = make_repo(tmp_path / "repo")
    keys = [f"k{i:02d}" for i in range(12)]
    for i, k in enumerate(keys):
        apply(str(repo.path), _patch(i), key=k)
    store = ReceiptStore(str(repo.store))
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setenv("OPC_TEST_VERIFY_LOG", str(logs))
    report = verify(store, _adapters(store), jobs=2, verifiers_factory="test_verify_parallel:recording_adapters",
                    parallel_min=1)
    assert report.ok, report.failures
    runs = sorted((p.read_text().split() for p in logs.iterdir()), key=lambda ks: ks[0])
    assert runs == [keys[:6], keys[6:]]


def test_a_receipt_gone_between_listing_and_reading_is_not_counted(tmp_path: Path,
                                                                   monkeypatch: Any) -> None:
    repo = make_repo(tmp_path / "repo")
    for i in range(3):
        apply(str(repo.path), _patch(i), key=f"k{i}")
    store = ReceiptStore(str(repo.store))
    real = ReceiptStore.receipt_paths
    ghost = os.path.join(store.receipts_dir, "00", "0" * 64 + ".json")
    monkeypatch.setattr(ReceiptStore, "receipt_paths", lambda s: [ghost, *real(s)])
    serial = verify(store, _adapters(store))
    parallel = verify(store, _adapters(store), jobs=2, verifiers_factory=FACTORY, parallel_min=1)
    assert serial.receipts == parallel.receipts == 3 and serial.ok and parallel.ok


def test_an_empty_store_verifies_with_any_threshold(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    store = ReceiptStore(str(repo.store))
    report = verify(store, _adapters(store), jobs=2, verifiers_factory=FACTORY, parallel_min=0)
    assert report.ok and report.receipts == 0

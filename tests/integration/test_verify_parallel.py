"""verify split over worker processes gives the same report as one process."""

from __future__ import annotations

from pathlib import Path

from conftest import make_repo
from patcher.cli_recovery import _adapters
from patcher.protocol import apply
from receipts.store import ReceiptStore
from receipts.verifier import verify


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
    parallel = verify(store, _adapters(store), jobs=2, verifiers_factory="patcher.cli_recovery:_adapters",
                      parallel_min=1)
    assert serial.receipts == parallel.receipts == 6
    assert not serial.ok and len(serial.failures) == 1 and "sha256" in serial.failures[0].reason
    assert sorted((f.key, f.reason) for f in parallel.failures) == sorted((f.key, f.reason) for f in serial.failures)

"""receipts.quarantine: evidence moved aside through folder descriptors, never through a symlink."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import receipts.quarantine
from receipts.identity import key_hash
from receipts.quarantine import QUARANTINE_DIR, quarantine_receipt, quarantines
from receipts.receipt import now_iso, receipt_bytes
from receipts.store import ReceiptStore
from tests.unit.test_receipt_store import make_receipt


def _files_under(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else b"" for p in folder.rglob("*")}


def _swap(folder: str, outside: Path) -> None:
    os.rename(folder, folder + ".aside")
    os.symlink(outside, folder)


@pytest.fixture
def store(tmp_path: Path) -> ReceiptStore:
    s = ReceiptStore(str(tmp_path / "store"))
    s.record(make_receipt(1, key="k"), "prepared")
    return s


def test_a_receipt_is_moved_aside_recorded_and_listed(store: ReceiptStore) -> None:
    path = store.receipt_path("k")
    data = Path(path).read_bytes()
    record = quarantine_receipt(store, "k", note="looked at")
    assert not os.path.exists(path)
    assert (Path(store.root) / record["to"]).read_bytes() == data
    assert list(quarantines(store)) == [record]
    assert [e["event"] for e in store.ledger.events()] == ["prepared", "quarantined"]


def test_a_shard_swapped_for_a_symlink_after_the_check_is_never_read_or_moved_from(
        store: ReceiptStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = os.path.dirname(store.receipt_path("k"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{key_hash('k')}.json").write_bytes(receipt_bytes(make_receipt(1, key="k")))
    before = _files_under(outside)
    real = receipts.quarantine._digest

    def swap_then_digest(*args: Any) -> Any:  # the moment after every check, before the file is read
        _swap(shard, outside)
        return real(*args)

    monkeypatch.setattr(receipts.quarantine, "_digest", swap_then_digest)
    record = quarantine_receipt(store, "k")
    assert _files_under(outside) == before  # the file there neither read into the record nor moved
    assert os.listdir(shard + ".aside") == []  # the receipt moved from the folder opened before the swap
    assert (Path(store.root) / record["to"]).read_bytes() == receipt_bytes(make_receipt(1, key="k"))


def test_a_quarantine_folder_swapped_for_a_symlink_meanwhile_gets_nothing_written_through_it(
        store: ReceiptStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = os.path.join(store.root, QUARANTINE_DIR)
    os.mkdir(base)
    outside = tmp_path / "outside"
    outside.mkdir()
    swapped: list[bool] = []

    def stamp_then_swap() -> str:  # the moment the new folder's name is made, after any check
        if not swapped:
            swapped.append(True)
            _swap(base, outside)
        return now_iso()

    monkeypatch.setattr(receipts.quarantine, "now_iso", stamp_then_swap)
    quarantine_receipt(store, "k")
    assert _files_under(outside) == {}  # the evidence went into the folder opened before the swap
    assert len(os.listdir(base + ".aside")) == 1

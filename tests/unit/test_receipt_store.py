"""receipts.store: sharded receipt files, per-key flock locks, scan and find."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from cas.durable import TMP_MARK
from receipts.errors import CorruptReceipt, InProgress
from receipts.identity import compute_args_sha256, compute_call_id, key_hash, make_identity
from receipts.receipt import Receipt, receipt_bytes
from receipts.store import ReceiptStore

ROOT = Path(__file__).resolve().parents[2]

HOLDER = r"""
import sys, time
from receipts.store import ReceiptStore
store = ReceiptStore(sys.argv[1])
with store.lock(sys.argv[2], timeout=5):
    print("locked", flush=True)
    time.sleep(120)
"""


def make_receipt(n: int = 0, key: str | None = None, **kw: Any) -> Receipt:
    args = {"repo": "/r", "patch_sha256": f"{n:064x}"}
    identity = make_identity("apply_patch", "1", args)
    call_id = compute_call_id(identity)
    fields: dict[str, Any] = dict(
        key=key or call_id, call_id=call_id, identity=identity,
        args_sha256=compute_args_sha256("apply_patch", "1", args), tool="apply_patch", tool_version="1",
        status="prepared", fencing_token=1, owner={"pid": 1}, created_at="t0", updated_at="t1",
    )
    fields.update(kw)
    return Receipt(**fields)


@pytest.fixture
def store(tmp_path: Path) -> ReceiptStore:
    return ReceiptStore(str(tmp_path / "store"))


@pytest.fixture
def holder(store: ReceiptStore) -> Iterator[Any]:
    """Start a real process that holds a key's lock; always reaped."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(key: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        p = subprocess.Popen([sys.executable, "-c", HOLDER, store.root, key], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line == b"locked\n", p.stderr.read() if p.stderr else line
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


# -- layout, write, read ------------------------------------------------------------


def test_write_then_read_round_trip(store: ReceiptStore) -> None:
    r = make_receipt(key="biz")
    path = store.write(r)
    h = key_hash("biz")
    assert path == os.path.join(store.root, "receipts", h[:2], f"{h}.json")
    assert Path(path).read_bytes() == receipt_bytes(r)
    assert store.read("biz") == r
    assert store.read_hash(h) == r
    assert store.read("other") is None
    assert [n for n in os.listdir(os.path.dirname(path)) if TMP_MARK in n] == []


def test_rewrite_replaces(store: ReceiptStore) -> None:
    r = make_receipt(key="k")
    store.write(r)
    store.write(r.evolve(status="committed", commit="c" * 40))
    got = store.read("k")
    assert got is not None and got.status == "committed" and got.commit == "c" * 40


def test_read_verifies_and_raises_on_corruption(store: ReceiptStore) -> None:
    path = store.write(make_receipt(key="k"))
    doc = orjson.loads(Path(path).read_bytes())
    doc["status"] = "committed"
    Path(path).write_bytes(orjson.dumps(doc))
    with pytest.raises(CorruptReceipt) as ei:
        store.read("k")
    assert ei.value.path == path


def test_receipt_under_wrong_name_is_corrupt(store: ReceiptStore) -> None:
    path = store.write(make_receipt(key="a"))
    other = store.receipt_path("b")
    os.makedirs(os.path.dirname(other), exist_ok=True)
    os.replace(path, other)
    with pytest.raises(CorruptReceipt) as ei:
        store.read("b")
    assert ei.value.reason == "key does not match the file name"


def test_record_writes_and_appends_to_ledger(store: ReceiptStore) -> None:
    r = make_receipt(key="k")
    store.record(r, "prepared", note="x")
    events = list(store.ledger.events())
    assert len(events) == 1
    ev = events[0]
    assert ev["event"] == "prepared" and ev["key"] == "k" and ev["receipt_sha256"] == r.digest and ev["note"] == "x"
    assert store.ledger.verify_chain() == []


# -- scan and find -----------------------------------------------------------------------


def test_scan_yields_corrupt_files_with_their_error_never_skips(store: ReceiptStore) -> None:
    good = [make_receipt(i, key=f"k{i}") for i in range(3)]
    for r in good:
        store.write(r)
    bad_path = store.receipt_path("broken")
    os.makedirs(os.path.dirname(bad_path), exist_ok=True)
    Path(bad_path).write_bytes(b"{not json")
    moved = store.write(make_receipt(9, key="moved"))
    wrong = store.receipt_path("wrong-name")
    os.makedirs(os.path.dirname(wrong), exist_ok=True)
    os.replace(moved, wrong)
    # noise that is not a receipt: tmp files, other names, stray folders
    Path(os.path.dirname(bad_path), f".x.json{TMP_MARK}1-ab").write_bytes(b"junk")
    Path(os.path.dirname(bad_path), "README").write_bytes(b"junk")
    os.makedirs(os.path.join(store.receipts_dir, "not-a-shard"), exist_ok=True)

    items = list(store.scan())
    by_hash = {i.key_hash: i for i in items}
    assert len(items) == 5
    for r in good:
        item = by_hash[key_hash(r.key)]
        assert item.receipt == r and item.error is None
    broken = by_hash[key_hash("broken")]
    assert broken.receipt is None and isinstance(broken.error, CorruptReceipt) and broken.path == bad_path
    assert broken.error.reason.startswith("not JSON")
    misnamed = by_hash[key_hash("wrong-name")]
    assert misnamed.receipt is None and misnamed.error is not None
    assert misnamed.error.reason == "key does not match the file name"


def test_scan_of_empty_store(store: ReceiptStore) -> None:
    assert list(store.scan()) == []


def test_find_by_key_or_call_id(store: ReceiptStore) -> None:
    a = make_receipt(1, key="business-key")
    b = make_receipt(2)  # key defaults to the call_id
    store.write(a)
    store.write(b)
    corrupt = store.receipt_path("zzz")
    os.makedirs(os.path.dirname(corrupt), exist_ok=True)
    Path(corrupt).write_bytes(b"[]")
    assert store.find("business-key") == a
    assert store.find(a.call_id) == a  # not its key: found by scanning call_ids
    assert store.find(b.call_id) == b
    assert store.find("opc1:" + "0" * 64) is None


# -- locks ----------------------------------------------------------------------------


def test_lock_can_be_taken_again_after_release(store: ReceiptStore) -> None:
    with store.lock("k", timeout=1):
        assert os.path.exists(store.lock_path("k"))
    with store.lock("k", timeout=1):
        pass
    assert store.lock_path("k") == os.path.join(store.root, "locks", f"{key_hash('k')}.lock")


def test_lock_timeout_raises_in_progress(store: ReceiptStore, holder: Any) -> None:
    holder("k")
    t0 = time.monotonic()
    with pytest.raises(InProgress) as ei:
        with store.lock("k", timeout=0.3):
            pytest.fail("lock taken while another process holds it")
    waited = time.monotonic() - t0
    assert 0.25 <= waited < 5
    err = ei.value
    assert err.key == "k" and err.exit_code == 5 and err.details["lock_path"] == store.lock_path("k")
    with store.lock("other-key", timeout=0.3):  # locks are per key
        pass


def test_try_lock(store: ReceiptStore, holder: Any) -> None:
    lk = store.try_lock("k")
    assert lk is not None and lk.is_locked
    lk.release()
    holder("k")
    t0 = time.monotonic()
    assert store.try_lock("k") is None
    assert time.monotonic() - t0 < 1  # does not wait
    other = store.try_lock("other")
    assert other is not None
    other.release()


def test_lock_is_released_when_the_holder_is_killed(store: ReceiptStore, holder: Any) -> None:
    p = holder("k")
    assert store.try_lock("k") is None
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    assert p.returncode == -signal.SIGKILL
    # flock: the kernel dropped it with the process; the lock file may stay, the lock does not
    with store.lock("k", timeout=2):
        pass
    lk = store.try_lock("k")
    assert lk is not None
    lk.release()


def test_try_lock_excludes_lock_in_same_process(store: ReceiptStore) -> None:
    lk = store.try_lock("k")
    assert lk is not None
    try:
        with pytest.raises(InProgress):
            with store.lock("k", timeout=0.1):
                pass
    finally:
        lk.release()


# -- a store folder swapped for a symlink between the check and the write (issue 25) ----------


def _files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def _swap_after_the_check(monkeypatch: pytest.MonkeyPatch, folder: str, outside: Path) -> None:
    """The race: right after the store's check passes, ``folder`` becomes a symlink to ``outside``."""
    real = ReceiptStore.check_folders

    def check_then_swap(self: ReceiptStore, path: str, **kw: Any) -> None:
        real(self, path, **kw)
        if os.path.isdir(folder) and not os.path.islink(folder):
            os.rename(folder, folder + ".aside")
            os.symlink(outside, folder)

    monkeypatch.setattr(ReceiptStore, "check_folders", check_then_swap)


@pytest.mark.parametrize("swapped", ["receipts", "shard"])
def test_a_folder_swapped_for_a_symlink_after_the_check_is_never_written_through(
        store: ReceiptStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str) -> None:
    store.write(make_receipt(1, key="k"))  # the shard of key "k" exists
    outside = tmp_path / "outside"
    (outside / key_hash("k")[:2]).mkdir(parents=True)  # a shard there too, to be written into
    before = _files_under(outside)
    folder = store.receipts_dir if swapped == "receipts" else os.path.dirname(store.receipt_path("k"))
    _swap_after_the_check(monkeypatch, folder, outside)
    with pytest.raises(CorruptReceipt) as exc:
        store.record(make_receipt(1, key="k").evolve(status="committed", commit="c" * 40), "committed")
    assert "symlink" in exc.value.reason and os.path.islink(folder)
    assert _files_under(outside) == before  # nothing written where the link points
    assert [e["event"] for e in store.ledger.events()] == []  # no event for a receipt never written


def test_a_scan_never_reads_through_a_folder_swapped_after_its_listing(store: ReceiptStore, tmp_path: Path) -> None:
    path = store.write(make_receipt(1, key="k"))
    assert store.receipt_paths() == [path]
    outside = tmp_path / "outside"
    (outside / key_hash("k")[:2]).mkdir(parents=True)
    (outside / key_hash("k")[:2] / os.path.basename(path)).write_bytes(b"planted")
    os.rename(store.receipts_dir, store.receipts_dir + ".aside")
    os.symlink(outside, store.receipts_dir)
    got = store.read_raw(path)
    assert isinstance(got, CorruptReceipt) and "symlink" in got.reason  # not b"planted"
    with pytest.raises(CorruptReceipt):
        store.receipt_paths()

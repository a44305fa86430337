"""recover with its first look split over worker processes gives the report one process gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli
from patcher.cli.recovery import _adapters
from patcher.protocol import apply
from receipts.recovery import recover
from receipts.store import ReceiptStore


def _patch(i: int) -> bytes:
    return f"--- /dev/null\n+++ b/f{i}.txt\n@@ -0,0 +1 @@\n+file {i}\n".encode()


def _mixed_store(path: Path) -> Repo:
    """Ten committed calls; one receipt rewritten without its ledger event, one torn, one orphaned ``prepared``."""
    repo = make_repo(path)
    for i in range(10):
        apply(str(repo.path), _patch(i), key=f"k{i}")
    store = ReceiptStore(str(repo.store))
    r = store.read("k2")
    assert r is not None
    store.write(r.evolve(result={**(r.result or {}), "note": "rewritten"}))  # the ledger lacks this state
    with open(store.receipt_path("k6"), "ab") as fh:
        fh.write(b"torn")
    (repo.path / "crash.diff").write_bytes(_patch(99))
    crashed = run_cli("apply", str(repo.path / "crash.diff"), "--repo", str(repo.path), "--json", "--key", "k9x",
                      env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    assert crashed.code == 137, crashed.err
    return repo


def _run(repo: Repo, dry_run: bool, **kw: Any) -> dict[str, Any]:
    store = ReceiptStore(str(repo.store))
    adapters = _adapters(store, read_only=dry_run)
    report = recover(store, adapters, dry_run=dry_run, tmp_age=0.0, extra_cleanup=adapters["apply_patch"].cleanup,
                     **kw)
    doc: dict[str, Any] = json.loads(json.dumps(report.to_json()).replace(str(repo.path), "<repo>"))
    return doc


@pytest.mark.parametrize("jobs", [2, 3])
def test_parallel_recover_matches_serial(tmp_path: Path, jobs: int) -> None:
    repo = _mixed_store(tmp_path / "repo")
    twin = Repo(tmp_path / "twin")
    shutil.copytree(repo.path, twin.path, symlinks=True)

    plan = _run(repo, True)
    assert _run(repo, True, jobs=jobs, parallel_min=1) == plan  # the same plan, nothing changed by either
    assert plan["scanned"] == 11 and len(plan["corrupt"]) == 1 and "k6" not in str(plan["rows"])
    assert [r["key"] for r in plan["rows"]] == ["k9x"] and plan["rows"][0]["to"] == "rejected"
    assert plan["ledger_repaired"] == ["k2"]

    serial = _run(repo, False)
    parallel = _run(twin, False, jobs=jobs, parallel_min=1)
    assert parallel == serial
    # The dry run names a dead call's leftovers among what it would remove; the run removes them
    # while it settles that call, and says so in the call's row: the same files either way.
    assert [{k: v for k, v in r.items() if k != "notes"} for r in serial["rows"]] == \
        [{k: v for k, v in r.items() if k != "notes"} for r in plan["rows"]]
    said = serial["removed"] + [note.split("'")[1] for r in serial["rows"] for note in r["notes"]
                                if note.startswith("removed '")]
    assert sorted(said) == sorted(plan["removed"]) and serial["ledger_repaired"] == ["k2"]
    again = _run(twin, False, jobs=jobs, parallel_min=1)  # a second run finds nothing to do
    assert not again["changed"] and again["scanned"] == 11 and len(again["corrupt"]) == 1


def test_below_the_threshold_no_worker_is_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import receipts.recovery as recovery

    repo = _mixed_store(tmp_path / "repo")

    def no_workers(*_a: Any) -> Any:
        raise AssertionError("workers started for a small store")

    monkeypatch.setattr(recovery, "_scan_parallel", no_workers)
    doc = _run(repo, True, jobs=2)  # 11 files, PARALLEL_MIN far above
    assert doc["scanned"] == 11


def test_the_cli_takes_jobs_and_gives_the_same_report(tmp_path: Path) -> None:
    """``oncepatch recover --jobs N``: the same JSON whatever N (a small store: no workers either way)."""
    repo = _mixed_store(tmp_path / "repo")
    one = run_cli("recover", "--dry-run", "--json", "--jobs", "1", "--repo", str(repo.path))
    two = run_cli("recover", "--dry-run", "--json", "--jobs", "2", "--repo", str(repo.path))
    assert one.code == two.code == 6, one.out + one.err  # the torn receipt
    assert one.json == two.json and one.json["rows"][0]["key"] == "k9x"

"""``oncepatch replay``: every recorded call decided again, nothing written (docs/LIFECYCLE.md, "replay").

Over the crash matrix's stores (each crash point of ``apply``, then
``recover``, then the same call again) the decisions agree with the ledger;
a receipt deleted by hand is a divergence.  Repository, index, worktree and
store are byte-for-byte as they were after every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, run_cli, snapshot
from test_crash_matrix import EDITS, POINTS, prepare


def _replay(repo: Repo, *extra: str) -> Any:
    before = snapshot(repo)
    r = run_cli("replay", "--repo", str(repo.path), "--json", *extra)
    assert snapshot(repo) == before, "replay changed the repository or the store"
    return r


def _crashed_and_recovered(tmp_path: Path, point: str) -> Repo:
    repo, pf, _base, _tree = prepare(tmp_path, EDITS["multi_file"])
    r = run_cli("apply", str(pf), "--repo", str(repo.path), "--key", "k", env={"ONCEPATCH_CRASH_AT": point})
    assert r.code == 137, r.out + r.err
    rec = run_cli("recover", "--repo", str(repo.path), "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    return repo


@pytest.mark.parametrize("point", sorted(POINTS))
def test_the_crash_matrix_stores_replay_without_divergence(tmp_path: Path, point: str) -> None:
    repo = _crashed_and_recovered(tmp_path, point)
    r = _replay(repo)
    assert r.code == 0, r.out + r.err
    doc = r.json
    assert doc["divergences"] == 0 and doc["refused_writes"] == [], doc
    now = {c["now"] for c in doc["calls"]}
    # Landed: the key replays; not landed: recover left it rejected and retryable, the next call executes.
    assert now == ({"replay"} if POINTS[point] else {"execute"}) or (point == "after-stage" and doc["calls"] == [])
    if point != "after-stage":
        assert {c["recorded"] for c in doc["calls"]} == {"execute", "query"}
    pf = tmp_path / "change.diff"
    again = run_cli("apply", str(pf), "--repo", str(repo.path), "--key", "k")
    assert again.code == 0, again.out + again.err
    r = _replay(repo)
    assert r.code == 0 and r.json["divergences"] == 0, r.out
    assert {c["now"] for c in r.json["calls"]} == {"replay"}


def test_a_prepared_receipt_left_by_a_crash_is_decided_by_query(tmp_path: Path) -> None:
    repo, pf, _base, _tree = prepare(tmp_path, EDITS["modify"])
    r = run_cli("apply", str(pf), "--repo", str(repo.path), "--key", "k", env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert r.code == 137
    r = _replay(repo)  # not recovered: the stale locks the crash left stay too
    assert r.code == 0, r.out + r.err
    (call,) = r.json["calls"]
    assert call["recorded"] == "execute" and call["recorded_outcome"] is None
    assert call["now"] == "query" and "applied" in call["detail"] and not call["divergence"]


def test_a_deleted_receipt_is_a_divergence(tmp_path: Path) -> None:
    repo = _crashed_and_recovered(tmp_path, "after-ref")
    run_cli("apply", str(tmp_path / "change.diff"), "--repo", str(repo.path), "--key", "k")
    (receipt,) = (repo.store / "receipts").rglob("*.json")
    receipt.unlink()
    r = _replay(repo)
    assert r.code == 7, r.out + r.err
    doc = r.json
    assert doc["ok"] is False and doc["divergences"] == len(doc["calls"]) > 0
    assert all(c["now"] == "execute" and c["expected"] == ["replay"] for c in doc["calls"])
    text = run_cli("replay", "--repo", str(repo.path), "--from", "3")
    assert text.code == 7 and "DIVERGES" in text.out and "the ledger says replay" in text.out
    assert all(int(line.split()[0]) >= 3 for line in text.out.splitlines()[1:-1])


def test_a_receipt_replaced_by_hand_is_a_divergence(tmp_path: Path) -> None:
    """The key still replays, but its receipt is not the one the ledger last recorded."""
    repo = _crashed_and_recovered(tmp_path, "after-prepare")  # rejected, retryable
    receipt = next((repo.store / "receipts").rglob("*.json"))
    old = receipt.read_bytes()
    run_cli("apply", str(tmp_path / "change.diff"), "--repo", str(repo.path), "--key", "k")
    receipt.write_bytes(old)  # the retryable rejection put back over the committed receipt
    r = _replay(repo)
    assert r.code == 7
    assert any("is not the one the ledger's last event names" in (c["why"] or "") for c in r.json["calls"])

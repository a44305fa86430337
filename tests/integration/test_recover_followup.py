"""recover settles a committed call whose follow-up failed (its worktree was not updated)."""

from __future__ import annotations

from pathlib import Path

from conftest import make_repo, run_cli
from receipts.store import ReceiptStore

PATCH = b"--- a/src/app.py\n+++ b/src/app.py\n@@ -1,2 +1,2 @@\n a\n-b\n+B\n"


def test_committed_with_warnings_is_materialised_by_recover_once(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"src/app.py": "a\nb\n"})
    pf = tmp_path / "p.diff"
    pf.write_bytes(PATCH)
    first = run_cli("apply", str(pf), "--repo", str(repo.path), "--key", "k", "--json")
    assert first.code == 0, first.out + first.err
    # The state a failed materialise leaves: the commit landed, the worktree and
    # index still show the base, the receipt carries a warning.
    repo.git("checkout", "HEAD~1", "--", "src/app.py")
    assert (repo.path / "src/app.py").read_text() == "a\nb\n"
    store = ReceiptStore(str(repo.store))
    r = store.read("k")
    assert r is not None
    store.record(r.evolve(extra={**r.extra, "warnings": ["worktree not updated: injected"]}), "committed")

    rec = run_cli("recover", "--repo", str(repo.path), "--json")
    assert rec.code == 0, rec.out + rec.err
    rows = rec.json["rows"]
    assert [(x["from"], x["to"], x["reason"]) for x in rows] == [("committed", "committed", "follow_up_settled")]
    assert (repo.path / "src/app.py").read_text() == "a\nB\n"
    assert repo.git("status", "--porcelain") == ""

    again = run_cli("recover", "--repo", str(repo.path), "--json")
    assert again.json["changed"] is False and again.json["rows"] == []
    assert run_cli("verify", "--repo", str(repo.path)).code == 0

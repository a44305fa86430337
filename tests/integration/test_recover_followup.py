"""recover settles a committed call whose follow-up failed (its worktree was not updated)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from cas.errors import RefUpdateUnknown
from cas.objects import GitStore
from conftest import make_repo, run_cli
from patcher.api import Client
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


def test_a_key_ref_recover_could_not_create_is_created_by_the_next_recover(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Found with ENOSPC injected into recover: a call killed after its branch moved was settled
    ``committed``, its key ref's creation failed (the warning "follow-up not done" recorded), and from
    then on status, verify, the key's replay and recover itself said the receipt was corrupt (its key
    ref missing), for good.  Such a receipt is believed where its commit is on the branch; the next
    recover creates the ref."""
    repo = make_repo(tmp_path / "repo", {"src/app.py": "a\nb\n"})
    pf = tmp_path / "p.diff"
    pf.write_bytes(PATCH)
    argv = ("apply", str(pf), "--repo", str(repo.path), "--key", "k", "--json")
    crashed = run_cli(*argv, env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert crashed.code == 137, crashed.out + crashed.err
    real = GitStore.create_key_ref

    def full_disk(self: GitStore, ref: str, *args: Any, **kw: Any) -> bool:
        raise RefUpdateUnknown(f"creation of ref '{ref}' failed after locking: could not write to "
                               f"'logs/{ref}': No space left on device")

    monkeypatch.setattr(GitStore, "create_key_ref", full_disk)
    with Client(str(repo.path), server="never") as client:  # the fault is in this process
        report = client.recover().to_json()
    monkeypatch.setattr(GitStore, "create_key_ref", real)
    assert [(x["from"], x["to"]) for x in report["rows"]] == [("prepared", "committed")], report
    assert any(n.startswith("follow-up not done") for n in report["rows"][0]["notes"]), report
    h = hashlib.sha256(b"k").hexdigest()
    assert repo.git("for-each-ref", f"refs/oncepatch/keys/{h}") == ""

    status = run_cli("status", "k", "--repo", str(repo.path), "--json")
    assert status.code == 0 and status.json["receipt"]["status"] == "committed", status.out + status.err
    replay = run_cli(*argv)
    assert replay.code == 0 and replay.json["replayed"], replay.out + replay.err
    rec = run_cli("recover", "--repo", str(repo.path), "--json")
    assert rec.code == 0, rec.out + rec.err
    assert [x["reason"] for x in rec.json["rows"]] == ["follow_up_settled"], rec.out
    assert repo.head(f"refs/oncepatch/keys/{h}") == repo.head() and repo.count() == 2
    assert run_cli("verify", "--repo", str(repo.path)).code == 0
    assert run_cli("recover", "--repo", str(repo.path), "--json").json["rows"] == []

"""`oncepatch resolve` on git calls: the adapter is asked first; a person's word never overrides it.

A git call can always be queried (DESIGN.md section 1), so `resolve` settles a
crashed call as `recover` would when the claim agrees with what the adapter
finds, and refuses a claim that contradicts it (exit 2, `not_resolvable`,
nothing written).  Before, `--as committed` after a crash before the branch
moved recorded a commit that never landed, and every later retry replayed it.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import Repo, run_cli, snapshot

PATCH = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"


def _crash(repo: Repo, point: str) -> None:
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "k", "--json", input=PATCH,
                env={"ONCEPATCH_CRASH_AT": point})
    assert r.code == 137, r.out + r.err


def _resolve(repo: Repo, as_: str) -> Any:
    return run_cli("resolve", "k", "--as", as_, "--note", "by hand", "--repo", str(repo.path), "--json")


@pytest.mark.parametrize("point, wrong", [("after-prepare", "committed"), ("after-ref", "rejected")])
def test_a_claim_the_adapter_contradicts_is_refused(repo: Repo, point: str, wrong: str) -> None:
    _crash(repo, point)
    before = snapshot(repo)
    r = _resolve(repo, wrong)
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "not_resolvable" and err["next_action"] == "recover"
    assert err["effect_status"] == ("applied" if point == "after-ref" else "not_applied")
    assert "run 'oncepatch recover'" in err["message"]
    assert snapshot(repo) == before, "nothing written"


def test_a_claim_that_agrees_settles_as_recover_would(repo: Repo) -> None:
    base = repo.head()
    _crash(repo, "after-ref")  # the branch moved; the worktree was not brought along
    r = _resolve(repo, "committed")
    assert r.code == 0, r.out + r.err
    receipt = r.json["receipt"]
    assert receipt["status"] == "committed" and receipt["resolved_by_hand"] == "by hand"
    assert receipt["commit"] == repo.head() != base
    assert repo.git("status", "--porcelain") == "", "the worktree was brought along"
    assert (repo.path / "src/util.py").read_text() == "def f():\n    return 2\n"
    assert run_cli("verify", "--repo", str(repo.path)).code == 0
    again = run_cli("apply", "-", "--repo", str(repo.path), "--key", "k", "--json", input=PATCH)
    assert again.code == 0 and again.json["replayed"] is True


def test_rejected_by_hand_after_a_crash_before_the_move_lets_a_retry_apply_once(repo: Repo) -> None:
    base = repo.head()
    _crash(repo, "after-prepare")
    r = _resolve(repo, "rejected")
    assert r.code == 0, r.out + r.err
    assert r.json["receipt"]["status"] == "rejected" and r.json["receipt"]["retryable"] is True
    again = run_cli("apply", "-", "--repo", str(repo.path), "--key", "k", "--json", input=PATCH)
    assert again.code == 0 and again.json["replayed"] is False
    assert repo.git("rev-list", f"{base}..main").split() == [repo.head()]


def test_a_final_receipt_is_not_resolvable(repo: Repo) -> None:
    assert run_cli("apply", "-", "--repo", str(repo.path), "--key", "k", input=PATCH).code == 0
    before = snapshot(repo)
    r = _resolve(repo, "rejected")
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert (err["type"], err["effect_status"], err["next_action"]) == ("not_resolvable", "applied", "none")
    assert snapshot(repo) == before

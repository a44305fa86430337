"""`oncepatch resolve` on git calls: the adapter is asked first; a person's word never overrides it.

A git call can always be queried (docs/DESIGN.md section 1), so `resolve` settles a
crashed call as `recover` would when the claim agrees with what the adapter
finds, and refuses a claim that contradicts it (exit 2, `not_resolvable`,
nothing written).  Before, `--as committed` after a crash before the branch
moved recorded a commit that never landed, and every later retry replayed it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot

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


# -- found in review ---------------------------------------------------------------------------


def test_a_repository_gone_inside_another_is_not_asked_so_the_claim_is_recorded(tmp_path: Path) -> None:
    outer = make_repo(tmp_path / "outer", {"x": "outer\n"})
    inner = make_repo(outer.path / "inner", {"src/util.py": "def f():\n    return 1\n"})
    store = tmp_path / "store"
    r = run_cli("apply", "-", "--repo", str(inner.path), "--store", str(store), "--key", "k", "--json",
                input=PATCH, env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert r.code == 137, r.out + r.err
    (inner.path / ".git").rename(tmp_path / "moved-git")
    plan = run_cli("recover", "--store", str(store), "--dry-run", "--json")
    assert plan.json["rows"] == [] and plan.json["skipped"], "not asked of the enclosing repository"
    done = run_cli("resolve", "k", "--as", "committed", "--note", "seen", "--store", str(store), "--json")
    assert done.code == 0, done.out + done.err
    assert done.json["receipt"]["status"] == "committed"


def test_a_refused_claim_leaves_a_dead_owners_ref_lock_alone(repo: Repo) -> None:
    _crash(repo, "after-prepare")
    candidate = run_cli("status", "k", "--repo", str(repo.path), "--json").json["receipt"]["candidate"]
    lock = repo.path / ".git/refs/heads/main.lock"
    lock.write_text(candidate + "\n")
    before = snapshot(repo)
    assert _resolve(repo, "committed").code == 2
    assert lock.exists() and snapshot(repo) == before


def test_an_agreeing_claim_is_a_resolved_event_with_its_note(repo: Repo) -> None:
    _crash(repo, "after-ref")
    assert _resolve(repo, "committed").code == 0
    last = json.loads((repo.store / "events.jsonl").read_text().splitlines()[-1])
    assert (last["event"], last["note"]) == ("resolved", "by hand")


def test_a_call_id_shared_by_several_keys_is_ambiguous(repo: Repo) -> None:
    for key in ("A", "B"):
        r = run_cli("apply", "-", "--repo", str(repo.path), "--key", key, "--json", input=PATCH,
                    env={"ONCEPATCH_CRASH_AT": "after-prepare"})
        assert r.code == 137
    call_id = run_cli("status", "A", "--repo", str(repo.path), "--json").json["receipt"]["call_id"]
    before = snapshot(repo)
    for command in (["resolve", call_id, "--as", "rejected"], ["status", call_id]):
        r = run_cli(*command, "--repo", str(repo.path), "--json")
        assert r.code == 2, r.out + r.err
        assert r.json["error"]["type"] == "ambiguous_call_id" and r.json["error"]["keys"] == ["A", "B"]
    assert snapshot(repo) == before

"""``oncepatch drift``: is every applied change still there? (docs/LIFECYCLE.md, "drift").

The sequence of issue 29: a call killed at ``after-ref`` (the branch moved),
then git's own advice taken (``rm .git/index.lock``, ``git commit -a``).  The
worktree is written ahead of the move now, so that commit keeps the change
(issue 31, tests/integration/test_crash_then_git.py); a person who undoes the
change by hand and commits reverts it, ``verify`` cannot see it, ``drift``
names the reverting commit as outside oncepatch.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from conftest import Repo, make_repo, run_cli, snapshot

PATCH = b"--- a/greet.py\n+++ b/greet.py\n@@ -1 +1 @@\n-hello\n+hello world\n"
OTHER = b"--- a/other.txt\n+++ b/other.txt\n@@ -1 +1 @@\n-x\n+x2\n"


def _drift(repo: Repo) -> Any:
    before = snapshot(repo)
    r = run_cli("drift", "--repo", str(repo.path), "--json")
    assert snapshot(repo) == before, "drift changed something"
    return r


def _repo(tmp_path: Path) -> Repo:
    return make_repo(tmp_path / "repo", {"greet.py": "hello\n", "other.txt": "x\n"})


def _apply(repo: Repo, patch: bytes, key: str, **env: str) -> int:
    return run_cli("apply", "-", "--repo", str(repo.path), "--key", key, input=patch, env=env or None).code


def _path(doc: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    (row,) = [r for r in doc["receipts"] if r["key"] == key]
    (item,) = [p for p in row["paths"] if p["path"] == path]
    return item


def test_crash_then_a_revert_by_hand_is_named_as_an_outside_revert(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert _apply(repo, PATCH, "k1", ONCEPATCH_CRASH_AT="after-ref") == 137
    (repo.path / ".git" / "index.lock").unlink()  # git's advice, taken
    (repo.path / "greet.py").write_text("hello\n")  # the change undone by hand
    done = subprocess.run(["git", "commit", "-q", "-a", "-m", "x"], cwd=repo.path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    reverting = repo.head()
    assert repo.git("show", "HEAD:greet.py") == "hello\n"

    r = _drift(repo)  # before recover: the candidate is on the branch, the receipt still prepared
    assert r.code == 7, r.out + r.err
    item = _path(r.json, "k1", "greet.py")
    assert (item["state"], item["commit"], item["by"], item["subject"]) == ("reverted", reverting, "outside", "x")

    assert run_cli("recover", "--repo", str(repo.path)).code == 0
    assert run_cli("verify", "--repo", str(repo.path)).code == 0  # the receipt's own truth holds
    r = _drift(repo)
    assert r.code == 7
    row = r.json["receipts"][0]
    assert row["status"] == "committed" and row["state"] == "reverted"
    assert _path(r.json, "k1", "greet.py")["commit"] == reverting
    text = run_cli("drift", "--repo", str(repo.path))
    assert text.code == 7
    assert f"greet.py: reverted by {reverting[:12]} (outside oncepatch: 'x')" in text.out


def test_unchanged_then_changed_by_oncepatch_then_dirty(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert _apply(repo, PATCH, "k1") == 0
    r = _drift(repo)
    assert r.code == 0 and r.json["ok"] is True and r.json["receipts"][0]["state"] == "unchanged"

    again = b"--- a/greet.py\n+++ b/greet.py\n@@ -1 +1 @@\n-hello world\n+hello there\n"
    assert _apply(repo, again, "k2") == 0
    r = _drift(repo)
    assert r.code == 7
    item = _path(r.json, "k1", "greet.py")
    assert item["state"] == "changed" and item["by"] == "oncepatch" and item["commit"] == repo.head()
    assert item["call_id"] is not None and item["key_sha256"] is not None and item["key"] == "k2"
    text = run_cli("drift", "--repo", str(repo.path))
    assert f"greet.py: changed by {repo.head()[:12]} (by oncepatch, key 'k2':" in text.out
    assert _path(r.json, "k2", "greet.py")["state"] == "unchanged"

    assert _apply(repo, OTHER, "k3") == 0
    (repo.path / "other.txt").write_text("mine\n")
    r = _drift(repo)
    item = _path(r.json, "k3", "other.txt")
    assert item["state"] == "dirty" and item["dirty"] == [str(repo.path)]


def test_a_commit_reset_away_is_gone(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    base = repo.head()
    assert _apply(repo, PATCH, "k1") == 0
    repo.git("reset", "-q", "--hard", base)
    r = _drift(repo)
    assert r.code == 7 and _path(r.json, "k1", "greet.py")["state"] == "gone"


def test_a_receipt_that_could_not_be_checked_is_no_all_clear(tmp_path: Path) -> None:
    """A receipt skipped for want of a reading (its repository gone, its file corrupt) exits 6, not 0."""
    store = tmp_path / "store"
    a, b = (make_repo(tmp_path / name, {"greet.py": "hello\n"}) for name in ("a", "b"))
    for repo, key in ((a, "in-a"), (b, "in-b")):
        r = run_cli("apply", "-", "--repo", str(repo.path), "--key", key, "--store", str(store), input=PATCH)
        assert r.code == 0, r.out + r.err
    ok = run_cli("drift", "--repo", str(a.path), "--store", str(store), "--json")
    assert ok.code == 0 and ok.json["unchecked"] == 0, ok.out + ok.err
    subprocess.run(["rm", "-rf", str(b.path)], check=True)
    r = run_cli("drift", "--repo", str(a.path), "--store", str(store), "--json")
    assert r.code == 6, r.out + r.err
    assert r.json["ok"] is False and r.json["drifted"] == 0 and r.json["unchecked"] == 1
    assert [s["key"] for s in r.json["skipped"]] == ["in-b"] and r.json["skipped"][0]["kind"] == "unchecked"
    text = run_cli("drift", "--repo", str(a.path), "--store", str(store))
    assert text.code == 6 and "1 receipt(s), 0 drifted, 1 not checked" in text.out, text.out + text.err
    # Every receipt skipped (the only one left corrupt): still not "0 drifted, exit 0".
    only = _repo(tmp_path / "only")
    assert _apply(only, PATCH, "fix") == 0
    (receipt,) = (only.path / ".git" / "oncepatch" / "receipts").glob("*/*.json")
    receipt.write_bytes(b"{not json")
    r = _drift(only)
    assert r.code == 6 and r.json["receipts"] == [] and r.json["unchecked"] == 1, r.out + r.err

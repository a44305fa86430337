"""``oncepatch revert KEY --key NEW_KEY``: compensation as a new keyed apply (docs/LIFECYCLE.md, "revert").

Through real CLI calls: the inverse lands once, a retry replays, a conflict with
later edits changes nothing, an unknown key is a clear error, a crash at any
crash point then ``recover`` ends with one compensating commit or none; and the
generic effect API's compensation (file_write's).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot
from receipts.adapters.file_write import FileWriteAdapter, write_file
from receipts.effects import compensate

BASE = {"src/app.py": "".join(f"line {i}\n" for i in range(1, 31)), "README": "hello\n"}
POINTS = ["after-stage", "after-prepare", "after-ref", "after-materialise", "before-receipt-replace"]


def change(repo: Repo, line: int, word: str) -> bytes:
    head = repo.head()
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace(f"line {line}\n", f"{word}\n"))
    diff = repo.git("diff", "--full-index").encode()
    repo.git("checkout", "-q", head, "--", "src/app.py")
    return diff


def applied(tmp_path: Path) -> tuple[Repo, str]:
    """A repo where key 'orig' changed line 5 (and added a file); the original content of src/app.py."""
    repo = make_repo(tmp_path / "repo", BASE)
    original = (repo.path / "src/app.py").read_text()
    patch = change(repo, 5, "FIVE") + (b"--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+new\n")
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "orig", input=patch)
    assert r.code == 0, r.out + r.err
    return repo, original


def revert(repo: Repo, key: str, new_key: str, env: dict[str, str] | None = None) -> Any:
    return run_cli("revert", key, "--key", new_key, "--repo", str(repo.path), "--json", env=env)


def test_revert_lands_once_and_a_retry_replays(tmp_path: Path) -> None:
    repo, original = applied(tmp_path)
    count = repo.count()
    r = revert(repo, "orig", "undo-1")
    assert r.code == 0, r.out + r.err
    assert r.json["replayed"] is False and r.json["compensates"] == "orig"
    assert (repo.path / "src/app.py").read_text() == original and not (repo.path / "new.txt").exists()
    assert repo.count() == count + 1 and repo.git("status", "--porcelain") == ""
    assert repo.git("diff", "HEAD~2", "HEAD") == ""  # the tree is the one before 'orig'
    # The retry replays: no second commit.
    again = revert(repo, "orig", "undo-1")
    assert again.code == 0 and again.json["replayed"] is True and again.json["commit"] == r.json["commit"]
    assert repo.count() == count + 1
    # Linked in status, log and the ledger event.
    st = run_cli("status", "undo-1", "--repo", str(repo.path), "--json")
    assert st.json["receipt"]["identity"]["args"]["compensates"] == "orig"
    assert "compensates orig" in run_cli("status", "undo-1", "--repo", str(repo.path)).out
    log = run_cli("log", "--repo", str(repo.path), "--json").json["events"]
    assert [e["event"] for e in log if e.get("compensates") == "orig"] == ["prepared", "committed", "replayed"]
    assert "(compensates orig)" in run_cli("log", "--repo", str(repo.path)).out
    assert run_cli("verify", "--repo", str(repo.path), "--json", "--jobs", "1").code == 0


def test_a_revert_named_by_call_id_links_the_key(tmp_path: Path) -> None:
    repo, original = applied(tmp_path)
    call_id = run_cli("status", "orig", "--repo", str(repo.path), "--json").json["receipt"]["call_id"]
    r = revert(repo, call_id, "undo-1")
    assert r.code == 0, r.out + r.err
    assert r.json["compensates"] == "orig" and (repo.path / "src/app.py").read_text() == original
    # The same pair named by the key replays.
    assert revert(repo, "orig", "undo-1").json["replayed"] is True


def test_the_same_new_key_for_another_key_is_an_idempotency_conflict(tmp_path: Path) -> None:
    repo, _ = applied(tmp_path)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "other", input=change(repo, 20, "TWENTY"))
    assert r.code == 0
    assert revert(repo, "orig", "undo-1").code == 0
    before = snapshot(repo)
    clash = revert(repo, "other", "undo-1")
    assert clash.code == 3, clash.out + clash.err
    assert clash.json["error"]["type"] == "idempotency_conflict"
    assert snapshot(repo) == before


def test_revert_conflicting_with_later_edits_changes_nothing(tmp_path: Path) -> None:
    repo, _ = applied(tmp_path)
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace("FIVE\n", "five, edited later\n"))
    repo.commit_all("later edit of the same line")
    before = snapshot(repo)
    r = revert(repo, "orig", "undo-1")
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "conflict" and err["effect_status"] == "not_started" and err["retryable"] is False
    assert "src/app.py" in err["message"]
    assert snapshot(repo) == before


def test_revert_after_unrelated_later_edits_lands(tmp_path: Path) -> None:
    repo, _ = applied(tmp_path)
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace("line 25\n", "twenty-five\n"))
    repo.commit_all("later edit elsewhere")
    r = revert(repo, "orig", "undo-1")
    assert r.code == 0, r.out + r.err
    text = (repo.path / "src/app.py").read_text()
    assert "line 5\n" in text and "twenty-five\n" in text


def test_revert_of_an_unknown_key_is_a_clear_error(tmp_path: Path) -> None:
    repo, _ = applied(tmp_path)
    before = snapshot(repo)
    r = revert(repo, "no-such-key", "undo-1")
    assert r.code == 2, r.out + r.err
    assert r.json["error"]["type"] == "not_found" and "no-such-key" in r.json["error"]["message"]
    assert snapshot(repo) == before


def _tree_of(path: Path) -> dict[str, str]:
    """Every file under ``path`` (a store), by content digest."""
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_revert_in_a_clone_sharing_the_store_is_refused(tmp_path: Path) -> None:
    """The undo goes to the repository the change went to: a clone with the same store is another one."""
    a = make_repo(tmp_path / "a", BASE)
    store = tmp_path / "store"
    r = run_cli("apply", "-", "--repo", str(a.path), "--key", "k1", "--store", str(store), "--json",
                input=change(a, 5, "FIVE"))
    assert r.code == 0, r.out + r.err
    subprocess.run(["git", "clone", "-q", str(a.path), str(tmp_path / "b")], check=True)
    b = Repo(tmp_path / "b")
    before = (snapshot(a), snapshot(b), _tree_of(store))
    clash = run_cli("revert", "k1", "--key", "rk1", "--repo", str(b.path), "--store", str(store), "--json")
    assert clash.code == 2, clash.out + clash.err
    err = clash.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started"
    assert str(a.path) in err["message"] and "another one" in err["message"]
    assert (snapshot(a), snapshot(b), _tree_of(store)) == before
    assert "Revert k1" not in b.git("log", "--format=%s")
    # In the repository it changed, the same revert lands.
    ok = run_cli("revert", "k1", "--key", "rk1", "--repo", str(a.path), "--store", str(store), "--json")
    assert ok.code == 0 and ok.json["compensates"] == "k1", ok.out + ok.err
    assert a.git("log", "-1", "--format=%s").strip() == "Revert k1"


def test_a_repository_moved_with_its_store_is_still_the_one_changed(tmp_path: Path) -> None:
    repo, original = applied(tmp_path)
    moved = Repo(tmp_path / "moved")
    repo.path.rename(moved.path)
    r = revert(moved, "orig", "undo-1")
    assert r.code == 0, r.out + r.err
    assert (moved.path / "src/app.py").read_text() == original


def test_revert_of_a_commit_no_longer_on_the_branch_is_refused(tmp_path: Path) -> None:
    repo, _ = applied(tmp_path)
    repo.git("reset", "-q", "--hard", "HEAD~1")
    before = snapshot(repo)
    r = revert(repo, "orig", "undo-1")
    assert r.code == 2, r.out + r.err
    assert "is not on refs/heads/main" in r.json["error"]["message"]
    assert snapshot(repo) == before


def test_revert_of_a_local_change_in_a_repository_now_in_remote_mode_is_refused(tmp_path: Path) -> None:
    repo, _ = applied(tmp_path)
    repo.git("remote", "add", "origin", str(tmp_path / "nowhere.git"))
    repo.git("config", "oncepatch.remote", "origin")
    before = snapshot(repo)
    r = revert(repo, "orig", "undo-1")
    assert r.code == 2, r.out + r.err
    assert "oncepatch.remote" in r.json["error"]["message"]
    assert snapshot(repo) == before


@pytest.mark.parametrize("point", POINTS)
def test_crash_during_revert_then_recover_ends_once_or_none(tmp_path: Path, point: str) -> None:
    repo, original = applied(tmp_path)
    count = repo.count()
    crashed = revert(repo, "orig", "undo-1", env={"ONCEPATCH_CRASH_AT": point})
    assert crashed.code == 137, crashed.out + crashed.err
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    assert repo.count() in (count, count + 1)  # once or none
    again = revert(repo, "orig", "undo-1")
    assert again.code == 0, again.out + again.err
    assert repo.count() == count + 1
    assert (repo.path / "src/app.py").read_text() == original
    subjects = repo.git("log", "--format=%s", f"-{repo.count() - count + 1}").splitlines()
    assert subjects.count("Revert orig") == 1
    assert run_cli("verify", "--repo", str(repo.path), "--json", "--jobs", "1").code == 0


def test_file_write_declares_a_compensation_linked_to_its_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    target = tmp_path / "out.txt"
    write_file(target, b"v1\n", key="w1", store=str(store))
    write_file(target, b"v2\n", key="w2", store=str(store))
    adapter = FileWriteAdapter()
    # Undoing w2 needs the bytes it replaced (the receipt keeps only their digest).
    res = compensate("w2", new_key="undo-w2", adapter=adapter, store=str(store), data=b"v1\n")
    assert res.status == "committed" and not res.replayed and target.read_bytes() == b"v1\n"
    again = compensate("w2", new_key="undo-w2", adapter=adapter, store=str(store), data=b"v1\n")
    assert again.replayed and target.read_bytes() == b"v1\n"
    events = [json.loads(line) for line in (store / "events.jsonl").read_bytes().splitlines()]
    assert {e["event"] for e in events if e.get("compensates") == "w2"} == {"prepared", "committed", "replayed"}
    # Undoing w1 (which created the file) removes it, unless it changed since: then it is left alone.
    from receipts.effects import EffectRejected

    target.write_bytes(b"edited by hand\n")
    with pytest.raises(EffectRejected):
        compensate("w1", new_key="undo-w1", adapter=adapter, store=str(store))
    assert target.read_bytes() == b"edited by hand\n"
    made = tmp_path / "made.txt"
    write_file(made, b"x\n", key="w3", store=str(store))
    assert compensate("w3", new_key="undo-w3", adapter=adapter, store=str(store)).status == "committed"
    assert not made.exists()

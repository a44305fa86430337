"""The Python API (docs/DESIGN.md section 7), in-process: no oncepatch subprocess anywhere here.

`patcher.protocol.apply(repo, patch, ...)` commits, replays, raises
`IdempotencyConflict` for a reused key and the patcher errors for a refusal,
each carrying the envelope fields the CLI prints.  The git CLI is used only to
build and inspect repositories.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import patcher
from cas.errors import EXIT_CONFLICT, EXIT_REJECTED, OncepatchError
from conftest import Repo, snapshot
from patcher.errors import ContextNotFound, DirtyPath, PatchError
from patcher.protocol import ApplyResult, apply
from receipts.errors import IdempotencyConflict

P1 = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"
P2 = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello, world\n"
BAD = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-goodbye\n+hello, world\n"


def key_ref(key: str) -> str:
    return "refs/oncepatch/keys/" + hashlib.sha256(key.encode()).hexdigest()


def test_apply_commits(repo: Repo) -> None:
    base = repo.head()
    res = apply(str(repo.path), P1)
    assert isinstance(res, ApplyResult)
    assert res.status == "committed" and res.replayed is False and res.already_applied is False
    assert res.key == res.call_id and res.call_id.startswith("opc1:")
    assert res.commit == repo.head() and repo.head("HEAD^") == base
    assert res.tree == repo.head("HEAD^{tree}")
    assert (repo.path / "src/util.py").read_text() == "def f():\n    return 2\n"
    assert repo.git("status", "--porcelain") == ""
    assert repo.head(key_ref(res.key)) == res.commit
    [out] = res.outputs
    assert out["path"] == "src/util.py" and out["op"] == "modify"
    assert out["blob"] == repo.head("HEAD:src/util.py")
    assert out["sha256"] == hashlib.sha256(b"def f():\n    return 2\n").hexdigest()
    receipt = json.loads(Path(res.receipt).read_bytes())
    assert receipt["status"] == "committed" and receipt["commit"] == res.commit
    doc = res.to_json()
    assert doc["ok"] is True and doc["commit"] == res.commit and doc["receipt"] == res.receipt


def test_replay_in_process(repo: Repo) -> None:
    first = apply(str(repo.path), P1)
    data = Path(first.receipt).read_bytes()
    again = apply(str(repo.path), P1.decode())  # str and bytes of the same patch are the same intent
    assert again.replayed is True
    assert (again.key, again.commit, again.tree, again.outputs) == (first.key, first.commit, first.tree, first.outputs)
    assert repo.count() == 2
    assert Path(first.receipt).read_bytes() == data


def test_key_branch_message_attempt_and_store(repo: Repo, tmp_path: Path) -> None:
    repo.git("branch", "other")
    store = tmp_path / "elsewhere"
    res = apply(str(repo.path), P1, key="fix-42", branch="other", message="Fix f", store=str(store))
    assert res.key == "fix-42" and res.call_id != "fix-42"
    assert repo.head("refs/heads/other") == res.commit and repo.count("main") == 1
    assert repo.git("log", "-1", "--format=%s", "other").strip() == "Fix f"
    assert repo.head(key_ref("fix-42")) == res.commit
    assert Path(res.receipt).is_relative_to(store) and not repo.store.exists()
    # A new attempt is a new call with its own id; the change is already on 'other'.
    res2 = apply(str(repo.path), P1, branch="other", attempt=2, store=str(store))
    assert res2.call_id != res.call_id and res2.already_applied is True
    assert res2.commit == res.commit and repo.count("other") == 2


def test_conflict_raises_idempotency_conflict(repo: Repo) -> None:
    first = apply(str(repo.path), P1, key="ticket-7")
    before = snapshot(repo)
    with pytest.raises(IdempotencyConflict) as info:
        apply(str(repo.path), P2, key="ticket-7")
    exc = info.value
    assert isinstance(exc, OncepatchError)
    assert exc.exit_code == EXIT_CONFLICT == 3
    env = exc.envelope()
    assert env["type"] == "idempotency_conflict"
    assert env["key"] == "ticket-7"
    assert env["retryable"] is False
    assert env["effect_status"] == "not_started"
    assert env["next_action"] == "new_key"
    assert env["existing_call_id"] == first.call_id
    assert env["message"] and "ticket-7" in env["message"]
    assert snapshot(repo) == before


def test_rejection_raises_context_not_found(repo: Repo) -> None:
    before = snapshot(repo)
    with pytest.raises(ContextNotFound) as info:
        apply(str(repo.path), BAD)
    exc = info.value
    assert isinstance(exc, PatchError) and isinstance(exc, OncepatchError)
    assert exc.exit_code == EXIT_REJECTED == 4
    env = exc.envelope()
    assert env["type"] == "context_not_found"
    assert env["retryable"] is False and env["effect_status"] == "not_started"
    assert env["next_action"] == "fix_input"
    assert env["key"].startswith("opc1:") and env["path"] == "README"
    assert snapshot(repo) == before


def test_rejection_raises_dirty_path(repo: Repo) -> None:
    repo.write("src/util.py", "def f():\n    return 1\n# unsaved\n")
    before = snapshot(repo)
    with pytest.raises(DirtyPath) as info:
        apply(str(repo.path), P1, key="k")
    env = info.value.envelope()
    assert env["type"] == "dirty_path" and env["retryable"] is True and env["next_action"] == "retry"
    assert env["key"] == "k" and info.value.exit_code == 4
    assert snapshot(repo) == before


def test_public_api_is_exported_from_patcher(repo: Repo) -> None:
    """docs/DESIGN.md section 7 names `patcher.apply`."""
    assert patcher.apply is apply
    res = patcher.apply(str(repo.path), P2)
    assert res.status == "committed" and (repo.path / "README").read_text() == "hello, world\n"


def test_packed_repository_objects_already_packed_are_not_written_again(repo: Repo) -> None:
    """A clone-like repository (everything packed): a change back to content the pack holds writes no blob."""
    first = apply(str(repo.path), P2)
    repo.git("gc", "-q", "--prune=now")  # every object packed, no loose ones left
    objects = repo.path / ".git" / "objects"
    assert not [p for p in objects.glob("??/*")]
    back = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello, world\n+hello\n"
    res = apply(str(repo.path), back, key="back")
    loose = sorted(p.parent.name + p.name for p in objects.glob("??/*"))
    old_blob = repo.git("rev-parse", f"{first.commit}~1:README").strip()
    assert res.outputs[0]["blob"] == old_blob and old_blob not in loose  # in the pack already
    assert res.tree == repo.git("rev-parse", f"{first.commit}~1^{{tree}}").strip()  # the old tree: packed too
    assert loose == [res.commit]  # only the new commit was written
    # no tmp file of libgit2 left; the process's temporary object folder (kept while it lives) holds no file
    assert not [p for p in objects.rglob("tmp_*") if p.is_file()]
    assert not [p for d in objects.glob("tmp_objdir-oncepatch-*") for p in d.rglob("*") if not p.is_dir()]
    repo.git("fsck", "--strict", "--no-dangling")
    assert repo.git("cat-file", "-p", f"{res.commit}:README") == "hello\n"


def test_a_str_patch_with_a_lone_surrogate_is_a_usage_error(tmp_path: Path) -> None:
    from cas.errors import UsageError
    from conftest import make_repo, snapshot
    from patcher.protocol import apply as api_apply

    repo = make_repo(tmp_path / "repo")
    before = snapshot(repo)
    with pytest.raises(UsageError, match="not valid Unicode"):
        api_apply(str(repo.path), "--- /dev/null\n+++ b/s.txt\n@@ -0,0 +1 @@\n+bad \ud800 x\n", key="sur")
    assert snapshot(repo) == before


@pytest.mark.parametrize("patch", [None, 5, 10**9, ["--- a"]])
def test_a_patch_that_is_not_str_or_bytes_is_a_usage_error(tmp_path: Path, patch: object) -> None:
    """bytes(5) is five NUL bytes and bytes(10**9) a gigabyte: neither is read as a patch."""
    from cas.errors import UsageError
    from conftest import make_repo

    repo = make_repo(tmp_path / "repo")
    before = snapshot(repo)
    with pytest.raises(UsageError, match="must be its content as str or bytes"):
        apply(str(repo.path), patch, key="typed")  # type: ignore[arg-type]
    assert snapshot(repo) == before

"""The Python API (`patcher.apply`, `patcher.Client`, `receipts.status`) in-process: no CLI, no child process.

The same outcomes as the CLI tests — commit, replay, idempotency conflict,
rejection, a branch that moved under the call — checked against git and the
receipt, plus what only a long-lived caller has: the repository stays open
between calls, and one client serves many threads.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import patcher
import receipts
from cas.errors import EXIT_CONFLICT, EXIT_REJECTED, OncepatchError
from conftest import Repo, snapshot
from patcher.errors import Conflict, ContextNotFound
from receipts.errors import IdempotencyConflict, ReceiptNotFound

EDIT_LINE3 = """\
--- a/src/app.py
+++ b/src/app.py
@@ -1,5 +1,5 @@
 line 1
 line 2
-line 3
+line three
 line 4
 line 5
"""

EDIT_LINE3_OTHER = EDIT_LINE3.replace("+line three", "+line THREE")

STALE_CONTEXT = """\
--- a/src/app.py
+++ b/src/app.py
@@ -1,3 +1,3 @@
 not in the file
-line 2
+line two
 line 3
"""


def add_file(name: str, text: str) -> str:
    return f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1 @@\n+{text}\n"


ENVELOPE_FIELDS = {"type", "message", "retryable", "effect_status", "key", "next_action"}


# -- exports ---------------------------------------------------------------------------------


def test_public_names_are_exported() -> None:
    from patcher.protocol import ApplyResult, apply

    assert patcher.apply is apply
    assert patcher.ApplyResult is ApplyResult
    assert isinstance(patcher.Client, type)
    assert callable(receipts.status)
    assert {"apply", "ApplyResult", "Client"} <= set(patcher.__all__)
    assert "status" in receipts.__all__


# -- the outcomes ------------------------------------------------------------------------------


def test_apply_commits_once_and_a_repeat_replays(repo: Repo) -> None:
    before = repo.count()
    with patcher.Client(repo.path) as client:
        first = client.apply(EDIT_LINE3, key="fix/line-3")
        assert first.status == "committed" and not first.replayed
        assert repo.head("main") == first.commit
        assert (repo.path / "src/app.py").read_text().splitlines()[2] == "line three"
        assert repo.git("status", "--porcelain") == ""
        second = client.apply(EDIT_LINE3, key="fix/line-3")
    assert second.replayed and second.commit == first.commit and second.receipt == first.receipt
    assert repo.count() == before + 1
    # The one-shot function sees the same receipt.
    third = patcher.apply(str(repo.path), EDIT_LINE3, key="fix/line-3")
    assert third.replayed and third.commit == first.commit
    receipt = receipts.status("fix/line-3", repo=repo.path)
    assert receipt.status == "committed" and receipt.commit == first.commit
    assert receipts.status(first.call_id, repo=repo.path).key == "fix/line-3"
    assert repo.git("log", "-1", "--format=%B", first.commit).count("Oncepatch-Call: " + first.call_id) == 1


def test_same_key_with_another_patch_is_an_idempotency_conflict(repo: Repo) -> None:
    with patcher.Client(repo.path) as client:
        client.apply(EDIT_LINE3, key="k")
        head = repo.head()
        with pytest.raises(IdempotencyConflict) as info:
            client.apply(EDIT_LINE3_OTHER, key="k")
    err = info.value
    assert err.exit_code == EXIT_CONFLICT
    env = err.envelope()
    assert ENVELOPE_FIELDS <= set(env) and env["type"] == "idempotency_conflict" and env["key"] == "k"
    assert env["retryable"] is False and env["next_action"] == "new_key"
    assert repo.head() == head


def test_a_patch_that_does_not_apply_is_rejected_and_changes_nothing(repo: Repo) -> None:
    before = snapshot(repo)
    with patcher.Client(repo.path) as client, pytest.raises(ContextNotFound) as info:
        client.apply(STALE_CONTEXT, key="stale")
    err = info.value
    assert isinstance(err, OncepatchError) and err.exit_code == EXIT_REJECTED
    assert err.envelope()["type"] == "context_not_found"
    assert err.effect_status == "not_started" and err.key == "stale"
    assert snapshot(repo) == before  # no commit, no receipt, no lock file
    with pytest.raises(ReceiptNotFound):
        receipts.status("stale", repo=repo.path)


def test_branch_moved_under_the_call_to_a_conflicting_change_is_a_retryable_conflict(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone commits the same lines between staging and the compare-and-swap: rejected, never forced."""
    from cas.objects import GitStore, TreeEntry

    real_cas = GitStore.compare_and_swap
    moved: list[str] = []

    def move_first(self: GitStore, ref: str, expected: str | None, new: str, message: str,
                   *args: Any, **kw: Any) -> None:
        if not moved:  # another writer wins the race, in-process, through libgit2
            tip = self.resolve(ref)
            assert tip is not None
            text = "".join(f"line {i}\n" for i in range(1, 21)).replace("line 3\n", "line 3 (theirs)\n")
            blob = self.write_blob(text.encode())
            tree = self.edit_tree(self.commit_tree(tip), {"src/app.py": TreeEntry(blob, 0o100644)})
            theirs = self.create_commit(tree, [tip], "theirs")
            real_cas(self, ref, tip, theirs, "theirs")
            moved.append(theirs)
        real_cas(self, ref, expected, new, message, *args, **kw)

    monkeypatch.setattr(GitStore, "compare_and_swap", move_first)
    with patcher.Client(repo.path) as client, pytest.raises(Conflict) as info:
        client.apply(EDIT_LINE3, key="racy")
    env = info.value.envelope()
    assert env["type"] == "conflict" and env["retryable"] is True and env["effect_status"] == "not_applied"
    assert repo.head("main") == moved[0]  # theirs stays; ours never landed
    receipt = receipts.status("racy", repo=repo.path)
    assert receipt.status == "rejected" and receipt.retryable is True


# -- long-lived ------------------------------------------------------------------------------------


def test_client_keeps_the_repository_open_between_calls(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    from cas import objects

    opened: list[str] = []
    real_init = objects.GitStore.__init__

    def counting_init(self: Any, path: str) -> None:
        opened.append(path)
        real_init(self, path)

    monkeypatch.setattr(objects.GitStore, "__init__", counting_init)
    with patcher.Client(repo.path) as client:
        for i in range(5):
            client.apply(add_file(f"kept/{i}.txt", str(i)), key=f"kept-{i}")
        assert len(opened) == 1
        # A one-shot call opens its own (and the client's stays the one it had).
        patcher.apply(str(repo.path), add_file("kept/x.txt", "x"), key="kept-x")
        assert len(opened) > 1
        n = len(opened)
        client.apply(add_file("kept/z.txt", "z"), key="kept-z")
        assert len(opened) == n
    with pytest.raises(RuntimeError):
        client.apply(add_file("kept/y.txt", "y"), key="after-close")


def test_one_client_serves_many_threads(repo: Repo) -> None:
    """Distinct changes from 8 threads all land, each once; one key raced by 8 threads lands once."""
    before = repo.count()
    errors: list[BaseException] = []
    results: dict[str, Any] = {}
    with patcher.Client(repo.path, lock_timeout=60) as client:

        def work(i: int) -> None:
            try:
                results[f"t{i}"] = client.apply(add_file(f"threads/{i}.txt", f"thread {i}"), key=f"thread-{i}")
                results[f"same{i}"] = client.apply(add_file("threads/same.txt", "same"), key="same-for-all")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(client._caches) == 8  # one open repository per thread
    assert repo.count() == before + 9
    same = [results[f"same{i}"] for i in range(8)]
    assert sum(not r.replayed for r in same) == 1 and len({r.commit for r in same}) == 1
    assert repo.git("log", "--format=%H", "main").split() == repo.git("rev-list", "--first-parent", "main").split()
    for i in range(8):
        assert (repo.path / f"threads/{i}.txt").read_text() == f"thread {i}\n"
    assert repo.git("status", "--porcelain") == ""
    repo.git("fsck", "--strict")


def test_client_verify_and_recover_cover_git_and_generic_receipts(repo: Repo, tmp_path: Path) -> None:
    with patcher.Client(repo.path) as client:
        client.apply(EDIT_LINE3, key="v1")
        out = tmp_path / "note.txt"
        receipts.write_file(out, b"note\n", key="file-1", store=client.store_root())
        report = client.verify()
        assert report.ok and report.receipts == 2, report.to_json()
        rec = client.recover()
        assert not rec.rows and not rec.corrupt

"""A committed receipt is believed only where git agrees (issue 25, docs/SECURITY.md).

The receipt's digests prove only that nobody edited it without re-sealing it,
and anyone who can write the store can re-seal (the digest fields are plain
SHA-256: recomputed here the way ``receipts/receipt.py`` does).  So a replay,
``status``, ``verify`` and ``recover`` each ask git: a re-sealed receipt that
names a commit off its branch, a commit that does not exist, another call's
commit, or forged output digests is ``corrupt_receipt`` (exit 6), and nothing
is answered from it or settled of it.  Legitimate histories — the branch moved
on, gc and packed refs, a linked worktree, an edit already in the branch, a
branch reset since — keep replaying and verifying.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot
from patcher.protocol import apply

PATCH_ONE = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"
PATCH_TWO = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello, world\n"


def reseal(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` with its digest recomputed: what anyone who can write the store can do."""
    body = {k: v for k, v in doc.items() if k != "receipt_sha256"}
    doc = dict(body, receipt_sha256=hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest())
    path.write_bytes(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n")


class Store:
    """A repository with two committed calls, keys ``one`` and ``two``."""

    def __init__(self, root: Path) -> None:
        self.repo = make_repo(root / "repo", {"README": "hello\n", "src/util.py": "def f():\n    return 1\n"})
        self.patches = {"one": root / "one.patch", "two": root / "two.patch"}
        self.patches["one"].write_bytes(PATCH_ONE)
        self.patches["two"].write_bytes(PATCH_TWO)
        self.results = {k: apply(str(self.repo.path), p.read_bytes(), key=k).to_json()
                        for k, p in self.patches.items()}
        self.path = Path(self.results["one"]["receipt"])
        self.doc: dict[str, Any] = json.loads(self.path.read_bytes())

    def receipt(self, key: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(Path(self.results[key]["receipt"]).read_bytes())
        return doc

    def replay(self, key: str = "one") -> Any:
        return run_cli("apply", str(self.patches[key]), "--key", key, "--repo", str(self.repo.path), "--json")

    def cli(self, *args: str) -> Any:
        return run_cli(*args, "--repo", str(self.repo.path), "--json")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path)


def _off_branch(s: Store, doc: dict[str, Any]) -> str:
    """The same tree and this call's own trailer, in a commit that was never on the branch."""
    message = s.repo.git("log", "-1", "--format=%B", doc["commit"])
    parent = s.repo.head("main~2")
    off = s.repo.git("commit-tree", doc["tree"], "-p", parent, input=message.encode()).strip()
    doc["commit"] = off
    return "not on branch 'refs/heads/main'"


def _missing(s: Store, doc: dict[str, Any]) -> str:
    doc["commit"] = "0123456789abcdef0123456789abcdef01234567"
    return "does not exist"


def _forged_outputs(s: Store, doc: dict[str, Any]) -> str:
    out = doc["outputs"][0]
    out["sha256"] = hashlib.sha256(b"def f():\n    return 42\n").hexdigest()
    return "sha256 differs from the receipt's output digest"


def _another_calls_commit(s: Store, doc: dict[str, Any]) -> str:
    two = s.receipt("two")
    doc.update(commit=two["commit"], tree=two["tree"], outputs=two["outputs"])
    return "does not carry this call's trailer"


FORGERIES: dict[str, Callable[[Store, dict[str, Any]], str]] = {
    "off_branch": _off_branch,
    "missing_commit": _missing,
    "forged_outputs": _forged_outputs,
    "another_calls_commit": _another_calls_commit,
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_resealed_receipt_git_contradicts_is_corrupt_everywhere(store: Store, forgery: str) -> None:
    doc = json.loads(json.dumps(store.doc))
    reason = FORGERIES[forgery](store, doc)
    reseal(store.path, doc)
    before = snapshot(store.repo)

    # The replay: corrupt, nothing answered from the receipt, nothing written (not even a ledger note).
    r = store.replay()
    assert r.code == 6, r.out + r.err
    assert r.json["ok"] is False and set(r.json) == {"ok", "error"}
    err = r.json["error"]
    assert err["type"] == "corrupt_receipt" and err["effect_status"] == "unknown"
    assert err["path"] == str(store.path)
    assert "commit" not in err and "outputs" not in err
    if forgery != "forged_outputs":  # a replay's cheap form: the key ref is not at the named commit
        assert "key ref" in err["reason"] or reason in err["reason"], err["reason"]
    else:
        assert reason in err["reason"], err["reason"]
    assert snapshot(store.repo) == before

    r = store.cli("status", "one")
    assert r.code == 6, r.out + r.err
    assert r.json["error"]["type"] == "corrupt_receipt" and reason in r.json["error"]["reason"]
    assert "receipt" not in r.json

    r = store.cli("verify")
    assert r.code == 6, r.out + r.err
    named = [f for f in r.json["failures"] if f["receipt"] == str(store.path)]
    assert named and any(reason in f["reason"] for f in named), r.json
    assert all(f["receipt"] == str(store.path) for f in r.json["failures"]), r.json  # receipt two is fine

    r = store.cli("recover")
    assert r.code == 6, r.out + r.err
    assert [c["path"] for c in r.json["corrupt"]] == [str(store.path)]
    assert reason in r.json["corrupt"][0]["reason"]
    assert r.json["rows"] == [] and r.json["ledger_repaired"] == []
    r = run_cli("recover", "--repo", str(store.repo.path))
    assert r.code == 6 and "nothing to do" not in r.out and f"corrupt {store.path}" in r.out, r.out
    assert snapshot(store.repo) == before
    assert store.repo.count() == 3

    # The other key is untouched by all this.
    assert store.replay("two").code == 0


def test_an_already_applied_receipt_must_name_a_commit_on_its_branch(store: Store, tmp_path: Path) -> None:
    """No new commit, no trailer, no key ref: the branch and the outputs are what git can say."""
    res = apply(str(store.repo.path), PATCH_ONE, key="again")
    assert res.already_applied and res.commit == store.repo.head()
    path = Path(res.receipt)
    patch = tmp_path / "again.patch"
    patch.write_bytes(PATCH_ONE)
    args = ("--key", "again", "--repo", str(store.repo.path), "--json")
    assert run_cli("apply", str(patch), *args).code == 0
    assert store.cli("verify").code == 0

    doc = json.loads(path.read_bytes())
    _off_branch(store, doc)
    reseal(path, doc)
    before = snapshot(store.repo)
    r = run_cli("apply", str(patch), *args)
    assert r.code == 6 and r.json["error"]["type"] == "corrupt_receipt", r.out + r.err
    assert "not on branch 'refs/heads/main'" in r.json["error"]["reason"]
    assert "commit" not in r.json["error"]
    r = store.cli("status", "again")
    assert r.code == 6 and "not on branch" in r.json["error"]["reason"]
    assert store.cli("verify").code == 6
    assert store.cli("recover").code == 6
    assert snapshot(store.repo) == before


def test_a_deleted_store_with_key_refs_fails_verify(store: Store) -> None:
    refs = store.repo.git("for-each-ref", "--format=%(refname)", "refs/oncepatch/keys/").split()
    assert len(refs) == 2
    shutil.rmtree(store.repo.store)
    r = store.cli("verify")
    assert r.code == 6, r.out + r.err
    assert r.json["receipts"] == 0 and r.json["ok"] is False
    reasons = " ".join(f["reason"] for f in r.json["failures"])
    for ref in refs:
        assert ref in reasons
    r = run_cli("verify", "--repo", str(store.repo.path))
    assert r.code == 6 and "ok:" not in r.out and refs[0] in r.out


def test_an_emptied_store_fails_verify_too(store: Store) -> None:
    """The receipts gone, the ledger kept: each key is named once."""
    shutil.rmtree(store.repo.store / "receipts")
    r = store.cli("verify")
    assert r.code == 6, r.out + r.err
    assert len(r.json["failures"]) == 2, r.json


def test_a_key_ref_whose_receipt_says_rejected_fails_verify(store: Store) -> None:
    doc = json.loads(json.dumps(store.doc))
    doc.update(status="rejected", retryable=False, commit=None, tree=None, outputs=[],
               error={"type": "conflict", "message": "m", "retryable": False, "effect_status": "not_applied",
                      "key": "one", "next_action": "none"})
    reseal(store.path, doc)
    r = store.cli("verify")
    assert r.code == 6
    assert any("never committed" in f["reason"] for f in r.json["failures"]), r.json


# -- legitimate histories keep replaying --------------------------------------------------


def _all_agree(s: Store, *keys: str) -> None:
    for key in keys or ("one", "two"):
        r = s.replay(key)
        assert r.code == 0 and r.json["replayed"] is True, r.out + r.err
        assert r.json["commit"] == s.results[key]["commit"]
        r = s.cli("status", key)
        assert r.code == 0, r.out + r.err
    r = s.cli("verify")
    assert r.code == 0, r.out + r.err
    r = run_cli("recover", "--repo", str(s.repo.path))
    assert r.code == 0 and "nothing to do" in r.out, r.out + r.err


def test_after_the_branch_moved_on(store: Store) -> None:
    store.repo.write("other.txt", "x\n")
    store.repo.commit_all("a person's commit")
    _all_agree(store)


def test_after_gc_and_packed_refs(store: Store) -> None:
    store.repo.git("pack-refs", "--all", "--prune")
    store.repo.git("gc", "--prune=now", "-q")
    assert not (store.repo.path / ".git" / "refs" / "oncepatch" / "keys").exists() or not any(
        (store.repo.path / ".git" / "refs" / "oncepatch" / "keys").iterdir())
    _all_agree(store)


def test_after_a_reset_that_left_the_commit_only_in_the_reflog(store: Store) -> None:
    """The key ref keeps the commit; the branch's reflog shows it was there (decided: still believed)."""
    store.repo.git("reset", "-q", "--hard", "HEAD~2")
    assert store.repo.count() == 1
    _all_agree(store)


def test_after_the_branch_was_deleted(store: Store) -> None:
    """Git deletes the reflog with the branch; the key ref at the commit is the evidence left (decided)."""
    store.repo.git("checkout", "-q", "-b", "other")
    store.repo.git("branch", "-D", "main")
    for key in ("one", "two"):
        assert store.cli("status", key).code == 0
    assert store.cli("verify").code == 0


def test_after_an_edit_already_in_the_branch(store: Store) -> None:
    res = apply(str(store.repo.path), PATCH_TWO, key="three")
    assert res.already_applied
    store.patches["three"] = store.patches["two"]
    store.results["three"] = res.to_json()
    store.repo.write("other.txt", "x\n")
    store.repo.commit_all("a person's commit")
    _all_agree(store, "one", "two", "three")


def test_in_a_linked_worktree(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    repo.git("branch", "side")
    linked = tmp_path / "linked"
    repo.git("worktree", "add", "-q", str(linked), "side")
    patch = tmp_path / "p.patch"
    patch.write_bytes(PATCH_TWO)
    first = run_cli("apply", str(patch), "--key", "k", "--repo", str(linked), "--json")
    assert first.code == 0, first.out + first.err
    again = run_cli("apply", str(patch), "--key", "k", "--repo", str(linked), "--json")
    assert again.code == 0 and again.json["replayed"] is True and again.json["commit"] == first.json["commit"]
    for where in (linked, repo.path):
        assert run_cli("status", "k", "--repo", str(where)).code == 0
        r = run_cli("verify", "--repo", str(where), "--json")
        assert r.code == 0, r.out + r.err
    Repo(linked).git("reset", "-q", "--hard", "HEAD~1")
    assert run_cli("apply", str(patch), "--key", "k", "--repo", str(linked), "--json").code == 0
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


@pytest.mark.parametrize("forgery", ["forged_outputs", "off_branch"])
def test_recover_with_workers_asks_git_too(store: Store, forgery: str) -> None:
    """The first look split over worker processes: each asks git about the receipts it looks at."""
    from patcher.cli.recovery import _adapters
    from receipts.recovery import recover
    from receipts.store import ReceiptStore

    rstore = ReceiptStore(str(store.repo.store))
    adapters = _adapters(rstore, read_only=True)
    for jobs in (1, 2):
        report = recover(rstore, adapters, dry_run=True, jobs=jobs, parallel_min=1,
                         adapters_factory="patcher.cli.recovery:_adapters")
        assert report.corrupt == [] and report.rows == [], report.to_json()
    doc = json.loads(json.dumps(store.doc))
    reason = FORGERIES[forgery](store, doc)
    reseal(store.path, doc)
    before = snapshot(store.repo)
    for jobs in (1, 2):
        report = recover(rstore, _adapters(rstore), jobs=jobs, parallel_min=1,
                         adapters_factory="patcher.cli.recovery:_adapters")
        assert [c["path"] for c in report.corrupt] == [str(store.path)], report.to_json()
        assert reason in report.corrupt[0]["reason"]
        assert report.rows == [] and report.ledger_repaired == []
    assert snapshot(store.repo) == before


def test_a_branch_at_a_missing_commit_is_a_verification_failure_not_an_internal_error(store: Store) -> None:
    """A pruned tip (an unsafe 'gc --prune=now' beside a call): each receipt fails, verify does not crash."""
    store.repo.git("pack-refs", "--all")
    (store.repo.path / ".git" / "refs" / "heads" / "main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    r = store.cli("verify")
    assert r.code == 0, r.out + r.err  # the reflog still shows both commits on the branch
    (store.repo.path / ".git" / "logs" / "refs" / "heads" / "main").unlink()
    r = store.cli("verify")
    assert r.code == 6, r.out + r.err
    assert any("not on branch 'refs/heads/main'" in f["reason"] for f in r.json["failures"]), r.json

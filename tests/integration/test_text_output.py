"""Text mode shows what ``--json`` has (issue 31): a failed hunk's closest match, a failed check's output,
what an idempotency conflict differs in and that the fix is a new key, the way out of a corrupt receipt."""

from __future__ import annotations

from pathlib import Path

from conftest import Repo, make_repo, run_cli

from receipts.store import ReceiptStore

BASE = {"m.py": "def f():\n    return 1\n\ndef g():\n    return 2\n"}
STALE = b"--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 10\n+    return 11\n"
BROKEN = b"--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return (\n"
GOOD = b"--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 3\n"


def _repo(tmp_path: Path) -> Repo:
    return make_repo(tmp_path / "repo", BASE)


def _apply(repo: Repo, patch: bytes, *args: str) -> object:
    return run_cli("apply", "-", "--repo", str(repo.path), *args, input=patch)


def test_a_hunk_that_does_not_apply_shows_its_closest_match_in_text(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    r = _apply(repo, STALE)
    assert r.code == 4  # type: ignore[attr-defined]
    err = r.err  # type: ignore[attr-defined]
    assert "closest match at line 1 of 'm.py'" in err
    assert "  -    return 10\n" in err and "  +    return 1\n" in err


def test_a_failed_check_shows_its_output_in_text(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    for _ in range(2):  # the call, then the replay of its final rejection
        r = _apply(repo, BROKEN, "--key", "k", "--check", "python3 -m py_compile m.py")
        assert r.code == 4  # type: ignore[attr-defined]
        assert "check output" in r.err and "SyntaxError" in r.err, r.err  # type: ignore[attr-defined]


def test_an_idempotency_conflict_says_what_differs_and_that_the_fix_is_a_new_key(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert _apply(repo, GOOD, "--key", "k").code == 0  # type: ignore[attr-defined]
    r = _apply(repo, BROKEN, "--key", "k")
    assert r.code == 3  # type: ignore[attr-defined]
    assert "args.patch_sha256 differs" in r.err and "(next: new_key)" in r.err  # type: ignore[attr-defined]
    assert "give this one a new --key" in r.err  # type: ignore[attr-defined]
    other = run_cli("apply", "-", "--repo", str(repo.path), "--key", "k", "--branch", "side", input=GOOD)
    assert "args.branch" in other.err, other.err


def test_a_corrupt_receipt_names_recover_and_quarantine(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert _apply(repo, GOOD, "--key", "k").code == 0  # type: ignore[attr-defined]
    Path(ReceiptStore(str(repo.store)).receipt_path("k")).write_bytes(b"{}\n")
    r = run_cli("status", "k", "--repo", str(repo.path))
    assert r.code == 6 and "'oncepatch quarantine k'" in r.err and "oncepatch recover" in r.err, r.err

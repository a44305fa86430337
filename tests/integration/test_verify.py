"""``oncepatch verify`` catches each way a store can stop telling the truth (docs/DESIGN.md section 5).

Two real calls commit two receipts (and four ledger lines); then one thing is
broken per case and ``verify`` must exit 6 with a line naming that receipt (or
the ledger) and the reason, and the same failure in ``--json``'s list.
Tampered receipts that should still *parse* are rewritten through the
receipt helpers (``parse_receipt`` → ``dataclasses.replace`` →
``receipt_bytes``), which recompute ``receipt_sha256``: only the deeper
checks (commit, blobs, ledger) can catch them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli

from receipts.receipt import parse_receipt, receipt_bytes
from receipts.store import ReceiptStore

BASE: dict[str, str | bytes] = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 21))}


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    """A repo where keys ``one`` and ``two`` have each committed one change."""
    repo = make_repo(tmp_path / "repo", BASE)
    for key, line in (("one", 3), ("two", 15)):
        head = repo.head()
        repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace(f"line {line}\n", f"{key}\n"))
        pf = tmp_path / f"{key}.diff"
        pf.write_bytes(repo.git("diff", "--full-index").encode())
        repo.git("reset", "-q", "--hard", head)
        r = run_cli("apply", "--repo", str(repo.path), "--key", key, "--json", str(pf))
        assert r.code == 0, r.out + r.err
    return repo


def receipt_path(repo: Repo, key: str) -> Path:
    return Path(ReceiptStore(str(repo.store)).receipt_path(key))


def rewrite(repo: Repo, key: str, **changes: Any) -> Path:
    """Rewrite ``key``'s receipt with ``changes``; it still parses (digest recomputed)."""
    path = receipt_path(repo, key)
    r = parse_receipt(path.read_bytes(), path=str(path))
    path.write_bytes(receipt_bytes(replace(r, **changes)))
    parse_receipt(path.read_bytes(), path=str(path))  # still verifies on read
    return path


def verify(repo: Repo, *extra: str) -> tuple[Any, Any]:
    text = run_cli("verify", "--repo", str(repo.path), *extra)
    js = run_cli("verify", "--repo", str(repo.path), "--json", *extra)
    return text, js


# -- the ways to break it ---------------------------------------------------------------------------


def edited_field(repo: Repo) -> tuple[Path, str]:
    path = receipt_path(repo, "one")
    path.write_bytes(path.read_bytes().replace(b'"status": "committed"', b'"status": "rejected"'))
    return path, "corrupt: receipt_sha256 does not match"


def wrong_output_digest(repo: Repo) -> tuple[Path, str]:
    r = ReceiptStore(str(repo.store)).read("one")
    outputs = tuple({**o, "sha256": "0" * 64} for o in r.outputs)
    return rewrite(repo, "one", outputs=outputs), "'src/app.py' sha256 differs from the receipt's output digest"


def missing_commit(repo: Repo) -> tuple[Path, str]:
    gone = "1234567890abcdef1234567890abcdef12345678"
    return rewrite(repo, "two", commit=gone), f"commit {gone} does not exist"


def _ledger(repo: Repo) -> tuple[Path, list[bytes]]:
    path = repo.store / "events.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 4
    return path, lines


def deleted_ledger_line(repo: Repo) -> tuple[Path, str]:
    path, lines = _ledger(repo)
    del lines[1]
    path.write_bytes(b"".join(lines))
    return path, "ledger line 2: hash chain broken"


def reordered_ledger_lines(repo: Repo) -> tuple[Path, str]:
    path, lines = _ledger(repo)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_bytes(b"".join(lines))
    return path, "ledger line 2: hash chain broken"


def unresolved_prepared(repo: Repo) -> tuple[Path, str]:
    pf = repo.path.parent / "three.diff"
    head = repo.head()
    repo.write("README", "hello there\n")
    pf.write_bytes(repo.git("diff", "--full-index").encode())
    repo.git("reset", "-q", "--hard", head)
    r = run_cli("apply", "--repo", str(repo.path), "--key", "three", "--json", str(pf),
                env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    assert r.code == 137
    # Its call is gone (the key lock is free): a failure at once, even within the default grace.
    assert run_cli("verify", "--repo", str(repo.path)).code == 6
    return receipt_path(repo, "three"), "unresolved prepared receipt"


def deleted_receipt(repo: Repo) -> tuple[Path, str]:
    path = receipt_path(repo, "one")
    path.unlink()  # the ledger still records its receipt, its key ref still names the commit
    return path, "the ledger records this key's receipt, but its file is missing"


def dangling_symlink(repo: Repo) -> tuple[Path, str]:
    path = receipt_path(repo, "one")
    path.unlink()
    path.symlink_to(path.parent / "nowhere.json")  # was skipped as if the file were gone
    return path, "a symlink, not a receipt file"


def fifo_receipt(repo: Repo) -> tuple[Path, str]:
    path = receipt_path(repo, "one")
    path.unlink()
    os.mkfifo(path)  # every command used to hang reading it
    return path, "not a regular file"


def folder_receipt(repo: Repo) -> tuple[Path, str]:
    path = receipt_path(repo, "one")
    path.unlink()
    path.mkdir()  # was an internal error (exit 1) with a traceback
    return path, "not a regular file"


def wrong_shard(repo: Repo) -> tuple[Path, str]:
    path = receipt_path(repo, "one")
    elsewhere = path.parent.parent / ("00" if path.parent.name != "00" else "01") / path.name
    elsewhere.parent.mkdir(exist_ok=True)
    path.rename(elsewhere)  # was found by neither verify (it passed) nor status
    return elsewhere, "in the wrong folder"


def resealed_bad_output(repo: Repo) -> tuple[Path, str]:
    r = ReceiptStore(str(repo.store)).read("one")
    outputs = tuple({**o, "mode": "x"} for o in r.outputs)
    path = receipt_path(repo, "one")
    path.write_bytes(receipt_bytes(replace(r, outputs=outputs)))  # re-sealed: its digest matches
    return path, "output 1: field 'mode' has the wrong type"


def ledger_folder(repo: Repo) -> tuple[Path, str]:
    path = repo.store / "events.jsonl"
    path.unlink()
    path.mkdir()  # was an internal error (exit 1)
    return path, "is not a regular file"


def ledger_fifo(repo: Repo) -> tuple[Path, str]:
    path = repo.store / "events.jsonl"
    path.unlink()
    os.mkfifo(path)  # reading it would block for ever
    return path, "is not a regular file"


CASES: dict[str, Callable[[Repo], tuple[Path, str]]] = {
    "ledger_folder": ledger_folder,
    "ledger_fifo": ledger_fifo,
    "dangling_symlink": dangling_symlink,
    "fifo_receipt": fifo_receipt,
    "folder_receipt": folder_receipt,
    "wrong_shard": wrong_shard,
    "resealed_bad_output": resealed_bad_output,
    "deleted_receipt": deleted_receipt,
    "edited_field": edited_field,
    "wrong_output_digest": wrong_output_digest,
    "missing_commit": missing_commit,
    "deleted_ledger_line": deleted_ledger_line,
    "reordered_ledger_lines": reordered_ledger_lines,
    "unresolved_prepared": unresolved_prepared,
}


def test_clean_store_passes(repo: Repo) -> None:
    text, js = verify(repo, "--grace", "0")
    assert text.code == 0 and text.out == "ok: 2 receipt(s), 4 ledger event(s) verified (unsigned store)\n"
    assert js.code == 0 and js.json == {"ok": True, "receipts": 2, "ledger_events": 4, "signatures": {"mode": "unsigned"},
                                       "failures": []}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_names_the_receipt_and_the_reason(repo: Repo, case: str) -> None:
    broken, reason = CASES[case](repo)
    text, js = verify(repo, "--grace", "0")
    assert text.code == 6 and js.code == 6, text.out + text.err
    lines = text.out.splitlines()
    assert lines[-1].startswith("verification failed: ")
    problems = lines[:-1]
    assert len(problems) == len(js.json["failures"]) >= 1
    # One line per failure: "<receipt file> (key '<key>'): <reason>".
    ours = [ln for ln in problems if ln.startswith(str(broken)) and reason in ln]
    assert ours, f"no line names {broken} with {reason!r}:\n{text.out}"
    failures = js.json["failures"]
    assert js.json["ok"] is False
    assert any(f["receipt"] == str(broken) and reason in f["reason"] for f in failures), failures
    for f in failures:
        assert set(f) == {"key", "receipt", "reason"} and f["receipt"] and f["reason"]
    if case in ("edited_field", "resealed_bad_output"):
        # A corrupt receipt whose text still names its key: the report names it too (it said null).
        assert [f["key"] for f in failures if f["receipt"] == str(broken)] == ["one"], failures
        assert f"(key 'one')" in next(ln for ln in problems if ln.startswith(str(broken)))
    if case in ("wrong_output_digest", "missing_commit", "edited_field", "unresolved_prepared", "deleted_receipt"):
        # Only the broken receipt is named (a lost ledger line may also orphan a receipt's state).
        assert {f["receipt"] for f in failures} == {str(broken)}, failures


def test_failure_after_recover_is_gone(repo: Repo) -> None:
    """The unresolved prepared receipt fails verify until ``recover`` settles it."""
    _, reason = unresolved_prepared(repo)
    assert run_cli("verify", "--repo", str(repo.path), "--grace", "0").code == 6
    assert run_cli("recover", "--repo", str(repo.path)).code == 0
    assert run_cli("verify", "--repo", str(repo.path), "--grace", "0").code == 0


def test_a_receipt_ahead_of_the_ledger_is_a_call_in_progress_while_its_key_lock_is_held(repo: Repo) -> None:
    """A call renames its receipt, then appends its ledger event, under its key lock: a verify in
    between (a pre-commit hook beside a running apply) must not fail; once the lock is free, it does."""
    store = ReceiptStore(str(repo.store))
    r = store.read("one")
    assert r is not None
    store.write(r.evolve(updated_at="2026-01-01T00:00:00Z"))  # a new state, its event not yet appended
    lock = store.try_lock("one")
    assert lock is not None
    try:
        assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0
    finally:
        lock.release()
    after = run_cli("verify", "--repo", str(repo.path), "--json")
    assert after.code == 6 and "is not in the ledger" in after.json["failures"][0]["reason"]


def test_a_receipts_folder_that_is_a_file_is_a_corrupt_store_not_an_internal_error(repo: Repo) -> None:
    receipts = repo.store / "receipts"
    import shutil

    shutil.rmtree(receipts)
    receipts.write_text("not a folder\n")
    text, js = verify(repo)
    assert text.code == 6 and js.code == 6, text.out + text.err
    assert js.json["error"]["type"] == "corrupt_receipt" and "cannot be listed" in js.json["error"]["message"]
    assert "Traceback" not in text.err


def test_a_receipt_file_removed_by_hand_is_a_corrupt_store_for_status_and_recover(repo: Repo) -> None:
    """The ledger (and the key ref) say the call landed: 'no receipt' would say it never started."""
    pf = repo.path.parent / "p.diff"
    pf.write_bytes(b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+gone\n")
    assert run_cli("apply", str(pf), "--repo", str(repo.path), "--key", "d1").code == 0
    from receipts.store import ReceiptStore

    receipt = Path(ReceiptStore(str(repo.store)).receipt_path("d1"))
    receipt.unlink()
    st = run_cli("status", "d1", "--repo", str(repo.path), "--json")
    assert st.code == 6, st.out + st.err
    assert st.json["error"]["type"] == "corrupt_receipt" and "file is missing" in st.json["error"]["message"]
    rec = run_cli("recover", "--repo", str(repo.path), "--json")
    assert rec.code == 6, rec.out + rec.err
    assert rec.json["corrupt"] == [{"path": str(receipt), "key": "d1",
                                    "reason": "the ledger records this key's receipt, but its file is missing"}]
    assert run_cli("verify", "--repo", str(repo.path)).code == 6
    assert run_cli("status", "never-used", "--repo", str(repo.path), "--json").code == 2  # still not_found

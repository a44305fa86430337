"""Fencing (issue 4): a worker that lost its key lock can never move the ref or overwrite a newer receipt.

The worker is paused for real: ``ONCEPATCH_PAUSE_AT=<point>`` (a test seam in
``patcher.execute``) makes it SIGSTOP itself at that point while it holds the
key's lock.  The test then breaks the lock the way a broken NFS lock or a
careless person would — it deletes the lock file, so the next process locks a
new file — lets another process take the key over, and sends SIGCONT.

Points used: ``before-ref`` (after the worker's last check made without the
branch's lock, just before it takes that lock and swaps), ``after-prepare``,
``before-finalise`` (the branch has moved; the receipt is not final yet).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, run_cli

DEADLINE = 120.0
PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+fenced\n"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Paused:
    """An ``oncepatch apply`` process that stops itself at a pause point; always reaped."""

    def __init__(self, repo: Repo, patch: Path, point: str, key: str = "K") -> None:
        env = dict(os.environ, ONCEPATCH_PAUSE_AT=point)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path), "--json",
             "--key", key], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + DEADLINE
        while self.state() != "T":
            assert self.proc.poll() is None, f"exited before pausing: {self.proc.communicate()}"
            assert time.monotonic() < deadline, f"never reached pause point '{point}'"
            time.sleep(0.01)

    def state(self) -> str:
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as fh:
                return fh.read().rsplit(b")", 1)[1].split()[0].decode()
        except FileNotFoundError:
            return "gone"

    def resume(self) -> tuple[int, dict[str, Any]]:
        os.kill(self.proc.pid, signal.SIGCONT)
        out, err = self.proc.communicate(timeout=DEADLINE)
        assert out, err.decode()
        return self.proc.returncode, json.loads(out)

    def reap(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def paused() -> Iterator[Any]:
    made: list[Paused] = []

    def start(*args: Any, **kw: Any) -> Paused:
        p = Paused(*args, **kw)
        made.append(p)
        return p

    yield start
    for p in made:
        p.reap()


@pytest.fixture
def patch(tmp_path: Path) -> Path:
    p = tmp_path / "p.diff"
    p.write_bytes(PATCH)
    return p


def break_key_lock(repo: Repo, key: str = "K") -> None:
    """What a broken NFS lock amounts to: the lock file is gone while its owner still runs."""
    lock = repo.store / "locks" / f"{key_hash(key)}.lock"
    assert lock.exists()
    lock.unlink()


def receipt_file(repo: Repo, key: str = "K") -> Path:
    h = key_hash(key)
    return repo.store / "receipts" / h[:2] / f"{h}.json"


def commits_with_key(repo: Repo, key: str = "K") -> int:
    out = repo.git("log", "--format=%(trailers:key=Oncepatch-Key,valueonly)", "--all")
    return sum(1 for line in out.splitlines() if line.strip() == key_hash(key))


def assert_fenced(code: int, doc: dict[str, Any]) -> None:
    assert code == 5, doc
    err = doc["error"]
    assert err["type"] == "in_progress"
    assert err["effect_status"] == "unknown" and err["next_action"] == "query_before_retry"
    assert err["fencing_token"] == 1


def test_paused_worker_cannot_move_the_ref_after_a_takeover(repo: Repo, patch: Path, paused: Any) -> None:
    base = repo.head()
    a = paused(repo, patch, "before-ref")
    prepared = json.loads(receipt_file(repo).read_text())
    assert prepared["status"] == "prepared" and prepared["fencing_token"] == 1
    break_key_lock(repo)

    b = run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K")
    assert b.code == 0, b.out + b.err
    assert b.json["replayed"] is False
    newer = receipt_file(repo).read_bytes()
    assert json.loads(newer)["fencing_token"] == 2 and json.loads(newer)["status"] == "committed"
    head = repo.head()
    assert repo.git("rev-parse", f"{head}^").strip() == base

    code, doc = a.resume()
    assert_fenced(code, doc)
    assert doc["error"]["current_token"] == 2
    assert repo.head() == head  # the superseded attempt did not move the ref
    assert receipt_file(repo).read_bytes() == newer  # nor touch the newer receipt
    assert commits_with_key(repo) == 1
    assert repo.count() == 2
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


def test_fence_is_checked_under_the_ref_lock(repo: Repo, patch: Path, paused: Any) -> None:
    """The taker-over is itself paused after its prepare: the branch has not moved yet.

    The first worker's last check without the branch's lock passed before it
    was stopped; only a check made under the ref lock sees that its token is
    stale.  Without it, the old attempt would land and the new one would be
    rejected as a conflict.
    """
    base = repo.head()
    a = paused(repo, patch, "before-ref")
    break_key_lock(repo)
    b = paused(repo, patch, "after-prepare")
    assert json.loads(receipt_file(repo).read_text())["fencing_token"] == 2

    code, doc = a.resume()
    assert_fenced(code, doc)
    assert repo.head() == base  # not moved for the superseded attempt

    code, doc = b.resume()
    assert code == 0, doc
    assert doc["replayed"] is False
    receipt = json.loads(receipt_file(repo).read_text())
    assert receipt["status"] == "committed" and receipt["fencing_token"] == 2
    assert repo.head() == doc["commit"] and commits_with_key(repo) == 1
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


def test_recover_settling_a_paused_attempt_fences_it_off(repo: Repo, patch: Path, paused: Any) -> None:
    """``recover`` takes the broken lock, finds the candidate not landed and rejects it (same token).

    The paused worker must read that as a takeover too: its token still
    matches, but its receipt is no longer ``prepared``.
    """
    base = repo.head()
    a = paused(repo, patch, "before-ref")
    break_key_lock(repo)
    rec = run_cli("recover", "--repo", str(repo.path), "--json")
    assert rec.code == 0, rec.out + rec.err
    assert [(r["from"], r["to"]) for r in rec.json["rows"]] == [("prepared", "rejected")]
    settled = receipt_file(repo).read_bytes()

    code, doc = a.resume()
    assert_fenced(code, doc)
    assert doc["error"]["current_status"] == "rejected"
    assert repo.head() == base
    assert receipt_file(repo).read_bytes() == settled
    assert commits_with_key(repo) == 0

    # The rejection is retryable: the next call executes the key once, with the next token.
    again = run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K")
    assert again.code == 0, again.out
    assert json.loads(receipt_file(repo).read_text())["fencing_token"] == 2
    assert commits_with_key(repo) == 1
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


def test_paused_worker_cannot_overwrite_the_receipt_after_a_takeover(repo: Repo, patch: Path,
                                                                     paused: Any) -> None:
    """Paused after its ref moved: the taker-over finds the effect (key ref) and settles it as committed."""
    a = paused(repo, patch, "before-finalise")
    head = repo.head()
    assert commits_with_key(repo) == 1
    break_key_lock(repo)

    b = run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K")
    assert b.code == 0, b.out + b.err
    assert b.json["replayed"] is True and b.json["commit"] == head
    settled = receipt_file(repo).read_bytes()
    assert json.loads(settled)["status"] == "committed"

    code, doc = a.resume()
    assert_fenced(code, doc)
    assert doc["error"]["current_status"] == "committed"
    assert receipt_file(repo).read_bytes() == settled
    assert repo.head() == head and commits_with_key(repo) == 1
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0

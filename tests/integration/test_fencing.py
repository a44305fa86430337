"""Fencing (issue 4): a worker that lost its key lock can never move the ref or overwrite a newer receipt.

The worker is paused for real: ``ONCEPATCH_PAUSE_AT=<point>`` (a test seam in
``patcher.execute``) makes it SIGSTOP itself at that point while it holds the
key's lock.  The test then breaks the lock the way a broken NFS lock or a
careless person would — it deletes the lock file, so the next process locks a
new file — lets another process take the key over, and sends SIGCONT.

The same rule holds for every tool (``receipts.engine``): a generic effect
(``file_write``) paused the same way is fenced off as ``apply_patch`` is.

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

    def __init__(self, repo: Repo | None, patch: Path | None, point: str, key: str = "K",
                 argv: list[str] | None = None) -> None:
        env = dict(os.environ, ONCEPATCH_PAUSE_AT=point)
        if argv is None:
            assert repo is not None and patch is not None
            argv = [sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path), "--json",
                    "--key", key]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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


def assert_fenced(code: int, doc: dict[str, Any], *, effect_ran: bool = False) -> None:
    """Fenced off; once this attempt's effect ran, its envelope says so (``applied``, ``recover``)."""
    assert code == 5, doc
    err = doc["error"]
    assert err["type"] == "in_progress"
    if effect_ran:
        assert err["effect_status"] == "applied" and err["next_action"] == "recover"
    else:
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
    assert_fenced(code, doc, effect_ran=True)
    assert doc["error"]["current_status"] == "committed"
    assert receipt_file(repo).read_bytes() == settled
    assert repo.head() == head and commits_with_key(repo) == 1
    assert run_cli("verify", "--repo", str(repo.path), "--json").code == 0


# -- the same rule for a generic effect --------------------------------------------------------------

WRITE_FILE = r"""
import json, sys
import receipts
from cas.errors import OncepatchError
try:
    done = receipts.write_file(sys.argv[1], b"fenced\n", key="K", store=sys.argv[2])
except OncepatchError as exc:
    print(json.dumps({"ok": False, "error": exc.envelope()}))
    sys.exit(exc.exit_code)
print(json.dumps(done.to_json()))
"""


def settle_by_recover(tool: str, repo: Repo, store: Path) -> list[tuple[str, str]]:
    """``recover`` run by another process than the paused one (here: the test's, or the CLI's)."""
    if tool == "apply_patch":
        rec = run_cli("recover", "--repo", str(repo.path), "--json")
        assert rec.code == 0, rec.out + rec.err
        return [(r["from"], r["to"]) for r in rec.json["rows"]]
    from receipts.adapters import builtin_adapters
    from receipts.recovery import recover
    from receipts.store import ReceiptStore

    return [(r.from_, r.to) for r in recover(ReceiptStore(str(store)), builtin_adapters()).rows]


@pytest.mark.parametrize("tool", ["file_write", "apply_patch"])
@pytest.mark.parametrize("point", ["after-prepare", "before-finalise"])
def test_one_fencing_rule_for_every_tool_a_call_settled_while_it_ran_is_fenced_off(
        repo: Repo, patch: Path, paused: Any, tmp_path: Path, tool: str, point: str) -> None:
    """A call whose prepared receipt another process settled while it was paused writes nothing more.

    The settle keeps the token and changes the status: a rule that fences only
    on a newer token (the generic engine's, before there was one engine) lets
    the paused call run its effect after a ``rejected`` or write its own
    ``committed`` over the settled receipt.  Paused after prepare, the effect
    has not run: recover settles it ``rejected`` and the call must not run it.
    Paused before finalising, the effect ran: recover settles it ``committed``
    and the call must not write its receipt again.
    """
    executed = point == "before-finalise"
    if tool == "apply_patch":
        store = repo.store
        base = repo.head()
        a = paused(repo, patch, point)

        def effect_done() -> bool:
            return commits_with_key(repo) == 1 and repo.head() != base
    else:
        store = tmp_path / "store"
        target = tmp_path / "out.txt"
        target.write_bytes(b"before\n")
        a = paused(None, None, point, argv=[sys.executable, "-c", WRITE_FILE, str(target), str(store)])

        def effect_done() -> bool:
            return target.read_bytes() == b"fenced\n"
    receipt = store / "receipts" / key_hash("K")[:2] / f"{key_hash('K')}.json"
    assert json.loads(receipt.read_text())["status"] == "prepared"
    assert effect_done() is executed
    (store / "locks" / f"{key_hash('K')}.lock").unlink()  # the paused call's lock is lost

    to = "committed" if executed else "rejected"
    assert settle_by_recover(tool, repo, store) == [("prepared", to)]
    settled = receipt.read_bytes()
    events = ReceiptStoreEvents(store)

    code, doc = a.resume()
    assert_fenced(code, doc, effect_ran=executed)
    assert doc["error"]["current_status"] == to and doc["error"]["current_token"] == 1
    assert receipt.read_bytes() == settled  # the settled receipt is not overwritten
    assert effect_done() is executed  # nor the effect run after a settle said it did not happen
    assert events.new() == []  # the fenced call appended nothing to the ledger


class ReceiptStoreEvents:
    """The ledger events appended since it was made."""

    def __init__(self, store: Path) -> None:
        from receipts.store import ReceiptStore

        self.store = ReceiptStore(str(store))
        self.seen = len(list(self.store.ledger.events()))

    def new(self) -> list[str]:
        return [str(e["event"]) for e in list(self.store.ledger.events())[self.seen:]]

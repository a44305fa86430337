"""Every error path tells the truth (docs/DESIGN.md section 6): what a failed call says is what git holds.

After the branch moved, any failure answers ``applied`` (or ``unknown`` when
the move itself is in doubt) with ``next_action: recover`` — never
``not_started`` / ``retry`` — and leaves a receipt ``recover`` finishes.  No
raw ``OSError`` (nor libgit2's ``GitError``) leaves the API.

Faults are injected in-process at seams: the durable-write helper's
``os.write`` / ``os.fsync`` / ``os.replace`` (``cas.durable``), and the
branch's compare-and-swap raising libgit2's ``GitError``; each is armed at a
phase of the call, named by the crash point that opens it.  A last test runs
the CLI under libfiu (``fiu-run``) when it is installed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pygit2
import pytest

import cas.durable
import patcher.execute
import receipts.engine
from cas.errors import OncepatchError
from cas.objects import GitStore
from conftest import ROOT, Repo, snapshot
from patcher.api import Client
from patcher.protocol import apply

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello, world\n"
KEY = "truthful-1"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_ref_lock(repo: Repo, key: str = KEY) -> Path:
    return repo.path / ".git" / "refs" / "oncepatch" / "keys" / f"{key_hash(key)}.lock"


def receipt_of(repo: Repo, key: str = KEY) -> dict[str, Any]:
    h = key_hash(key)
    return dict(json.loads((repo.store / "receipts" / h[:2] / f"{h}.json").read_bytes()))


def commits_with_key(repo: Repo, key: str = KEY) -> list[str]:
    out = repo.git("log", "--all", "--format=%H %(trailers:key=Oncepatch-Key,valueonly,separator=)")
    return [line.split()[0] for line in out.splitlines() if line.split()[1:] == [key_hash(key)]]


def recover(repo: Repo) -> None:
    # A settle that failed for good keeps this process's own index.lock (on purpose, see
    # patcher.execute): waiting for it would change nothing, so recover waits briefly.
    with Client(str(repo.path), lock_timeout=0.5) as client:
        report = client.recover()
    assert not report.corrupt, report.to_json()


def assert_settled_truthfully(repo: Repo, base: str) -> None:
    """After ``recover``: exactly one commit for the key or none, and a final receipt that says which."""
    receipt = receipt_of(repo) if _has_receipt(repo) else None
    on_branch = [c for c in commits_with_key(repo) if _is_ancestor(repo, c)]
    if receipt is None:
        assert on_branch == [] and repo.head() == base
        return
    assert receipt["status"] in ("committed", "rejected"), receipt["status"]
    if receipt["status"] == "committed":
        assert on_branch == [receipt["commit"]] and repo.head() == receipt["commit"]
        assert repo.head(f"refs/oncepatch/keys/{key_hash(KEY)}") == receipt["commit"]
    else:
        assert on_branch == [] and repo.head() == base
        assert receipt["retryable"] is True


def _has_receipt(repo: Repo) -> bool:
    h = key_hash(KEY)
    return (repo.store / "receipts" / h[:2] / f"{h}.json").exists()


def _is_ancestor(repo: Repo, commit: str) -> bool:
    return subprocess.run(["git", "merge-base", "--is-ancestor", commit, "main"], cwd=repo.path,
                          check=False).returncode == 0


# -- the foreign key-ref lock ------------------------------------------------------------------


def test_a_held_key_ref_lock_refuses_the_call_before_the_branch_moves(repo: Repo) -> None:
    """Found by a hostile run: the branch moved and the worktree changed, yet exit 5 ``not_started``, ``retry``."""
    lock = key_ref_lock(repo)
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    base = repo.head()
    before = {k: v for k, v in snapshot(repo).items() if k != "store"}  # the store records the rejection
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), PATCH, key=KEY, lock_timeout=0.2)
    err = info.value.envelope()
    assert (err["type"], err["effect_status"], err["next_action"], err["retryable"]) == (
        "in_progress", "not_applied", "retry", True)
    assert err["lock_path"] == str(lock)
    # Nothing moved: branch, index, worktree.
    assert repo.head() == base and commits_with_key(repo) == []
    assert repo.git("status", "--porcelain") == "" and (repo.path / "README").read_text() == "hello\n"
    assert {k: v for k, v in snapshot(repo).items() if k != "store"} == before
    assert receipt_of(repo)["status"] == "rejected" and receipt_of(repo)["retryable"] is True
    assert lock.exists()  # someone else's: never removed

    lock.unlink()
    res = apply(str(repo.path), PATCH, key=KEY)
    assert res.status == "committed" and commits_with_key(repo) == [res.commit] == [repo.head()]


def test_a_key_ref_lock_taken_after_the_move_answers_applied_and_recover_finishes(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock appears in the window after the move (the look under the branch's lock passed)."""
    lock = key_ref_lock(repo)

    def pause_point(name: str) -> None:
        if name == "after-ref":
            lock.parent.mkdir(parents=True, exist_ok=True)
            lock.write_bytes(b"")

    monkeypatch.setattr(patcher.execute, "pause_point", pause_point)
    base = repo.head()
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), PATCH, key=KEY, lock_timeout=0.2)
    err = info.value.envelope()
    assert (err["effect_status"], err["next_action"], err["retryable"]) == ("applied", "recover", False)
    assert info.value.exit_code == 5
    [commit] = commits_with_key(repo)
    assert repo.head() == commit != base  # it did move: the envelope says so
    assert (repo.path / "README").read_text() == "hello, world\n"
    receipt = receipt_of(repo)
    assert receipt["status"] == "unknown" and receipt["error"]["effect_status"] == "applied"

    lock.unlink()
    recover(repo)
    assert_settled_truthfully(repo, base)
    assert receipt_of(repo)["status"] == "committed"
    again = apply(str(repo.path), PATCH, key=KEY)
    assert again.replayed and again.commit == commit


# -- faults at the seams, phase by phase ------------------------------------------------------

#: The phases of a call, each opened by its crash point (docs/DESIGN.md section 4).
PHASES = ["after-stage", "after-prepare", "after-ref", "after-materialise", "before-receipt-replace"]


class FaultyOs:
    """``os`` as :mod:`cas.durable` sees it, with one call failing once armed (every time, or once)."""

    def __init__(self, op: str, code: int, persistent: bool) -> None:
        self.op, self.code, self.persistent = op, code, persistent
        self.armed = False
        self.fired = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _fault(self, op: str) -> None:
        if self.armed and op == self.op and (self.persistent or not self.fired):
            self.fired += 1
            raise OSError(self.code, os.strerror(self.code))

    def write(self, fd: int, data: Any) -> int:
        self._fault("write")
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        self._fault("fsync")
        os.fsync(fd)

    def replace(self, *args: Any, **kw: Any) -> None:
        self._fault("replace")
        os.replace(*args, **kw)


@pytest.fixture
def arm_at(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, Callable[[], None]], None]:
    """``arm_at(phase, arm)``: call ``arm`` when the call reaches the crash point that opens ``phase``."""

    def install(phase: str, arm: Callable[[], None]) -> None:
        def point(name: str) -> None:
            if name == phase:
                arm()

        def hook(name: str) -> Callable[[], None] | None:
            return (lambda: point(name)) if name == phase else None

        monkeypatch.setattr(patcher.execute, "crash_point", point)
        monkeypatch.setattr(patcher.execute, "crash_hook", hook)
        monkeypatch.setattr(receipts.engine, "crash_point", point)

    return install


def check_failed_call(repo: Repo, base: str, call: Callable[[], Any], disarm: Callable[[], None]) -> None:
    """The call raises only the tree's errors, and what it says matches git; recover (no fault) then settles it."""
    try:
        call()
    except OncepatchError as exc:
        err = exc.envelope()
        moved = repo.head() != base
        if moved:
            assert err["effect_status"] in ("applied", "unknown"), err
            assert err["next_action"] == "recover" and err["retryable"] is False, err
        else:
            assert err["effect_status"] != "applied", err
            if err["effect_status"] in ("not_started", "not_applied"):
                assert err["next_action"] in ("retry", "fix_input"), err
    finally:
        disarm()
    # (a fault that only cost a worktree file is a warning: the call committed)
    recover(repo)
    assert_settled_truthfully(repo, base)


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize(("op", "code"), [("write", errno.ENOSPC), ("fsync", errno.EIO), ("replace", errno.EIO)])
@pytest.mark.parametrize("phase", PHASES)
def test_a_durable_write_fault_in_any_phase_is_reported_truthfully(
        repo: Repo, monkeypatch: pytest.MonkeyPatch, arm_at: Callable[[str, Callable[[], None]], None],
        phase: str, op: str, code: int, persistent: bool) -> None:
    faulty = FaultyOs(op, code, persistent)
    monkeypatch.setattr(cas.durable, "os", faulty)

    def arm() -> None:
        faulty.armed = True

    arm_at(phase, arm)
    base = repo.head()

    def disarm() -> None:
        faulty.armed = False

    check_failed_call(repo, base, lambda: apply(str(repo.path), PATCH, key=KEY), disarm)


@pytest.mark.parametrize("landed", [False, True], ids=["before-the-rename", "after-the-rename"])
def test_libgit2_failing_in_the_branch_move_is_reported_truthfully(
        repo: Repo, monkeypatch: pytest.MonkeyPatch, landed: bool) -> None:
    """libgit2's ``GitError`` out of the ref write: ``unknown`` (the move may have landed), never raw."""
    swap = GitStore.compare_and_swap

    def failing(self: GitStore, *args: Any, **kw: Any) -> None:
        if landed:
            swap(self, *args, **kw)
        else:
            kw["precondition"]()  # the fence passed; the write then fails
        raise pygit2.GitError("failed to fsync '.git/refs/heads': Input/output error")

    monkeypatch.setattr(GitStore, "compare_and_swap", failing)
    base = repo.head()
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), PATCH, key=KEY)
    err = info.value.envelope()
    assert (err["type"], err["effect_status"], err["next_action"]) == ("unknown", "unknown", "recover")
    assert receipt_of(repo)["status"] == "unknown"
    assert (repo.head() != base) is landed
    monkeypatch.setattr(GitStore, "compare_and_swap", swap)
    recover(repo)
    assert_settled_truthfully(repo, base)
    assert receipt_of(repo)["status"] == ("committed" if landed else "rejected")


def test_a_committed_receipt_that_landed_is_not_downgraded_by_a_later_failure(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger event after the committed receipt's rename fails: the call says ``applied``, the receipt stays."""
    from receipts.ledger import Ledger

    def fail(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "events.jsonl")

    original = Ledger.append_receipt_event

    def append(self: Ledger, event: str, *args: Any, **kw: Any) -> Any:
        if event == "committed":
            fail()
        return original(self, event, *args, **kw)

    monkeypatch.setattr(Ledger, "append_receipt_event", append)
    base = repo.head()
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), PATCH, key=KEY)
    err = info.value.envelope()
    assert (err["effect_status"], err["next_action"]) == ("applied", "recover")
    assert receipt_of(repo)["status"] == "committed"  # never turned back into unknown
    monkeypatch.setattr(Ledger, "append_receipt_event", original)
    recover(repo)
    assert_settled_truthfully(repo, base)


def test_no_raw_os_error_before_the_lock(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError while the key's receipt is read: the tree's error, effect ``unknown`` (it could not be read)."""
    from receipts.store import ReceiptStore

    def read(self: ReceiptStore, key: str, **kw: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), "receipt.json")

    monkeypatch.setattr(ReceiptStore, "read", read)
    with pytest.raises(OncepatchError) as info:
        Client(str(repo.path), server="never").apply(PATCH, key=KEY)  # the fault is in this process
    err = info.value.envelope()
    assert (err["effect_status"], err["retryable"], err["errno"]) == ("unknown", True, "EIO")
    assert repo.count() == 1


# -- libgit2 failing to write the call's objects ------------------------------------------------


def _limit_file_size(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_objects_that_cannot_be_written_say_not_started_and_retry(repo: Repo, tmp_path: Path) -> None:
    """A disk that takes no more bytes while the call's objects are written: ``not_started``, ``retry``.

    Found with a full tmpfs: libgit2 failing to write the new blob (before any
    receipt, the branch untouched) answered ``unknown``, not retryable,
    ``query_before_retry``.  A file-size limit (``RLIMIT_FSIZE``) makes the
    same real write fail portably: the blob's loose object is larger than
    the limit, the receipt and the ledger's lines are not.
    """
    rng = random.Random(23)
    lines = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(76)) for _ in range(800)]
    patch = tmp_path / "big.diff"
    patch.write_text(f"--- /dev/null\n+++ b/big.txt\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{x}\n" for x in lines))
    before = snapshot(repo)
    argv = [sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path), "--key", KEY, "--json",
            "--no-server"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(argv, capture_output=True, env=env, check=False, timeout=120,
                         preexec_fn=_limit_file_size(16 * 1024))
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and not doc["ok"], res.stdout + res.stderr
    err = doc["error"]
    assert "cannot write object" in err["message"], err
    assert (err["effect_status"], err["retryable"], err["next_action"]) == ("not_started", True, "retry"), err
    after = snapshot(repo)
    assert {k: v for k, v in after.items() if k != "store"} == {k: v for k, v in before.items() if k != "store"}
    assert not _has_receipt(repo)
    # The retry the envelope asks for lands, once.
    res = subprocess.run(argv, capture_output=True, env=env, check=False, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert repo.count() == 2 and receipt_of(repo)["status"] == "committed"


# -- the CLI under libfiu ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("fiu-run") is None, reason="libfiu's fiu-run is not installed")
def test_cli_under_random_write_and_fsync_faults_never_lies(repo: Repo, tmp_path: Path) -> None:
    """Random ENOSPC/EIO on the process's writes and syncs over many calls: one JSON envelope each, no lie.

    After every call: the envelope is JSON (no raw traceback), and its
    ``effect_status`` agrees with the branch; at the end ``recover`` (without
    faults) leaves one commit per committed key and none for the others.
    """
    patch_file = tmp_path / "p.diff"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    calls = 40
    for n in range(calls):
        repo.write(f"f{n}.txt", "")  # a fresh file per call: each call adds its own line
    repo.commit_all("files")
    base = repo.head()
    said = unsaid = 0
    for n in range(calls):
        patch_file.write_bytes(f"--- a/f{n}.txt\n+++ b/f{n}.txt\n@@ -0,0 +1 @@\n+call {n}\n".encode())
        head = repo.head()
        res = subprocess.run(
            ["fiu-run", "-x", "-c", "enable_random name=posix/io/rw/write,probability=0.05",
             "-c", "enable_random name=posix/io/sync/fsync,probability=0.05",
             sys.executable, "-m", "patcher.cli", "apply", str(patch_file), "--repo", str(repo.path),
             "--json", "--key", f"k{n}", "--lock-timeout", "1"],
            capture_output=True, env=env, check=False, timeout=120)
        try:
            doc = json.loads(res.stdout)
        except ValueError:
            # The fault fell on writing the envelope itself (Python then reports the lost
            # stdout on stderr as it can): nothing was said, so nothing false.
            unsaid += 1
            doc = None
        if doc is not None:
            assert "Traceback" not in res.stderr.decode("utf-8", "replace"), res.stderr.decode()
            said += 1
        moved = repo.head() != head
        if doc is None:
            pass
        elif doc["ok"]:
            assert moved or doc.get("already_applied"), doc
        else:
            err = doc["error"]
            if moved:
                assert err["effect_status"] in ("applied", "unknown") and err["next_action"] == "recover", doc
            else:
                assert err["effect_status"] != "applied", doc
        # Each call is settled at once, so the next one starts from a settled branch.
        rec = subprocess.run([sys.executable, "-m", "patcher.cli", "recover", "--repo", str(repo.path), "--json"],
                             capture_output=True, env=env, check=False, timeout=120)
        assert rec.returncode == 0, rec.stdout.decode() + rec.stderr.decode()
    landed = repo.count(f"{base}..main")
    committed = 0
    for n in range(calls):
        h = key_hash(f"k{n}")
        path = repo.store / "receipts" / h[:2] / f"{h}.json"
        if not path.exists():
            continue
        receipt = json.loads(path.read_bytes())
        assert receipt["status"] in ("committed", "rejected"), receipt
        if receipt["status"] == "committed":
            committed += 1
            assert _is_ancestor(repo, receipt["commit"])
    assert landed == committed
    assert said > unsaid  # most envelopes were written: the calls were checked, not skipped


@pytest.mark.parametrize(("method", "target", "effect"), [
    ("status", "patcher.api._status", "not_started"),
    ("verify", "patcher.api.verify", "not_started"),
    ("recover", "patcher.api.recover", "unknown"),  # it may have settled some before failing
])
def test_no_raw_os_error_out_of_the_client(repo: Repo, monkeypatch: pytest.MonkeyPatch, method: str, target: str,
                                           effect: str) -> None:
    def fail(*args: Any, **kw: Any) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(repo.store))

    monkeypatch.setattr(target, fail)
    with Client(str(repo.path), server="never") as client:  # the fault is injected in this process
        with pytest.raises(OncepatchError) as info:
            getattr(client, method)(*([KEY] if method == "status" else []))
    err = info.value.envelope()
    assert (err["effect_status"], err["retryable"], err["errno"], err["path"]) == (effect, True, "EIO",
                                                                                  str(repo.store))


# -- a pack that git maintenance replaced under a read ---------------------------------------

#: libgit2's words when a pack it listed changed or went away before it read from it.
VANISHED = "90a5ed6b4404971c220f6efda74bec7a330748b6: invalid packfile '/r/.git/objects/pack/loose-91.pack': "


def _fail_move(monkeypatch: pytest.MonkeyPatch, message: str, times: int) -> list[GitStore]:
    """The branch's move raises libgit2's ``message`` for the first ``times`` calls; returns each call's store."""
    seen: list[GitStore] = []
    real = patcher.execute._move_refs

    def move_refs(run: Any, *args: Any, **kw: Any) -> Any:
        seen.append(run.gstore)
        if len(seen) <= times:
            raise pygit2.GitError(message)
        return real(run, *args, **kw)

    monkeypatch.setattr(patcher.execute, "_move_refs", move_refs)
    return seen


def test_a_pack_replaced_under_a_read_is_read_again_from_fresh_packs(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found beside ``git maintenance``: the call ended ``internal`` although a second read would have worked.

    After ``prepared``, before the branch moves: nothing is applied, so the call runs
    once more on a freshly opened repository (a long-lived client's stale pack list
    is dropped with it) and lands once.
    """
    seen = _fail_move(monkeypatch, VANISHED, times=1)
    base = repo.head()
    with Client(str(repo.path), server="never") as client:  # (the fault is in this process)
        res = client.apply(PATCH, key=KEY)
        assert res.status == "committed" and not res.replayed
        assert len(seen) == 2 and seen[0] is not seen[1]  # the second round opened the repository afresh
        assert client.apply(PATCH, key=KEY).replayed
    assert commits_with_key(repo) == [res.commit] == [repo.head()]
    assert repo.head(f"{res.commit}^") == base
    events = [json.loads(line) for line in (repo.store / "events.jsonl").read_text().splitlines()]
    mine = [e.get("status") for e in events if e.get("key") == KEY]
    assert mine.index("rejected") < mine.index("committed"), mine  # the first round's, then the second's


def test_a_pack_that_stays_unreadable_is_read_again_a_few_times_then_busy_and_nothing_applied(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repack loop on a loaded machine replaced the packs under two rounds in a row: the call
    ended ``internal`` (found beside ``git maintenance``).  It is read again a bounded number of
    times, then answers busy (``in_progress``, exit 5), retryable, with nothing applied."""
    from patcher.protocol import PACK_ROUNDS

    seen = _fail_move(monkeypatch, VANISHED, times=99)
    base = repo.head()
    before = {k: v for k, v in snapshot(repo).items() if k != "store"}
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), PATCH, key=KEY)
    err = info.value.envelope()
    assert (err["type"], err["effect_status"], err["next_action"], err["retryable"], err["reason"]) == (
        "in_progress", "not_applied", "retry", True, "packs_replaced")
    assert info.value.exit_code == 5
    assert PACK_ROUNDS > 2 and len(seen) == PACK_ROUNDS  # a few more rounds, never more
    assert repo.head() == base and commits_with_key(repo) == []
    assert {k: v for k, v in snapshot(repo).items() if k != "store"} == before
    assert receipt_of(repo)["status"] == "rejected" and receipt_of(repo)["retryable"] is True


def test_another_libgit2_failure_is_not_run_again(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fail_move(monkeypatch, "failed to write reference: disk quota exceeded", times=1)
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), PATCH, key=KEY)
    assert info.value.envelope()["effect_status"] == "not_applied"
    assert len(seen) == 1


def test_a_replay_whose_pack_was_replaced_reads_again(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    import patcher.git_adapter

    first = apply(str(repo.path), PATCH, key=KEY)
    real = patcher.git_adapter.GitAdapter.confirm
    calls: list[int] = []

    def confirm(self: Any, receipt: Any) -> list[str]:
        calls.append(1)
        if len(calls) == 1:
            raise pygit2.GitError(VANISHED)
        return real(self, receipt)

    monkeypatch.setattr(patcher.git_adapter.GitAdapter, "confirm", confirm)
    again = apply(str(repo.path), PATCH, key=KEY)
    assert again.replayed and again.commit == first.commit and len(calls) == 2


def test_a_replay_whose_packs_keep_being_replaced_answers_busy_not_internal(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    import patcher.git_adapter
    from patcher.protocol import PACK_ROUNDS

    apply(str(repo.path), PATCH, key=KEY)
    calls: list[int] = []

    def confirm(self: Any, receipt: Any) -> list[str]:
        calls.append(1)
        raise pygit2.GitError(VANISHED)

    monkeypatch.setattr(patcher.git_adapter.GitAdapter, "confirm", confirm)
    before = snapshot(repo)
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), PATCH, key=KEY)
    err = info.value.envelope()
    assert (err["type"], err["next_action"], err["retryable"], err["reason"]) == (
        "in_progress", "retry", True, "packs_replaced")
    assert info.value.exit_code == 5 and len(calls) == PACK_ROUNDS
    assert snapshot(repo) == before  # a replay reads only

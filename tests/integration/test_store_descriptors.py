"""Lock files and ``tmp/`` entries of the store are opened through folder descriptors (issue 25, docs/SECURITY.md).

The store's ``lstat`` check of its folders runs once, before the key lock; a
folder swapped for a symlink after it must still never be followed.  The
swap is made for real: the call stops itself at a pause point
(``ONCEPATCH_PAUSE_AT``, after the check and before the lock or scratch file
is opened) and the test replaces the folder with a symlink to a folder outside
the store before letting it go on.  Pre-placed symlinks the check cannot see
(``tmp/worktrees``, a marker's own name) are refused the same way.

Every case: the call is refused with an error naming the symlink, nothing is
created outside the store, the branch never moves, index and worktree are
unchanged, and ``effect_status`` says what happened.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot

from receipts.errors import CorruptReceipt
from receipts.store import ReceiptStore

DEADLINE = 120.0
PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+once\n"


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _everything_in(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


class Paused:
    """An ``oncepatch apply`` that SIGSTOPs itself at ``point``; always reaped (:meth:`reap`)."""

    def __init__(self, repo: Repo, patch: Path, point: str, key: str) -> None:
        env = dict(os.environ, ONCEPATCH_PAUSE_AT=point)
        self.proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo",
                                      str(repo.path), "--json", "--key", key],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + DEADLINE
        while self._state() != "T":
            assert self.proc.poll() is None, f"exited before pausing: {self.proc.communicate()}"
            assert time.monotonic() < deadline, f"never reached pause point '{point}'"
            time.sleep(0.01)

    def _state(self) -> str:
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

    def start(*args: Any) -> Paused:
        p = Paused(*args)
        made.append(p)
        return p

    yield start
    for p in made:
        p.reap()


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return make_repo(tmp_path / "repo", {"README": "hello\n"})


@pytest.fixture
def patch(tmp_path: Path) -> Path:
    p = tmp_path / "p.diff"
    p.write_bytes(PATCH)
    return p


def _swap_for_symlink(folder: Path, outside: Path, kept: Path) -> None:
    """Move ``folder`` aside to ``kept`` and put a symlink to ``outside`` in its place."""
    folder.rename(kept)
    folder.symlink_to(outside, target_is_directory=True)


def _git_state(repo: Repo) -> dict[str, Any]:
    state = snapshot(repo)
    del state["store"]
    return state


def _refused_before_the_branch_moved(repo: Repo, code: int, doc: dict[str, Any], before: dict[str, Any],
                                     outside: Path) -> dict[str, Any]:
    assert code == 6, doc
    err: dict[str, Any] = doc["error"]
    assert err["type"] == "corrupt_receipt" and "symlink" in err["message"], err
    assert err["effect_status"] == "not_applied" and err["key"] == "k", err  # the branch never moved: and it says so
    assert _everything_in(outside) == []  # nothing created where the symlink points
    assert _git_state(repo) == before  # refs, HEAD, index, worktree
    return err


# -- locks/ ---------------------------------------------------------------------------------------------------------


def test_locks_swapped_for_a_symlink_after_the_check_gets_no_lock_file_where_it_points(
        repo: Repo, patch: Path, tmp_path: Path, paused: Any) -> None:
    """Paused before the writer turn's lock (``locks/branch-*.lock``), the first lock opened after the key's."""
    outside, kept = tmp_path / "outside", tmp_path / "locks-kept"
    outside.mkdir()
    before = _git_state(repo)
    p = paused(repo, patch, "before-ref", "k")
    _swap_for_symlink(repo.store / "locks", outside, kept)
    code, doc = p.resume()
    err = _refused_before_the_branch_moved(repo, code, doc, before, outside)
    assert "/locks" in err["message"], err
    # The store as it was meant to be, put back: recover settles the call from what git says.
    (repo.store / "locks").unlink()
    kept.rename(repo.store / "locks")
    assert run_cli("recover", "--repo", str(repo.path), "--json").code == 0
    receipt = json.loads((repo.store / "receipts" / h("k")[:2] / f"{h('k')}.json").read_bytes())
    assert receipt["status"] == "rejected"
    assert _git_state(repo) == before
    again = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k2", input=PATCH)
    assert again.code == 0, again.out + again.err  # the store works again


def test_a_lock_taken_through_a_locks_folder_swapped_after_the_check_is_refused(
        repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key lock, the ledger lock and recover's probes: all opened through the descriptor of ``locks/``."""
    assert run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "first", input=PATCH).code == 0
    store = ReceiptStore(str(repo.store))
    outside, kept = tmp_path / "outside", tmp_path / "locks-kept"
    outside.mkdir()
    _swap_for_symlink(repo.store / "locks", outside, kept)
    monkeypatch.setattr(ReceiptStore, "check_folders", lambda self, path, **kw: None)  # the swap came after it
    with pytest.raises(CorruptReceipt) as exc:
        with store.lock("k", timeout=1):
            pass
    assert "symlink" in exc.value.reason and exc.value.effect_status == "not_started" and exc.value.key == "k"
    with pytest.raises(CorruptReceipt):
        store.try_lock("k")
    with pytest.raises(CorruptReceipt):
        store.ledger.append({"event": "note"})
    with pytest.raises(CorruptReceipt):
        store.key_held_elsewhere("k")
    assert _everything_in(outside) == []


def test_a_symlinked_writer_turn_lock_file_is_refused_and_its_target_never_created(repo: Repo, tmp_path: Path) -> None:
    assert run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "first",
                   input=b"--- /dev/null\n+++ b/other\n@@ -0,0 +1 @@\n+x\n").code == 0
    turns = [p for p in (repo.store / "locks").iterdir() if p.name.startswith("branch-")]
    assert len(turns) == 1
    target = tmp_path / "created-by-the-turn"
    turns[0].unlink()
    turns[0].symlink_to(target)
    before = _git_state(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", input=PATCH)
    assert r.code == 6, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "corrupt_receipt" and "symlink" in err["message"] and err["effect_status"] == "not_applied"
    assert not target.exists() and _git_state(repo) == before


# -- tmp/ -----------------------------------------------------------------------------------------------------------


def test_tmp_swapped_for_a_symlink_after_the_check_gets_no_marker_where_it_points(
        repo: Repo, patch: Path, tmp_path: Path, paused: Any) -> None:
    """Paused before the index lock and its marker (``tmp/index-lock-<h>``) and the ref lock's (``tmp/ref-lock-<h>``)."""
    (repo.store / "tmp").mkdir(parents=True)
    outside, kept = tmp_path / "outside", tmp_path / "tmp-kept"
    outside.mkdir()
    before = _git_state(repo)
    p = paused(repo, patch, "before-ref", "k")
    _swap_for_symlink(repo.store / "tmp", outside, kept)
    code, doc = p.resume()
    _refused_before_the_branch_moved(repo, code, doc, before, outside)
    assert not (repo.path / ".git" / "index.lock").exists()  # released on the way out
    (repo.store / "tmp").unlink()
    kept.rename(repo.store / "tmp")
    assert run_cli("recover", "--repo", str(repo.path), "--json").code == 0
    assert _git_state(repo) == before


@pytest.mark.parametrize("marker", ["ref-lock", "index-lock"])
def test_a_symlink_planted_at_a_marker_name_is_never_followed(repo: Repo, tmp_path: Path, marker: str) -> None:
    tmp = repo.store / "tmp"
    tmp.mkdir(parents=True)
    target = tmp_path / "created-by-the-marker"
    (tmp / f"{marker}-{h('k')}").symlink_to(target)
    before = _git_state(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", input=PATCH)
    assert r.code == 6, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "corrupt_receipt" and "symlink" in err["message"], err
    assert err["effect_status"] == "not_started", err  # refused before the key's lock: nothing written
    assert not target.exists() and _git_state(repo) == before


def test_a_symlinked_check_worktrees_folder_is_refused_and_nothing_is_checked_out_there(
        repo: Repo, tmp_path: Path) -> None:
    (repo.store / "tmp").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (repo.store / "tmp" / "worktrees").symlink_to(outside, target_is_directory=True)
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", "--check", "true", input=PATCH)
    assert r.code == 6, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "corrupt_receipt" and "symlink" in err["message"], err
    assert err["effect_status"] == "not_started", err
    assert _everything_in(outside) == []  # no worktree checked out where it points
    assert "outside" not in repo.git("worktree", "list")
    assert snapshot(repo) == before


def test_recover_never_removes_through_a_check_worktrees_folder_swapped_for_a_symlink(
        repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crashed check's worktree is removed by recover through ``tmp/worktrees``'s descriptor: a symlink there
    is refused, and the folder it points at (with a worktree-like entry) is left whole."""
    outside = tmp_path / "outside"
    victim = outside / f"{h('k')}-1"
    victim.mkdir(parents=True)
    (victim / "precious").write_text("keep me\n")
    (repo.store / "tmp").mkdir(parents=True)
    (repo.store / "tmp" / "worktrees").symlink_to(outside, target_is_directory=True)
    r = run_cli("recover", "--repo", str(repo.path), "--json")
    assert r.code != 0 and "symlink" in r.out + r.err, r.out + r.err
    assert (victim / "precious").read_text() == "keep me\n"
    shutil.rmtree(outside)

"""``oncepatch recover`` through the CLI on real repositories (docs/DESIGN.md section 5).

* idempotent: a second run reports ``changed: false`` and touches nothing;
* crash-safe: killed at its own crash points, a second run ends in the same
  state as one clean run;
* ``--dry-run`` changes nothing (snapshot, stale git locks included) and lists
  the rows the real run then does;
* a key whose lock a live process holds is skipped, never touched;
* SIGKILL at exact system calls (strace fault injection): inside libgit2's ref
  update (the reflog entry is written before the branch moves) and inside the
  index update (a stale ``index.lock`` with or without its store marker).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot
from torture_driver import commits_with_trailer, fsck

from receipts.store import ReceiptStore

BASE: dict[str, str | bytes] = {
    "README": "hello\n",
    "src/app.py": "".join(f"line {i}\n" for i in range(1, 21)),
    "docs/guide.txt": "guide\n",
}
KEY = "recover-test-key"


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def make_patch(tmp_path: Path, name: str = "change.diff", line: str = "line 7") -> tuple[Repo, Path]:
    """A clean repo and a patch (modify one file, add another) made by git against its head."""
    repo = make_repo(tmp_path / "repo", BASE)
    pf = patch_for(repo, tmp_path / name, line)
    return repo, pf


def patch_for(repo: Repo, pf: Path, line: str = "line 7", new: str = "pkg/added.txt") -> Path:
    base = repo.head()
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace(f"{line}\n", f"{line} changed\n"))
    repo.write(new, "added\n")
    repo.git("add", "-A")
    pf.write_bytes(repo.git("diff", "--cached", "--full-index").encode())
    repo.git("reset", "-q", "--hard", base)
    repo.git("clean", "-qfd")
    return pf


def apply(repo: Repo, pf: Path, *extra: str, key: str = KEY, env: dict[str, str] | None = None) -> Any:
    return run_cli("apply", "--repo", str(repo.path), "--key", key, "--json", *extra, str(pf), env=env)


def recover(repo: Repo, *extra: str, env: dict[str, str] | None = None) -> Any:
    return run_cli("recover", "--repo", str(repo.path), "--json", *extra, env=env)


def receipt(repo: Repo, key: str = KEY) -> Any:
    return ReceiptStore(str(repo.store)).read(key)


def tmp_files(repo: Repo) -> list[str]:
    return sorted(p.name for p in repo.store.rglob("*") if ".optmp-" in p.name)


def crashed(tmp_path: Path, point: str) -> tuple[Repo, Path]:
    repo, pf = make_patch(tmp_path)
    r = apply(repo, pf, env={"ONCEPATCH_CRASH_AT": point})
    assert r.code == 137, (r.code, r.out, r.err)
    return repo, pf


# -- idempotence -----------------------------------------------------------------------------


def test_second_recover_reports_no_change_and_touches_nothing(tmp_path: Path) -> None:
    repo, _pf = crashed(tmp_path, "after-ref")
    first = recover(repo)
    assert first.code == 0 and first.json["changed"] is True
    assert [(r["from"], r["to"]) for r in first.json["rows"]] == [("prepared", "committed")]
    before = snapshot(repo)
    second = recover(repo)
    assert second.code == 0, second.err
    doc = second.json
    assert doc["changed"] is False
    assert (doc["rows"], doc["removed"], doc["ledger_repaired"], doc["skipped"]) == ([], [], [], [])
    assert snapshot(repo) == before
    text = run_cli("recover", "--repo", str(repo.path))
    assert text.code == 0 and "nothing to do" in text.out


@pytest.mark.parametrize("damage", ["edited", "copied over another key's file"])
def test_a_final_receipt_damaged_by_hand_is_reported_corrupt(tmp_path: Path, damage: str) -> None:
    """Its digest is in the ledger, but the file is not what was written: exit 6, never skipped."""
    repo, pf = make_patch(tmp_path)
    assert apply(repo, pf).code == 0
    assert run_cli("apply", str(pf), "--key", "other", "--repo", str(repo.path)).code == 0
    files = sorted(repo.store.glob("receipts/*/*.json"))
    assert len(files) == 2
    if damage == "edited":
        text = files[0].read_text()
        assert '"fencing_token": 1' in text
        files[0].write_text(text.replace('"fencing_token": 1', '"fencing_token": 2'))
    else:
        shutil.copyfile(files[1], files[0])
    before = snapshot(repo)
    r = recover(repo)
    assert r.code == 6, r.out + r.err
    assert [c["path"] for c in r.json["corrupt"]] == [str(files[0])]
    assert snapshot(repo) == before


def test_torn_ledger_tail_is_cut_so_verify_passes(tmp_path: Path) -> None:
    """A crash mid-append leaves a torn last ledger line: verify fails on it, and recover (not
    only some later call's append) must cut it; then a second run has nothing to do."""
    repo, pf = make_patch(tmp_path)
    assert apply(repo, pf).code == 0
    ledger = repo.store / "events.jsonl"
    good = ledger.read_bytes()
    with open(ledger, "ab") as fh:
        fh.write(b'{"at":"2026-01-01T00:00:00Z","event":"repl')  # no newline: torn
    bad = run_cli("verify", "--repo", str(repo.path))
    assert bad.code == 6 and "torn last line" in bad.out
    plan = recover(repo, "--dry-run")
    assert plan.json["removed"] == [f"{ledger} (torn last line)"] and ledger.read_bytes().endswith(b"repl")
    rec = recover(repo)
    assert rec.code == 0 and rec.json["changed"] is True
    assert ledger.read_bytes().startswith(good) and ledger.read_bytes().endswith(b"\n")
    assert run_cli("verify", "--repo", str(repo.path)).code == 0
    assert recover(repo).json["changed"] is False


# -- recover killed at its own crash points ------------------------------------------------------


def outcome(repo: Repo) -> dict[str, Any]:
    """The state a recovery leaves, free of oids and times (so two repos can be compared)."""
    r = receipt(repo)
    head = repo.head("main")
    key_ref = repo.git("for-each-ref", "--format=%(objectname)", f"refs/oncepatch/keys/{h(KEY)}").strip()
    events = [(e["event"], e["status"]) for e in run_cli("log", "--repo", str(repo.path), "--json").json["events"]]
    return {
        "tree": repo.head("main^{tree}"),
        "commits": repo.count("main"),
        "status": r.status,
        "retryable": r.retryable,
        "commit_is_head": r.commit == head,
        "key_ref_is_head": key_ref == head,
        "porcelain": repo.git("status", "--porcelain", "--untracked-files=all"),
        "tmp": tmp_files(repo),
        "events": events,
        "verify": run_cli("verify", "--repo", str(repo.path), "--grace", "0").code,
    }


@pytest.mark.parametrize("recover_point", ["recover-after-resolve", "recover-before-receipt-replace"])
@pytest.mark.parametrize("apply_point", ["after-prepare", "after-ref"])
def test_recover_killed_then_rerun_ends_as_one_clean_recover(tmp_path: Path, apply_point: str,
                                                             recover_point: str) -> None:
    clean, _ = crashed(tmp_path / "clean", apply_point)
    assert recover(clean, "--tmp-age", "0").code == 0
    expected = outcome(clean)

    repo, _ = crashed(tmp_path / "killed", apply_point)
    killed = recover(repo, "--tmp-age", "0", env={"ONCEPATCH_CRASH_AT": recover_point})
    assert killed.code == 137, (killed.code, killed.out, killed.err)
    assert receipt(repo).status == "prepared"  # nothing was settled before the kill
    if recover_point == "recover-before-receipt-replace":
        assert len(tmp_files(repo)) == 1  # the settled receipt's tmp, never renamed
    again = recover(repo, "--tmp-age", "0")
    assert again.code == 0, again.err
    assert [(r["from"], r["to"]) for r in again.json["rows"]] == [
        ("prepared", "committed" if apply_point == "after-ref" else "rejected")]
    assert outcome(repo) == expected
    assert expected["verify"] == 0 and expected["porcelain"] == "" and expected["tmp"] == []


# -- dry run ------------------------------------------------------------------------------------


def test_dry_run_lists_the_plan_and_changes_nothing(tmp_path: Path) -> None:
    repo, pf = crashed(tmp_path, "before-receipt-replace")
    # A second key crashed before its commit landed, in the same store.
    pf2 = patch_for(repo, tmp_path / "other.diff", "line 15", "pkg/other.txt")
    assert apply(repo, pf2, key="other", env={"ONCEPATCH_CRASH_AT": "after-prepare"}).code == 137
    before = snapshot(repo)
    plan = recover(repo, "--dry-run", "--tmp-age", "0")
    assert plan.code == 0, plan.err
    doc = plan.json
    assert doc["dry_run"] is True
    rows = sorted((r["key"], r["from"], r["to"]) for r in doc["rows"])
    assert rows == sorted([(KEY, "prepared", "committed"), ("other", "prepared", "rejected")])
    assert any(".optmp-" in p for p in doc["removed"])  # would remove the receipt tmp
    assert snapshot(repo) == before
    text = run_cli("recover", "--repo", str(repo.path), "--dry-run", "--tmp-age", "0")
    assert text.code == 0 and text.out.startswith("plan: 2 receipt(s)")
    assert f"{KEY}: prepared -> committed" in text.out and "other: prepared -> rejected" in text.out
    assert "would remove" in text.out
    assert snapshot(repo) == before

    leftovers = sorted(str(p) for p in (repo.path / ".git").glob(".*.optmp-*"))
    assert leftovers and set(leftovers) <= set(doc["removed"]), "the dead calls' tmp files in the git dir"
    real = recover(repo, "--tmp-age", "0")
    assert sorted((r["key"], r["from"], r["to"]) for r in real.json["rows"]) == rows
    # What the plan lists is removed: by the cleanup, or while settling a receipt (named in its notes).
    notes = " ".join(n for r in real.json["rows"] for n in r["notes"])
    assert all(p in real.json["removed"] or f"'{p}'" in notes for p in doc["removed"]), (doc, real.json)
    assert not list((repo.path / ".git").glob(".*.optmp-*"))
    assert {r["key"]: r["commit"] for r in real.json["rows"]} == {r["key"]: r["commit"] for r in doc["rows"]}


# -- a live owner's key is never touched -------------------------------------------------------------

HOLDER = """
import sys, filelock
lk = filelock.FileLock(sys.argv[1], thread_local=False)
lk.acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def test_key_locked_by_a_live_process_is_skipped_untouched(tmp_path: Path) -> None:
    repo, _pf = crashed(tmp_path, "after-ref")
    lock = repo.store / "locks" / f"{h(KEY)}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        before = snapshot(repo)
        for extra in ((), ("--dry-run",)):
            r = recover(repo, *extra)
            assert r.code == 5, r.err  # something is left unresolved: in progress
            assert r.json["rows"] == []
            assert r.json["skipped"] == [{"key": KEY, "reason": "locked by a live process"}]
            assert snapshot(repo) == before
        assert receipt(repo).status == "prepared"
    finally:
        holder.kill()
        holder.wait()
    r = recover(repo)
    assert [(x["key"], x["to"]) for x in r.json["rows"]] == [(KEY, "committed")]
    assert r.json["skipped"] == []


# -- SIGKILL at exact system calls (strace fault injection) ------------------------------------------

needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


def apply_killed_at(repo: Repo, pf: Path, path: Path, syscalls: str, key: str = KEY, nth: int = 1) -> None:
    """Run ``apply`` under strace, SIGKILLed on entry to the ``nth`` of ``syscalls`` on ``path``."""
    cmd = ["strace", "-f", "-qq", "-o", os.devnull, "-P", str(path), "-e", f"trace={syscalls}",
           "-e", f"inject={syscalls}:signal=KILL:when={nth}", sys.executable, "-m", "patcher.cli", "apply",
           "--repo", str(repo.path), "--key", key, "--json", str(pf)]
    res = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    if b"ptrace" in res.stderr and b"Operation not permitted" in res.stderr:
        pytest.skip("ptrace is not permitted here")
    assert res.returncode in (137, -9), (res.returncode, res.stdout, res.stderr)


RENAMES = "rename,renameat,renameat2"


@needs_strace
def test_kill_between_reflog_and_ref_rename_is_not_applied(tmp_path: Path) -> None:
    """libgit2 appends the branch's reflog entry *before* renaming ``main.lock``: killed in
    between, the reflog names the candidate but the branch never moved.  That call did not
    land: recover must say ``rejected`` (retryable), and the retry must commit it — never a
    ``committed`` receipt for a commit the branch does not have."""
    repo, pf = make_patch(tmp_path)
    base = repo.head("main")
    apply_killed_at(repo, pf, repo.path / ".git/refs/heads/main.lock", RENAMES)
    r = receipt(repo)
    assert r.status == "prepared" and repo.head("main") == base
    reflog = (repo.path / ".git/logs/refs/heads/main").read_text()
    assert r.candidate in reflog  # the torn transaction's evidence
    assert (repo.path / ".git/refs/heads/main.lock").exists()

    plan = recover(repo, "--dry-run")
    assert [(x["to"], x["reason"]) for x in plan.json["rows"]] == [("rejected", "crashed_before_commit")]
    assert (repo.path / ".git/refs/heads/main.lock").exists()  # a dry run removes nothing

    rec = recover(repo)
    assert rec.code == 0, rec.err
    assert [(x["to"], x["reason"]) for x in rec.json["rows"]] == [("rejected", "crashed_before_commit")]
    assert not (repo.path / ".git/refs/heads/main.lock").exists()  # provably ours: removed
    assert repo.head("main") == base

    again = apply(repo, pf)
    assert again.code == 0, again.out + again.err
    doc = again.json
    head = repo.head("main")
    assert doc["replayed"] is False and doc["commit"] == head and repo.head(f"{head}^") == base
    assert "line 7 changed" in (repo.path / "src/app.py").read_text()
    assert commits_with_trailer(repo.path, doc["call_id"], "main") == [head]
    assert run_cli("verify", "--repo", str(repo.path)).code == 0
    assert fsck(repo.path)[0]


@needs_strace
def test_kill_holding_libgit2s_empty_branch_lock(tmp_path: Path) -> None:
    """When libgit2 moves the branch (here: a folder where its reflog goes), its ``main.lock`` is
    created empty and filled only at commit.  Killed in between, the lock is empty: the marker
    the call wrote just before libgit2 locked proves it ours, so recover removes it."""
    repo, pf = make_patch(tmp_path)
    base = repo.head("main")
    log = repo.path / ".git/logs/refs/heads/main"
    log.unlink()
    log.mkdir()  # the files-backend path leaves this branch to libgit2
    lock = repo.path / ".git/refs/heads/main.lock"
    apply_killed_at(repo, pf, lock, "write,pwrite64")
    assert lock.exists() and lock.read_bytes() == b"" and repo.head("main") == base
    markers = [p for p in (repo.store / "tmp").iterdir() if p.name.startswith("ref-lock-")]
    assert len(markers) == 1

    rec = recover(repo)
    assert rec.code == 0, rec.err
    assert [(x["to"], x["reason"]) for x in rec.json["rows"]] == [("rejected", "crashed_before_commit")]
    assert not lock.exists() and not markers[0].exists()
    again = apply(repo, pf)
    assert again.code == 0, again.out + again.err
    assert repo.head("main") == again.json["commit"] and repo.head("main~1") == base


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("where", ["before-marker", "after-ref"])
def test_kill_holding_index_lock_after_the_ref_moved(tmp_path: Path, where: str) -> None:
    """The call holds the worktree's ``index.lock`` (``oncepatch-index-lock <pid> <host>``) from
    before the branch moves until the index is written.  Killed after the move — with its store
    marker (crash point ``after-ref``) or before the marker was renamed into place — recover
    removes the provably stale lock before settling (so it never waits on it), brings worktree
    and index to the commit, and the next call works normally."""
    repo, pf = make_patch(tmp_path)
    index_lock = repo.path / ".git/index.lock"
    marker = repo.store / "tmp" / f"index-lock-{h(KEY)}"
    assert apply(repo, pf, env={"ONCEPATCH_CRASH_AT": "after-ref"}).code == 137
    if where == "before-marker":
        # strace -P does not match a rename's second path, so this state is made by hand:
        # the same files, with the marked lock of a pid that is gone, and no marker.
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
        index_lock.write_bytes(b"oncepatch-index-lock %d %s\n" % (dead_pid(), socket.gethostname().encode()))
    assert index_lock.read_bytes().startswith(b"oncepatch-index-lock ")
    assert receipt(repo).status == "prepared"

    t0 = time.monotonic()
    rec = recover(repo)
    took = time.monotonic() - t0
    assert rec.code == 0, rec.err
    assert [(x["from"], x["to"]) for x in rec.json["rows"]] == [("prepared", "committed")]
    assert not index_lock.exists() and not marker.exists()
    assert took < 8, f"recover waited on the stale index.lock ({took:.1f}s): {rec.json}"
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert receipt(repo).status == "committed"

    # The next call is not hindered by leftovers.
    pf2 = patch_for(repo, tmp_path / "next.diff", "line 15", "pkg/next.txt")
    nxt = apply(repo, pf2, key="next")
    assert nxt.code == 0, nxt.out + nxt.err
    assert "warnings" not in nxt.json
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


def test_a_later_call_settles_the_dead_call_whose_index_lock_it_meets(tmp_path: Path) -> None:
    """A call killed after its branch moved leaves its marked ``index.lock``: the index and file it
    touched still show the base.  A later call (another key, another file) must not just remove
    that lock: ``git commit -a`` would then commit the stale index and revert the dead call's
    change.  It settles the dead call first, as recover does: its receipt committed, its path
    brought along, and a human commit afterwards keeps both changes."""
    repo, pf = make_patch(tmp_path)
    assert apply(repo, pf, env={"ONCEPATCH_CRASH_AT": "after-ref"}).code == 137
    assert (repo.path / ".git/index.lock").exists()
    dead = receipt(repo)
    assert dead.status == "prepared"

    other = tmp_path / "other.diff"
    text = (repo.path / "README").read_text()
    other.write_text("--- a/README\n+++ b/README\n@@ -1 +1 @@\n-" + text + "+readme changed\n")
    nxt = apply(repo, other, key="other")
    assert nxt.code == 0, nxt.out + nxt.err
    assert receipt(repo).status == "committed" and receipt(repo).commit == dead.candidate
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert "line 7 changed" in (repo.path / "src/app.py").read_text()
    assert not (repo.path / ".git/index.lock").exists()
    assert not list((repo.store / "tmp").glob("index-lock-*"))

    repo.write("docs/guide.txt", "guide by hand\n")
    repo.git("commit", "-qam", "by hand")
    assert "line 7 changed" in repo.git("show", "HEAD:src/app.py")
    assert repo.git("show", "HEAD:README") == "readme changed\n"
    assert run_cli("verify", "--repo", str(repo.path)).code == 0
    rec = recover(repo)
    assert rec.code == 0 and rec.json["rows"] == [], rec.out


def test_a_dead_calls_index_lock_stays_while_its_call_cannot_be_settled(tmp_path: Path) -> None:
    """The repository moved after a crash, its store (outside it) did not: its receipt cannot be settled from
    the path it names. The lock is what keeps git commit from committing the stale index over the change, so
    neither recover nor a later apply removes it; both say to settle the call first."""
    repo, pf = make_patch(tmp_path)
    store = tmp_path / "store"
    assert apply(repo, pf, "--store", str(store), env={"ONCEPATCH_CRASH_AT": "after-ref"}).code == 137
    moved = Repo(tmp_path / "moved")
    os.rename(repo.path, moved.path)
    lock = moved.path / ".git/index.lock"
    rec = recover(moved, "--store", str(store))
    assert rec.code == 5 and rec.json["skipped"], rec.out
    assert lock.exists() and str(lock) not in rec.json["removed"]
    other = tmp_path / "other.diff"
    other.write_text("--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n")
    nxt = apply(moved, other, "--store", str(store), key="other")
    assert nxt.code == 5, nxt.out + nxt.err
    err = nxt.json["error"]
    assert (err["reason"], err["next_action"], err["keys"]) == ("crashed_call_unsettled", "recover", [KEY])
    assert lock.exists()
    blocked = subprocess.run(["git", "commit", "-qam", "by hand"], cwd=moved.path, capture_output=True, check=False)
    assert blocked.returncode != 0 and b"index.lock" in blocked.stderr


def test_a_repository_moved_with_its_store_is_settled_and_verified_where_it_is(tmp_path: Path) -> None:
    """The default store lives in the repository's git dir: moved (or copied) with it, its receipts are the
    moved repository's. recover settles the crashed call there; verify checks there (it failed for good,
    and the installed hook blocked every commit; a copy was checked against the original)."""
    repo, pf = make_patch(tmp_path)
    assert apply(repo, pf, env={"ONCEPATCH_CRASH_AT": "after-ref"}).code == 137
    moved = Repo(tmp_path / "moved")
    os.rename(repo.path, moved.path)
    rec = recover(moved)
    assert rec.code == 0 and [(x["from"], x["to"]) for x in rec.json["rows"]] == [("prepared", "committed")], rec.out
    assert not (moved.path / ".git/index.lock").exists()
    assert moved.git("status", "--porcelain", "--untracked-files=all") == ""
    assert run_cli("verify", "--repo", str(moved.path)).code == 0
    copy = Repo(tmp_path / "copy")
    shutil.copytree(moved.path, copy.path, symlinks=True)
    copy.git("reset", "-q", "--hard", "HEAD~1")
    for ref in copy.git("for-each-ref", "--format=%(refname)", "refs/oncepatch/keys").split():
        copy.git("update-ref", "-d", ref)
    copy.git("reflog", "expire", "--expire=now", "--all")
    copy.git("gc", "-q", "--prune=now")
    assert run_cli("verify", "--repo", str(copy.path)).code == 6  # the copy lost the commit; the original has it
    assert run_cli("verify", "--repo", str(moved.path)).code == 0


def test_another_stores_calls_and_recover_leave_a_dead_calls_index_lock_to_its_store(tmp_path: Path) -> None:
    """A call through ``--store A`` killed after its branch moved: its index.lock names store A. The default
    store's apply and recover used to remove it (the next 'git commit' then reverted the change); they now
    leave it and say which store settles it. That store's recover does, and a human commit keeps the change."""
    repo, pf = make_patch(tmp_path)
    store_a = tmp_path / "storeA"
    assert apply(repo, pf, "--store", str(store_a), env={"ONCEPATCH_CRASH_AT": "after-ref"}).code == 137
    lock = repo.path / ".git/index.lock"
    assert lock.exists()
    rec = recover(repo)
    assert rec.code == 0 and str(lock) not in rec.json["removed"], rec.out
    assert lock.exists()
    other = tmp_path / "other.diff"
    other.write_text("--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n")
    nxt = apply(repo, other, key="other")
    assert nxt.code == 5, nxt.out + nxt.err
    err = nxt.json["error"]
    assert (err["reason"], err["next_action"], err["store"]) == ("crashed_call_other_store", "recover",
                                                                 str(store_a))
    assert lock.exists()
    settled = recover(repo, "--store", str(store_a))
    assert settled.code == 0, settled.out
    assert not lock.exists()
    assert apply(repo, other, key="other").code == 0
    repo.write("docs/guide.txt", "guide by hand\n")
    repo.git("commit", "-qam", "by hand")
    assert "line 7 changed" in repo.git("show", "HEAD:src/app.py")
    assert repo.git("show", "HEAD:README") == "hello there\n"


@pytest.mark.parametrize("index", ["staged_ahead", "base"])
def test_recover_keeps_a_file_edited_since_the_crash_and_stages_the_commits_version(tmp_path: Path,
                                                                                    index: str) -> None:
    """Killed after the branch moved, the touched file then edited by hand: recover keeps the edit
    (never overwrites it), but the index must not keep the base: that is a staged revert of the
    commit, which the next ``git commit`` would make.  The index gets the commit's entry; the edit
    shows as an unstaged change, and a second recover has nothing to do.

    ``staged_ahead``: the index as the call left it (the commit's entries, staged before the move).
    ``base``: the index it replaced put back by hand, as a call that moved the branch first left
    it: recover stages the commit's entry itself."""
    repo, pf = make_patch(tmp_path)
    assert apply(repo, pf, env={"ONCEPATCH_CRASH_AT": "after-ref"}).code == 137
    (kept,) = (repo.path / ".git").glob("index.oncepatch-base.*")
    if index == "base":
        os.replace(kept, repo.path / ".git/index")
    edited = (repo.path / "src/app.py").read_text() + "edited by hand\n"
    repo.write("src/app.py", edited)

    rec = recover(repo)
    assert rec.code == 0, rec.err
    notes = " ".join(n for row in rec.json["rows"] for n in row.get("notes", []))
    assert "alone" in notes, rec.out
    assert ("staged the commit's version" in notes) is (index == "base"), rec.out
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))
    assert (repo.path / "src/app.py").read_text() == edited
    assert repo.git("diff", "--cached", "--name-only") == ""  # nothing staged against the commit
    assert repo.git("status", "--porcelain", "--", "src/app.py") == " M src/app.py\n"
    assert repo.git("ls-files", "-s", "src/app.py").split()[1] == repo.git("rev-parse", "HEAD:src/app.py").strip()
    repo.write("docs/guide.txt", "another file\n")
    repo.git("add", "docs/guide.txt")
    repo.git("commit", "-qm", "another file")  # commits the index: the change stays
    assert "line 7 changed" in repo.git("show", "HEAD:src/app.py")
    again = recover(repo)
    assert again.code == 0 and again.json["rows"] == [], again.out


@needs_strace
@pytest.mark.parametrize("nth", [1, 2])
def test_kill_right_after_taking_index_lock(tmp_path: Path, nth: int) -> None:
    """A call takes the worktree's ``index.lock`` more than once (today: briefly for the dirty-path
    check, before its key lock and receipt; then from before the ref update on).  SIGKILLed right
    after the lock (born with its mark) is linked into place (the ``nth`` time), no store marker names the lock
    yet, and the call may have no receipt or one that did not land — nothing to settle.  recover
    must still remove the lock, or every later call would wait on it and fail (found by the
    kill -9 torture: a round where every re-run exited 5)."""
    repo, pf = make_patch(tmp_path)
    index_lock = repo.path / ".git/index.lock"
    apply_killed_at(repo, pf, index_lock, "lstat,newfstatat,statx", nth=nth)
    assert index_lock.read_bytes().startswith(b"oncepatch-index-lock ")

    plan = recover(repo, "--dry-run")
    assert str(index_lock) in plan.json["removed"] and index_lock.exists()
    rec = recover(repo)
    assert rec.code == 0, rec.err
    assert not index_lock.exists()
    t0 = time.monotonic()
    again = apply(repo, pf)
    assert again.code == 0, again.out + again.err
    assert time.monotonic() - t0 < 8  # did not wait on a lock
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    assert commits_with_trailer(repo.path, again.json["call_id"], "main") == [repo.head("main")]
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


@needs_strace
def test_kill_while_taking_the_index_lock_leaves_no_lock(tmp_path: Path) -> None:
    """The index lock is born with its mark (a tmp file link()ed to ``index.lock``): a call
    killed on that link leaves no ``index.lock`` at all — never an empty one that nothing could
    prove a dead oncepatch call's — so the next call is not blocked."""
    repo, pf = make_patch(tmp_path)
    index_lock = repo.path / ".git/index.lock"
    apply_killed_at(repo, pf, index_lock, "link,linkat")
    assert not index_lock.exists()
    rec = recover(repo)
    assert rec.code == 0, rec.err
    t0 = time.monotonic()
    again = run_cli("apply", "--repo", str(repo.path), "--key", KEY, "--json", str(pf))
    assert again.code == 0, again.out + again.err
    assert time.monotonic() - t0 < 8  # did not wait on a lock
    assert repo.git("status", "--porcelain") == ""


@needs_strace
def test_a_call_killed_writing_an_object_leaves_no_tmp_file_after_recover(tmp_path: Path) -> None:
    """libgit2 writes a loose object to ``objects/tmp_object_git2_*`` and links it into place (then
    unlinks the tmp file): a call killed on its first link leaves the tmp file; ``recover --tmp-age 0`` removes it (as ``git prune``
    would past its expiry), and the retry lands with fsck clean."""
    repo, pf = make_patch(tmp_path)
    repo.git("branch", "side")  # not checked out: the call's first link() is its first object's
    base = repo.head("side")
    links = "link,linkat,rename,renameat,renameat2"
    cmd = ["strace", "-f", "-qq", "-o", os.devnull, "-e", f"trace={links}",
           "-e", f"inject={links}:signal=KILL:when=1", sys.executable, "-m", "patcher.cli", "apply",
           "--repo", str(repo.path), "--key", KEY, "--json", "--branch", "side", str(pf)]
    res = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    if b"ptrace" in res.stderr and b"Operation not permitted" in res.stderr:
        pytest.skip("ptrace is not permitted here")
    assert res.returncode in (137, -9), (res.returncode, res.stdout, res.stderr)
    objects = repo.path / ".git/objects"
    left = [p for p in objects.iterdir() if p.name.startswith("tmp_")]
    assert left, sorted(p.name for p in objects.iterdir())
    assert receipt(repo) is None and repo.head("side") == base  # killed before its receipt
    kept = recover(repo)  # the default age: a writer may still be filling a fresh one
    assert kept.code == 0, kept.err
    assert all(p.exists() for p in left)
    rec = recover(repo, "--tmp-age", "0")
    assert rec.code == 0, rec.err
    assert not [p for p in objects.iterdir() if p.name.startswith("tmp_")]
    assert set(map(str, left)) <= set(rec.json["removed"]), rec.json
    again = run_cli("apply", "--repo", str(repo.path), "--key", KEY, "--json", "--branch", "side", str(pf))
    assert again.code == 0, again.out + again.err
    repo.git("fsck", "--full", "--strict")


def test_dead_calls_tmp_files_in_the_worktree_are_removed(tmp_path: Path) -> None:
    """A call killed while writing a touched file leaves ``.<name>.optmp-<pid>-<rand>`` beside it
    (found by the torture: an untracked file in the user's worktree), ``index.optmp-<pid>``
    beside the index.  Settling removes those of dead pids — never a live process's."""
    repo, _pf = crashed(tmp_path, "after-ref")  # touches src/app.py and pkg/added.txt
    dead = dead_pid()
    (repo.path / "pkg").mkdir(exist_ok=True)
    stray = repo.path / "pkg" / f".added.txt.optmp-{dead}-0badf00d"
    stray.write_bytes(b"half a fi")
    index_tmp = repo.path / ".git" / f"index.optmp-{dead}"
    index_tmp.write_bytes(b"DIRC")
    lock_tmp = repo.path / ".git" / f".index.lock.optmp-{dead}"  # a mark not yet linked to index.lock
    lock_tmp.write_bytes(b"oncepatch-index-lock %d\n" % dead)
    live_index_tmp = repo.path / ".git" / f"index.optmp-{os.getpid()}"
    live_index_tmp.write_bytes(b"DIRC")
    live = repo.path / "src" / f".app.py.optmp-{os.getpid()}-12345678"
    live.write_bytes(b"being written")
    rec = recover(repo)
    assert rec.code == 0, rec.err
    assert not stray.exists() and not index_tmp.exists() and not lock_tmp.exists()
    assert live.exists() and live_index_tmp.exists()
    live_index_tmp.unlink()
    notes = rec.json["rows"][0]["notes"]
    assert any(str(stray) in n for n in notes) and any(str(index_tmp) in n for n in notes), notes
    live.unlink()
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""


def test_live_gits_index_lock_is_never_removed(tmp_path: Path) -> None:
    """An ``index.lock`` that is not provably a dead oncepatch call's is left alone, even with
    that call's marker beside it: here someone removed the crashed call's lock by hand and a
    ``git commit`` (index data in its lock) holds it now.  recover still commits the receipt,
    never deleting a live git's lock; the worktree needs no follow-up (written ahead of the move)."""
    repo, pf = crashed(tmp_path, "after-ref")
    index_lock = repo.path / ".git/index.lock"
    index_lock.unlink(missing_ok=True)  # the user's 'rm .git/index.lock' ...
    time.sleep(0.05)
    index_lock.write_bytes((repo.path / ".git/index").read_bytes())  # ... then git took it
    rec = recover(repo, "--lock-timeout", "0.5")  # a live git's lock: waiting longer changes nothing
    assert rec.code == 0, rec.err
    assert [(x["from"], x["to"]) for x in rec.json["rows"]] == [("prepared", "committed")]
    assert index_lock.exists()
    assert not any("follow-up not done" in n for n in rec.json["rows"][0]["notes"]), rec.json
    assert "line 7 changed" in (repo.path / "src/app.py").read_text()


def test_status_by_call_id_reports_a_corrupt_receipt(tmp_path: Path) -> None:
    repo, pf = make_patch(tmp_path)
    ok = apply(repo, pf)
    assert ok.code == 0
    call_id = ok.json["call_id"]
    (path,) = repo.store.glob("receipts/*/*.json")
    doc = path.read_text()
    path.write_text(doc.replace('"fencing_token": 1', '"fencing_token": 2'))
    for ask in (KEY, call_id):
        r = run_cli("status", ask, "--repo", str(repo.path), "--json")
        assert r.code == 6, (ask, r.out + r.err)
        assert r.json["error"]["type"] == "corrupt_receipt"
    assert run_cli("status", KEY, "--repo", str(repo.path), "--json").json["error"]["key"] == KEY


def test_a_call_id_finds_its_valid_receipt_beside_a_corrupt_copy_of_it(tmp_path: Path) -> None:
    repo, pf = make_patch(tmp_path)
    # sha256("b") sorts before sha256("a"): the stray copy is met first in a scan.
    assert h("b") < h("a")
    assert apply(repo, pf, key="b").code == 0
    ok = run_cli("apply", str(pf), "--key", "a", "--attempt", "2", "--repo", str(repo.path), "--json")
    assert ok.code == 0
    files = {p: p.read_text() for p in repo.store.glob("receipts/*/*.json")}
    mine = next(p for p, t in files.items() if ok.json["call_id"] in t)
    other = next(p for p in files if p != mine)
    other.write_text(files[mine])  # a stray copy under the other key's name, whichever sorts first
    r = run_cli("status", ok.json["call_id"], "--repo", str(repo.path), "--json")
    assert r.code == 0 and r.json["receipt"]["key"] == "a", r.out


def test_a_digest_of_the_wrong_type_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    repo, pf = make_patch(tmp_path)
    assert apply(repo, pf).code == 0
    (path,) = repo.store.glob("receipts/*/*.json")
    doc = json.loads(path.read_text())
    doc["receipt_sha256"] = [doc["receipt_sha256"]]
    path.write_text(json.dumps(doc))
    r = recover(repo)
    assert r.code == 6 and "Traceback" not in r.err, r.out + r.err
    assert r.json["corrupt"][0]["reason"] == "wrong type of field 'receipt_sha256'"


def test_dry_run_lists_each_leftover_once_with_a_linked_worktree(tmp_path: Path) -> None:
    repo, pf = make_patch(tmp_path)
    repo.git("branch", "side")
    repo.git("worktree", "add", "-q", str(tmp_path / "side-wt"), "side")
    assert apply(repo, pf, env={"ONCEPATCH_CRASH_AT": "after-prepare"}).code == 137
    plan = recover(repo, "--dry-run")
    assert plan.code == 0
    assert plan.json["removed"] and len(plan.json["removed"]) == len(set(plan.json["removed"]))

"""`git commit` racing `oncepatch apply` on the same checked-out branch (issue 4).

Both sides use git's own lock files: the branch's ``refs/heads/main.lock``
(oncepatch through libgit2's reference transaction, re-reading the ref under
the lock) and the worktree's ``index.lock``.  A side that meets the other's
lock fails and its loop retries: git with "cannot lock ref" / "index.lock:
File exists", oncepatch with exit 5.  Afterwards nothing of either side is
lost — every commit is in ``git log`` and every change is in the final tree,
the worktree and the index.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot, wait_paused
from test_concurrency import (  # noqa: F401  (workers: the fixture)
    DEADLINE,
    apply_argv,
    assert_worktree_equals_head,
    key_hash,
    trailer_counts,
    verify_ok,
    workers,
)

GIT_COMMITS = 40
ONCEPATCH_WORKERS = 2
ONCEPATCH_CALLS = 20

GIT_LOOP = r"""
set -u
fail=0
for i in $(seq 1 "$1"); do
  printf 'git %s\n' "$i" > "g$i.txt"
  n=0
  # git refuses (exit 128) while oncepatch holds index.lock or the branch's lock: retry.
  until git add "g$i.txt" 2>>git-errors.log; do n=$((n+1)); [ $n -gt 2000 ] && exit 3; sleep 0.005; done
  until git commit -q -m "git loop $i" 2>>git-errors.log; do
    n=$((n+1)); [ $n -gt 2000 ] && exit 4; sleep 0.005
  done
done
"""


def test_git_commit_loop_and_oncepatch_loops_lose_nothing(tmp_path: Path, workers: Any) -> None:
    files: dict[str, str | bytes] = {"README": "race\n"}
    files.update({f"op/w{w}-{j}.txt": f"file {w} {j}\n" for w in range(ONCEPATCH_WORKERS)
                  for j in range(ONCEPATCH_CALLS)})
    repo = make_repo(tmp_path / "repo", files)
    (repo.path / ".git" / "info" / "exclude").write_text("git-errors.log\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    batch = workers()
    for w in range(ONCEPATCH_WORKERS):
        jobs = []
        for j in range(ONCEPATCH_CALLS):
            p = patches / f"{w}-{j}.diff"
            p.write_text(f"--- a/op/w{w}-{j}.txt\n+++ b/op/w{w}-{j}.txt\n@@ -1 +1,2 @@\n file {w} {j}\n"
                         f"+oncepatch {w} {j}\n")
            # exit 5: the branch's or the index's lock stayed held by git: retry, like git's loop.
            jobs.append({"name": f"{w}-{j}", "argv": apply_argv(repo, p, f"k-{w}-{j}"), "retry_on": [5],
                         "retries": 200})
        batch.add(jobs)
    batch.release()
    git_loop = subprocess.Popen(["bash", "-c", GIT_LOOP, "git-loop", str(GIT_COMMITS)], cwd=repo.path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = git_loop.communicate(timeout=DEADLINE)
    finally:
        if git_loop.poll() is None:
            git_loop.kill()
            git_loop.communicate()
    results = [r for n in range(ONCEPATCH_WORKERS) for r in batch.wait(n)]
    assert git_loop.returncode == 0, err.decode()

    git_errors = (repo.path / "git-errors.log").read_text()
    retried = Counter(r.attempts.count(5) for r in results)
    print(f"\ngit side: {git_errors.count('fatal') + git_errors.count('error')} refusals; "
          f"oncepatch side: calls by number of exit-5 retries {dict(sorted(retried.items()))}")
    assert [r.code for r in results] == [0] * len(results), [r.out for r in results if r.code]
    assert all(set(r.attempts) <= {0, 5} for r in results)

    # Every commit of either side is in the history, once.
    subjects = Counter(repo.git("log", "--format=%s", "main").splitlines())
    for i in range(1, GIT_COMMITS + 1):
        assert subjects[f"git loop {i}"] == 1, i
    assert trailer_counts(repo) == Counter({key_hash(f"k-{r.name}"): 1 for r in results})
    assert repo.count() == 1 + GIT_COMMITS + len(results)
    on_branch = set(repo.git("rev-list", "main").split())
    assert {r.json["commit"] for r in results} <= on_branch

    # ... and every change of either side is in the final tree, the worktree and the index.
    tree = {line.split("\t")[1]: line.split()[2] for line in repo.git("ls-tree", "-r", "main").splitlines()}
    for i in range(1, GIT_COMMITS + 1):
        assert repo.git("cat-file", "blob", tree[f"g{i}.txt"]) == f"git {i}\n"
    for w in range(ONCEPATCH_WORKERS):
        for j in range(ONCEPATCH_CALLS):
            want = f"file {w} {j}\noncepatch {w} {j}\n"
            assert repo.git("cat-file", "blob", tree[f"op/w{w}-{j}.txt"]) == want, (w, j)
            assert (repo.path / f"op/w{w}-{j}.txt").read_text() == want
    assert_worktree_equals_head(repo)
    verify_ok(repo)


def _paused_apply(repo: Repo, patch: bytes, *extra: str, at: str = "after-prepare") -> subprocess.Popen[bytes]:
    """``oncepatch apply`` stopped (SIGSTOP, the ``ONCEPATCH_PAUSE_AT`` seam) at ``at``."""
    import os
    import sys
    import time

    (repo.path / ".git/race.diff").write_bytes(patch)
    env = dict(os.environ, ONCEPATCH_PAUSE_AT=at)
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(repo.path / ".git/race.diff"),
                             "--repo", str(repo.path), "--json", "--key", "K", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_paused(proc, DEADLINE)
    return proc


def _resume(proc: subprocess.Popen[bytes]) -> tuple[int, Any]:
    import json
    import signal

    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=DEADLINE)
    return proc.returncode, json.loads(out or b"{}")


PATCH_F = b"--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"

#: Files enough for an index of more than 1 MiB, which is swapped into place when staged
#: (``cas.index._EXCHANGE_MIN``), where a small one is renamed.
BULK_FILES = 7_000


def _race_repo(path: Path, files: dict[str, str], index: str = "small") -> Repo:
    """``make_repo``; with ``index="big"``, also ``BULK_FILES`` tracked files (an index above 1 MiB)."""
    if index == "small":
        return make_repo(path, files)
    path.mkdir(parents=True)
    for i in range(BULK_FILES):
        folder = path / f"bulk/d{i % 70:02d}"
        if i < 70:
            folder.mkdir(parents=True)
        (folder / f"{'long-name-' * 8}{i:05d}.txt").write_bytes(b"bulk\n")  # an entry of 168 bytes
    repo = make_repo(path, files)
    assert (path / ".git/index").stat().st_size > 1 << 20
    return repo


both_indexes = pytest.mark.parametrize("index", ["small", "big"])


def test_a_checkout_onto_the_branch_while_the_call_runs_moves_nothing(tmp_path: Path) -> None:
    """Planned with the branch checked out nowhere, then 'git checkout main' before the move: had
    the branch moved, the worktree's index (old main) would be a staged revert of the commit."""
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    repo.git("checkout", "-q", "-b", "t")
    proc = _paused_apply(repo, PATCH_F, "--branch", "main")
    repo.git("checkout", "-q", "main")
    code, doc = _resume(proc)
    assert code == 4 and doc["error"]["type"] == "conflict" and doc["error"]["retryable"], doc
    assert doc["error"]["reason"] == "worktree_switched"
    assert repo.count("main") == 1 and repo.git("status", "--porcelain") == ""
    again = run_cli(*apply_argv(repo, repo.path / ".git/race.diff", "K", "--branch", "main"))
    assert again.code == 0, again.out + again.err
    assert repo.git("status", "--porcelain") == "" and (repo.path / "f.txt").read_text() == "a\nB\nc\n"
    verify_ok(repo)


def test_a_switch_away_from_the_branch_while_the_call_runs_moves_nothing(tmp_path: Path) -> None:
    """Planned with main checked out, then 'git checkout -b t': main's files must not land on t."""
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    proc = _paused_apply(repo, PATCH_F, "--branch", "main")
    repo.git("checkout", "-q", "-b", "t")
    code, doc = _resume(proc)
    assert code == 4 and doc["error"]["reason"] == "worktree_switched", doc
    assert repo.count("main") == 1 and repo.git("status", "--porcelain") == ""
    assert (repo.path / "f.txt").read_text() == "a\nb\nc\n"


@pytest.mark.parametrize("at", ["after-prepare", "before-ref"])
def test_an_edit_made_while_the_call_waits_is_never_overwritten(tmp_path: Path, at: str) -> None:
    """A touched path found clean by the pre-check, then edited (not committed) before the move.

    Found by a race sweep: the call wrote its version over the person's edit
    and committed; the edit was in no commit and no file any more.  Now the
    touched paths are looked at again under the index locks: ``dirty_path``,
    retryable, nothing moved, the edit kept; stashed, the retry lands.
    """
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    proc = _paused_apply(repo, PATCH_F, at=at)
    (repo.path / "f.txt").write_text("a\nmine\nc\n")
    code, doc = _resume(proc)
    assert code == 4 and doc["error"]["type"] == "dirty_path" and doc["error"]["retryable"], doc
    assert doc["error"]["effect_status"] == "not_applied" and doc["error"]["paths"] == ["f.txt"], doc
    assert repo.count("main") == 1 and (repo.path / "f.txt").read_text() == "a\nmine\nc\n"
    assert repo.git("status", "--porcelain") == " M f.txt\n"
    repo.git("stash", "-q")
    again = run_cli(*apply_argv(repo, repo.path / ".git/race.diff", "K"))
    assert again.code == 0, again.out + again.err
    assert repo.count("main") == 2 and repo.git("status", "--porcelain") == ""
    assert (repo.path / "f.txt").read_text() == "a\nB\nc\n"
    verify_ok(repo)


def test_a_call_that_landed_on_the_same_file_meanwhile_is_no_edit(tmp_path: Path) -> None:
    """The look under the index locks compares with the branch's tip: another call's landed change of
    the same file (its worktree brought along) is not a person's edit; the paused call re-stages."""
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\nd\ne\nf\ng\n"})
    proc = _paused_apply(repo, b"--- a/f.txt\n+++ b/f.txt\n@@ -5,3 +5,3 @@\n e\n-f\n+F\n g\n")
    other = tmp_path / "other.diff"
    other.write_bytes(b"--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n")
    first = run_cli(*apply_argv(repo, other, "K2"))
    assert first.code == 0, first.out + first.err
    code, doc = _resume(proc)
    assert code == 0 and doc["ok"], doc
    assert repo.count("main") == 3 and repo.git("status", "--porcelain") == ""
    assert (repo.path / "f.txt").read_text() == "a\nB\nc\nd\ne\nF\ng\n"
    verify_ok(repo)


@both_indexes
def test_git_commit_that_read_the_index_during_the_move_commits_the_change(tmp_path: Path, index: str) -> None:
    """``git commit`` reads HEAD and the index *before* it takes ``index.lock``.

    The call is paused after its branch moved, holding ``index.lock``; ``git
    commit`` (a file of its own staged) reads the new HEAD and the index, and
    strace holds its ``index.lock`` create for five seconds; the call resumes,
    writes the files and releases the lock, then git takes it and commits what
    it read.  Had the index followed the branch, git would have read the old
    entry and committed a revert of the call's change on top of its commit.
    """
    import os
    import shutil
    import time

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install -y strace)")
    repo = _race_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"}, index)
    repo.write("g.txt", "git's own\n")
    repo.git("add", "g.txt")
    proc = _paused_apply(repo, PATCH_F, at="after-ref")
    git_dir = os.path.realpath(repo.path / ".git")
    log = tmp_path / "git.strace"
    git = subprocess.Popen([strace, "-f", "-qq", "-o", str(log), "-P", ".git/index",  # git opens it by this name
                            "-P", os.path.join(git_dir, "index.lock"), "-e", "trace=openat",
                            "-e", "inject=openat:delay_enter=5000000:when=2", "git", "commit", "-q", "-m", "git side"],
                           cwd=repo.path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + DEADLINE
    while b'index", O_RDONLY' not in (log.read_bytes() if log.exists() else b""):
        if git.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"git never read the index: {git.communicate()} {log.read_text() if log.exists() else ''}")
        time.sleep(0.005)
    code, doc = _resume(proc)  # while git waits, before its index.lock
    assert code == 0 and doc["status"] == "committed", doc
    out, err = git.communicate(timeout=DEADLINE)
    trace = log.read_text()
    delayed = [line for line in trace.splitlines() if "(DELAYED)" in line]
    if not delayed:
        pytest.skip(f"strace could not delay git's index.lock here: {trace[-500:]}")
    assert len(delayed) == 1 and "index.lock" in delayed[0], trace  # the index was read before, once
    assert git.returncode == 0, err.decode()
    assert repo.git("log", "--format=%s", "main").splitlines()[:2] == ["git side", "oncepatch: apply patch to f.txt"]
    assert repo.git("show", "main:f.txt") == "a\nB\nc\n"  # not reverted by git's commit
    assert repo.git("show", "main:g.txt") == "git's own\n"
    assert repo.git("status", "--porcelain") == ""
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))
    verify_ok(repo)


@both_indexes
def test_the_index_is_staged_before_the_branch_moves(tmp_path: Path, index: str) -> None:
    """After the move: HEAD, the index and the file agree on the touched path (all written ahead of the move)."""
    import os
    import signal

    repo = _race_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n", "h.txt": "h\n"}, index)
    proc = _paused_apply(repo, PATCH_F, at="after-ref")
    try:
        assert repo.git("diff-index", "--cached", "--name-only", "main") == ""  # index == HEAD
        assert (repo.path / "f.txt").read_text() == "a\nB\nc\n"  # the file was written before the move
        assert repo.git("diff", "--name-only") == ""  # ... and git sees it (the index's stat data follows)
        kept = list((repo.path / ".git").glob("index.oncepatch-base.*"))
        assert [k.name.rsplit(".", 1)[1] for k in kept] == [repo.head("main")]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    code, doc = _resume(proc)
    assert code == 0, doc
    assert repo.git("status", "--porcelain") == "" and repo.git("diff-files") == ""  # stat data written too
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))


def _can_exchange(folder: Path) -> bool:
    """Whether this system and filesystem swap names (else the staged index is renamed, as a small one)."""
    from cas.durable import exchange

    a, b = folder / "xchg-a", folder / "xchg-b"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    try:
        return exchange(str(a), str(b))
    finally:
        a.unlink()
        b.unlink()


@both_indexes
def test_a_big_staged_index_is_swapped_into_place_and_a_small_one_renamed(tmp_path: Path, index: str) -> None:
    """A staged index above 1 MiB goes in by ``renameat2(RENAME_EXCHANGE)``: ext4 starts writing out a
    file renamed over another, and the branch's rename would wait behind it.  The index with stat data
    that follows is renamed, synced; nothing of either is left beside the index."""
    import re
    import shutil
    import sys

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install -y strace)")
    repo = _race_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"}, index)
    patch = tmp_path / "p.diff"
    patch.write_bytes(PATCH_F)
    log = tmp_path / "apply.strace"
    run = subprocess.run([strace, "-f", "-qq", "-o", str(log), "-e", "trace=rename,renameat,renameat2",
                          sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path),
                          "--json", "--key", "K"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    into_index = [line for line in log.read_text().splitlines() if re.search(r'/\.git/index"', line)]
    swapped = ["RENAME_EXCHANGE" in line for line in into_index]
    assert swapped == ([_can_exchange(tmp_path), False] if index == "big" else [False, False]), into_index
    assert all(line.rstrip().endswith("= 0") for line in into_index), into_index
    assert repo.git("status", "--porcelain") == "" and repo.git("diff-files") == ""
    assert repo.git("show", "main:f.txt") == "a\nB\nc\n"
    left = [p.name for p in (repo.path / ".git").iterdir() if p.name.startswith("index") and p.name != "index"]
    assert left == [], left


def _commit_beside(repo: Repo, parent: str, files: dict[str, bytes]) -> str:
    """A commit on ``parent`` with a flat tree of ``files``, made without the index (for ``git update-ref``)."""
    lines = b"".join(b"100644 blob " + repo.git("hash-object", "-w", "--stdin", input=data).strip().encode()
                     + b"\t" + name.encode() + b"\n" for name, data in sorted(files.items()))
    tree = repo.git("mktree", input=lines).strip()
    return repo.git("commit-tree", "-p", parent, "-m", "elsewhere", tree).strip()


@both_indexes
def test_a_conflict_at_the_swap_brings_the_index_back_byte_for_byte(tmp_path: Path, index: str) -> None:
    """The branch moved (``git update-ref``, which takes no index lock) to a head the patch conflicts with:
    the index staged for the candidate is replaced by the one it replaced."""
    repo = _race_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"}, index)
    base = repo.head()
    proc = _paused_apply(repo, PATCH_F)
    before = snapshot(repo)
    other = _commit_beside(repo, base, {"f.txt": b"a\nX\nc\n"})
    repo.git("update-ref", "refs/heads/main", other, base)
    code, doc = _resume(proc)
    assert code == 4 and doc["error"]["type"] == "conflict", doc
    after = snapshot(repo)
    assert after["index"] == before["index"] and after["worktree"] == before["worktree"]
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))
    assert not (repo.path / ".git/index.lock").exists()


def test_a_restage_at_the_swap_stages_the_new_candidate(tmp_path: Path) -> None:
    """The branch moved elsewhere (another file): re-staged, the index is staged again for the new candidate."""
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n", "o.txt": "o\n"})
    base = repo.head()
    proc = _paused_apply(repo, PATCH_F)
    other = _commit_beside(repo, base, {"f.txt": b"a\nb\nc\n", "o.txt": b"O\n"})
    repo.git("update-ref", "refs/heads/main", other, base)
    code, doc = _resume(proc)
    assert code == 0 and doc["status"] == "committed", doc
    assert repo.git("rev-parse", f"{doc['commit']}^").strip() == other
    assert repo.git("ls-files", "-s", "f.txt").split()[1] == repo.git("rev-parse", "main:f.txt").strip()
    assert (repo.path / "f.txt").read_text() == "a\nB\nc\n"
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))


@both_indexes
def test_a_call_killed_with_its_index_staged_ahead_is_undone_by_the_next_call(tmp_path: Path, index: str) -> None:
    """Killed after staging the index, before the move: the next call (another key) settles the dead call
    (rejected) and brings the index it replaced back before it takes the lock, then lands its own change."""
    repo = _race_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n", "h.txt": "h\n"}, index)
    before = snapshot(repo)
    (repo.path / ".git/race.diff").write_bytes(PATCH_F)
    crashed = run_cli(*apply_argv(repo, repo.path / ".git/race.diff", "K"), env={"ONCEPATCH_CRASH_AT": "after-index-ahead"})
    assert crashed.code == 137, crashed.err
    assert (repo.path / ".git/index.lock").exists()
    assert snapshot(repo)["index"] != before["index"]  # staged for the candidate
    (repo.path / ".git/h.diff").write_bytes(b"--- a/h.txt\n+++ b/h.txt\n@@ -1 +1 @@\n-h\n+H\n")
    other = run_cli(*apply_argv(repo, repo.path / ".git/h.diff", "K2"))
    assert other.code == 0, other.out + other.err
    assert repo.git("show", "main:f.txt") == "a\nb\nc\n"  # the dead call did not land
    assert repo.git("status", "--porcelain") == ""  # and its staged entry is gone from the index
    assert repo.git("ls-files", "-s", "f.txt").split()[1] == repo.git("rev-parse", "main~1:f.txt").strip()
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))
    receipt = run_cli("status", "K", "--repo", str(repo.path), "--json").json["receipt"]
    assert receipt["status"] == "rejected" and receipt["retryable"] is True, receipt
    again = run_cli(*apply_argv(repo, repo.path / ".git/race.diff", "K"))  # the dead call's retry lands
    assert again.code == 0 and repo.git("show", "main:f.txt") == "a\nB\nc\n", again.out + again.err
    assert repo.git("status", "--porcelain") == ""


def test_an_index_that_cannot_be_staged_rejects_the_call_and_changes_nothing(tmp_path: Path) -> None:
    """The index kept aside cannot be linked (EIO injected by strace into that ``link``): the call is
    rejected before the branch moves (retryable), with repo, index, worktree and locks as they were."""
    import os
    import shutil
    import sys

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install -y strace)")
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    patch = tmp_path / "p.diff"
    patch.write_bytes(PATCH_F)
    before = snapshot(repo)
    log = tmp_path / "apply.strace"
    # The call's sixth link(): its index.lock (the dirty check), its three loose objects (libgit2
    # links each into place), its index.lock again (the move), then, under the branch's lock, the
    # kept index.
    run = subprocess.run([strace, "-f", "-qq", "-o", str(log), "-e", "trace=link,linkat",
                          "-e", "inject=link,linkat:error=EIO:when=6", sys.executable, "-m", "patcher.cli",
                          "apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K"],
                         capture_output=True, text=True)
    failed = [line for line in log.read_text().splitlines() if "EIO" in line]
    assert len(failed) == 1 and "index.oncepatch-base." in failed[0], log.read_text()
    import json

    doc = json.loads(run.stdout)
    assert run.returncode != 0 and doc["error"]["retryable"] is True, doc
    assert "cannot keep the index" in doc["error"]["message"], doc
    after = snapshot(repo)
    assert {k: v for k, v in after.items() if k != "store"} == {k: v for k, v in before.items() if k != "store"}
    assert not (repo.path / ".git/index.lock").exists()
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))
    receipt = run_cli("status", "K", "--repo", str(repo.path), "--json").json["receipt"]
    assert receipt["status"] == "rejected" and receipt["retryable"] is True, receipt
    again = run_cli("apply", str(patch), "--repo", str(repo.path), "--json", "--key", "K")
    assert again.code == 0 and repo.git("show", "main:f.txt") == "a\nB\nc\n", again.out + again.err
    assert repo.git("status", "--porcelain") == ""
    assert os.path.exists(repo.path / ".git/index")


def test_a_call_that_never_gets_the_branchs_lock_never_stages_the_index(tmp_path: Path) -> None:
    """The branch's ref lock is held (by a git, say): the call gives up (exit 5) without ever staging the
    index.  Staged before the lock, a ``git commit`` could have read the staged entries on the unmoved
    branch and committed them as its own once the call put the index back and let go."""
    import shutil
    import sys

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install -y strace)")
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    (repo.path / ".git/refs/heads/main.lock").write_bytes(b"")
    patch = tmp_path / "p.diff"
    patch.write_bytes(PATCH_F)
    before = snapshot(repo)
    log = tmp_path / "apply.strace"
    run = subprocess.run([strace, "-f", "-qq", "-o", str(log), "-e", "trace=link,linkat,rename,renameat,renameat2",
                          sys.executable, "-m", "patcher.cli", "apply", str(patch), "--repo", str(repo.path),
                          "--json", "--key", "K", "--lock-timeout", "1"], capture_output=True, text=True)
    assert run.returncode == 5, run.stdout + run.stderr
    trace = log.read_text()
    assert "index.lock" in trace  # the call did get as far as the index locks
    assert "index.oncepatch-base." not in trace and '/.git/index")' not in trace, trace
    after = snapshot(repo)
    assert after["index"] == before["index"] and after["worktree"] == before["worktree"]


def test_the_branch_moved_past_the_candidate_keeps_the_materialised_index(tmp_path: Path) -> None:
    """Between the move and the end of the call, something that takes no index lock (``git update-ref``)
    moved the branch on past the candidate: the index the call wrote stays (the candidate is on the
    branch); putting the kept one back would be a staged revert of the call's own change."""
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n", "o.txt": "o\n"})
    proc = _paused_apply(repo, PATCH_F, at="after-ref")
    candidate = repo.head("main")
    child = _commit_beside(repo, candidate, {"f.txt": b"a\nB\nc\n", "o.txt": b"O\n"})
    repo.git("update-ref", "refs/heads/main", child, candidate)
    code, doc = _resume(proc)
    assert code == 0 and doc["commit"] == candidate, doc
    assert repo.git("diff", "--cached", "--name-only", "--", "f.txt") == ""  # index == HEAD for the call's path
    assert (repo.path / "f.txt").read_text() == "a\nB\nc\n"
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))


def test_a_dead_lock_settles_only_its_own_kept_index(tmp_path: Path) -> None:
    """A call killed with its index staged, its lock then removed by hand (as git's message says), the
    user's own staging since: a later dead oncepatch lock of another pid, broken by the next call,
    must not bring the first call's kept index back over the user's index."""
    import socket

    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n", "h.txt": "h\n"})
    (repo.path / ".git/race.diff").write_bytes(PATCH_F)
    crashed = run_cli(*apply_argv(repo, repo.path / ".git/race.diff", "K"), env={"ONCEPATCH_CRASH_AT": "after-index-ahead"})
    assert crashed.code == 137, crashed.err
    (repo.path / ".git/index.lock").unlink()
    (repo.path / ".git/refs/heads/main.lock").unlink()
    repo.git("reset", "-q")  # the user drops the staged entry
    repo.write("g.txt", "new\n")
    repo.git("add", "g.txt")  # and stages work of their own
    gone = subprocess.Popen(["true"])
    gone.wait()
    (repo.path / ".git/index.lock").write_bytes(f"oncepatch-index-lock {gone.pid} {socket.gethostname()}\n".encode())
    (repo.path / ".git/h.diff").write_bytes(b"--- a/h.txt\n+++ b/h.txt\n@@ -1 +1 @@\n-h\n+H\n")
    other = run_cli(*apply_argv(repo, repo.path / ".git/h.diff", "K2"))
    assert other.code == 0, other.out + other.err
    assert "A  g.txt" in repo.git("status", "--porcelain")  # the user's staging survived
    assert not list((repo.path / ".git").glob("index.oncepatch-base.*"))  # the stale kept index is gone


def _rebase_stopped(repo: Repo, where: Path) -> None:
    """``feat`` (one commit on ``a.txt``) rebased onto ``main`` (another) in ``where``: stopped at the conflict."""
    repo.git("checkout", "-q", "-b", "feat")
    repo.write("a.txt", "feat\n")
    repo.commit_all("feat")
    repo.git("checkout", "-q", "main")
    repo.write("a.txt", "main\n")
    repo.commit_all("main")
    if where != repo.path:
        repo.git("checkout", "-q", "--detach")
        repo.git("worktree", "add", "-q", str(where), "feat")
    else:
        repo.git("checkout", "-q", "feat")
    res = subprocess.run(["git", "rebase", "main"], cwd=where, capture_output=True, check=False)
    assert res.returncode != 0 and b"CONFLICT" in res.stdout, res


@pytest.mark.parametrize("where", ["main-worktree", "linked-worktree"])
def test_a_branch_being_rebased_is_refused_and_the_rebase_finishes(tmp_path: Path, where: str) -> None:
    """A rebase of the branch stopped at a conflict (HEAD detached meanwhile): git counts the branch as
    checked out there.  Found by a race sweep: the call committed to it, then 'git rebase --continue'
    failed ("cannot lock ref 'refs/heads/feat': is at ... but expected ..."), the person's rebased
    commits left on a detached HEAD.  Now: ``conflict``, retryable, nothing written; after the rebase
    the retry lands on the rebased branch."""
    repo = make_repo(tmp_path / "repo", {"a.txt": "base\n"})
    at = repo.path if where == "main-worktree" else tmp_path / "linked"
    _rebase_stopped(repo, at)
    patch = tmp_path / "r.diff"
    patch.write_bytes(b"--- /dev/null\n+++ b/r.txt\n@@ -0,0 +1 @@\n+r\n")
    before = snapshot(repo)
    r = run_cli(*apply_argv(repo, patch, "R", "--branch", "feat"))
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert (err["type"], err["reason"], err["retryable"], err["effect_status"]) == (
        "conflict", "branch_rebasing", True, "not_started"), err
    assert snapshot(repo) == before
    (at / "a.txt").write_text("resolved\n")
    subprocess.run(["git", "add", "a.txt"], cwd=at, check=True)
    done = subprocess.run(["git", "-c", "core.editor=true", "rebase", "--continue"], cwd=at, capture_output=True,
                          check=False)
    assert done.returncode == 0, done
    again = run_cli(*apply_argv(repo, patch, "R", "--branch", "feat"))
    assert again.code == 0, again.out + again.err
    log = repo.git("log", "--format=%s", "feat").split("\n")
    assert log[:3] == ["oncepatch: apply patch to r.txt", "feat", "main"], log
    assert subprocess.run(["git", "status", "--porcelain"], cwd=at, capture_output=True, check=True).stdout == b""
    verify_ok(repo)


def test_a_branch_being_bisected_is_refused(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"a.txt": "base\n"})
    repo.write("a.txt", "two\n")
    repo.commit_all("two")
    repo.git("bisect", "start", "main", "main~1")
    patch = tmp_path / "r.diff"
    patch.write_bytes(b"--- /dev/null\n+++ b/r.txt\n@@ -0,0 +1 @@\n+r\n")
    before = snapshot(repo)
    r = run_cli(*apply_argv(repo, patch, "R", "--branch", "main"))
    assert r.code == 4 and r.json["error"]["reason"] == "branch_rebasing", r.out + r.err
    assert snapshot(repo) == before
    repo.git("bisect", "reset")
    assert run_cli(*apply_argv(repo, patch, "R")).code == 0

"""Applies beside a ``git pack-refs --all`` loop (issue 23): never ``internal``, never effect ``unknown``.

``git pack-refs --all`` moves every loose ref — the branch and oncepatch's key
refs under ``refs/oncepatch/keys/`` — into ``packed-refs`` and deletes the
loose files, taking ``packed-refs.lock`` and each ref's lock as it goes.  git
supports it beside concurrent writers: a writer that meets a lock held waits
or fails cleanly, and a ref read while it moves between the two places is
still read.  So an apply beside it ends committed, or rejected retryable
(exit 4, ``retryable: true``; the key is then applied again): never exit 1
``internal`` nor ``effect_status: unknown``.  Every key lands exactly once
(one commit carrying its ``Oncepatch-Key`` trailer; the branch grows by one
commit per key), and afterwards ``git fsck --full --strict`` and ``oncepatch
verify`` are clean.

Four workers apply their keys (each key adds its own file) through
``python -m patcher.cli apply``, one process per call, while the loop runs;
the work is bounded by counts, never by time.  The branch is ``main`` or
``agent/work``: a branch in a folder, whose folder ``pack-refs`` removes each
time it prunes the branch's loose file, as it removes the emptied
``refs/oncepatch/keys``.  The baseline runs git's own writers (``update-ref``
with the old value) on the same branches beside the same loop: fsck clean,
every commit on the branch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_repo
from maintenance_driver import (
    apply_each,
    outcomes_problems,
    MaintenanceLoop,
    fsck_full,
    git_apply_commit,
    Procs,
    final_problems,
    new_file_patch,
    run_workers,
)

WORKERS = 4
#: Applies per worker.  On ``agent/work`` about one apply in three meets the window today
#: (``pack-refs --prune`` removes the emptied ``refs/heads/agent`` folder after each move the
#: loop packs, and the next move makes it again): 24 applies meet it every run.  On ``main``
#: (``refs/heads`` is never removed) the window is the emptied ``refs/oncepatch/keys``
#: folder, met by about one apply in a hundred: 40 applies meet it in about one run in two,
#: the soak below every run.
PER_WORKER = {"main": 10, "agent/work": 6}


def _pack_refs_loop(tmp_path: Path, checked_out: bool, per_worker: int, name: str = "main") -> None:
    repo = make_repo(tmp_path / "repo", {"README": "pack-refs loop\n"})
    if name != "main":
        repo.git("branch", name)
    repo.git("checkout", "-q", name if checked_out else "-b", *(() if checked_out else ("side",)))
    branch = None if checked_out else name
    base = repo.count(name)
    patches: dict[str, Path] = {}
    for w in range(WORKERS):
        for i in range(per_worker):
            key = f"pr-w{w}-k{i}"
            p = tmp_path / f"{key}.diff"
            p.write_bytes(new_file_patch(f"w{w}/k{i}.txt", f"worker {w} key {i}"))
            patches[key] = p
    keys = list(patches)
    procs = Procs()
    try:
        with MaintenanceLoop(repo.path, procs, commands=(("pack-refs", "--all"),), min_cycles=5) as loop:
            outcomes = apply_each(procs, repo.path, patches, branch, WORKERS)
        problems = outcomes_problems(outcomes)
        problems += final_problems(procs, repo.path, name, base, keys, all_committed=True)
    finally:
        procs.reap()
    retries = sum(len(seen) - 1 for seen in outcomes.values())
    report = f"{len(keys)} keys, {retries} retried after a retryable rejection; {loop.describe()}"
    print(report)
    assert not problems, report + "\n" + "\n".join(problems)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["main", "agent/work"])
def test_applies_beside_a_pack_refs_loop_never_end_internal_or_unknown(tmp_path: Path, name: str) -> None:
    _pack_refs_loop(tmp_path, False, PER_WORKER[name], name)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("checked_out", [False, True], ids=["branch-not-checked-out", "branch-checked-out"])
def test_applies_beside_a_pack_refs_loop_soak(tmp_path: Path, checked_out: bool) -> None:
    _pack_refs_loop(tmp_path, checked_out, 50)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["main", "agent/work"])
def test_git_writers_beside_a_pack_refs_loop_stay_clean(tmp_path: Path, name: str) -> None:
    """The baseline: git's writers beside the same loop (a lost lock or swap is retried, nothing breaks).

    Asserted: the repository stays whole (fsck) and the branch holds no more
    commits than were written.  The commit count is reported, not asserted: git 2.39's own
    ``update-ref`` beside ``pack-refs --all`` has been seen to lose one update
    of a nested branch name in about one run in ten (60 of 61 commits), which
    is git's behaviour, not this project's; oncepatch's own applies beside the
    same loop are held to the exact count above.
    """
    repo = make_repo(tmp_path / "repo", {"README": "pack-refs loop\n"})
    if name != "main":
        repo.git("branch", name)
    repo.git("checkout", "-q", "-b", "side")
    base = repo.count(name)
    procs = Procs()
    retried: list[str] = []
    try:
        with MaintenanceLoop(repo.path, procs, commands=(("pack-refs", "--all"),), min_cycles=5) as loop:
            def work(w: int) -> None:
                for i in range(15):
                    p = tmp_path / f"g-w{w}-k{i}.diff"
                    p.write_bytes(new_file_patch(f"w{w}/k{i}.txt", f"worker {w} key {i}"))
                    retried.extend(git_apply_commit(procs, repo.path, p, tmp_path / f"index-{w}", branch=name))

            run_workers(WORKERS, work)
        clean, out = fsck_full(repo.path)
        count = repo.count(name)
    finally:
        procs.reap()
    print(f"{loop.describe()}; git's writers started over {len(retried)} times: {sorted(set(retried))[:3]}")
    assert clean, out
    assert count <= base + WORKERS * 15, f"{count - base} commits from {WORKERS * 15} writes"
    if count != base + WORKERS * 15:
        print(f"git lost {base + WORKERS * 15 - count} of {WORKERS * 15} updates beside the loop")

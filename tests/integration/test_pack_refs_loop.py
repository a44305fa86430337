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

Four workers apply twelve keys each (each key adds its own file) through
``python -m patcher.cli apply``, one process per call, while the loop runs;
the work is bounded by counts, never by time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_repo
from maintenance_driver import (
    MaintenanceLoop,
    Outcome,
    Procs,
    apply_until_settled,
    final_problems,
    new_file_patch,
    outcome_problem,
    run_workers,
)

WORKERS = 4
#: 48 applies: enough to meet, one run in two or so, the window the soak below meets about
#: once per hundred applies (``pack-refs --prune`` removing the emptied ``refs/oncepatch/keys``
#: folder between a call's making it and its creating the key ref's lock there).
PER_WORKER = 12


def _pack_refs_loop(tmp_path: Path, checked_out: bool, per_worker: int) -> None:
    repo = make_repo(tmp_path / "repo", {"README": "pack-refs loop\n"})
    if not checked_out:
        repo.git("checkout", "-q", "-b", "side")
    branch = None if checked_out else "main"
    base = repo.count("main")
    patches: dict[str, Path] = {}
    for w in range(WORKERS):
        for i in range(per_worker):
            key = f"pr-w{w}-k{i}"
            p = tmp_path / f"{key}.diff"
            p.write_bytes(new_file_patch(f"w{w}/k{i}.txt", f"worker {w} key {i}"))
            patches[key] = p
    keys = list(patches)
    outcomes: dict[str, list[Outcome]] = {}
    procs = Procs()
    try:
        with MaintenanceLoop(repo.path, procs, commands=(("pack-refs", "--all"),), min_cycles=5) as loop:
            def work(w: int) -> None:
                for key in keys[w::WORKERS]:
                    outcomes[key] = apply_until_settled(procs, repo.path, patches[key], key, branch)

            run_workers(WORKERS, work)
        problems = [f"{key}: {p}" for key, seen in outcomes.items() for o in seen
                    if (p := outcome_problem(o)) is not None]
        problems += [f"{key}: never committed: {[o.describe() for o in seen]}"
                     for key, seen in outcomes.items() if not seen[-1].committed]
        problems += final_problems(procs, repo.path, "main", base, keys, all_committed=True)
    finally:
        procs.reap()
    retries = sum(len(seen) - 1 for seen in outcomes.values())
    report = f"{len(keys)} keys, {retries} retried after a retryable rejection; {loop.describe()}"
    print(report)
    assert not problems, report + "\n" + "\n".join(problems)


@pytest.mark.timeout(300)
def test_applies_beside_a_pack_refs_loop_never_end_internal_or_unknown(tmp_path: Path) -> None:
    _pack_refs_loop(tmp_path, False, PER_WORKER)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("checked_out", [False, True], ids=["branch-not-checked-out", "branch-checked-out"])
def test_applies_beside_a_pack_refs_loop_soak(tmp_path: Path, checked_out: bool) -> None:
    _pack_refs_loop(tmp_path, checked_out, 50)

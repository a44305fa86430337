"""git's pruning commands run while a call is paused after prepare (issue 23).

A call's objects are unreferenced until its branch moves.  ``git gc
--prune=now`` and ``git prune --expire=now`` (which git documents as unsafe
beside concurrent writers) remove them; ``git repack -a -d`` drops them from
packs.  The call is stopped at ``after-prepare`` (the ``ONCEPATCH_PAUSE_AT``
seam: it SIGSTOPs itself), the git command runs, the call resumes.  It must
land whole (its objects written again under the branch's lock) or be rejected
retryable with nothing moved; never a ref at a missing object: ``git fsck
--full --strict`` is clean and ``oncepatch verify`` passes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, wait_paused
from test_concurrency import DEADLINE, verify_ok

PATCH = b"--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
NEW_FILE = b"--- /dev/null\n+++ b/new/deep/n.txt\n@@ -0,0 +1 @@\n+brand new\n"


def _apply(repo: Repo, patch: bytes, branch: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    diff = repo.path.parent / "p.diff"
    diff.write_bytes(patch)
    return subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(diff), "--repo", str(repo.path),
                             "--branch", branch, "--json", "--key", "K"],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_stopped(proc: subprocess.Popen[bytes]) -> None:
    """Until ``/proc/<pid>/stat`` shows the call stopped (state T) at its pause point."""
    wait_paused(proc, DEADLINE)


def _resume(proc: subprocess.Popen[bytes]) -> tuple[int, Any]:
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=DEADLINE)
    assert out, err.decode()
    return proc.returncode, json.loads(out)


def _missing(repo: Repo, oid: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", oid], cwd=repo.path, capture_output=True).returncode != 0


@pytest.mark.parametrize("command", [["gc", "--prune=now"], ["prune", "--expire=now"], ["repack", "-a", "-d"]],
                         ids=["gc-prune-now", "prune-expire-now", "repack-a-d"])
@pytest.mark.parametrize("checked_out", [False, True], ids=["other-branch", "checked-out"])
@pytest.mark.parametrize("patch", [PATCH, NEW_FILE], ids=["modify", "new-folders"])
def test_pruning_beside_a_paused_call_never_leaves_a_ref_at_a_missing_object(
        tmp_path: Path, command: list[str], checked_out: bool, patch: bytes) -> None:
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n", "g.txt": "g\n"})
    branch = "main" if checked_out else "side"
    if not checked_out:
        repo.git("branch", "side")
    base = repo.head(branch)
    proc = _apply(repo, patch, branch, {"ONCEPATCH_PAUSE_AT": "after-prepare"})
    try:
        _wait_stopped(proc)
        receipt = next((repo.path / ".git/oncepatch/receipts").rglob("*.json"))
        candidate = json.loads(receipt.read_text())["candidate"]
        repo.git(*command)
        if command[0] != "repack":  # (repack -a -d drops unreferenced objects from packs, never loose ones)
            # The window is real: the call's objects, unreferenced, are gone now.
            assert _missing(repo, candidate), f"'git {' '.join(command)}' kept the unreferenced candidate"
        code, out = _resume(proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.communicate()
    if code == 0:
        assert out["status"] == "committed" and repo.head(branch) == out["commit"] == candidate
    else:
        assert code == 4 and out["error"]["retryable"] and out["error"]["effect_status"] == "not_applied", out
        assert repo.head(branch) == base
    repo.git("fsck", "--full", "--strict", "--no-dangling")
    if code != 0:  # rejected retryable: the retry lands
        retry = _apply(repo, patch, branch, {})
        out_b, err_b = retry.communicate(timeout=DEADLINE)
        assert retry.returncode == 0, out_b.decode() + err_b.decode()
        out = json.loads(out_b)
    assert repo.head(branch) == out["commit"]
    assert repo.git("rev-parse", f"{out['commit']}~1").strip() == base
    assert repo.git("for-each-ref", "--format=%(objectname)", "refs/oncepatch/keys/").strip() == out["commit"]
    want = ("f.txt", "a\nB\nc\n") if patch == PATCH else ("new/deep/n.txt", "brand new\n")
    assert repo.git("show", f"{branch}:{want[0]}") == want[1]
    if checked_out:
        assert (repo.path / want[0]).read_text() == want[1]
        assert repo.git("status", "--porcelain") == ""
    repo.git("fsck", "--full", "--strict", "--no-dangling")
    verify_ok(repo)

"""What a cold CLI process loads: a replay loads what asking git needs, and no more (issue 25)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import make_repo

PROBE = """
import sys
from patcher.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stderr.write("MODULES " + " ".join(sorted(sys.modules)) + "\\n")
"""


def modules_of(repo: Path, patch: Path) -> tuple[dict[str, object], set[str]]:
    res = subprocess.run([sys.executable, "-c", PROBE, "apply", str(patch), "--json"], cwd=repo,
                         capture_output=True, text=True, check=False)
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, res.stderr
    return json.loads(res.stdout), set(line[-1].split()[1:])


def test_a_replay_asks_git_but_does_not_execute(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    patch = tmp_path / "p.diff"
    patch.write_bytes(b"--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n")
    first, mods = modules_of(repo.path, patch)
    assert first["status"] == "committed" and first["replayed"] is False
    assert "patcher.execute" in mods  # the first call executes
    again, mods = modules_of(repo.path, patch)
    assert again["replayed"] is True and again["commit"] == first["commit"]
    # A committed receipt is answered only where git agrees: the replay opens the repository
    # (pygit2) to read the key ref, the commit and the outputs' blobs ...
    assert "pygit2" in mods
    # ... and loads nothing of the protocol's execution: no staging, no matching, no worktrees (the
    # format is only detected: it is part of the call's identity).
    assert not {"patcher.execute", "patcher.stage", "patcher.matching", "patcher.worktrees"} & mods, mods

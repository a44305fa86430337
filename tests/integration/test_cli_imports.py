"""What a cold CLI process loads: a replay reads its receipt without libgit2."""

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
sys.stderr.write("PYGIT2 " + str("pygit2" in sys.modules) + "\\n")
"""


def loads_pygit2(repo: Path, patch: Path) -> tuple[dict[str, object], bool]:
    res = subprocess.run([sys.executable, "-c", PROBE, "apply", str(patch), "--json"], cwd=repo,
                         capture_output=True, text=True, check=False)
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("PYGIT2 ")]
    assert line, res.stderr
    return json.loads(res.stdout), line[-1] == "PYGIT2 True"


def test_a_replay_does_not_load_libgit2(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    patch = tmp_path / "p.diff"
    patch.write_bytes(b"--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n")
    first, pygit2 = loads_pygit2(repo.path, patch)
    assert first["status"] == "committed" and first["replayed"] is False
    assert pygit2  # the first call executes
    again, pygit2 = loads_pygit2(repo.path, patch)
    assert again["replayed"] is True and again["commit"] == first["commit"]
    assert not pygit2  # the receipt is read, checked and printed without opening the repository's objects

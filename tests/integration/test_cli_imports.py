"""What a cold CLI process loads: a replay loads what asking git needs, and no more (issue 7, issue 25)."""

from __future__ import annotations

import ast
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
heavy = ("pygit2", "_hashlib", "hashlib", "orjson", "filelock", "ssl", "typing", "threading", "dataclasses", "inspect",
         "datetime", "secrets", "socket", "concurrent.futures", "patcher.execute", "patcher.model", "patcher.paths",
         "re", "enum", "json", "argparse", "gettext")
sys.stderr.write("LOADED " + repr(sorted(m for m in heavy if m in sys.modules)) + "\\n")
"""


def loaded(repo: Path, patch: Path) -> tuple[dict[str, object], list[str]]:
    res = subprocess.run([sys.executable, "-c", PROBE, "apply", str(patch), "--json"], cwd=repo,
                         capture_output=True, text=True, check=False)
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("LOADED ")]
    assert line, res.stderr
    mods: list[str] = ast.literal_eval(line[-1][len("LOADED "):])
    return json.loads(res.stdout), mods


def test_apply_loads_no_orjson_and_a_replay_only_what_asking_git_needs(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    patch = tmp_path / "p.diff"
    patch.write_bytes(b"--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n")
    first, mods = loaded(repo.path, patch)
    assert first["status"] == "committed" and first["replayed"] is False
    assert "pygit2" in mods  # the first call executes
    assert "orjson" not in mods and "filelock" not in mods  # one call, then exit: the stdlib does its JSON
    again, mods = loaded(repo.path, patch)
    assert again["replayed"] is True and again["commit"] == first["commit"]
    # A committed receipt is answered from only where git agrees (issue 25): the replay opens the
    # repository (pygit2, and what it brings) to read the key ref, the commit and the outputs' blobs.
    assert "pygit2" in mods
    # Still not loaded: the protocol's execution, the patch model and the path checks (the format is
    # only detected), json (receipts are read and printed through _json), argparse (a plain apply line
    # is read without it), orjson and filelock (one replay, then exit), the fsync pool's futures.
    assert not {"patcher.execute", "patcher.model", "patcher.paths", "json", "argparse", "gettext", "orjson",
                "filelock", "concurrent.futures", "secrets"} & set(mods), mods

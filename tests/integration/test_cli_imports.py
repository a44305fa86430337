"""What a cold CLI process loads: a replay stays lean (issue 7's start-up figures depend on it)."""

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


def test_apply_loads_no_orjson_and_a_replay_neither_libgit2_nor_openssl(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"f.txt": "a\nb\nc\n"})
    patch = tmp_path / "p.diff"
    patch.write_bytes(b"--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n")
    first, mods = loaded(repo.path, patch)
    assert first["status"] == "committed" and first["replayed"] is False
    assert "pygit2" in mods  # the first call executes
    assert "orjson" not in mods and "filelock" not in mods  # one call, then exit: the stdlib does its JSON
    again, mods = loaded(repo.path, patch)
    assert again["replayed"] is True and again["commit"] == first["commit"]
    # The receipt is read, checked and printed with the interpreter alone: none of the modules a cold
    # start avoids (docs/DECISIONS.md), typing (2-4 ms) and threading (the fsync pool's) among them;
    # nor the protocol's execution, nor the patch model and the path checks (the format is only detected);
    # nor re and enum (the format's detection and the branch's check need no pattern for such a patch),
    # json (receipts are read and printed through _json), argparse (a plain apply line is read without it).
    assert mods == [], mods

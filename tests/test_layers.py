"""The layers hold: imports point one way (cas <- receipts <- patcher), receipts never
imports pygit2, and no package's modules import each other in a cycle, at module level or
deferred inside a function (the contracts are in pyproject.toml, checked by import-linter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "BROKEN" not in res.stdout and "3 kept, 0 broken" in res.stdout, res.stdout[-2000:]

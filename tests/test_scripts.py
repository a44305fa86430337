"""The scripts a new user runs first (issue 31): a half-made .venv is made again; the demo talks as a user types."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = """[project]
name = "tiny"
version = "0"
[project.optional-dependencies]
dev = []
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[tool.setuptools]
py-modules = []
"""


def test_a_venv_without_pip_is_made_again_not_used_broken(tmp_path: Path) -> None:
    """_setup.sh on a .venv an interrupted set-up left without pip: it says so and makes it again.

    Then the same .venv with an older set-up's stamp: it is set up again, once.
    """
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "_setup.sh", tmp_path / "scripts" / "_setup.sh")
    (tmp_path / "pyproject.toml").write_text(TINY)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    res = subprocess.run(["bash", "-c", "source scripts/_setup.sh && .venv/bin/python -m pip --version"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert res.returncode == 0, res.stderr
    assert "no working pip" in res.stderr and "first run only" in res.stderr
    stamp = tmp_path / ".venv" / ".oncepatch-installed"
    assert stamp.exists()
    # pip >= 25.2: its console-script launchers do not import 're' (docs/DECISIONS.md).
    major, minor = (int(x) for x in res.stdout.split()[1].split(".")[:2])
    assert (major, minor) >= (25, 2), res.stdout
    # A stamp without the set-up's version (what the older set-up left: an empty file, newer than
    # pyproject.toml) is set up again, once.
    stamp.write_text("")
    run = ["bash", "-c", "source scripts/_setup.sh && .venv/bin/python -m pip --version"]
    res = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert res.returncode == 0 and "first run only" in res.stderr, res.stderr
    assert stamp.read_text().strip() != ""
    res = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert res.returncode == 0 and "first run only" not in res.stderr, res.stderr


def test_the_demo_echoes_oncepatch_and_writes_no_escape_codes_into_a_pipe() -> None:
    res = subprocess.run([str(ROOT / "scripts" / "demo")], capture_output=True, text=True, timeout=280, check=False)
    assert res.returncode == 0, res.stderr
    assert "\033" not in res.stdout
    commands = [ln for ln in res.stdout.splitlines() if ln.startswith("$ ")]
    assert commands and all("oncepatch " in ln and "patcher.cli" not in ln for ln in commands)

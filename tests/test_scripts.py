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
requires = []
build-backend = "tiny_backend"
backend-path = ["."]
"""
#: The tiny project's own build backend (PEP 517/660, in the tree): pip installs nothing to build it,
#: where a setuptools build had pip fetch and install setuptools twice in this test, ~40% of its time.
TINY_BACKEND = r'''
import base64, hashlib, zipfile

DIST = "tiny-0.dist-info"
FILES = {
    DIST + "/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 0\nProvides-Extra: dev\n",
    DIST + "/WHEEL": b"Wheel-Version: 1.0\nGenerator: tiny\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}


def _record(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = "tiny-0-py3-none-any.whl"
    with zipfile.ZipFile(f"{wheel_directory}/{name}", "w") as wheel:
        for path, data in FILES.items():
            wheel.writestr(path, data)
        wheel.writestr(DIST + "/RECORD", "".join(_record(p, d) for p, d in FILES.items()) + DIST + "/RECORD,,\n")
    return name


build_editable = build_wheel
'''


def test_a_venv_without_pip_is_made_again_not_used_broken(tmp_path: Path) -> None:
    """_setup.sh on a .venv an interrupted set-up left without pip: it says so and makes it again.

    Then the same .venv with an older set-up's stamp: it is set up again, once.
    """
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "_setup.sh", tmp_path / "scripts" / "_setup.sh")
    (tmp_path / "pyproject.toml").write_text(TINY)
    (tmp_path / "tiny_backend.py").write_text(TINY_BACKEND)
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

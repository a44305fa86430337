"""The packages type-check under ``mypy --strict`` (STYLE.md: full typing)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def test_packages_pass_mypy_strict() -> None:
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-c", "import mypy"],
                                                       capture_output=True).returncode != 0:
        pytest.skip("mypy is not installed (it comes with the [dev] extra)")
    res = subprocess.run([sys.executable, "-m", "mypy", "cas", "receipts", "patcher"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr

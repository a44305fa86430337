"""cas.folder_ops.is_real_folder: the one "is this a folder itself" test (lstat, no symlink followed)."""

from __future__ import annotations

import os
from pathlib import Path

from cas.folder_ops import is_real_folder


def test_a_folder_is_one_and_a_symlink_to_it_or_a_file_is_not(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    os.symlink("d", tmp_path / "link")
    assert is_real_folder(str(tmp_path / "d"))
    assert not is_real_folder(str(tmp_path / "f"))
    assert not is_real_folder(str(tmp_path / "link"))
    assert not is_real_folder(str(tmp_path / "missing"))


def test_a_path_through_a_file_is_no_folder_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert not is_real_folder(str(tmp_path / "f" / "below"))  # ENOTDIR: read as "no folder here"

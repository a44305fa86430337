"""``cas.generations.outside_edits``: every kind of write into a built generation is named (docs/DIRECTORIES.md).

A generation is built from a tree in a bare object database (no CLI), then
changed the ways another program (or root) can: a file rewritten, chmod'ed,
added, removed, replaced by a folder, a folder added or made writable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pygit2

from cas.generations import DirLayout, build, layout_of, outside_edits


def _generation(tmp_path: Path) -> tuple[DirLayout, str, Path]:
    layout = layout_of(str(tmp_path / "site"))
    os.makedirs(layout.home)
    repo = pygit2.init_repository(layout.objects, bare=True)
    sub = repo.TreeBuilder()
    sub.insert("b.txt", repo.create_blob(b"b\n"), pygit2.enums.FileMode.BLOB)
    sub.insert("c.txt", repo.create_blob(b"c\n"), pygit2.enums.FileMode.BLOB)
    top = repo.TreeBuilder()
    top.insert("a.txt", repo.create_blob(b"a\n"), pygit2.enums.FileMode.BLOB)
    top.insert("sub", sub.write(), pygit2.enums.FileMode.TREE)
    tree = str(top.write())
    assert build(repo, layout, tree, None)
    return layout, tree, Path(layout.generation(tree))


def _writable(folder: Path) -> None:
    os.chmod(folder, 0o755)


def test_a_built_generation_has_no_outside_edits(tmp_path: Path) -> None:
    layout, tree, _gen = _generation(tmp_path)
    assert outside_edits(layout, tree) == []


def test_each_kind_of_write_is_named(tmp_path: Path) -> None:
    layout, tree, gen = _generation(tmp_path)
    os.chmod(gen / "a.txt", 0o644)  # a chmod alone changes the mode
    _writable(gen / "sub")
    (gen / "sub/c.txt").unlink()  # removed
    os.chmod(gen / "sub/b.txt", 0o644)
    (gen / "sub/b.txt").write_text("rewritten\n")
    (gen / "sub/new.txt").write_text("added\n")
    assert outside_edits(layout, tree) == ["a.txt", "sub/", "sub/b.txt", "sub/c.txt", "sub/new.txt"]


def test_a_file_replaced_by_a_read_only_folder_is_named(tmp_path: Path) -> None:
    layout, tree, gen = _generation(tmp_path)
    _writable(gen)
    (gen / "a.txt").unlink()
    (gen / "a.txt").mkdir(0o555)
    os.chmod(gen, 0o555)
    assert outside_edits(layout, tree) == ["a.txt"]


def test_a_missing_folder_or_manifest_is_said_so(tmp_path: Path) -> None:
    layout, tree, gen = _generation(tmp_path)
    os.chmod(layout.manifests, 0o755)
    os.rename(os.path.join(layout.manifests, tree), os.path.join(layout.manifests, "aside"))
    assert outside_edits(layout, tree) == ["(no manifest)"]
    os.rename(os.path.join(layout.manifests, "aside"), os.path.join(layout.manifests, tree))
    for folder, _dirs, _files in os.walk(gen):
        os.chmod(folder, 0o755)
    shutil.rmtree(gen)
    assert outside_edits(layout, tree) == ["(no folder)"]

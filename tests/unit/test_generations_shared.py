"""``cas.tree_folders``: what a content link's climb is, and what the shared layout's checks name (no CLI).

Trees are made in a bare object database and built as the shared layout
(docs/DIRECTORIES.md, "Sharing folders"); then written to as another
program (or root) can.
"""

from __future__ import annotations

import os
from pathlib import Path

import pygit2
import pytest

from cas.generations import DirLayout, build, layout_of, outside_edits
from cas.tree_folders import _ANYWHERE, link_climb, reusable


@pytest.mark.parametrize(("target", "climb"), [
    ("x", 0), ("./x/y", 0), ("/etc/passwd", 0), ("..", 1), ("../x", 1), ("../../a/b", 2), ("../x/../..", _ANYWHERE),
    ("a/../b", _ANYWHERE), ("a/b/../../..", _ANYWHERE), ("../..//./x", 2),
])
def test_link_climb(target: str, climb: int) -> None:
    assert link_climb(target.encode()) == climb


def _tree(repo: pygit2.Repository, files: dict[str, bytes]) -> str:
    """A tree of ``files`` (``"->target"`` as bytes makes a symlink)."""
    def make(entries: dict[str, bytes]) -> pygit2.Oid:
        tb = repo.TreeBuilder()
        subs: dict[str, dict[str, bytes]] = {}
        for path, data in entries.items():
            head, _, rest = path.partition("/")
            if rest:
                subs.setdefault(head, {})[rest] = data
            elif data.startswith(b"->"):
                tb.insert(head, repo.create_blob(data[2:]), pygit2.enums.FileMode.LINK)
            else:
                tb.insert(head, repo.create_blob(data), pygit2.enums.FileMode.BLOB)
        for name, sub in subs.items():
            tb.insert(name, make(sub), pygit2.enums.FileMode.TREE)
        return tb.write()

    return str(make(files))


FILES = {"top.txt": b"top\n", "a/b/c.txt": b"c\n", "a/b/d.txt": b"d\n", "x/y.txt": b"y\n"}


def _shared(tmp_path: Path) -> tuple[DirLayout, pygit2.Repository]:
    plain = layout_of(str(tmp_path / "site"))
    os.makedirs(plain.home)
    repo = pygit2.init_repository(plain.objects, bare=True)
    return DirLayout(plain.path, shared=True), repo


def test_a_change_links_the_unchanged_and_the_checks_name_what_was_written(tmp_path: Path) -> None:
    layout, repo = _shared(tmp_path)
    first = _tree(repo, FILES)
    assert build(repo, layout, first, None)
    second = _tree(repo, {**FILES, "a/b/c.txt": b"c2\n"})
    assert build(repo, layout, second, first)
    assert outside_edits(layout, second) == [] and outside_edits(layout, second, ["a/b/c.txt"]) == []
    gen = Path(layout.generation(second))
    assert os.path.islink(gen / "x") and (gen / "a/b/c.txt").read_bytes() == b"c2\n"
    x = str(repo[second].peel(pygit2.Tree)["x"].id)
    assert reusable(layout, x)
    # A write into the shared x/: the check of a change elsewhere does not look there; the whole check does.
    y = Path(layout.generation(x)) / "y.txt"
    os.chmod(y, 0o644)
    y.write_bytes(b"edited\n")
    assert outside_edits(layout, second, ["a/b/c.txt"]) == []
    assert outside_edits(layout, second, ["x/new.txt"]) == ["x/y.txt"]
    assert outside_edits(layout, second) == ["x/y.txt"]
    assert reusable(layout, x)  # the folder's own lstat does not see a write into a file ...
    os.chmod(layout.generation(x), 0o755)  # ... it sees a chmod of the folder, and an entry added
    assert not reusable(layout, x)


def test_an_untrusted_tree_folder_is_moved_aside_and_built_again(tmp_path: Path) -> None:
    layout, repo = _shared(tmp_path)
    first = _tree(repo, FILES)
    assert build(repo, layout, first, None)
    x = str(repo[first].peel(pygit2.Tree)["x"].id)
    folder = Path(layout.generation(x))
    os.chmod(folder, 0o755)
    (folder / "planted.txt").write_bytes(b"planted\n")  # the folder's mtime moves: its proof fails
    second = _tree(repo, {**FILES, "x/z.txt": b"z\n", "a/new.txt": b"n\n"})
    third = _tree(repo, {**FILES, "a/new.txt": b"n\n"})  # x as in the first: shared again, if trusted
    moved: list[str] = []
    assert build(repo, layout, second, first, moved_aside=moved)
    assert build(repo, layout, third, second, moved_aside=moved)
    assert len(moved) == 1 and os.path.basename(moved[0]).startswith(f".quarantine-{x}-")
    assert sorted(os.listdir(folder)) == ["y.txt"] and outside_edits(layout, third) == []


def test_a_link_that_climbs_keeps_its_folders_real(tmp_path: Path) -> None:
    layout, repo = _shared(tmp_path)
    tree = _tree(repo, {**FILES, "a/b/up": b"->../../top.txt"})
    assert build(repo, layout, tree, None)
    gen = Path(layout.generation(tree))
    assert not os.path.islink(gen / "a") and not os.path.islink(gen / "a/b") and os.path.islink(gen / "x")
    assert (gen / "a/b/up").read_bytes() == b"top\n"

"""Directory targets against planted entries (docs/DIRECTORIES.md, "Entries oncepatch did not make").

A symlink or a folder planted under a generation's name is never shown nor
followed: it is moved aside (``generations/.quarantine-...``) and the
generation built anew; ``gc`` and ``recover`` unlink a planted symlink and
never change anything it points at; ``init --dir`` refuses a git directory,
a store, a target's own folder, ``/`` and the home folder, changing nothing.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import git, run_cli
from dirs_helpers import patch_between, tree_of, view_of_folder, write_tree
from test_dirs import BASE, EDITS, adopt, expected_view, objects

A40 = "a" * 40


def gens(site: Path) -> Path:
    return Path(str(site) + ".oncepatch") / "generations"


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (itself included): type and mode, a file's bytes, a link's text; no link followed."""
    out: dict[str, object] = {}
    for folder, dirs, files, in os.walk(root):
        for name in [".", *dirs, *files]:
            p = os.path.join(folder, name)
            st = os.lstat(p)
            rel = os.path.normpath(os.path.relpath(p, root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", st.st_mode, hashlib.sha256(Path(p).read_bytes()).hexdigest())
            else:
                out[rel] = ("dir", st.st_mode)
    return out


def victim(tmp_path: Path, name: str = "victim") -> Path:
    """A folder outside every target, its folders 0700: nothing of oncepatch's may change it."""
    v = tmp_path / name
    (v / "sub").mkdir(parents=True)
    (v / "sub/keep.txt").write_text("not oncepatch's\n")
    os.chmod(v / "sub", 0o700)
    os.chmod(v, 0o700)
    return v


def dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(gone.stdout)


def quarantined(site: Path, tree: str) -> list[Path]:
    return sorted(p for p in gens(site).iterdir() if p.name.startswith(f".quarantine-{tree}-"))


def shows_its_own_generation(site: Path, tree: str) -> bool:
    real = gens(site).resolve() / tree
    return os.readlink(site) == f"site.oncepatch/generations/{tree}" and os.path.realpath(site) == str(real) \
        and stat.S_ISDIR(os.lstat(real).st_mode)


# -- 2. removal never reaches through a symlink ---------------------------------------------------


def test_gc_unlinks_a_planted_generation_symlink_and_leaves_what_it_points_at_alone(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    v = victim(tmp_path)
    before = snapshot(v)
    os.symlink(v, gens(site) / A40)
    gc = run_cli("gc", "--dir", str(site), "--json")
    assert gc.code == 0 and gc.json["generations"] == [A40], gc.out + gc.err
    assert snapshot(v) == before  # modes (0700) and content as they were
    assert not [n for n in os.listdir(gens(site)) if A40 in n]  # the link itself is gone, not left as .tmp-


def test_recover_removes_planted_leftovers_without_following_them(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    dead = dead_pid()
    v1, v2 = victim(tmp_path, "victim1"), victim(tmp_path, "victim2")
    before = (snapshot(v1), snapshot(v2))
    as_link = gens(site) / f".tmp-{A40}-{dead}-x"
    os.symlink(v1, as_link)
    holding = gens(site) / f".tmp-{'b' * 40}-{dead}-y"
    (holding / "deep").mkdir(parents=True)
    os.symlink(v2, holding / "deep/into")
    os.symlink(v2 / "sub", holding / "sub")
    os.chmod(holding / "deep", 0o555)
    os.chmod(holding, 0o555)
    rec = run_cli("recover", "--dir", str(site), "--json")
    assert rec.code == 0, rec.out + rec.err
    assert not os.path.lexists(as_link) and not os.path.lexists(holding)
    assert (snapshot(v1), snapshot(v2)) == before


def test_remove_tree_never_chmods_through_a_link(tmp_path: Path) -> None:
    from cas.generations import _remove_tree

    v = victim(tmp_path)
    before = snapshot(v)
    link = tmp_path / "link"
    os.symlink(v, link)
    _remove_tree(str(link))
    assert not os.path.lexists(link) and snapshot(v) == before
    folder = tmp_path / "folder"
    (folder / "a").mkdir(parents=True)
    os.symlink(v, folder / "a/v")
    os.symlink(v / "sub", folder / "s")
    os.chmod(folder / "a", 0o555)
    os.chmod(folder, 0o555)
    _remove_tree(str(folder))
    assert not os.path.lexists(folder) and snapshot(v) == before


def test_a_folder_holding_symlinks_is_adopted_and_they_stay_links(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_tree(site, {"index.html": "x\n"})
    os.symlink("index.html", site / "latest")
    os.symlink("/nowhere/at/all", site / "dangling")
    res = run_cli("init", "--dir", str(site), "--json")  # (a symlink was fsynced by path: ELOOP)
    assert res.code == 0, res.out + res.err
    assert (os.readlink(site / "latest"), os.readlink(site / "dangling")) == ("index.html", "/nowhere/at/all")

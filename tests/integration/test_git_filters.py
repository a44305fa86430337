"""Working files under conversions only git reproduces (filter drivers, working-tree-encoding, ident) and the umask.

Each test checks the worktree against what git itself writes for the same
commit (``git cat-file --filters``), and that git sees nothing changed
afterwards, without a refresh (``git diff-index --quiet HEAD``).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from tests.conftest import Repo, make_repo, run_cli, snapshot


def git_bytes(repo: Repo, path: str, rev: str = "HEAD") -> bytes:
    """What git writes into the worktree at ``path`` for ``rev``'s blob (its smudge side)."""
    return subprocess.run(["git", "cat-file", "--filters", f"--path={path}", f"{rev}:{path}"], cwd=repo.path,
                          capture_output=True, check=True).stdout


def assert_git_sees_it_clean(repo: Repo) -> None:
    assert repo.git("status", "--porcelain") == ""
    assert subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd=repo.path).returncode == 0


def apply(repo: Repo, tmp_path: Path, patch: bytes, *extra: str) -> dict[str, object]:
    pf = tmp_path / "p.diff"
    pf.write_bytes(patch)
    res = run_cli("apply", str(pf), "--json", "--repo", str(repo.path), *extra)
    assert res.code == 0, res.out + res.err
    doc: dict[str, object] = res.json
    return doc


def checked_out_again(repo: Repo, path: str) -> None:
    """The file as git checks it out (its filters applied), the index refreshed."""
    (repo.path / path).unlink()
    repo.git("checkout", "--", path)


def test_an_ident_file_is_clean_and_a_new_id_is_expanded(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {".gitattributes": "*.py ident\n", "m.py": "# $Id$\nx = 1\ny = 2\n"})
    checked_out_again(repo, "m.py")
    assert (repo.path / "m.py").read_bytes().startswith(b"# $Id: ")  # git expanded it
    doc = apply(repo, tmp_path, b"--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,4 @@\n # $Id$\n x = 1\n-y = 2\n+y = 3\n"
                                b"+# again: $Id$\n")
    assert doc["status"] == "committed"
    assert (repo.path / "m.py").read_bytes() == git_bytes(repo, "m.py")
    assert (repo.path / "m.py").read_bytes().count(b"$Id: ") == 2
    assert_git_sees_it_clean(repo)


def _rot13_repo(tmp_path: Path) -> Repo:
    repo = make_repo(tmp_path / "r", {"README": "x\n"})
    rot = "tr a-zA-Z n-za-mN-ZA-M"
    repo.git("config", "filter.rot.clean", rot)
    repo.git("config", "filter.rot.smudge", rot)
    repo.write(".gitattributes", "*.dat filter=rot\n")
    repo.write("f.dat", "alpha\nbeta\ngamma\n")
    repo.commit_all("base")
    checked_out_again(repo, "f.dat")
    return repo


def test_a_file_under_a_filter_driver_is_clean_and_written_through_it(tmp_path: Path) -> None:
    repo = _rot13_repo(tmp_path)
    assert (repo.path / "f.dat").read_bytes() == b"alpha\nbeta\ngamma\n"  # the blob holds its rot13
    # The patch is in the repository's form (git diff shows blobs: rot13), as git diff writes it.
    doc = apply(repo, tmp_path, b"--- a/f.dat\n+++ b/f.dat\n@@ -1,3 +1,3 @@\n nycun\n-orgn\n+ORGN\n tnzzn\n")
    assert doc["status"] == "committed"
    assert (repo.path / "f.dat").read_bytes() == b"alpha\nBETA\ngamma\n" == git_bytes(repo, "f.dat")
    assert_git_sees_it_clean(repo)


def test_a_real_change_under_a_filter_driver_is_still_dirty_and_nothing_changes(tmp_path: Path) -> None:
    repo = _rot13_repo(tmp_path)
    repo.write("f.dat", "alpha\nbeta\nGAMMA (mine)\n")
    before = snapshot(repo)
    pf = tmp_path / "p.diff"
    pf.write_bytes(b"--- a/f.dat\n+++ b/f.dat\n@@ -1,3 +1,3 @@\n nycun\n-orgn\n+ORGN\n tnzzn\n")
    res = run_cli("apply", str(pf), "--json", "--repo", str(repo.path))
    assert res.code == 4 and res.json["error"]["type"] == "dirty_path", res.out
    assert snapshot(repo) == before


def test_a_working_tree_encoding_file_is_clean_and_written_encoded(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {".gitattributes": "*.txt text working-tree-encoding=UTF-16LE\n"})
    repo.write("u.txt", "one\ntwo\nthree\n".encode("utf-16-le"))
    repo.commit_all("base")
    checked_out_again(repo, "u.txt")
    doc = apply(repo, tmp_path, b"--- a/u.txt\n+++ b/u.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n")
    assert doc["status"] == "committed"
    assert repo.git("show", "HEAD:u.txt") == "one\nTWO\nthree\n"  # stored as UTF-8, as git stores it
    assert (repo.path / "u.txt").read_bytes() == "one\nTWO\nthree\n".encode("utf-16-le") == git_bytes(repo, "u.txt")
    assert_git_sees_it_clean(repo)


def test_files_and_folders_get_gits_modes_under_the_umask(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"old.txt": "a\n"})
    patch = (b"diff --git a/new/n.txt b/new/n.txt\nnew file mode 100644\n--- /dev/null\n+++ b/new/n.txt\n"
             b"@@ -0,0 +1 @@\n+x\n"
             b"diff --git a/run.sh b/run.sh\nnew file mode 100755\n--- /dev/null\n+++ b/run.sh\n@@ -0,0 +1 @@\n+echo\n"
             b"diff --git a/old.txt b/old.txt\n--- a/old.txt\n+++ b/old.txt\n@@ -1 +1 @@\n-a\n+b\n")
    pf = tmp_path / "p.diff"
    pf.write_bytes(patch)
    res = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", str(pf), "--json", "--repo", str(repo.path)],
                         capture_output=True, text=True, preexec_fn=lambda: os.umask(0o002), check=False)
    assert res.returncode == 0, res.stdout + res.stderr

    def mode(rel: str) -> int:
        return stat.S_IMODE((repo.path / rel).stat().st_mode)

    # git checks files out as 0666 / 0777 less the umask, and makes folders 0777 less it
    assert (mode("new/n.txt"), mode("run.sh"), mode("old.txt"), mode("new")) == (0o664, 0o775, 0o664, 0o775)
    assert_git_sees_it_clean(repo)

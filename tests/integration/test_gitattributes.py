"""Worktrees with eol filters (``.gitattributes``): checked and written as git would."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import make_repo, run_cli

PATCH = b"--- a/run.bat\n+++ b/run.bat\n@@ -1,2 +1,2 @@\n echo a\n-echo b\n+echo c\n"


def test_eol_crlf_file_is_clean_and_written_with_crlf(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {".gitattributes": "*.bat eol=crlf\n", "run.bat": "echo a\necho b\n"})
    (repo.path / "run.bat").unlink()
    repo.git("checkout", "--", "run.bat")  # as a clone has it: CRLF in the worktree, LF in the blob
    assert (repo.path / "run.bat").read_bytes() == b"echo a\r\necho b\r\n"
    assert repo.git("status", "--porcelain") == ""

    pf = tmp_path / "p.diff"
    pf.write_bytes(PATCH)
    r = run_cli("apply", str(pf), "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err  # a clean CRLF checkout is not a dirty path
    assert repo.git("show", "HEAD:run.bat") == "echo a\necho c\n"  # the blob stays LF
    assert (repo.path / "run.bat").read_bytes() == b"echo a\r\necho c\r\n"  # the worktree gets git's CRLF
    assert repo.git("status", "--porcelain") == ""
    assert repo.git("diff-files") == ""
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


@pytest.mark.parametrize("where", ["xdg", "info", "autocrlf", "committed-only"])
def test_attributes_outside_the_worktree_folders_still_filter(tmp_path: Path, where: str) -> None:
    """Without a .gitattributes beside the file, other sources still make git write CRLF (libgit2 decides)."""
    files = {"sub/run.bat": "echo a\necho b\n"}
    if where == "committed-only":
        files["sub/.gitattributes"] = "*.bat eol=crlf\n"
    repo = make_repo(tmp_path / "repo", files)
    if where == "xdg":
        xdg = Path(os.environ["XDG_CONFIG_HOME"]) / "git"
        xdg.mkdir(parents=True, exist_ok=True)
        (xdg / "attributes").write_text("*.bat eol=crlf\n")
    elif where == "info":
        (repo.path / ".git" / "info").mkdir(exist_ok=True)
        (repo.path / ".git" / "info" / "attributes").write_text("*.bat eol=crlf\n")
    elif where == "autocrlf":
        repo.git("config", "core.autocrlf", "true")
    (repo.path / "sub" / "run.bat").unlink()
    repo.git("checkout", "--", "sub/run.bat")
    if where == "committed-only":
        (repo.path / "sub" / ".gitattributes").unlink()  # in the index and the commit, not on disk
    assert (repo.path / "sub" / "run.bat").read_bytes() == b"echo a\r\necho b\r\n"

    pf = tmp_path / "p.diff"
    pf.write_bytes(PATCH.replace(b"run.bat", b"sub/run.bat"))
    r = run_cli("apply", str(pf), "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err
    assert (repo.path / "sub" / "run.bat").read_bytes() == b"echo a\r\necho c\r\n"
    assert repo.git("diff-files", "--", "sub/run.bat") == ""


def test_without_attributes_blobs_are_written_without_asking_libgit2(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import pygit2

    from patcher.protocol import apply

    calls: list[str] = []
    real = pygit2.Repository.load_filter_list

    def spy(self: pygit2.Repository, path: str, *args: object, **kwargs: object) -> object:
        calls.append(path)
        return real(self, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pygit2.Repository, "load_filter_list", spy)
    repo = make_repo(tmp_path / "repo", {"sub/run.bat": "echo a\necho b\n"})
    res = apply(str(repo.path), PATCH.replace(b"run.bat", b"sub/run.bat"))
    assert res.status == "committed"
    assert calls == []
    assert (repo.path / "sub" / "run.bat").read_bytes() == b"echo a\necho c\n"
    assert repo.git("status", "--porcelain") == ""


@pytest.mark.parametrize("setting", ["autocrlf", "attributes"])
def test_a_racily_clean_crlf_checkout_of_an_untouched_file_stays_clean(tmp_path: Path, setting: str) -> None:
    """An untouched entry whose file git wrote with CRLF, racily clean (same second as the index):
    its bytes differ from its blob only by the eol conversion, so it is not smudged — git's
    plumbing (diff-files, diff-index --quiet) kept reporting it modified until a refresh."""
    import time

    files = {"a.txt": "a\n", "b.txt": "b\n"}
    if setting == "attributes":
        files[".gitattributes"] = "*.txt text eol=crlf\n"
    repo = make_repo(tmp_path / "repo", files)
    if setting == "autocrlf":
        repo.git("config", "core.autocrlf", "true")
    for name in ("a.txt", "b.txt"):
        (repo.path / name).unlink()
    repo.git("checkout", "--", ".")
    assert (repo.path / "b.txt").read_bytes() == b"b\r\n"
    time.sleep(1.1)
    os.utime(repo.path / "b.txt")
    repo.git("update-index", "--refresh")
    st = os.stat(repo.path / "b.txt")
    os.utime(repo.path / ".git/index", ns=(st.st_atime_ns, st.st_mtime_ns))  # b.txt: racily clean
    assert repo.git("diff-files") == ""
    patch = b"diff --git a/a.txt b/a.txt\n--- a/a.txt\n+++ b/a.txt\n@@ -1 +1,2 @@\n a\n+a2\n"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 0, r.out + r.err
    assert repo.git("diff-files") == ""
    res = subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd=repo.path, check=False)
    assert res.returncode == 0


@pytest.mark.parametrize("setting", ["eol=lf attribute", "core.autocrlf=input"])
def test_a_crlf_file_git_cleans_to_its_lf_blob_is_not_dirty(tmp_path: Path, setting: str) -> None:
    """CRLF on disk, LF in the blob, and git calls it clean (its status compares the cleaned bytes)."""
    repo = make_repo(tmp_path / "repo", {"README": "x\n"})
    if setting == "eol=lf attribute":
        repo.write(".gitattributes", "* text=auto eol=lf\n")
    else:
        repo.git("config", "core.autocrlf", "input")
    repo.write("a.txt", b"line1\r\nline2\r\n")
    repo.commit_all("crlf on disk")
    assert repo.git("show", "HEAD:a.txt") == "line1\nline2\n"
    assert repo.git("status", "--porcelain") == ""
    pf = tmp_path / "p.diff"
    pf.write_bytes(b"--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n line1\n-line2\n+LINE2\n")
    r = run_cli("apply", str(pf), "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err  # it was dirty_path, 'retryable', for ever
    assert repo.git("show", "HEAD:a.txt") == "line1\nLINE2\n"
    assert repo.git("status", "--porcelain") == ""
    assert subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd=repo.path).returncode == 0

"""Worktrees with eol filters (``.gitattributes``): checked and written as git would."""

from __future__ import annotations

from pathlib import Path

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

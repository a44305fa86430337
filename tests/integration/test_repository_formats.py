"""Repository formats libgit2 cannot write: a SHA-256 repository, a split index.

Like git where git has a rule: what libgit2 can do is done (a split index on a
branch that is not checked out is never touched), what it cannot is refused at
once — exit 2 ``usage``, the setting named, and the repository, its index, its
worktree and the store byte-for-byte as they were.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from conftest import Repo, git, make_repo, run_cli, snapshot

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"


def _git_dir_bytes(repo: Repo) -> dict[str, str]:
    """Every file of the git dir (the default store with it) by content."""
    root = repo.path / ".git"
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _refused_unchanged(repo: Repo, patch: Path, *names: str) -> None:
    before, files = snapshot(repo), _git_dir_bytes(repo)
    r = run_cli("apply", str(patch), "--repo", str(repo.path), "--key", "k1", "--json")
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and err["next_action"] == "fix_input"
    for name in names:
        assert name in err["message"], err["message"]
    assert snapshot(repo) == before and _git_dir_bytes(repo) == files
    assert not repo.store.exists()


def test_a_sha256_repository_is_refused_naming_its_object_format(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    path.mkdir()
    made = subprocess.run(["git", "init", "-q", "-b", "main", "--object-format=sha256", str(path)],
                          capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"this git makes no SHA-256 repository: {made.stderr.decode()}")
    repo = Repo(path)
    repo.write("README", "hello\n")
    repo.commit_all("initial")
    assert len(repo.head()) == 64
    (tmp_path / "p.diff").write_bytes(PATCH)
    _refused_unchanged(repo, tmp_path / "p.diff", "sha256", "extensions.objectFormat")
    assert repo.count() == 1


@pytest.fixture
def split(tmp_path: Path) -> Repo:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n", "other.txt": "other\n"})
    repo.git("config", "core.splitIndex", "true")
    repo.git("update-index", "--split-index")
    assert list((repo.path / ".git").glob("sharedindex.*"))
    return repo


def test_a_split_index_on_the_checked_out_branch_is_refused(split: Repo, tmp_path: Path) -> None:
    (tmp_path / "p.diff").write_bytes(PATCH)
    _refused_unchanged(split, tmp_path / "p.diff", "split index", "core.splitIndex",
                       "git update-index --no-split-index")
    assert split.count() == 1 and split.git("status", "--porcelain") == ""


def test_a_split_index_is_left_alone_when_the_branch_is_not_checked_out(split: Repo, tmp_path: Path) -> None:
    split.git("branch", "side")
    (tmp_path / "p.diff").write_bytes(PATCH)
    index_files = _git_dir_bytes(split)
    r = run_cli("apply", str(tmp_path / "p.diff"), "--repo", str(split.path), "--branch", "side", "--key", "k1",
                "--json")
    assert r.code == 0, r.out + r.err
    receipt = json.loads(Path(r.json["receipt"]).read_text())
    assert receipt["status"] == "committed" and receipt["commit"] == split.head("side") == r.json["commit"]
    assert split.git("log", "-1", "--format=%T", "side").strip() == receipt["tree"]
    assert split.git("show", "side:README") == "hello there\n"
    git(split.path, "fsck", "--strict", "--no-progress")
    # The checked-out branch's split index is untouched, and git still reads it clean.
    after = _git_dir_bytes(split)
    assert all(after[name] == digest for name, digest in index_files.items()
               if name == "index" or name.startswith("sharedindex."))
    assert split.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(split.path), "--json").code == 0


def test_core_split_index_set_before_git_splits_the_index_commits(tmp_path: Path) -> None:
    """``core.splitIndex`` set, the index still whole (git splits it at its next write): a correct commit."""
    repo = make_repo(tmp_path / "repo")
    repo.git("config", "core.splitIndex", "true")
    assert not list((repo.path / ".git").glob("sharedindex.*"))
    (tmp_path / "p.diff").write_bytes(PATCH)
    r = run_cli("apply", str(tmp_path / "p.diff"), "--repo", str(repo.path), "--key", "k1", "--json")
    assert r.code == 0, r.out + r.err
    assert r.json["commit"] == repo.head() and repo.git("log", "-1", "--format=%T").strip() == r.json["tree"]
    assert repo.git("status", "--porcelain") == "" and repo.git("diff", "--cached") == ""
    git(repo.path, "fsck", "--strict", "--no-progress")
    assert (repo.path / "README").read_text() == "hello there\n"

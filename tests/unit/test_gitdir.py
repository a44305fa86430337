"""cas.gitdir: finding a repository's folders without libgit2, checked against git itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cas.errors import UsageError
from cas.gitdir import GitLayout, common_dir_of, discover, read_head, worktrees_on
from tests.conftest import Repo, git, make_repo


def real(p: Path | str) -> str:
    return os.path.realpath(p)


def git_says(cwd: Path, *args: str) -> str:
    return real(Path(cwd, git(cwd, "rev-parse", *args).strip()))


def test_discover_normal_repo(repo: Repo) -> None:
    lay = discover(str(repo.path))
    assert lay == GitLayout(real(repo.path), real(repo.path / ".git"), real(repo.path / ".git"))
    assert lay.git_dir == git_says(repo.path, "--git-dir")
    assert lay.common_dir == git_says(repo.path, "--git-common-dir")


def test_discover_from_a_subfolder(repo: Repo) -> None:
    sub = repo.path / "src" / "deep" / "er"
    sub.mkdir(parents=True)
    lay = discover(str(sub))
    assert lay.workdir == real(repo.path)
    assert lay.git_dir == real(repo.path / ".git")


def test_discover_through_a_symlinked_path(repo: Repo, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(repo.path / "src")
    lay = discover(str(link))
    assert lay.workdir == real(repo.path)  # paths are absolute and real


def test_discover_linked_worktree(repo: Repo, tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    repo.git("worktree", "add", "-q", "-b", "feat", str(wt))
    for start in (wt, wt / "src"):
        lay = discover(str(start))
        assert lay.workdir == real(wt)
        assert lay.git_dir == git_says(wt, "--git-dir")
        assert lay.git_dir == real(repo.path / ".git" / "worktrees" / "wt")
        assert lay.common_dir == real(repo.path / ".git") == git_says(wt, "--git-common-dir")
    assert read_head(lay.git_dir) == "refs/heads/feat"


def test_discover_linked_worktree_with_relative_gitdir(repo: Repo, tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    repo.git("worktree", "add", "-q", "-b", "feat", str(wt))
    target = real(repo.path / ".git" / "worktrees" / "wt")
    (wt / ".git").write_text("gitdir: " + os.path.relpath(target, wt) + "\n")
    lay = discover(str(wt))
    assert lay.git_dir == target and lay.common_dir == real(repo.path / ".git")


def test_discover_bare_repo(tmp_path: Path) -> None:
    bare = tmp_path / "b.git"
    git(tmp_path, "init", "-q", "--bare", str(bare))
    for start in (bare, bare / "refs" / "heads"):
        lay = discover(str(start))
        assert lay == GitLayout(None, real(bare), real(bare))
    assert lay.common_dir == git_says(bare, "--git-common-dir")


def test_discover_non_repo_is_usage_error(tmp_path: Path) -> None:
    plain = tmp_path / "plain" / "sub"
    plain.mkdir(parents=True)
    with pytest.raises(UsageError) as ei:
        discover(str(plain))
    assert ei.value.exit_code == 2 and "not a git repository" in ei.value.message
    with pytest.raises(UsageError):
        discover(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError):
        discover(str(tmp_path / "file"))


def test_fake_dotgit_folder_is_not_a_repo(tmp_path: Path) -> None:
    (tmp_path / "x" / ".git").mkdir(parents=True)  # no HEAD, no objects
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / ".git").write_text("gitdir: /nonexistent\n")
    with pytest.raises(UsageError):
        discover(str(tmp_path / "x"))
    with pytest.raises(UsageError):
        discover(str(tmp_path / "y"))


def test_nested_repo_wins(repo: Repo) -> None:
    inner = make_repo(repo.path / "vendor" / "inner")
    assert discover(str(inner.path)).workdir == real(inner.path)


# -- HEAD -----------------------------------------------------------------------------


def test_read_head_symbolic_and_detached(repo: Repo) -> None:
    gd = str(repo.path / ".git")
    assert read_head(gd) == "refs/heads/main"
    repo.git("checkout", "-q", "--detach")
    assert read_head(gd) is None
    repo.git("checkout", "-q", "-b", "other")
    assert read_head(gd) == "refs/heads/other"


def test_common_dir_of(repo: Repo, tmp_path: Path) -> None:
    gd = real(repo.path / ".git")
    assert common_dir_of(gd) == gd
    repo.git("worktree", "add", "-q", "--detach", str(tmp_path / "wt2"))
    assert common_dir_of(real(repo.path / ".git" / "worktrees" / "wt2")) == gd


# -- worktrees_on -------------------------------------------------------------------------


def test_worktrees_on(repo: Repo, tmp_path: Path) -> None:
    common = real(repo.path / ".git")
    wt_feat = tmp_path / "wt-feat"
    wt_det = tmp_path / "wt-det"
    repo.git("worktree", "add", "-q", "-b", "feat", str(wt_feat))
    repo.git("worktree", "add", "-q", "--detach", str(wt_det))
    assert worktrees_on(common, "refs/heads/main") == [(real(repo.path), common)]
    assert worktrees_on(common, "refs/heads/feat") == [(real(wt_feat), real(repo.path / ".git/worktrees/wt-feat"))]
    assert worktrees_on(common, "refs/heads/nobody") == []

    # the main worktree moves to another branch; the detached worktree is on none
    repo.git("checkout", "-q", "-b", "side")
    assert worktrees_on(common, "refs/heads/main") == []
    assert worktrees_on(common, "refs/heads/side") == [(real(repo.path), common)]


def test_worktrees_on_skips_a_deleted_worktree_folder(repo: Repo, tmp_path: Path) -> None:
    import shutil

    wt = tmp_path / "gone"
    repo.git("worktree", "add", "-q", "-b", "feat", str(wt))
    shutil.rmtree(wt)
    assert worktrees_on(real(repo.path / ".git"), "refs/heads/feat") == []


def test_worktrees_on_bare_repo_lists_only_linked(tmp_path: Path) -> None:
    src = make_repo(tmp_path / "src")
    bare = tmp_path / "b.git"
    git(tmp_path, "clone", "-q", "--bare", str(src.path), str(bare))
    assert worktrees_on(real(bare), "refs/heads/main") == []  # bare: HEAD names main, but no worktree
    wt = tmp_path / "wt"
    git(bare, "worktree", "add", "-q", "-b", "feat", str(wt))
    assert worktrees_on(real(bare), "refs/heads/feat") == [(real(wt), real(bare / "worktrees" / "wt"))]
    assert discover(str(wt)).common_dir == real(bare)


def test_worktrees_on_bare_repo_named_dotgit(tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q", "--bare", ".git")
    assert worktrees_on(real(outer / ".git"), "refs/heads/main") == []

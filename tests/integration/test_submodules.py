"""A repository with a submodule: files beside it apply; the submodule itself is never written.

A submodule is a tree entry of mode ``160000`` (a gitlink: a commit of another
repository) and, where it is checked out, a folder with a repository of its
own.  Editing a file beside it must keep the gitlink, the index entry and the
submodule's checkout as they are.  A path in it, or the gitlink itself, is
refused as ``unsafe_path`` with nothing changed: a file written there would
land in the other repository's working tree, and a commit of ours could not
hold it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Repo, git, make_repo, run_cli
from test_rejections import refuse


@pytest.fixture
def with_sub(tmp_path: Path) -> Repo:
    lib = make_repo(tmp_path / "lib", {"a.txt": "a\n", "src/m.c": "int m;\n"})
    top = make_repo(tmp_path / "top", {"top.txt": "hi\n", "d/x.txt": "x\n"})
    top.git("-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib.path), "vendor/lib")
    top.git("commit", "-q", "-m", "add submodule")
    assert "160000" in top.git("ls-tree", "HEAD", "vendor/lib")
    return top


def _sub_state(repo: Repo) -> tuple[str, str, bytes]:
    """The submodule's refs, status and index (its files are in the outer snapshot)."""
    sub = repo.path / "vendor/lib"
    return (git(sub, "for-each-ref", "--format=%(refname) %(objectname)") + git(sub, "rev-parse", "HEAD"),
            git(sub, "status", "--porcelain", "--untracked-files=all"),
            (repo.path / ".git/modules/vendor/lib/index").read_bytes())


def _gitlink(repo: Repo, rev: str = "HEAD") -> str:
    return repo.git("ls-tree", rev, "vendor/lib")


def test_a_file_beside_a_submodule_applies_and_the_gitlink_stays(with_sub: Repo) -> None:
    link = _gitlink(with_sub)
    sub_head = git(with_sub.path / "vendor/lib", "rev-parse", "HEAD")
    patch = b"--- a/d/x.txt\n+++ b/d/x.txt\n@@ -1 +1 @@\n-x\n+y\n"
    r = run_cli("apply", "-", "--repo", str(with_sub.path), "--json", input=patch)
    assert r.code == 0, r.out + r.err
    assert _gitlink(with_sub) == link
    assert with_sub.git("ls-files", "-s", "vendor/lib").startswith("160000 ")
    assert git(with_sub.path / "vendor/lib", "rev-parse", "HEAD") == sub_head
    assert with_sub.git("status", "--porcelain", "--untracked-files=all") == ""
    assert (with_sub.path / "d/x.txt").read_bytes() == b"y\n"
    v = run_cli("verify", "--repo", str(with_sub.path))
    assert v.code == 0, v.out + v.err


def test_a_file_beside_a_submodule_applies_with_a_check(with_sub: Repo) -> None:
    patch = b"--- a/top.txt\n+++ b/top.txt\n@@ -1 +1 @@\n-hi\n+hello\n"
    r = run_cli("apply", "-", "--repo", str(with_sub.path), "--json", "--check", "test -f top.txt", input=patch)
    assert r.code == 0, r.out + r.err
    assert with_sub.git("status", "--porcelain", "--untracked-files=all") == ""
    assert with_sub.git("worktree", "list").count("\n") == 1


REFUSED = [
    ("edit_inside", b"--- a/vendor/lib/a.txt\n+++ b/vendor/lib/a.txt\n@@ -1 +1 @@\n-a\n+b\n", "in_submodule"),
    ("add_inside", b"*** Begin Patch\n*** Add File: vendor/lib/new.txt\n+n\n*** End Patch\n", "in_submodule"),
    ("add_deeper", b"--- /dev/null\n+++ b/vendor/lib/src/n.c\n@@ -0,0 +1 @@\n+int n;\n", "in_submodule"),
    ("delete_gitlink", b"*** Begin Patch\n*** Delete File: vendor/lib\n*** End Patch\n", "submodule"),
    ("add_over_gitlink", b"*** Begin Patch\n*** Add File: vendor/lib\n+n\n*** End Patch\n", "submodule"),
    ("update_gitlink", b"*** Begin Patch\n*** Update File: vendor/lib\n@@\n-a\n+b\n*** End Patch\n", "submodule"),
    ("move_onto_gitlink", b"*** Begin Patch\n*** Update File: top.txt\n*** Move to: vendor/lib\n@@\n-hi\n+ho\n"
     b"*** End Patch\n", "submodule"),
    ("move_into", b"*** Begin Patch\n*** Update File: top.txt\n*** Move to: vendor/lib/top.txt\n@@\n-hi\n+ho\n"
     b"*** End Patch\n", "in_submodule"),
    ("rename_gitlink", b"diff --git a/vendor/lib b/vendor/lib2\nsimilarity index 100%\nrename from vendor/lib\n"
     b"rename to vendor/lib2\n", "submodule"),
]


@pytest.mark.parametrize("name,patch,reason", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_path_in_a_submodule_or_the_submodule_is_refused_and_nothing_changes(
        with_sub: Repo, name: str, patch: bytes, reason: str) -> None:
    sub_before = _sub_state(with_sub)
    err = refuse(with_sub, patch, code=4, type="unsafe_path")
    assert err["reason"] == reason
    assert err["submodule"] == "vendor/lib"
    assert "submodule" in err["message"]
    assert _sub_state(with_sub) == sub_before


def test_a_submodule_on_a_branch_not_checked_out_is_refused_too(with_sub: Repo) -> None:
    with_sub.git("branch", "side")
    patch = b"--- a/vendor/lib/a.txt\n+++ b/vendor/lib/a.txt\n@@ -1 +1 @@\n-a\n+b\n"
    err = refuse(with_sub, patch, "--branch", "side", code=4, type="unsafe_path")
    assert err["reason"] == "in_submodule"

"""Repositories whose git dir is not ``<worktree>/.git``: the worktree that has the branch is still found.

``git init --separate-git-dir``, a submodule's checkout (its git dir under the
superproject's ``.git/modules/``) and ``core.worktree`` all leave the main
worktree somewhere the git dir's own location does not tell.  A call made
from there must check and bring along that worktree — not skip it (its index
would then hold a staged revert of the commit) and not write into the folder
above the git dir.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import Repo, Run, git, make_repo, run_cli

PATCH = b"diff --git a/f.txt b/f.txt\n--- a/f.txt\n+++ b/f.txt\n@@ -1 +1,2 @@\n hi\n+there\n"


def _separate(tmp_path: Path, git_dir: Path) -> Repo:
    wt = tmp_path / "wt"
    git(tmp_path, "init", "-q", "-b", "main", "--separate-git-dir", str(git_dir), str(wt))
    repo = Repo(wt)
    repo.write("f.txt", "hi\n")
    repo.commit_all("c1")
    return repo


def _apply(repo_path: Path, *extra: str, env: dict[str, str] | None = None) -> Run:
    return run_cli("apply", "-", "--repo", str(repo_path), "--json", *extra, input=PATCH, env=env)


def _clean(path: Path) -> bool:
    return git(path, "status", "--porcelain", "--untracked-files=all") == ""


def test_separate_git_dir_worktree_is_checked_and_brought_along(tmp_path: Path) -> None:
    repo = _separate(tmp_path, tmp_path / "repo.git")
    repo.write("f.txt", "hi\nlocal edit\n")
    r = _apply(repo.path)
    assert r.code == 4 and r.json["error"]["type"] == "dirty_path", r.out
    assert (repo.path / "f.txt").read_text() == "hi\nlocal edit\n"
    repo.git("checkout", "-q", "f.txt")
    r = _apply(repo.path)
    assert r.code == 0, r.out + r.err
    assert (repo.path / "f.txt").read_text() == "hi\nthere\n"
    assert _clean(repo.path)
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


def test_separate_git_dir_crash_after_the_move_is_recovered_into_the_worktree(tmp_path: Path) -> None:
    repo = _separate(tmp_path, tmp_path / "repo.git")
    r = _apply(repo.path, "--key", "K", env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert r.code == 137
    rec = run_cli("recover", "--repo", str(repo.path), "--json")
    assert rec.code == 0, rec.err
    assert (repo.path / "f.txt").read_text() == "hi\nthere\n"
    assert _clean(repo.path)


def test_separate_git_dir_named_dotgit_writes_the_worktree_not_the_folder_above(tmp_path: Path) -> None:
    """The git dir is ``elsewhere/.git``: 'elsewhere' is not the worktree the call came from."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere/f.txt").write_text("not this one\n")
    repo = _separate(tmp_path, tmp_path / "elsewhere/.git")
    r = _apply(repo.path)
    assert r.code == 0, r.out + r.err
    assert (repo.path / "f.txt").read_text() == "hi\nthere\n"
    assert (tmp_path / "elsewhere/f.txt").read_text() == "not this one\n"
    assert _clean(repo.path)


def test_core_worktree_names_the_worktree_of_a_repository_opened_at_its_git_dir(tmp_path: Path) -> None:
    src = make_repo(tmp_path / "src", {"f.txt": "hi\n"})
    gd = tmp_path / "repo.git"
    git(tmp_path, "clone", "-q", "--bare", str(src.path), str(gd))
    wt = tmp_path / "wt"
    wt.mkdir()
    git(gd, "config", "core.bare", "false")
    git(gd, "config", "core.worktree", str(wt))
    git(wt, "--git-dir", str(gd), "checkout", "-q", "-f", "main")
    r = _apply(gd)
    assert r.code == 0, r.out + r.err
    assert (wt / "f.txt").read_text() == "hi\nthere\n"
    assert git(wt, "--git-dir", str(gd), "--work-tree", str(wt), "status", "--porcelain") == ""


def test_a_submodules_checkout_is_its_own_worktree(tmp_path: Path) -> None:
    lib = make_repo(tmp_path / "lib", {"f.txt": "hi\n"})
    top = make_repo(tmp_path / "top", {"top.txt": "top\n"})
    top.git("-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib.path), "vendor/lib")
    top.git("commit", "-q", "-m", "add submodule")
    sub = top.path / "vendor/lib"
    assert (sub / ".git").is_file()
    r = _apply(sub)
    assert r.code == 0, r.out + r.err
    assert (sub / "f.txt").read_text() == "hi\nthere\n"
    assert _clean(sub)
    assert not os.path.exists(top.path / ".git/modules/vendor/f.txt")
    assert "there" in git(sub, "show", "HEAD:f.txt")


def test_core_symlinks_false_checks_and_writes_a_symlink_as_git_does(tmp_path: Path) -> None:
    """With core.symlinks=false git checks a symlink out as a plain file holding its target: that
    file is clean (it was dirty_path on every retry), and a changed link is written the same way."""
    repo = make_repo(tmp_path / "repo", {"target": "t\n"})
    os.symlink("target", repo.path / "link")
    repo.commit_all("a link")
    repo.git("config", "core.symlinks", "false")
    (repo.path / "link").unlink()
    repo.git("checkout", "--", "link")
    assert (repo.path / "link").read_bytes() == b"target" and not (repo.path / "link").is_symlink()
    patch = (b"diff --git a/link b/link\n--- a/link\n+++ b/link\n@@ -1 +1 @@\n-target\n"
             b"\\ No newline at end of file\n+other\n\\ No newline at end of file\n")
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 0, r.out + r.err
    assert (repo.path / "link").read_bytes() == b"other" and not (repo.path / "link").is_symlink()
    assert repo.git("ls-files", "-s", "link").startswith("120000 ")
    assert _clean(repo.path)


def test_a_separate_git_dir_named_at_itself_is_refused_while_its_worktree_has_the_branch(tmp_path: Path) -> None:
    """'--repo repo.git': the worktree that has the branch cannot be found from there (no '.git' file
    leads to it, no core.worktree names it).  The folder above the git dir is not it: nothing may be
    written there, and a move without its index following would leave a staged revert."""
    repo = _separate(tmp_path, tmp_path / "repo.git")
    before = repo.head()
    for target in (tmp_path / "repo.git",):
        r = run_cli("apply", "-", "--repo", str(target), "--json", input=b"--- /dev/null\n+++ b/new.txt\n"
                    b"@@ -0,0 +1 @@\n+hello\n")
        assert r.code == 2, r.out + r.err
        assert r.json["error"]["reason"] == "main_worktree_unknown"
    assert not (tmp_path / "new.txt").exists() and repo.head() == before and _clean(repo.path)
    side = run_cli("apply", "-", "--repo", str(tmp_path / "repo.git"), "--json", "--branch", "side",
                   input=PATCH)
    assert side.code == 2 and "does not exist" in side.json["error"]["message"]  # other branches: usual rules
    repo.git("branch", "side")
    side = run_cli("apply", "-", "--repo", str(tmp_path / "repo.git"), "--json", "--branch", "side",
                   input=PATCH)
    assert side.code == 0, side.out + side.err
    assert _clean(repo.path)


def test_a_linked_worktree_of_a_separate_git_dir_repository_cannot_reach_the_main_one(tmp_path: Path) -> None:
    repo = _separate(tmp_path, tmp_path / "repo.git")
    linked = tmp_path / "linked"
    repo.git("worktree", "add", "-q", "-b", "feat", str(linked))
    r = run_cli("apply", "-", "--repo", str(linked), "--json", "--branch", "main", input=PATCH)
    assert r.code == 2 and r.json["error"]["reason"] == "main_worktree_unknown", r.out
    r = run_cli("apply", "-", "--repo", str(linked), "--json", input=PATCH)  # its own branch: fine
    assert r.code == 0, r.out + r.err
    assert _clean(linked) and _clean(repo.path)


def test_the_same_call_from_a_linked_worktree_is_the_same_intent(tmp_path: Path) -> None:
    """A linked worktree shares the branches and the store: the same patch to the same branch replays there.

    (Its identity named the worktree's folder: from the other worktree the call was a new intent,
    and a pure insertion, which no retry can find already applied, landed twice.)
    """
    repo = make_repo(tmp_path / "main", {"f.txt": "hi\n", "tox.ini": "[tox]\nenvlist = py\n"})
    repo.git("branch", "side")
    linked = tmp_path / "linked"
    repo.git("worktree", "add", "-q", str(linked), "side")
    envelope = b"*** Begin Patch\n*** Update File: tox.ini\n@@ [tox]\n+# once\n*** End Patch\n"
    first = run_cli("apply", "-", "--repo", str(repo.path), "--branch", "side", "--json", input=envelope)
    assert first.code == 0 and first.json["replayed"] is False, first.out + first.err
    again = run_cli("apply", "-", "--repo", str(linked), "--branch", "side", "--json", input=envelope)
    assert again.code == 0, again.out + again.err
    assert again.json["replayed"] is True and again.json["call_id"] == first.json["call_id"]
    assert repo.git("show", "side:tox.ini").count("# once") == 1
    assert _clean(linked) and _clean(repo.path)
    # By its default branch too: the linked worktree's HEAD is 'side'.
    default = run_cli("apply", "-", "--repo", str(linked), "--json", input=envelope)
    assert default.code == 0 and default.json["call_id"] == first.json["call_id"], default.out


def test_a_branch_alias_moves_the_branch_it_names(tmp_path: Path) -> None:
    """refs/heads/master as a symbolic ref to main, HEAD on master: main moves, the alias stays one."""
    repo = make_repo(tmp_path / "r", {"f.txt": "hi\n"})
    repo.git("symbolic-ref", "refs/heads/master", "refs/heads/main")
    repo.git("symbolic-ref", "HEAD", "refs/heads/master")
    base = repo.head("main")
    r = _apply(repo.path, "--key", "via-alias")
    assert r.code == 0, r.out + r.err
    assert repo.git("symbolic-ref", "refs/heads/master").strip() == "refs/heads/main"  # still an alias
    assert repo.head("main") == r.json["commit"] and repo.git("rev-parse", "main^").strip() == base
    assert (repo.path / "f.txt").read_text() == "hi\nthere\n" and _clean(repo.path)  # the worktree came along
    # --branch master and --branch main name one branch: the same intent.
    for name in ("master", "main"):
        again = _apply(repo.path, "--key", "via-alias", "--branch", name)
        assert again.code == 0 and again.json["replayed"] is True, again.out
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


def test_core_file_mode_false_ignores_the_executable_bit_as_git_does(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"f.txt": "hi\n"})
    repo.write("run.sh", "#!/bin/sh\necho hi\n", mode=0o755)
    repo.commit_all("exec")
    repo.git("config", "core.fileMode", "false")
    os.chmod(repo.path / "run.sh", 0o644)
    assert _clean(repo.path)  # git does not look at the bit
    patch = b"--- a/run.sh\n+++ b/run.sh\n@@ -1,2 +1,3 @@\n #!/bin/sh\n echo hi\n+echo there\n"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 0, r.out + r.err  # it was dirty_path, 'retryable', for ever
    assert repo.git("show", "HEAD:run.sh").endswith("echo there\n") and _clean(repo.path)


def test_a_bare_repository_takes_a_patch_under_a_folder_named_like_its_store(tmp_path: Path) -> None:
    """The default store is <git dir>/oncepatch: a bare repository's tree may still have an 'oncepatch/' folder."""
    src = make_repo(tmp_path / "src", {"f.txt": "hi\n"})
    bare = tmp_path / "bare.git"
    git(tmp_path, "clone", "-q", "--bare", str(src.path), str(bare))
    patch = b"--- /dev/null\n+++ b/oncepatch/notes.txt\n@@ -0,0 +1 @@\n+n\n"
    r = run_cli("apply", "-", "--repo", str(bare), "--branch", "main", "--json", input=patch)
    assert r.code == 0, r.out + r.err
    assert git(bare, "show", "main:oncepatch/notes.txt") == "n\n"


def test_a_bare_repository_kept_as_dotgit_with_worktrees_is_one_repository(tmp_path: Path) -> None:
    """'git clone --bare . proj/.git' plus linked worktrees: the folder above .git is no worktree (git says so too).

    A call from that folder and one from a linked worktree are the same intent (they landed twice).
    """
    src = make_repo(tmp_path / "src", {"f.txt": "hi\n"})
    proj = tmp_path / "proj"
    proj.mkdir()
    git(tmp_path, "clone", "-q", "--bare", str(src.path), str(proj / ".git"))
    git(proj / ".git", "branch", "side", "main")
    git(proj / ".git", "worktree", "add", "-q", str(proj / "wb"), "side")
    envelope = b"*** Begin Patch\n*** Update File: f.txt\n@@\n+# once\n*** End Patch\n"
    first = run_cli("apply", "-", "--repo", str(proj), "--branch", "side", "--json", input=envelope)
    assert first.code == 0, first.out + first.err
    again = run_cli("apply", "-", "--repo", str(proj / "wb"), "--json", input=envelope)
    assert again.code == 0 and again.json["replayed"] is True, again.out + again.err
    assert git(proj / ".git", "show", "side:f.txt") == "hi\n# once\n"
    assert _clean(proj / "wb")
    assert not (proj / "f.txt").exists()  # nothing written into the folder above the bare git dir


def test_a_linked_worktree_of_a_separate_git_dir_repository_verifies_with_an_outside_store(tmp_path: Path) -> None:
    """Its calls name the common git dir (the main worktree cannot be found from there): that opens as the repository."""
    repo = _separate(tmp_path, tmp_path / "repo.git")
    repo.git("branch", "side")
    linked = tmp_path / "linked"
    repo.git("worktree", "add", "-q", str(linked), "side")
    store = tmp_path / "store"
    r = _apply(linked, "--store", str(store))
    assert r.code == 0, r.out + r.err
    other = b"diff --git a/f.txt b/f.txt\n--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,3 @@\n hi\n there\n+again\n"
    crashed = run_cli("apply", "-", "--repo", str(linked), "--store", str(store), "--key", "k", "--json",
                      input=other, env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert crashed.code == 137, crashed.out + crashed.err
    assert run_cli("recover", "--repo", str(linked), "--store", str(store)).code == 0
    assert _clean(linked)
    v = run_cli("verify", "--repo", str(linked), "--store", str(store))
    assert v.code == 0, v.out + v.err

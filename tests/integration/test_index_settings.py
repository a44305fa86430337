"""The index of a checked-out branch under git's index settings: every apply leaves git's view clean.

For each setting a repository is made, the setting applied the way a user
does, and two patches go through the CLI: one that only modifies files
already in the index (the in-place update, ``cas/index_raw.py``) and one
that adds, modifies and deletes (pygit2's ``Index``, then the stat pass).
After each: the touched paths are clean in ``git status`` and ``git
diff-files``, the rest of git's view is what it was, ``git diff --cached``
is unchanged, ``git fsck --full --strict`` is clean and the files hold the
patch's content.  Where libgit2 cannot read the index (a split index; a path
new to a sparse index) the apply refuses with a usage error naming the fix,
and nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Repo, make_repo, run_cli, snapshot

FILES = {
    "README": "hello\n",
    "src/app.py": "".join(f"line {i}\n" for i in range(1, 21)),
    "src/util.py": "def f():\n    return 1\n",
    "src/old.txt": "old\n",
    "docs/guide.txt": "guide\n",
    "docs/deep/more.txt": "more\n",
}

MODIFY = (b"--- a/src/app.py\n+++ b/src/app.py\n@@ -1,3 +1,3 @@\n line 1\n-line 2\n+line two\n line 3\n")
MODIFY_AFTER = {"src/app.py": FILES["src/app.py"].replace("line 2\n", "line two\n")}

MIXED = (b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"
         b"--- /dev/null\n+++ b/src/new.txt\n@@ -0,0 +1 @@\n+new\n"
         b"--- a/src/old.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-old\n")
MIXED_AFTER = {"src/util.py": "def f():\n    return 2\n", "src/new.txt": "new\n", "src/old.txt": None}


def _reindex(repo: Repo) -> None:
    """The index written again by git, under the settings now configured."""
    (repo.path / ".git" / "index").unlink()
    repo.git("reset", "-q")
    repo.git("status", "--porcelain")  # fills the untracked cache, fsmonitor's token


def _version_4(repo: Repo) -> None:
    repo.git("config", "index.version", "4")
    _reindex(repo)
    assert (repo.path / ".git" / "index").read_bytes()[4:8] == (4).to_bytes(4, "big")


def _many_files(repo: Repo) -> None:
    repo.git("config", "feature.manyFiles", "true")
    _reindex(repo)


def _untracked_cache(repo: Repo) -> None:
    repo.git("config", "core.untrackedCache", "true")
    repo.write("scratch.txt", "untracked\n")
    _reindex(repo)
    assert b"UNTR" in (repo.path / ".git" / "index").read_bytes()


def _fsmonitor_hook(repo: Repo) -> None:
    # A version 2 hook that reports everything as possibly changed (git then stats every file).
    hook = repo.path.parent / "fsmonitor-hook"
    hook.write_text("#!/bin/sh\nprintf 'oncepatch-token\\0/\\0'\n")
    hook.chmod(0o755)
    repo.git("config", "core.fsmonitor", str(hook))
    repo.git("config", "core.fsmonitorHookVersion", "2")
    _reindex(repo)
    assert b"FSMN" in (repo.path / ".git" / "index").read_bytes()


def _fsmonitor_true(repo: Repo) -> None:
    repo.git("config", "core.fsmonitor", "true")  # git's own daemon, where this git has one
    repo.git("config", "fsmonitor.socketDir", str(repo.path.parent))
    _reindex(repo)


def _sparse_cone(repo: Repo) -> None:
    repo.git("sparse-checkout", "init", "--cone")
    repo.git("sparse-checkout", "set", "src")
    assert not (repo.path / "docs" / "guide.txt").exists()


def _sparse_index(repo: Repo) -> None:
    repo.git("sparse-checkout", "init", "--cone", "--sparse-index")
    repo.git("sparse-checkout", "set", "src")
    assert b"sdir" in (repo.path / ".git" / "index").read_bytes()


def _skip_worktree(repo: Repo) -> None:
    repo.git("update-index", "--skip-worktree", "docs/guide.txt")


def _intent_to_add(repo: Repo) -> None:
    repo.write("notes.txt", "notes\n")
    repo.git("add", "-N", "notes.txt")


def _split_index(repo: Repo) -> None:
    repo.git("config", "core.splitIndex", "true")
    repo.git("update-index", "--split-index")


def _head_symlink(repo: Repo) -> None:
    # git takes a symlinked HEAD only when it points under refs/ (and then reads its target as a ref).
    git_dir = repo.path / ".git"
    (git_dir / "refs" / "head-file").write_text("ref: refs/heads/main\n")
    (git_dir / "HEAD").unlink()
    os.symlink("refs/head-file", git_dir / "HEAD")
    assert repo.git("symbolic-ref", "HEAD").strip() == "refs/heads/main"


def _head_symlink_to_branch(repo: Repo) -> None:
    # git's own symlinked HEAD (core.preferSymlinkRefs): the link's target is the ref, the file a commit id.
    repo.git("-c", "core.preferSymlinkRefs=true", "symbolic-ref", "HEAD", "refs/heads/main")
    assert os.readlink(repo.path / ".git" / "HEAD") == "refs/heads/main"


SETTINGS: dict[str, Callable[[Repo], None]] = {
    "index.version=4": _version_4,
    "feature.manyFiles": _many_files,
    "core.untrackedCache": _untracked_cache,
    "core.fsmonitor=hook": _fsmonitor_hook,
    "core.fsmonitor=true": _fsmonitor_true,
    "sparse-checkout-cone": _sparse_cone,
    "index.sparse": _sparse_index,
    "skip-worktree": _skip_worktree,
    "intent-to-add": _intent_to_add,
    "core.splitIndex": _split_index,
    "HEAD-symlink": _head_symlink,
    "HEAD-symlink-to-branch": _head_symlink_to_branch,
}

#: (setting, patch) pairs libgit2 cannot carry out: refused, nothing changed.
REFUSED = {("core.splitIndex", "modify"): "split index", ("core.splitIndex", "mixed"): "split index",
           ("index.sparse", "mixed"): "sparse index"}


def _view(repo: Repo) -> dict[str, str]:
    """git's view of the worktree and index, as a user's commands show it."""
    return {
        "status": repo.git("status", "--porcelain", "--untracked-files=all"),
        "cached": repo.git("diff", "--cached"),
        "files": repo.git("diff-files", "--name-only"),
        "flags": repo.git("ls-files", "-t", "-v"),
    }


def _fsck_clean(repo: Repo) -> None:
    out = repo.git("fsck", "--full", "--strict", "--no-dangling")
    assert out.strip() == "", out


@pytest.mark.parametrize("patch", ["modify", "mixed"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_apply_under_index_setting(tmp_path: Path, setting: str, patch: str) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    if setting == "core.fsmonitor=true":
        if "fsmonitor--daemon" not in repo.git("help", "-a"):
            pytest.skip("this git has no fsmonitor daemon")
    SETTINGS[setting](repo)
    view = _view(repo)
    base = repo.head()
    patch_file = tmp_path / "p.diff"
    patch_file.write_bytes(MODIFY if patch == "modify" else MIXED)
    after = MODIFY_AFTER if patch == "modify" else MIXED_AFTER
    before = snapshot(repo)

    r = run_cli("apply", str(patch_file), "--key", f"k-{patch}", "--json", cwd=repo.path)

    refused = REFUSED.get((setting, patch))
    if refused is not None:
        assert r.code == 2, r.out + r.err
        message = r.json["error"]["message"]
        assert refused in message and "nothing was changed" in message, message
        assert "Traceback" not in r.err and "Exception ignored" not in r.err, r.err
        assert snapshot(repo) == before
        return
    assert r.code == 0, r.out + r.err
    assert "Exception ignored" not in r.err, r.err
    assert repo.git("rev-parse", "main^").strip() == base
    assert repo.git("rev-parse", "HEAD").strip() == r.json["commit"]
    for path, text in after.items():
        full = repo.path / path
        if text is None:
            assert not full.exists(), path
        else:
            assert full.read_text() == text, path
        assert repo.git("status", "--porcelain", "--", path) == "", path
        assert repo.git("diff-files", "--name-only", "--", path) == "", path
    assert repo.git("diff", "--cached") == view["cached"]
    now = _view(repo)
    # Only the touched paths' lines may differ in the flags (a new path, a deleted one).
    assert {k: v for k, v in now.items() if k != "flags"} == {k: v for k, v in view.items() if k != "flags"}
    touched = set(after)
    assert ([ln for ln in now["flags"].splitlines() if ln[2:] not in touched]
            == [ln for ln in view["flags"].splitlines() if ln[2:] not in touched])
    _fsck_clean(repo)

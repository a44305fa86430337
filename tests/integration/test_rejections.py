"""Every refusal of `oncepatch apply` changes nothing (docs/DESIGN.md sections 4 and 6).

For each refusal path: the exit code, the error envelope, and a `snapshot()`
of refs, HEAD, index, worktree and store taken before and after must be equal.

Input checks (decode, plan against the branch head, worktree checks) run
before the key's lock is taken, so a refusal does not even leave a lock file.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, git, run_cli, snapshot

CALL_ID = re.compile(r"^opc1:[0-9a-f]{64}$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def patch_of(repo: Repo, change: Callable[[Repo], None]) -> bytes:
    """The `git diff` of ``change`` made on top of HEAD; the repo is put back at HEAD."""
    base = repo.head()
    change(repo)
    target = repo.commit_all("tmp")
    data = git(repo.path, "diff", "--full-index", "--binary", "-M", base, target).encode("utf-8", "surrogateescape")
    repo.git("reset", "-q", "--hard", base)
    repo.git("reflog", "expire", "--expire=all", "--all")
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
    return data


def refuse(repo: Repo, patch: bytes, *extra: str, code: int, type: str, retryable: bool = False,
           effect_status: str = "not_started", next_action: str = "fix_input", key: str | None = "K",
           env: dict[str, str] | None = None, expect_key: Any = "same") -> dict[str, Any]:
    """Run a refused apply; check exit code, envelope and that nothing changed; return the error object."""
    before = snapshot(repo)
    args = ["apply", "-", "--repo", str(repo.path), "--json", *extra]
    if key is not None:
        args += ["--key", key]
    r = run_cli(*args, input=patch, env=env)
    assert r.code == code, r.out + r.err
    doc = r.json
    assert set(doc) == {"ok", "error"} and doc["ok"] is False
    err: dict[str, Any] = doc["error"]
    assert err["type"] == type, err
    assert err["retryable"] is retryable
    assert err["effect_status"] == effect_status
    assert err["next_action"] == next_action
    assert isinstance(err["message"], str) and err["message"] and not err["message"].endswith(".")
    if expect_key == "same":
        assert err["key"] == key if key is not None else CALL_ID.match(err["key"]), err["key"]
    else:
        assert err["key"] == expect_key
    assert snapshot(repo) == before
    return err


def add_patch(path: bytes, body: bytes = b"x\n") -> bytes:
    lines = body.count(b"\n")
    return (b"--- /dev/null\n+++ " + path + b"\n@@ -0,0 +1," + str(lines).encode() + b" @@\n"
            + b"".join(b"+" + line + b"\n" for line in body.splitlines()))


# -- unsafe paths -------------------------------------------------------------------------


UNSAFE = [
        ("absolute", add_patch(b"/etc/oncepatch-evil"), "absolute path"),
        ("absolute_git_prefix", add_patch(b"b//tmp/oncepatch-evil"), "absolute path"),
        ("dotdot", add_patch(b"b/../escape.txt"), "'..' component"),
        ("dotdot_inner", add_patch(b"b/src/../../escape.txt"), "'..' component"),
        ("dotgit_config", b"diff --git a/.git/config b/.git/config\n--- a/.git/config\n+++ b/.git/config\n"
         b"@@ -1 +1 @@\n-[core]\n+[core]\n", "'.git' component"),
        ("dotgit_upper", add_patch(b"b/.GIT/x"), "'.git' component"),
        ("dotgit_nested", add_patch(b"b/src/.Git/hooks/pre-commit"), "'.git' component"),
        ("nul_byte", add_patch(b"b/a\x00b"), "control character in path"),
        ("latin1_quoted", b'diff --git "a/caf\\351.txt" "b/caf\\351.txt"\nnew file mode 100644\n--- /dev/null\n'
         b'+++ "b/caf\\351.txt"\n@@ -0,0 +1 @@\n+x\n', "not UTF-8"),
        ("latin1_raw", add_patch(b"b/caf\xe9.txt"), "not UTF-8"),
        ("nul_quoted", b'diff --git "a/a\\000b" "b/a\\000b"\nnew file mode 100644\n--- /dev/null\n'
         b'+++ "b/a\\000b"\n@@ -0,0 +1 @@\n+x\n', "control character in path"),
        # 2000 folders fit in PATH_MAX; the call used to end in a RecursionError (exit 1, internal).
        ("too_deep", add_patch(b"b/" + b"d/" * 2000 + b"f"), "path deeper than 512 components"),
    ]


@pytest.mark.parametrize(("name", "patch", "reason"), UNSAFE, ids=[c[0] for c in UNSAFE])
def test_unsafe_path_in_patch(repo: Repo, name: str, patch: bytes, reason: str) -> None:
    err = refuse(repo, patch, code=4, type="unsafe_path")
    assert err["reason"] == reason
    assert not Path("/etc/oncepatch-evil").exists() and not Path("/tmp/oncepatch-evil").exists()
    assert not (repo.path.parent / "escape.txt").exists()


def test_a_path_as_deep_as_allowed_commits_and_is_checked_out(repo: Repo) -> None:
    deep = "d/" * 511 + "f"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "deep", input=add_patch(b"b/" + deep.encode()))
    assert r.code == 0, r.out + r.err
    assert (repo.path / deep).read_text() == "x\n"
    assert repo.git("status", "--porcelain") == ""
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


def test_unsafe_path_through_symlink_in_tree(repo: Repo, tmp_path: Path) -> None:
    os.symlink("src", repo.path / "lnk")
    repo.commit_all("a symlink to a folder")
    patch = add_patch(b"b/lnk/new.py")
    err = refuse(repo, patch, code=4, type="unsafe_path", key=None)
    assert err["reason"] == "through_symlink" and err["symlink"] == "lnk"
    assert not (repo.path / "src/new.py").exists()
    # Modifying a file "under" the symlink is refused the same way.
    patch = (b"--- a/lnk/util.py\n+++ b/lnk/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n")
    err = refuse(repo, patch, code=4, type="unsafe_path")
    assert err["reason"] == "through_symlink"


def test_unsafe_path_through_untracked_symlinked_folder(repo: Repo, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, repo.path / "ext")  # only in the worktree, not in any tree
    err = refuse(repo, add_patch(b"b/ext/new.txt"), code=4, type="unsafe_path")
    assert err["reason"] == "through_symlink"
    assert list(outside.iterdir()) == []


def test_unsafe_path_tracked_folder_swapped_for_symlink(repo: Repo, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "guide.txt").write_text("guide\n")
    (repo.path / "docs/guide.txt").unlink()
    (repo.path / "docs").rmdir()
    os.symlink(outside, repo.path / "docs")
    patch = b"--- a/docs/guide.txt\n+++ b/docs/guide.txt\n@@ -1 +1 @@\n-guide\n+GUIDE\n"
    err = refuse(repo, patch, code=4, type="unsafe_path")
    assert err["reason"] == "through_symlink"
    assert (outside / "guide.txt").read_text() == "guide\n"


def new_symlink_patch(path: bytes, target: bytes = b"../../../../etc/passwd") -> bytes:
    """A unified diff adding ``path`` as a symlink (mode 120000) to ``target``, as git writes one."""
    return (b"diff --git a/" + path + b" b/" + path + b"\nnew file mode 120000\n--- /dev/null\n+++ b/" + path
            + b"\n@@ -0,0 +1 @@\n+" + target + b"\n\\ No newline at end of file\n")


GIT_FILE_LINKS = [
    (".gitmodules", b".gitmodules", "'.gitmodules' as a symlink"),
    ("gitmodules_nested", b"vendor/lib/.gitmodules", "'.gitmodules' as a symlink"),
    ("gitmodules_case", b".GitModules", "'.gitmodules' as a symlink"),
    ("gitmodules_ntfs_dots", b".gitmodules . .", "'.gitmodules' as a symlink"),
    ("gitmodules_ntfs_short", b"GITMOD~1", "'.gitmodules' as a symlink"),
    ("gitmodules_ntfs_hashed", b"gi7eba~2", "'.gitmodules' as a symlink"),
    ("gitmodules_hfs", ".git\u200cmodules".encode(), "'.gitmodules' as a symlink"),
    ("gitattributes", b".gitattributes", "'.gitattributes' as a symlink"),
    ("gitignore", b"src/.gitignore", "'.gitignore' as a symlink"),
    ("mailmap", b".mailmap", "'.mailmap' as a symlink"),
]


@pytest.mark.parametrize(("name", "path", "reason"), GIT_FILE_LINKS, ids=[c[0] for c in GIT_FILE_LINKS])
def test_git_files_as_symlinks_are_refused_and_nothing_changes(repo: Repo, name: str, path: bytes,
                                                              reason: str) -> None:
    """git's verify_path refuses them (fsck: gitmodulesSymlink, ...); they were committed."""
    err = refuse(repo, new_symlink_patch(path), code=4, type="unsafe_path")
    assert err["reason"] == reason and err["path"] == path.decode()
    assert repo.git("fsck", "--strict", "--no-progress") == ""


def test_a_file_turned_into_a_symlink_named_like_a_git_file_is_refused(repo: Repo) -> None:
    """The mode change alone makes it a symlink ('old mode 100644' / 'new mode 120000')."""
    repo.write(".mailmap", "A <a@example.com>\n")
    repo.commit_all("a mailmap")
    patch = (b"diff --git a/.mailmap b/.mailmap\nold mode 100644\nnew mode 120000\n--- a/.mailmap\n+++ b/.mailmap\n"
             b"@@ -1 +1 @@\n-A <a@example.com>\n+/home/someone/.mailmap\n\\ No newline at end of file\n")
    err = refuse(repo, patch, code=4, type="unsafe_path")
    assert err["reason"] == "'.mailmap' as a symlink"


def test_a_symlink_renamed_to_a_git_file_keeps_its_mode_and_is_refused(repo: Repo) -> None:
    """A rename carries no mode line: the symlink's mode comes from the base tree."""
    os.symlink("../outside", repo.path / "innocent")
    repo.commit_all("a symlink")
    patch = (b"diff --git a/innocent b/.gitmodules\nsimilarity index 100%\n"
             b"rename from innocent\nrename to .gitmodules\n")
    err = refuse(repo, patch, code=4, type="unsafe_path")
    assert err["reason"] == "'.gitmodules' as a symlink"


def test_git_files_as_regular_files_and_other_symlinks_still_commit(repo: Repo) -> None:
    patch = (b"--- /dev/null\n+++ b/.gitmodules\n@@ -0,0 +1,3 @@\n+[submodule \"x\"]\n+\tpath = x\n"
             b"+\turl = https://example.com/x\n" + new_symlink_patch(b".gitmodules-link", b".gitmodules"))
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 0, r.out + r.err
    assert os.readlink(repo.path / ".gitmodules-link") == ".gitmodules"
    assert repo.git("fsck", "--strict", "--no-progress") == ""


@pytest.mark.parametrize("path", [
    ".gitmodules", "sub/.gitmodules", ".GITMODULES", ".git\u200cmodules", "\u200c.gitmodules\u200d", ".gitmodules ",
    ".gitmodules. .", ".gitmodules::$DATA", "gitmod~1", "GITMOD~4", "gi7eba~1", "gi7eb~12", ".gitmodules/below",
    ".gitattributes", "gitatt~1", ".gitignore", "gi250a~1", ".mailmap", "MAILMA~1",
    ".gitmodulesx", "x.gitmodules", "gitmod~5", "gitmod~1x", "gi7eba~0", "gi7eba1~1", "gitmod~1/below",
    ".gitmodule\u017f", ".mailmapx", "link",
])
def test_symlink_paths_git_refuses_are_the_ones_refused(repo: Repo, path: str) -> None:
    """Conformance: git's own verify_path (update-index, both protections on) against patcher.paths.

    git refuses only '.gitmodules' as a symlink at checkout; '.gitattributes', '.gitignore' and
    '.mailmap' it reports in fsck, and oncepatch refuses them too: those differ on purpose.
    """
    from patcher.errors import UnsafePath
    from patcher.paths import verify_path

    oid = repo.git("hash-object", "-w", "--stdin", input=b"target").strip()
    res = subprocess.run(["git", "-c", "core.protectHFS=true", "-c", "core.protectNTFS=true", "update-index",
                          "--add", "--cacheinfo", f"120000,{oid},{path}"], cwd=repo.path, capture_output=True)
    try:
        verify_path(path, 0o120000)
        refused = None
    except UnsafePath as exc:
        refused = exc.details["reason"]
    if refused is None or refused == "'.gitmodules' as a symlink":
        assert (res.returncode != 0) == (refused is not None), (path, res.stderr)
    else:
        assert refused in ("'.gitattributes' as a symlink", "'.gitignore' as a symlink", "'.mailmap' as a symlink")


# -- does not apply -----------------------------------------------------------------------


def test_context_not_found(repo: Repo) -> None:
    patch = (b"--- a/src/app.py\n+++ b/src/app.py\n@@ -3,3 +3,3 @@\n line 3\n-line 4 (as it never was)\n"
             b"+line four\n line 5\n")
    err = refuse(repo, patch, code=4, type="context_not_found", key=None)
    assert err["path"] == "src/app.py" and err["hunk"] == 1
    assert err["closest"]["line"] == 3


def test_ambiguous_match(repo: Repo) -> None:
    # 'x / y' sits two lines above and two lines below where the hunk says it is (line 4).
    repo.write("amb.txt", "top\nx\ny\nmid1\nmid2\nx\ny\nend\n")
    repo.commit_all("ambiguous file")
    patch = b"--- a/amb.txt\n+++ b/amb.txt\n@@ -4,2 +4,2 @@\n x\n-y\n+Y\n"
    err = refuse(repo, patch, code=4, type="ambiguous_match")
    assert err["candidates"] == [2, 6]
    assert err["path"] == "amb.txt"


def test_add_of_existing_file_with_other_content(repo: Repo) -> None:
    patch = patch_of(repo, lambda r: r.write("new.txt", "mine\n"))
    repo.write("new.txt", "theirs\n")
    repo.commit_all("someone added it first")
    err = refuse(repo, patch, code=4, type="context_not_found")
    assert err["path"] == "new.txt"


def test_partially_applied(repo: Repo) -> None:
    def both(r: Repo) -> None:
        text = (r.path / "src/app.py").read_text()
        r.write("src/app.py", text.replace("line 3\n", "line three\n").replace("line 17\n", "line seventeen\n"))

    patch = patch_of(repo, both)
    text = (repo.path / "src/app.py").read_text()
    repo.write("src/app.py", text.replace("line 3\n", "line three\n"))  # hunk 1 landed some other way
    repo.commit_all("half of it")
    err = refuse(repo, patch, code=4, type="partially_applied")
    assert err["applied_hunks"] == [1] and err["missing_hunks"] == [2]


def test_delete_of_missing_file(repo: Repo) -> None:
    patch = patch_of(repo, lambda r: r.git("rm", "-q", "docs/guide.txt"))
    repo.git("rm", "-q", "docs/guide.txt")
    repo.commit_all("deleted already, by someone else")
    err = refuse(repo, patch, code=4, type="context_not_found")
    assert err["path"] == "docs/guide.txt"


def test_delete_without_hunks_of_a_file_that_changed_since(repo: Repo) -> None:
    """An empty file's delete carries no hunks, only its index line: content written since is not lost."""
    repo.write("empty.txt", "")
    repo.commit_all("an empty file")
    patch = patch_of(repo, lambda r: r.git("rm", "-q", "empty.txt"))
    assert b"@@" not in patch and b"index e69de29" in patch
    repo.write("empty.txt", "important data\n")
    repo.commit_all("filled since")
    err = refuse(repo, patch, code=4, type="context_not_found")
    assert err["path"] == "empty.txt" and err["expected_blob"].startswith("e69de29")


def test_irreversible_delete_checks_the_blob_it_names(repo: Repo) -> None:
    """'git diff --irreversible-delete' has no hunks: the index line's blob must be the file's."""
    base = repo.head()
    repo.git("rm", "-q", "docs/guide.txt")
    repo.commit_all("tmp")
    patch = repo.git("diff", "--irreversible-delete", base, "HEAD").encode()
    repo.git("reset", "-q", "--hard", base)
    assert b"@@" not in patch and b"deleted file mode" in patch
    repo.write("docs/guide.txt", "guide, rewritten\n")
    repo.commit_all("rewritten since")
    refuse(repo, patch, code=4, type="context_not_found")
    repo.git("reset", "-q", "--hard", base)  # unchanged since: the delete applies
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 0, r.out + r.err
    assert not (repo.path / "docs/guide.txt").exists()


def test_a_pure_rename_onto_someone_elses_file_is_not_already_applied(repo: Repo) -> None:
    """Source gone, target there: a pure rename carries no content, so only a blob id it names proves the target."""
    patch = patch_of(repo, lambda r: r.git("mv", "src/util.py", "src/helpers.py"))
    assert b"rename from src/util.py" in patch and b"@@" not in patch and b"\nindex " not in patch
    repo.git("rm", "-q", "src/util.py")
    repo.write("src/helpers.py", "someone else's helpers\n")
    repo.commit_all("util removed, an unrelated helpers.py added")
    err = refuse(repo, patch, code=4, type="context_not_found")
    assert err["path"] == "src/util.py" and err["target"] == "src/helpers.py"
    # Even the very bytes that were moved are not proof without a blob id: the same refusal.
    repo.write("src/helpers.py", "def f():\n    return 1\n")
    repo.commit_all("helpers.py holds util's old bytes")
    refuse(repo, patch, code=4, type="context_not_found")
    # A rename that names its blob (an 'index' line) is proven by it: already applied, nothing new committed.
    blob = repo.git("rev-parse", "HEAD:src/helpers.py").strip()
    named = patch.replace(b"rename to src/helpers.py\n",
                          b"rename to src/helpers.py\nindex " + blob.encode() + b".." + blob.encode() + b"\n")
    head = repo.head()
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "named", input=named)
    assert r.code == 0, r.out + r.err
    assert r.json["already_applied"] is True and repo.head() == head
    # The rename with an edit is proven by its edit, as before.
    def moved_and_edited(r: Repo) -> None:
        r.git("mv", "src/app.py", "src/main.py")
        r.write("src/main.py", (r.path / "src/main.py").read_text().replace("line 10\n", "line ten\n"))

    edit = patch_of(repo, moved_and_edited)
    assert b"rename from src/app.py" in edit and b"+line ten" in edit
    moved_and_edited(repo)
    repo.commit_all("done by hand")
    head = repo.head()
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "edited", input=edit)
    assert r.code == 0, r.out + r.err
    assert r.json["already_applied"] is True and repo.head() == head


# -- dirty worktree -----------------------------------------------------------------------


MODIFY_UTIL = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"


def test_dirty_modified_tracked_file(repo: Repo) -> None:
    repo.write("src/util.py", "def f():\n    return 1\n# my unsaved work\n")
    err = refuse(repo, MODIFY_UTIL, code=4, type="dirty_path", retryable=True, next_action="retry")
    assert err["paths"] == ["src/util.py"] and err["worktree"] == str(repo.path)
    assert (repo.path / "src/util.py").read_text().endswith("# my unsaved work\n")


def test_dirty_staged_change(repo: Repo) -> None:
    repo.write("src/util.py", "def f():\n    return 1\n\n")
    repo.git("add", "src/util.py")
    err = refuse(repo, MODIFY_UTIL, code=4, type="dirty_path", retryable=True, next_action="retry")
    assert err["paths"] == ["src/util.py"]


def test_dirty_untracked_file_where_add_goes(repo: Repo) -> None:
    patch = patch_of(repo, lambda r: r.write("notes/new.txt", "from the patch\n"))
    repo.write("notes/new.txt", "my untracked notes\n")
    err = refuse(repo, patch, code=4, type="dirty_path", retryable=True, next_action="retry", key=None)
    assert err["paths"] == ["notes/new.txt"]
    assert (repo.path / "notes/new.txt").read_text() == "my untracked notes\n"


def test_dirty_tracked_file_replaced_by_an_empty_folder(repo: Repo) -> None:
    """'git status' says the file is deleted: the empty folder used to pass the check and be replaced."""
    (repo.path / "src/util.py").unlink()
    (repo.path / "src/util.py").mkdir()
    assert repo.git("status", "--porcelain") == " D src/util.py\n"
    err = refuse(repo, MODIFY_UTIL, code=4, type="dirty_path", retryable=True, next_action="retry", key=None)
    assert err["paths"] == ["src/util.py"]
    assert (repo.path / "src/util.py").is_dir()


def test_dirty_only_matters_on_touched_paths(repo: Repo) -> None:
    repo.write("README", "edited but not touched by the patch\n")
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=MODIFY_UTIL)
    assert r.code == 0, r.out + r.err
    assert (repo.path / "README").read_text() == "edited but not touched by the patch\n"
    assert repo.git("status", "--porcelain") == " M README\n"


# -- malformed, binary, too large ---------------------------------------------------------


def test_malformed_hunk(repo: Repo) -> None:
    patch = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,3 +1,3 @@\n def f():\n-    return 1\n+    return 2\n"
    err = refuse(repo, patch, code=4, type="parse_error")
    assert err["path"] == "src/util.py"


def test_not_a_patch_at_all(repo: Repo) -> None:
    err = refuse(repo, b"this is a commit message, not a diff\n", code=4, type="parse_error", key=None,
                 expect_key=None)
    assert "format" in err["message"]


def test_binary_patch_made_against_other_bytes(repo: Repo) -> None:
    repo.write("blob.bin", bytes(range(256)))
    repo.commit_all("binary file")
    patch = patch_of(repo, lambda r: r.write("blob.bin", bytes(reversed(range(256)))))
    assert b"GIT binary patch" in patch
    repo.write("blob.bin", bytes(range(255)))
    repo.commit_all("changed since")
    err = refuse(repo, patch, code=4, type="context_not_found")
    assert err["path"] == "blob.bin"


def test_binary_files_differ_line(repo: Repo) -> None:
    patch = b"diff --git a/blob.bin b/blob.bin\nindex 1111111..2222222 100644\nBinary files a/blob.bin and b/blob.bin differ\n"
    err = refuse(repo, patch, code=4, type="parse_error")
    assert "git diff --binary" in err["message"]


def test_too_large(repo: Repo) -> None:
    patch = MODIFY_UTIL + b"\n" * 64
    assert len(patch) > 100
    err = refuse(repo, patch, code=4, type="too_large", env={"ONCEPATCH_MAX_PATCH_BYTES": "100"}, key=None,
                 expect_key=None)
    assert err["limit"] == 100 and err["size"] == len(patch)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 0, "the same patch applies under the default limit"


def test_too_large_envelope_names_the_given_key(repo: Repo) -> None:
    patch = MODIFY_UTIL + b"\n" * 64
    refuse(repo, patch, code=4, type="too_large", env={"ONCEPATCH_MAX_PATCH_BYTES": "100"}, key="K")


# -- usage: exit 2 ------------------------------------------------------------------------


def usage(repo: Repo, *args: str, cwd: Path | None = None, input: bytes | None = None) -> dict[str, Any]:
    before = snapshot(repo)
    r = run_cli("apply", *args, "--json", cwd=cwd, input=input)
    assert r.code == 2, r.out + r.err
    err: dict[str, Any] = r.json["error"]
    assert r.json["ok"] is False and err["type"] == "usage"
    assert err["retryable"] is False and err["effect_status"] == "not_started"
    assert err["next_action"] == "fix_input" and err["key"] is None
    assert snapshot(repo) == before
    return err


def test_an_unreadable_patch_or_message_names_the_calls_key(repo: Repo, tmp_path: Path) -> None:
    # Refused before the call began, these envelopes said key: null although --key was given.
    for argv, input_ in (([str(tmp_path / "missing.patch")], None), (["-", "--message", "\udcff"], MODIFY_UTIL)):
        before = snapshot(repo)
        r = run_cli("apply", *argv, "--repo", str(repo.path), "--json", "--key", "named", input=input_,
                    env={"ONCEPATCH_TEST_FORK": "0"})  # the message's byte 0xff, as a shell passes it
        assert r.code == 2, r.out + r.err
        err = r.json["error"]
        assert err["key"] == "named" and err["effect_status"] == "not_started", err
        assert snapshot(repo) == before


def test_unreadable_patch_file(repo: Repo, tmp_path: Path) -> None:
    err = usage(repo, str(tmp_path / "missing.patch"), "--repo", str(repo.path))
    assert "missing.patch" in err["message"]
    usage(repo, str(tmp_path), "--repo", str(repo.path))  # a folder
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.patch")
    usage(repo, str(tmp_path / "dangling.patch"), "--repo", str(repo.path))
    if os.geteuid() != 0:  # root reads anything
        p = tmp_path / "locked.patch"
        p.write_bytes(MODIFY_UTIL)
        p.chmod(0)
        usage(repo, str(p), "--repo", str(repo.path))


def test_not_a_repository(repo: Repo, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    err = usage(repo, "-", "--repo", str(plain), input=MODIFY_UTIL)
    assert "not a git repository" in err["message"]
    assert list(plain.iterdir()) == []
    usage(repo, "-", cwd=plain, input=MODIFY_UTIL)


def test_a_repository_libgit2_cannot_open_is_named(repo: Repo, tmp_path: Path) -> None:
    sha256 = tmp_path / "sha256"
    git(tmp_path, "init", "-q", "--object-format=sha256", str(sha256))
    (sha256 / "src").mkdir()
    (sha256 / "src/util.py").write_text("def f():\n    return 1\n")
    git(sha256, "add", "-A")
    git(sha256, "commit", "-q", "-m", "base")
    before = Repo(sha256)
    snap = snapshot(before)
    r = run_cli("apply", "-", "--repo", str(sha256), "--json", input=MODIFY_UTIL)
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert (err["type"], err["effect_status"], err["next_action"]) == ("usage", "not_started", "fix_input")
    assert "cannot open the git repository" in err["message"] and "sha256" in err["message"]
    assert snapshot(before) == snap


@pytest.mark.parametrize("command", [["apply", "-"], ["status", "K"], ["recover"], ["verify"], ["log"],
                                     ["watch", "--once"], ["resolve", "K", "--as", "rejected"]])
@pytest.mark.parametrize("where", ["a file", "under a file", "a dangling symlink"])
def test_a_store_that_is_not_a_folder_is_a_usage_error(repo: Repo, tmp_path: Path, command: list[str],
                                                       where: str) -> None:
    blocker = tmp_path / "store-file"
    blocker.write_text("x\n")
    store = blocker if where == "a file" else blocker / "sub"
    if where == "a dangling symlink":
        store = tmp_path / "dangling"
        store.symlink_to(tmp_path / "nowhere")
    before = snapshot(repo)
    r = run_cli(*command, "--repo", str(repo.path), "--store", str(store), "--json", input=MODIFY_UTIL)
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert (err["type"], err["effect_status"], err["next_action"]) == ("usage", "not_started", "fix_input")
    assert str(store) in err["message"] and "Traceback" not in r.err
    assert blocker.read_text() == "x\n" and snapshot(repo) == before
    text = run_cli(*command, "--repo", str(repo.path), "--store", str(store), input=MODIFY_UTIL)
    assert text.code == 2 and "Traceback" not in text.err and "cannot use the store" in text.err


def test_an_unknown_format_is_a_usage_error(repo: Repo) -> None:
    err = usage(repo, "-", "--repo", str(repo.path), "--format", "nonsense", input=MODIFY_UTIL)
    assert "unknown patch format 'nonsense'" in err["message"] and "unified" in err["message"]


def test_the_builtin_format_names_are_the_registered_ones() -> None:
    from patcher.formats import BUILTIN_NAMES, format_names

    assert tuple(format_names()) == BUILTIN_NAMES


def test_branch_head_means_the_branch_head_names(repo: Repo) -> None:
    r = run_cli("apply", "-", "--repo", str(repo.path), "--branch", "HEAD", "--json", input=MODIFY_UTIL)
    assert r.code == 0, r.out + r.err
    assert repo.git("rev-parse", "main") == r.json["commit"] + "\n"
    repo.git("checkout", "-q", "--detach")
    err = usage(repo, "-", "--repo", str(repo.path), "--branch", "HEAD", input=MODIFY_UTIL)
    assert "detached" in err["message"]


def test_detached_head_needs_branch(repo: Repo) -> None:
    repo.git("checkout", "-q", "--detach")
    err = usage(repo, "-", "--repo", str(repo.path), input=MODIFY_UTIL)
    assert "--branch" in err["message"]
    r = run_cli("apply", "-", "--repo", str(repo.path), "--branch", "main", "--json", input=MODIFY_UTIL)
    assert r.code == 0, r.out + r.err
    assert repo.git("status", "--porcelain") == ""  # a detached HEAD is not 'main' checked out


def test_missing_branch_is_refused_not_made_a_root_commit(repo: Repo) -> None:
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--branch", "no-such-branch", "--json", input=MODIFY_UTIL)
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and err["next_action"] == "fix_input"
    assert "does not exist" in err["message"] and "no-such-branch" in err["message"]
    assert snapshot(repo) == before


def test_bad_branch_name_and_attempt(repo: Repo) -> None:
    usage(repo, "-", "--repo", str(repo.path), "--branch", "bad..name", input=MODIFY_UTIL)
    usage(repo, "-", "--repo", str(repo.path), "--attempt", "0", input=MODIFY_UTIL)
    usage(repo, "-", "--repo", str(repo.path), "--attempt", "two", input=MODIFY_UTIL)


def test_refusal_is_not_remembered(repo: Repo) -> None:
    """A refusal before prepare writes no receipt: fixing the worktree and retrying applies."""
    repo.write("src/util.py", "dirty\n")
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "K", "--json", input=MODIFY_UTIL)
    assert r.code == 4 and r.json["error"]["type"] == "dirty_path"
    assert run_cli("status", "K", "--repo", str(repo.path), "--json").code == 2
    repo.git("checkout", "--", "src/util.py")
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "K", "--json", input=MODIFY_UTIL)
    assert r.code == 0 and r.json["replayed"] is False
    assert repo.count() == 2


def test_an_unwritable_receipts_folder_is_named_and_nothing_changes(repo: Repo) -> None:
    folder = repo.path / ".git/oncepatch/receipts"
    folder.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (it needs root and a filesystem with attributes)")
    try:
        before = snapshot(repo)
        r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "K", "--json", input=MODIFY_UTIL)
        assert r.code == 1, r.out + r.err
        err = r.json["error"]
        assert str(folder) in err["message"] and err["effect_status"] == "not_started", err
        after = snapshot(repo)
        # The key's lock file stays (taken before the write failed); recover removes such files.
        after["store"] = {k: v for k, v in after["store"].items() if not k.startswith("locks/")}
        assert after == before
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_blob_a_partial_clone_never_fetched_is_named_and_nothing_changes(repo: Repo, tmp_path: Path) -> None:
    """A blobless clone lacks the base blob of a branch never checked out: exit 2, not an internal error."""
    repo.git("checkout", "-q", "-b", "side")
    repo.write("src/util.py", "def f():\n    return 1\n# side\n")
    repo.commit_all("side only")
    repo.git("checkout", "-q", "main")
    repo.git("config", "uploadpack.allowFilter", "true")
    clone = Repo(tmp_path / "partial")
    git(tmp_path, "clone", "-q", "--filter=blob:none", f"file://{repo.path}", str(clone.path))
    clone.git("branch", "-q", "side", "origin/side")
    patch = b"--- a/src/util.py\n+++ b/src/util.py\n@@ -1,3 +1,3 @@\n def f():\n-    return 1\n+    return 2\n # side\n"
    err = refuse(clone, patch, "--branch", "side", code=2, type="usage")
    assert err["reason"] == "partial_clone" and "partial clone" in err["message"]
    assert not clone.store.exists()


def test_a_path_outside_the_sparse_checkout_is_refused_for_good_and_nothing_changes(repo: Repo) -> None:
    """Not 'uncommitted changes, retry': no retry would help until the sparse checkout is widened."""
    repo.git("sparse-checkout", "set", "--cone", "src")
    assert not (repo.path / "docs/guide.txt").exists()
    patch = b"--- a/docs/guide.txt\n+++ b/docs/guide.txt\n@@ -1 +1,2 @@\n guide\n+more\n"
    err = refuse(repo, patch, code=4, type="dirty_path")
    assert err["reason"] == "outside_sparse_checkout" and err["paths"] == ["docs/guide.txt"]
    assert "sparse-checkout add" in err["message"]
    side = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--branch", "side", input=patch)
    assert side.code == 2  # (no such branch) - the advice's other half is checked next
    repo.git("branch", "side")
    side = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--branch", "side", input=patch)
    assert side.code == 0, side.out + side.err
    assert repo.git("show", "side:docs/guide.txt") == "guide\nmore\n"
    assert repo.git("status", "--porcelain") == ""


def test_a_file_inside_the_sparse_checkout_deleted_by_hand_is_an_ordinary_dirty_path(repo: Repo) -> None:
    repo.git("sparse-checkout", "set", "--cone", "src")
    (repo.path / "src/util.py").unlink()
    err = refuse(repo, MODIFY_UTIL, code=4, type="dirty_path", retryable=True, next_action="retry")
    assert "reason" not in err and err["paths"] == ["src/util.py"]


def test_a_key_committed_through_another_store_is_refused_before_anything_moves(repo: Repo, tmp_path: Path) -> None:
    """The key ref is the repository's, the receipt the store's: the branch must not move for a key
    whose key ref exists (it used to move, then report 'not applied' when the key ref could not follow)."""
    other = tmp_path / "other-store"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", "--store", str(other),
                input=MODIFY_UTIL)
    assert r.code == 0, r.out + r.err
    second = b"--- a/docs/guide.txt\n+++ b/docs/guide.txt\n@@ -1 +1 @@\n-guide\n+the guide\n"
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", input=second)
    assert r.code == 3, r.out + r.err
    err = r.json["error"]
    assert (err["type"], err["effect_status"], err["key"]) == ("idempotency_conflict", "not_started", "K")
    assert err["key_ref"].startswith("refs/oncepatch/keys/") and err["commit"] == repo.head()
    assert "another store" in err["message"]
    after = snapshot(repo)
    # Decided under the key's lock (a call of this store holding the key has written its receipt
    # by then): the lock file is all that is new.
    assert {p for p in after["store"] if p not in before["store"]} <= {p for p in after["store"] if p.startswith("locks/")}
    assert all(after["store"].get(p) == digest for p, digest in before["store"].items())
    assert {k: v for k, v in after.items() if k != "store"} == {k: v for k, v in before.items() if k != "store"}


def test_a_whole_file_write_over_a_symlink_is_refused_and_nothing_changes(repo: Repo) -> None:
    """It would have set the link's target to the content ('/etc/passwd' included)."""
    os.symlink("README", repo.path / "link")
    repo.commit_all("a link")
    err = refuse(repo, b'[{"path": "link", "content": "/etc/passwd"}]', code=4, type="unsafe_path")
    assert err["reason"] == "symlink"
    assert os.readlink(repo.path / "link") == "README"


@pytest.mark.parametrize("patch", [
    b'[{"path": "f.txt", "old_str": "hello", "new_str": "\\ud800"}]',
    b'[{"path": "f.txt", "content": "\\ud800"}]',
    b'[{"path": "t\\ud800.txt", "content": "x"}]',
], ids=["str_replace_text", "whole_file_content", "whole_file_path"])
def test_a_json_lone_surrogate_is_refused_and_nothing_changes(repo: Repo, patch: bytes) -> None:
    """A JSON escape of a lone surrogate (no byte stands for it) was an internal error."""
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 4 and r.json["error"]["type"] in ("parse_error", "unsafe_path"), r.out + r.err
    assert snapshot(repo) == before


def test_a_patch_into_a_store_inside_the_worktree_is_refused(repo: Repo) -> None:
    """With --store inside the worktree, a patch could write receipts (checked out over the store's own)."""
    store = repo.path / ".opstore"
    run_cli("apply", "-", "--repo", str(repo.path), "--store", str(store), "--json", "--key", "first",
            input=b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+first\n")  # the store now exists
    for path in (".opstore/receipts/ab/x.json", ".opstore", ".opstore/events.jsonl"):
        patch = f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+{{}}\n".encode()
        err = refuse(repo, patch, "--store", str(store), code=4, type="unsafe_path")
        assert err["reason"] == "in_store" and err["path"] == path
    # A folder above the store, replaced by a file, would remove it: refused too.
    nested = repo.path / "var" / "store"
    err = refuse(repo, b"--- /dev/null\n+++ b/var\n@@ -0,0 +1 @@\n+x\n", "--store", str(nested), code=4,
                 type="unsafe_path")
    assert err["reason"] == "in_store"
    # The same store named through a symlink to the repository is the same folder.
    (repo.path.parent / "alias").symlink_to(repo.path)
    err = refuse(repo, b"--- /dev/null\n+++ b/.opstore/note.txt\n@@ -0,0 +1 @@\n+x\n", "--store",
                 str(repo.path.parent / "alias" / ".opstore"), code=4, type="unsafe_path")
    assert err["reason"] == "in_store"
    # Other paths apply as usual.
    ok = run_cli("apply", "-", "--repo", str(repo.path), "--store", str(store), "--json",
                 input=b"--- /dev/null\n+++ b/other.txt\n@@ -0,0 +1 @@\n+x\n")
    assert ok.code == 0, ok.out + ok.err


def _immutable(path: Path, on: bool) -> bool:
    """chattr +i / -i (ext4, xfs, btrfs): a folder even root cannot add to.  False where it cannot be set."""
    try:
        res = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True, check=False)
    except OSError:
        return False
    return res.returncode == 0


def test_a_store_this_process_cannot_write_replays_and_refuses_new_calls_cleanly(repo: Repo, tmp_path: Path) -> None:
    """A store made read-only (another user's; here immutable, which binds root too).

    A committed key still replays (its ledger note is skipped, with a warning); a new key is a
    usage error that started nothing, not an internal error of unknown effect.
    """
    store = tmp_path / "store"
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+once\n"
    first = run_cli("apply", "-", "--repo", str(repo.path), "--store", str(store), "--json", "--key", "k",
                    input=patch)
    assert first.code == 0, first.out + first.err
    folders = [store, store / "locks", store / "receipts"]
    if not _immutable(store, True):
        pytest.skip("chattr +i is not available here (the filesystem or the tool): no store root cannot write")
    try:
        for f in folders[1:]:
            assert _immutable(f, True)
        (store / "events.jsonl").chmod(0o444)
        _immutable(store / "events.jsonl", True)
        again = run_cli("apply", "-", "--repo", str(repo.path), "--store", str(store), "--json", "--key", "k",
                        input=patch)
        assert again.code == 0, again.out + again.err
        assert again.json["replayed"] is True and again.json["commit"] == first.json["commit"]
        assert any("not noted in the ledger" in w for w in again.json["warnings"])
        err = refuse(repo, b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+other\n", "--store", str(store),
                     code=2, type="usage", key="k2")
        assert "cannot take the lock of key 'k2'" in err["message"]
    finally:
        for f in [store / "events.jsonl", *folders]:
            _immutable(f, False)


def test_matching_over_the_work_budget_is_too_large(repo: Repo) -> None:
    """Many edit blocks of one file, each reading it whole: refused past the call's budget, nothing changed."""
    repo.write("big.txt", "".join(f"line {i}\n" for i in range(400)))
    repo.commit_all("big")
    blocks = "".join(f"big.txt\n<<<<<<< SEARCH\nline {i}\n=======\nLINE {i}\n>>>>>>> REPLACE\n\n"
                     for i in range(0, 400, 2))
    err = refuse(repo, blocks.encode(), code=4, type="too_large", env={"ONCEPATCH_MAX_MATCH_WORK": "0"})
    assert err["path"] == "big.txt" and err["reason"] == "work"
    # The same call under the default budget applies.
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", input=blocks.encode())
    assert r.code == 0, r.out + r.err

"""Binary patches and copies through the CLI, against trees and files made by git itself.

Each patch is `git diff --binary` (or `format-patch`) of a commit; applied by
`oncepatch apply` onto the commit's parent with the branch checked out, the
new commit must have git's tree, the working tree git's bytes, and `git
status` must be clean.  Patches that do not fit the file are refused with
nothing changed (`snapshot`).
"""

from __future__ import annotations

import os
import random

import pytest

from conftest import Repo, git, run_cli, snapshot
from cas.hashing import git_blob_oid

BLOB = random.Random(1).randbytes(40_000)


def _change(repo: Repo, edit, *diff_args: str) -> tuple[bytes, str]:  # type: ignore[no-untyped-def]
    """The patch of ``edit`` made on top of HEAD, and git's tree for it; HEAD is put back."""
    base = repo.head()
    edit(repo)
    target = repo.commit_all("target")
    tree = repo.head("HEAD^{tree}")
    patch = git(repo.path, "diff", "--binary", *diff_args, base, target).encode("utf-8", "surrogateescape")
    repo.git("reset", "-q", "--hard", base)
    return patch, tree


def _apply(repo: Repo, patch: bytes, *args: str) -> dict:  # type: ignore[type-arg]
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", *args, input=patch)
    assert r.code == 0, r.out + r.err
    return r.json  # type: ignore[no-any-return]


def _clean(repo: Repo) -> None:
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""


@pytest.fixture
def brepo(repo: Repo) -> Repo:
    repo.write("img/a.bin", BLOB)
    repo.write("img/small.bin", b"x\0y")
    repo.write("text.txt", "".join(f"line {i}\n" for i in range(40)))
    repo.commit_all("binary files")
    return repo


def test_delta_literal_and_delete_in_one_patch(brepo: Repo) -> None:
    def edit(r: Repo) -> None:
        data = bytearray(BLOB)
        data[1000:1010] = b"0123456789"
        r.write("img/a.bin", bytes(data))
        r.write("img/new.bin", b"new\0file")
        os.unlink(r.path / "img/small.bin")

    patch, tree = _change(brepo, edit)
    assert b"delta " in patch and b"literal " in patch
    doc = _apply(brepo, patch)
    assert doc["tree"] == tree
    assert [(o["path"], o["op"]) for o in doc["outputs"]] == [
        ("img/a.bin", "modify"), ("img/new.bin", "add"), ("img/small.bin", "delete")]
    assert (brepo.path / "img/new.bin").read_bytes() == b"new\0file"
    assert (brepo.path / "img/a.bin").read_bytes()[1000:1010] == b"0123456789"
    _clean(brepo)
    again = run_cli("apply", "-", "--repo", str(brepo.path), "--json", input=patch)
    assert again.code == 0 and again.json["replayed"] is True
    verify = run_cli("verify", "--repo", str(brepo.path), "--json")
    assert verify.code == 0, verify.out


def test_binary_rename_with_edit_and_mode_change(brepo: Repo) -> None:
    def edit(r: Repo) -> None:
        (r.path / "assets").mkdir()
        r.git("mv", "img/a.bin", "assets/a.bin")
        data = bytearray(BLOB)
        data[:4] = b"\xff\xfe\xfd\xfc"
        r.write("assets/a.bin", bytes(data), 0o755)

    patch, tree = _change(brepo, edit, "-M")
    assert b"rename from img/a.bin" in patch and b"GIT binary patch" in patch
    assert _apply(brepo, patch)["tree"] == tree
    assert os.access(brepo.path / "assets/a.bin", os.X_OK)
    _clean(brepo)


def test_binary_becomes_text_and_text_becomes_binary(brepo: Repo) -> None:
    def edit(r: Repo) -> None:
        r.write("img/small.bin", "plain text now\n")
        r.write("text.txt", b"\0\1\2 binary now")

    patch, tree = _change(brepo, edit)
    assert _apply(brepo, patch)["tree"] == tree
    _clean(brepo)


def test_format_patch_with_a_binary_file(brepo: Repo) -> None:
    base = brepo.head()
    brepo.write("img/a.bin", BLOB[::-1])
    brepo.commit_all("reverse the blob")
    tree = brepo.head("HEAD^{tree}")
    mail = git(brepo.path, "format-patch", "--stdout", "-1").encode("utf-8", "surrogateescape")
    brepo.git("reset", "-q", "--hard", base)
    assert _apply(brepo, mail)["tree"] == tree
    _clean(brepo)


def test_an_applied_binary_patch_under_a_new_key_is_already_applied(brepo: Repo) -> None:
    patch, tree = _change(brepo, lambda r: r.write("img/a.bin", BLOB + b"more"))
    first = _apply(brepo, patch, "--key", "one")
    head = brepo.head()
    second = _apply(brepo, patch, "--key", "two")
    assert second["replayed"] is False and second["tree"] == first["tree"] == tree
    assert brepo.head() == head, "nothing new to commit"


def test_binary_patch_against_other_content_changes_nothing(brepo: Repo) -> None:
    patch, _tree = _change(brepo, lambda r: r.write("img/a.bin", BLOB[:-1] + b"!"))
    brepo.write("img/a.bin", BLOB + b"moved on")
    brepo.commit_all("someone else changed it")
    before = snapshot(brepo)
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", "--key", "k", input=patch)
    assert r.code == 4, r.out + r.err
    assert r.json["error"]["type"] == "context_not_found"
    assert "the binary patch was made against" in r.json["error"]["message"]
    assert snapshot(brepo) == before


def test_binary_delete_of_other_content_changes_nothing(brepo: Repo) -> None:
    patch, _tree = _change(brepo, lambda r: os.unlink(r.path / "img/small.bin"))
    brepo.write("img/small.bin", b"other\0bytes")
    brepo.commit_all("changed")
    before = snapshot(brepo)
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", "--key", "k", input=patch)
    assert r.code == 4 and r.json["error"]["type"] == "context_not_found", r.out
    assert snapshot(brepo) == before


def test_corrupt_binary_data_changes_nothing(brepo: Repo) -> None:
    patch, _tree = _change(brepo, lambda r: r.write("img/new.bin", random.Random(2).randbytes(3000)))
    lines = patch.split(b"\n")
    at = lines.index(b"GIT binary patch") + 3
    lines[at] = lines[at][:10] + (b"0" if lines[at][10:11] != b"0" else b"1") + lines[at][11:]
    before = snapshot(brepo)
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", "--key", "k", input=b"\n".join(lines))
    assert r.code == 4 and r.json["error"]["type"] in ("parse_error", "context_not_found"), r.out
    assert snapshot(brepo) == before


def test_binary_files_differ_applies_when_the_repository_has_the_new_blob(brepo: Repo) -> None:
    base = brepo.head()
    brepo.write("img/a.bin", BLOB * 2)
    target = brepo.commit_all("doubled")
    tree = brepo.head("HEAD^{tree}")
    patch = git(brepo.path, "diff", "--full-index", base, target).encode()
    assert b"Binary files a/img/a.bin and b/img/a.bin differ" in patch
    brepo.git("reset", "-q", "--hard", base)
    assert _apply(brepo, patch)["tree"] == tree, "the blob is still in the object store"
    _clean(brepo)


def test_binary_files_differ_without_the_blob_changes_nothing(brepo: Repo) -> None:
    old = git(brepo.path, "rev-parse", "HEAD:img/a.bin").strip().encode()
    patch = (b"diff --git a/img/a.bin b/img/a.bin\nindex " + old + b".." + b"3" * 40
             + b" 100644\nBinary files a/img/a.bin and b/img/a.bin differ\n")
    before = snapshot(brepo)
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", "--key", "k", input=patch)
    assert r.code == 4 and r.json["error"]["type"] == "parse_error", r.out
    assert "git diff --binary" in r.json["error"]["message"]
    assert snapshot(brepo) == before


def test_copy_with_edit(brepo: Repo) -> None:
    def edit(r: Repo) -> None:
        text = (r.path / "text.txt").read_text()
        r.write("text.txt", text.replace("line 3\n", "line three\n"))
        r.write("copies/text.txt", text + "the copy's own line\n")

    patch, tree = _change(brepo, edit, "-C")
    assert b"copy from text.txt" in patch
    doc = _apply(brepo, patch)
    assert doc["tree"] == tree
    copy = next(o for o in doc["outputs"] if o["path"] == "copies/text.txt")
    assert (copy["op"], copy["from"]) == ("add", "text.txt")
    _clean(brepo)
    assert run_cli("verify", "--repo", str(brepo.path)).code == 0


def test_copy_onto_an_existing_file_changes_nothing(brepo: Repo) -> None:
    patch, _tree = _change(brepo, lambda r: (r.write("img/a.bin", BLOB + b"x"), r.write("img/b.bin", BLOB)),
                           "-C", "--find-copies-harder")
    assert b"copy from img/a.bin" in patch
    brepo.write("img/b.bin", b"already here")
    brepo.commit_all("b exists")
    before = snapshot(brepo)
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", "--key", "k", input=patch)
    assert r.code == 4 and r.json["error"]["type"] == "context_not_found", r.out
    assert "the target exists" in r.json["error"]["message"]
    assert snapshot(brepo) == before


@pytest.mark.parametrize("binary", [True, False])
def test_symlink_becomes_a_binary_file(brepo: Repo, binary: bool) -> None:
    os.symlink("text.txt", brepo.path / "link")
    brepo.commit_all("a symlink")
    base = brepo.head()
    os.unlink(brepo.path / "link")
    brepo.write("link", b"\0binary now\0")
    target = brepo.commit_all("typechange")
    tree = brepo.head("HEAD^{tree}")
    args = ["--binary"] if binary else ["--full-index"]  # without data: the blob is in the repository
    patch = git(brepo.path, "diff", *args, base, target).encode()
    assert (b"GIT binary patch" in patch) == binary
    brepo.git("reset", "-q", "--hard", base)
    assert _apply(brepo, patch)["tree"] == tree
    assert (brepo.path / "link").read_bytes() == b"\0binary now\0"
    _clean(brepo)


# -- found in review: each was wrong before its fix ---------------------------------------


def _refused(repo: Repo, patch: bytes, type: str) -> dict:  # type: ignore[type-arg]
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "refused", input=patch)
    assert r.code == 4, r.out + r.err
    assert r.json["error"]["type"] == type, r.json
    assert snapshot(repo) == before
    return r.json["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("shape", ["text copy, source edited", "binary copy, source edited",
                                   "copy, source renamed", "whole copy, source edited"])
def test_a_copy_applied_before_is_already_applied_under_a_new_key(brepo: Repo, shape: str) -> None:
    def edit(r: Repo) -> None:
        if shape == "text copy, source edited":
            text = (r.path / "text.txt").read_text()
            r.write("text.txt", text.replace("line 3\n", "line three\n"))
            r.write("text2.txt", text + "more\n")
        elif shape == "binary copy, source edited":
            r.write("img/b.bin", BLOB[:-1] + b"!")
            r.write("img/a.bin", BLOB + b"grown")
        elif shape == "copy, source renamed":
            r.write("img/c.bin", BLOB + b"c")
            (r.path / "moved").mkdir()
            r.git("mv", "img/a.bin", "moved/a.bin")
        else:
            r.write("img/b.bin", BLOB)
            r.write("img/a.bin", BLOB + b"grown")

    patch, tree = _change(brepo, edit, "-C", "--find-copies-harder")
    assert b"copy from " in patch, patch[:2000]
    first = _apply(brepo, patch, "--key", "one")
    assert first["tree"] == tree
    head = brepo.head()
    second = _apply(brepo, patch, "--key", "two")
    assert second["tree"] == tree and brepo.head() == head, "already applied: no new commit"
    assert run_cli("verify", "--repo", str(brepo.path)).code == 0


def test_a_copy_onto_a_path_the_patch_moves_away(brepo: Repo) -> None:
    def edit(r: Repo) -> None:
        r.write("img/g.bin", random.Random(3).randbytes(2000))
        r.commit_all("g")
    edit(brepo)

    def rewrite(r: Repo) -> None:
        r.git("mv", "img/g.bin", "img/k.bin")
        data = bytearray(BLOB)
        data[9] ^= 0xFF
        r.write("img/g.bin", bytes(data))

    patch, tree = _change(brepo, rewrite, "-B", "-M", "-C", "--find-copies-harder")
    assert b"copy to img/g.bin" in patch and b"rename from img/g.bin" in patch
    assert _apply(brepo, patch)["tree"] == tree
    _clean(brepo)
    assert run_cli("verify", "--repo", str(brepo.path)).code == 0


@pytest.mark.parametrize("old", [b"v1\0bin", b"plain text\n"])
def test_a_type_change_to_a_symlink_checks_what_it_replaces(brepo: Repo, old: bytes) -> None:
    brepo.write("f", old)
    brepo.commit_all("f")
    base = brepo.head()
    os.unlink(brepo.path / "f")
    os.symlink("text.txt", brepo.path / "f")
    target = brepo.commit_all("link")
    patch = git(brepo.path, "diff", "--binary", base, target).encode()
    brepo.git("reset", "-q", "--hard", base)
    brepo.write("f", old + b"changed since")
    brepo.commit_all("someone else")
    _refused(brepo, patch, "context_not_found")


def test_binary_patches_without_a_full_index_line_are_refused(brepo: Repo) -> None:
    patch, _tree = _change(brepo, lambda r: r.write("img/a.bin", BLOB[:-4] + b"four"))
    no_index = b"".join(line for line in patch.splitlines(keepends=True) if not line.startswith(b"index "))
    err = _refused(brepo, no_index, "parse_error")
    assert "full object ids" in err["message"] and "git diff --binary" in err["message"]
    delete = b"diff --git a/img/a.bin b/img/a.bin\ndeleted file mode 100644\nBinary files a/img/a.bin and /dev/null differ\n"
    _refused(brepo, delete, "parse_error")


def test_a_binary_size_over_the_limit_is_too_large(brepo: Repo) -> None:
    huge = (b"diff --git a/x.bin b/x.bin\nnew file mode 100644\nindex " + b"0" * 40 + b".." + b"1" * 40
            + b"\nGIT binary patch\nliteral 9223372036854775807\nHcmV?d00001\n\n")
    err = _refused(brepo, huge, "too_large")
    assert err["limit"] > 0 and err["path"] == "x.bin"
    _refused(brepo, huge.replace(b"9223372036854775807", b"9" * 5000), "too_large")


def test_text_hunks_after_a_binary_patch_are_refused(brepo: Repo) -> None:
    patch, _tree = _change(brepo, lambda r: r.write("img/a.bin", BLOB + b"x"))
    extra = patch.rstrip(b"\n") + b"\n\n@@ -1 +1 @@\n-a\n+b\n"
    _refused(brepo, extra, "parse_error")


def test_a_path_deleted_and_added_anew_has_one_output_and_verifies(brepo: Repo) -> None:
    patch = (b"diff --git a/text.txt b/text.txt\ndeleted file mode 100644\n--- a/text.txt\n+++ /dev/null\n"
             + b"@@ -1,40 +0,0 @@\n" + b"".join(b"-line %d\n" % i for i in range(40))
             + b"diff --git a/text.txt b/text.txt\nnew file mode 100755\n--- /dev/null\n+++ b/text.txt\n"
             + b"@@ -0,0 +1 @@\n+new life\n")
    doc = _apply(brepo, patch)
    assert [(o["path"], o["op"]) for o in doc["outputs"]] == [("text.txt", "add")]
    assert (brepo.path / "text.txt").read_text() == "new life\n" and os.access(brepo.path / "text.txt", os.X_OK)
    _clean(brepo)
    assert run_cli("verify", "--repo", str(brepo.path)).code == 0
    again = run_cli("apply", "-", "--repo", str(brepo.path), "--json", "--key", "again", input=patch)
    assert again.code == 4 and again.json["error"]["type"] == "context_not_found", again.out


def test_a_binary_file_under_text_auto_is_written_whole(repo: Repo) -> None:
    """`* text=auto eol=crlf`: git leaves a binary file's bytes alone; so must the worktree write.

    The eol filter's output used to be read as a C string, cut at the first NUL byte.
    """
    repo.write(".gitattributes", "* text=auto eol=crlf\n")
    data = random.Random(5).randbytes(5000) + b"\n\0\n"
    repo.write("img/a.bin", data)
    repo.commit_all("binary under text=auto")
    patch, tree = _change(repo, lambda r: r.write("img/a.bin", data[:100] + b"\n\n\0\n" + data[104:]))
    assert b"GIT binary patch" in patch
    assert _apply(repo, patch)["tree"] == tree
    assert (repo.path / "img/a.bin").read_bytes() == data[:100] + b"\n\n\0\n" + data[104:]
    _clean(repo)


def test_a_symlink_retarget_sent_again_is_already_applied(brepo: Repo) -> None:
    """A symlink's target has no final newline: the patch's one changed line ends the file, sent again it is there."""
    os.symlink("text.txt", brepo.path / "link")
    brepo.commit_all("link")

    def retarget(r: Repo) -> None:
        os.unlink(r.path / "link")
        os.symlink("img/a.bin", r.path / "link")

    patch, tree = _change(brepo, retarget)
    first = _apply(brepo, patch)
    assert brepo.head("HEAD^{tree}") == tree and os.readlink(brepo.path / "link") == "img/a.bin"
    head = brepo.head()
    again = _apply(brepo, patch, "--attempt", "2")  # the same patch as a new intent
    assert again["already_applied"] is True and again["commit"] == first["commit"] == head == brepo.head()
    _clean(brepo)


def _literal(data: bytes) -> bytes:
    """A ``literal`` hunk as git writes it."""
    import base64
    import zlib

    deflated = zlib.compress(data, 9)
    out = [f"literal {len(data)}\n".encode()]
    for at in range(0, len(deflated), 52):
        chunk = deflated[at:at + 52]
        n = len(chunk)
        out.append((chr(ord("A") + n - 1) if n <= 26 else chr(ord("a") + n - 27)).encode()
                   + base64.b85encode(chunk + b"\0" * (-n % 4)) + b"\n")
    return b"".join(out) + b"\n"


def test_zlib_bombs_together_over_the_limit_are_too_large(brepo: Repo) -> None:
    """Each literal under the file limit, together over it: one budget per patch, nothing changed."""
    bomb = bytes(600 << 10)  # 600 KiB of zeros: about 600 bytes of patch
    patch = b"".join(
        b"diff --git a/bomb%d.bin b/bomb%d.bin\nnew file mode 100644\nindex " % (k, k) + b"0" * 40 + b".."
        + git_blob_oid(bomb).encode() + b"\nGIT binary patch\n" + _literal(bomb) + _literal(b"")
        for k in range(4))
    before = snapshot(brepo)
    env = {"ONCEPATCH_MAX_BINARY_BYTES": str(1 << 20)}
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", input=patch, env=env)
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "too_large" and err["path"] == "bomb1.bin" and err["limit"] == 1 << 20, err
    assert snapshot(brepo) == before
    # One of them alone fits.
    one = patch[:patch.index(b"diff --git a/bomb1.bin")]
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", input=one, env=env)
    assert r.code == 0, r.out + r.err


def test_an_unsafe_path_is_refused_before_its_binary_data_is_inflated(brepo: Repo) -> None:
    corrupt = b"literal 5\nHcmV?d00001\n\n"  # inflates to 0 bytes, not 5
    patch = (b"diff --git a/../out.bin b/../out.bin\nnew file mode 100644\nindex " + b"0" * 40 + b".."
             + b"1" * 40 + b"\nGIT binary patch\n" + corrupt)
    _refused(brepo, patch, "unsafe_path")


def test_deltas_whose_results_together_are_over_the_limit_are_too_large(brepo: Repo) -> None:
    """Small deltas, big results (copies of the old bytes): the patch's results are bounded together."""
    brepo.write("img/b.bin", BLOB[::-1])
    brepo.commit_all("second binary")

    def edit(r: Repo) -> None:
        r.write("img/a.bin", BLOB * 15)  # 600 KB each, made of copies
        r.write("img/b.bin", BLOB[::-1] * 15)

    patch, _tree = _change(brepo, edit)
    assert patch.count(b"\ndelta ") >= 2 and len(patch) < 100_000
    before = snapshot(brepo)
    env = {"ONCEPATCH_MAX_BINARY_BYTES": str(1 << 20)}
    r = run_cli("apply", "-", "--repo", str(brepo.path), "--json", input=patch, env=env)
    assert r.code == 4, r.out + r.err
    assert r.json["error"]["type"] == "too_large" and r.json["error"]["path"] == "img/b.bin", r.json
    assert snapshot(brepo) == before

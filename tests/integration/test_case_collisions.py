"""core.ignorecase = true: a patch adding a path that differs only in case from another is refused.

docs/DECISIONS.md, "Paths differing only in case": exit 4, ``unsafe_path``
with ``reason: case_collision``, repo, index, worktree and store unchanged,
on a checked-out branch and on one that is not; without the setting the
patch applies as ``git apply --index`` applies it (both names kept).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot

from patcher.case_paths import case_collisions

BASE = {"README": "hello\n", "src/a.py": "x = 1\n", "docs/guide.txt": "guide\n"}


def add(path: str, body: str = "new\n") -> bytes:
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1 @@\n+{body}").encode()


def ignorecase(tmp_path: Any, value: str | None = "true") -> Repo:
    repo = make_repo(tmp_path / "repo", BASE)
    if value is not None:
        repo.git("config", "core.ignorecase", value)
    repo.git("branch", "other")
    return repo


def refused(repo: Repo, patch: bytes, *extra: str) -> dict[str, Any]:
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", *extra, input=patch)
    assert r.code == 4, r.out + r.err
    err: dict[str, Any] = r.json["error"]
    assert (err["type"], err["reason"], err["effect_status"], err["next_action"], err["retryable"]) == (
        "unsafe_path", "case_collision", "not_started", "fix_input", False), err
    assert snapshot(repo) == before  # refs, HEAD, index, worktree and store: byte for byte
    assert not (repo.store / "receipts").exists() or not any((repo.store / "receipts").rglob("*.json"))
    return err


@pytest.mark.parametrize("branch", [None, "other"], ids=["checked_out", "not_checked_out"])
def test_a_file_differing_only_in_case_is_refused(tmp_path: Any, branch: str | None) -> None:
    repo = ignorecase(tmp_path)
    err = refused(repo, add("readme"), *(["--branch", branch] if branch else []))
    assert (err["path"], err["collides_with"]) == ("readme", "README")
    assert "differs only in case from 'README'" in err["message"] and "core.ignorecase" in err["message"]


@pytest.mark.parametrize("branch", [None, "other"], ids=["checked_out", "not_checked_out"])
def test_a_folder_differing_only_in_case_is_refused(tmp_path: Any, branch: str | None) -> None:
    repo = ignorecase(tmp_path)
    err = refused(repo, add("Src/x.py"), *(["--branch", branch] if branch else []))
    assert (err["path"], err["collides_with"]) == ("Src/x.py", "src")


def test_two_new_paths_differing_only_in_case_are_refused(tmp_path: Any) -> None:
    repo = ignorecase(tmp_path)
    err = refused(repo, add("notes/a.txt") + add("Notes/b.txt"))
    assert (err["path"], err["collides_with"]) == ("Notes/b.txt", "notes")


def test_a_rename_to_another_case_of_its_own_name_applies(tmp_path: Any) -> None:
    repo = ignorecase(tmp_path)
    patch = b"diff --git a/README b/Readme\nsimilarity index 100%\nrename from README\nrename to Readme\n"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", input=patch)
    assert r.code == 0, r.out + r.err
    assert repo.git("ls-files").split() == ["Readme", "docs/guide.txt", "src/a.py"]


def test_a_path_replacing_its_other_case_in_the_same_patch_applies(tmp_path: Any) -> None:
    repo = ignorecase(tmp_path)
    delete = b"diff --git a/README b/README\ndeleted file mode 100644\n--- a/README\n+++ /dev/null\n@@ -1 +0,0 @@\n-hello\n"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", input=delete + add("readme"))
    assert r.code == 0, r.out + r.err
    assert "readme" in repo.git("ls-files").split() and "README" not in repo.git("ls-files").split()


@pytest.mark.parametrize("value", [None, "false"], ids=["unset", "false"])
def test_without_ignorecase_both_names_are_kept_as_git_apply_keeps_them(tmp_path: Any, value: str | None) -> None:
    repo = ignorecase(tmp_path, value)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", input=add("readme"))
    assert r.code == 0, r.out + r.err
    assert {"README", "readme"} <= set(repo.git("ls-files").split())
    assert (repo.path / "readme").read_text() == "new\n" and (repo.path / "README").read_text() == "hello\n"


def test_case_collisions_pure() -> None:
    base: dict[str, dict[str, bool] | None] = {"": {"README": True, "src": True, "Gone": False}, "src": {"a.py": True}}

    def listing(folder: str) -> dict[str, bool] | None:
        return base.get(folder)

    assert case_collisions(["readme"], listing) == [("readme", "README")]
    assert case_collisions(["src/A.py"], listing) == [("src/A.py", "src/a.py")]
    assert case_collisions(["SRC/b.py"], listing) == [("SRC/b.py", "src")]
    assert case_collisions(["gone"], listing) == []  # the other name does not stay
    assert case_collisions(["src/b.py", "new/x", "New/y"], listing) == [("New/y", "new")]
    assert case_collisions(["README2", "src/b.py"], listing) == []

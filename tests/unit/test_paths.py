"""Path-safety checks (pure)."""

from __future__ import annotations

import pytest

from patcher.errors import UnsafePath
from patcher.paths import check_path, check_paths


@pytest.mark.parametrize(
    ("path", "normal"),
    [
        ("a", "a"),
        ("src/x.py", "src/x.py"),
        ("./a", "a"),
        ("a/./b", "a/b"),
        ("./a/./b/.", "a/b"),
        (".gitignore", ".gitignore"),
        (".github/workflows/ci.yml", ".github/workflows/ci.yml"),
        ("a/.gitx/b", "a/.gitx/b"),
        ("git~10", "git~10"),
        ("café/ü.txt", "café/ü.txt"),
        ("a..b/c...", "a..b/c..."),
        ("name with spaces", "name with spaces"),
    ],
)
def test_safe_paths_are_normalised(path: str, normal: str) -> None:
    assert check_path(path) == normal


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("", "empty path"),
        (".", "empty path"),
        ("./.", "empty path"),
        ("/etc/passwd", "absolute path"),
        ("C:\\x", "absolute path"),
        ("C:/x", "absolute path"),
        ("c:x", "absolute path"),
        ("\\\\server\\share", "absolute path"),
        ("\\x", "absolute path"),
        ("a\\b", "backslash in path"),
        ("a\\..\\..\\b", "backslash in path"),
        ("..", "'..' component"),
        ("../x", "'..' component"),
        ("a/../../x", "'..' component"),
        ("a/..", "'..' component"),
        (".git", "'.git' component"),
        (".git/config", "'.git' component"),
        ("sub/.git/hooks/pre-commit", "'.git' component"),
        (".GIT/config", "'.git' component"),
        (".Git/HEAD", "'.git' component"),
        (".git /config", "'.git' component"),
        (".git./config", "'.git' component"),
        (".git . ./config", "'.git' component"),
        (".git::$INDEX_ALLOCATION/config", "'.git' component"),
        ("git~1/config", "'.git' component"),
        ("GIT~1/config", "'.git' component"),
        ("git~1 ./config", "'.git' component"),
        (".g\u200cit/config", "'.git' component"),
        ("\ufeff.git/config", "'.git' component"),
        ("a\x00b", "control character in path"),
        ("a\nb", "control character in path"),
        ("a\tb", "control character in path"),
        ("a\x1fb", "control character in path"),
        ("a/", "trailing slash"),
        ("a/b/", "trailing slash"),
        ("a//b", "empty path component"),
    ],
)
def test_unsafe_paths_are_refused(path: str, reason: str) -> None:
    with pytest.raises(UnsafePath) as info:
        check_path(path)
    assert info.value.details == {"path": path, "reason": reason}
    assert info.value.error_type == "unsafe_path"
    assert info.value.message.startswith("unsafe path '")
    assert "\n" not in info.value.message and "\x00" not in info.value.message


def test_check_paths_accepts_distinct_paths() -> None:
    check_paths(["a/b", "a/c", "b", "ab/c", "a.txt"])


def test_check_paths_checks_each_path() -> None:
    with pytest.raises(UnsafePath) as info:
        check_paths(["ok", "../bad"])
    assert info.value.details["path"] == "../bad"


def test_check_paths_refuses_duplicates_after_normalisation() -> None:
    with pytest.raises(UnsafePath) as info:
        check_paths(["a/b", "./a/b"])
    assert info.value.details["reason"] == "duplicate path"


@pytest.mark.parametrize("order", [["a", "a/b"], ["a/b/c", "a"], ["x/y", "x/y/z"]])
def test_check_paths_refuses_file_that_is_also_a_directory(order: list[str]) -> None:
    with pytest.raises(UnsafePath) as info:
        check_paths(order)
    assert "both a file and the directory" in info.value.details["reason"]
    assert info.value.details["conflicts_with"] in order
    assert info.value.details["path"] in order


def test_check_paths_allows_a_removed_file_to_become_a_directory() -> None:
    check_paths(["x", "x/y"], removed=["x"])
    check_paths(["folder/a", "folder"], removed=["./folder/a"])
    with pytest.raises(UnsafePath):
        check_paths(["x", "x/y", "z"], removed=["z"])

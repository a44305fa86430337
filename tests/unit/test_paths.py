"""Path-safety checks (pure)."""

from __future__ import annotations

import pytest

from patcher.errors import UnsafePath
from patcher.paths import check_path, check_paths, verify_path


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
        ("x" * 255, "x" * 255),
        ("/".join(["d" * 200] * 20), "/".join(["d" * 200] * 20)),  # 4019 bytes
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
        ("x" * 256, "path component longer than 255 bytes"),
        ("d/" + "\u00e9" * 128, "path component longer than 255 bytes"),  # 256 bytes in UTF-8
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


def test_check_paths_refuses_a_path_longer_than_a_checkout_can_write() -> None:
    check_paths(["/".join(["d" * 200] * 20)])  # 4019 bytes
    with pytest.raises(UnsafePath) as info:
        check_paths(["ok", "/".join(["d" * 200] * 21)])
    assert info.value.details["reason"] == "path longer than 4095 bytes"


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


# -- git's verify_path: '.git' as git spells it, and git's files refused as symlinks ----------

U200C = "\u200c"  # ZERO WIDTH NON-JOINER: HFS+ ignores it when comparing names


@pytest.mark.parametrize(
    "path",
    [
        ".git\u200d/config",
        "\u206a.git/x",
        f"a/.gi{U200C}t{U200C}/b",
        ".GiT::$INDEX_ALLOCATION",
        "git~1:stream/x",
        ".git. . :x",
    ],
)
def test_more_spellings_of_dotgit_are_refused(path: str) -> None:
    with pytest.raises(UnsafePath) as info:
        check_path(path)
    assert info.value.details["reason"] == "'.git' component"


@pytest.mark.parametrize(
    "path",
    [
        ".g\u0131t/x",  # dotless i: git folds ASCII case only
        ".git\u00a0/x",  # a no-break space is not NTFS's trailing space
        ".gitx/y",
        "git~2/x",
        "xgit~1/y",
        ".git~1/x",
    ],
)
def test_names_git_does_not_read_as_dotgit_are_kept(path: str) -> None:
    assert check_path(path) == path


LINK = 0o120000

# Every spelling git's is_hfs_dot*/is_ntfs_dot* match (git's t0060-path-utils.sh 'match .gitmodules', ...).
GIT_FILE_SPELLINGS = [
    (".gitmodules", ".gitmodules"),
    ("sub/dir/.gitmodules", ".gitmodules"),
    (".GITMODULES", ".gitmodules"),
    (".gitmoduleS", ".gitmodules"),
    (f".git{U200C}modules", ".gitmodules"),
    (f"{U200C}.gitmodules{U200C}", ".gitmodules"),
    (".gitmodules ", ".gitmodules"),
    (".gitmodules.", ".gitmodules"),
    (".gitmodules . .", ".gitmodules"),
    (".gitmodules:$DATA", ".gitmodules"),
    (".gitmodules::$INDEX_ALLOCATION", ".gitmodules"),
    ("gitmod~1", ".gitmodules"),
    ("GITMOD~4", ".gitmodules"),
    ("gitmod~2 .", ".gitmodules"),
    ("gi7eba~1", ".gitmodules"),
    ("GI7EBA~9", ".gitmodules"),
    ("gi7eb~12", ".gitmodules"),
    ("gi7e~123", ".gitmodules"),
    (".gitattributes", ".gitattributes"),
    (f".git{U200C}attributes", ".gitattributes"),
    (".gitattributes .", ".gitattributes"),
    ("gitatt~1", ".gitattributes"),
    ("gi7d29~1", ".gitattributes"),
    (".gitignore", ".gitignore"),
    (f".git{U200C}ignore", ".gitignore"),
    ("gitign~1", ".gitignore"),
    ("gi250a~1", ".gitignore"),
    (".mailmap", ".mailmap"),
    (".Mailmap", ".mailmap"),
    (f".mail{U200C}map", ".mailmap"),
    (".mailmap .", ".mailmap"),
    ("MAILMA~1", ".mailmap"),
    ("maba30~1", ".mailmap"),
    (".gitmodules/below", ".gitmodules"),  # HFS: a separator ends the name
]


@pytest.mark.parametrize(("path", "name"), GIT_FILE_SPELLINGS)
def test_git_files_are_refused_as_symlinks(path: str, name: str) -> None:
    with pytest.raises(UnsafePath) as info:
        verify_path(path, LINK)
    assert info.value.details == {"path": path, "reason": f"'{name}' as a symlink"}
    assert info.value.error_type == "unsafe_path"


@pytest.mark.parametrize(("path", "name"), GIT_FILE_SPELLINGS)
def test_git_files_are_kept_as_files(path: str, name: str) -> None:
    for mode in (0o100644, 0o100755):
        assert verify_path(path, mode) == path


@pytest.mark.parametrize(
    "path",
    [
        ".gitmodulesx",
        "x.gitmodules",
        "gitmodules",
        ".gitmodule",
        ".gitmodule\u017f",  # long s: Unicode folds it to 's', git does not
        "gitmod~5",  # short names of the name itself go to ~4 only
        "gitmod~1x",
        "gi7eba~0",
        "gi7eba1~1",
        "gitmod~1/below",  # NTFS: only spaces, dots or a stream may follow
        ".mailmapx",
        ".github/workflows",
        "docs/.gitkeep",
        "link",
    ],
)
def test_other_names_may_be_symlinks(path: str) -> None:
    assert verify_path(path, LINK) == path


def test_verify_path_checks_the_path_first() -> None:
    with pytest.raises(UnsafePath) as info:
        verify_path("../.gitmodules", 0o100644)
    assert info.value.details["reason"] == "'..' component"
    assert verify_path("./a/./.gitmodules", 0o100644) == "a/.gitmodules"


def test_path_checks_cost_grows_linearly_with_the_path() -> None:
    # Every check stops at its component's end: a deep path is checked once per component.
    deep = "/".join([".git" + U200C * 50 + "x"] * 20_000)
    assert check_path(deep) == deep
    assert verify_path(deep, LINK) == deep

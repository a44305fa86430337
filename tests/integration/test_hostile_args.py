"""Arguments an agent sends that must change nothing: forged commit messages, and a ``repo`` that moves under the call.

Driven in-process (``patcher.api.Client``, the MCP server's tool bodies with a
stand-in for the SDK's result types) and through the CLI; each refusal is
checked against a ``snapshot()`` of refs, index, worktree and store.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import patcher
from cas.errors import EXIT_USAGE, UsageError
from conftest import Repo, make_repo, run_cli, snapshot
from patcher.mcp_server import _Tools

EDIT = """\
--- a/src/app.py
+++ b/src/app.py
@@ -1,3 +1,3 @@
 line 1
-line 2
+line two
 line 3
"""

FILES = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 6)), "docs/guide.txt": "g\n"}
FORGED = "fix it\n\nOncepatch-Call: opc1:" + "0" * 64 + "\nOncepatch-Key: " + "1" * 64

#: The SDK's result types, as the tool bodies use them (the bodies are what is tested, not the SDK).
TYPES = SimpleNamespace(CallToolResult=lambda **kw: SimpleNamespace(**kw),
                        TextContent=lambda **kw: SimpleNamespace(**kw))


def envelope(result: Any) -> dict[str, Any]:
    doc: dict[str, Any] = result.structuredContent
    return doc


# -- messages ------------------------------------------------------------------------------------


@pytest.mark.parametrize("message", ["fix\x00it", "fix\r\nit", "fix \x1b[31mred", FORGED, "x\n\noncepatch-key: 00",
                                     "   "],
                         ids=["nul", "carriage_return", "escape", "forged_trailers", "forged_lowercase", "blank"])
def test_the_api_refuses_a_message_git_would_not_keep_and_nothing_changes(repo: Repo, message: str) -> None:
    before = snapshot(repo)
    with patcher.Client(repo.path) as client:
        with pytest.raises(UsageError) as info:
            client.apply(EDIT.replace("line 2", "line 2 of 20").replace("line two", "line 2"),
                         key="k", message=message)
        assert info.value.exit_code == EXIT_USAGE
        assert info.value.envelope()["key"] == "k"
        with pytest.raises(UsageError):
            patcher.apply(str(repo.path), EDIT, key="k", message=message)
    assert snapshot(repo) == before


def test_the_cli_refuses_a_message_git_would_not_keep_and_nothing_changes(repo: Repo) -> None:
    for message in ("fix \x1b[2J", FORGED, "   "):
        before = snapshot(repo)
        r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", "--message", message,
                    input=EDIT.encode())
        assert r.code == EXIT_USAGE, r.out + r.err
        assert r.json["error"]["type"] == "usage" and r.json["error"]["next_action"] == "fix_input"
        assert snapshot(repo) == before


def test_the_mcp_tool_refuses_a_message_with_nul_and_forged_trailers(repo: Repo) -> None:
    before = snapshot(repo)
    with patcher.Client(repo.path) as client:
        tools = _Tools(client, TYPES, allow_other_repos=False)
        for message in ("fix\x00" + FORGED, FORGED):
            res = tools.run("apply_patch", lambda m=message: tools.apply_patch(EDIT, "k", None, None, "auto", m))
            assert res.isError and envelope(res)["error"]["type"] == "usage"
    assert snapshot(repo) == before


def test_a_message_with_newlines_and_tabs_commits_with_only_our_trailers(repo: Repo) -> None:
    with patcher.Client(repo.path) as client:
        res = client.apply(EDIT, key="k", message="fix line 2\n\n\tmore, tab-indented\n")
    body = repo.git("log", "-1", "--format=%B", res.commit)
    assert body.startswith("fix line 2\n\n\tmore, tab-indented\n\nOncepatch-Call: ")
    keys = repo.git("log", "-1", "--format=%(trailers:only,unfold,key=Oncepatch-Call)", res.commit).strip()
    assert keys == f"Oncepatch-Call: {res.call_id}"
    assert repo.git("fsck", "--strict", "--no-progress") == ""


# -- the MCP server's repository, resolved once ---------------------------------------------------


@pytest.fixture
def two_repos(tmp_path: Path) -> tuple[Repo, Repo]:
    return make_repo(tmp_path / "served", FILES), make_repo(tmp_path / "other", FILES)


def _flip(link: Path, to: Path) -> None:
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(to)
    os.replace(tmp, link)  # atomic, as an attacker flipping it in a loop would


def test_a_repo_symlink_flipped_after_the_check_never_commits_into_the_other_repository(
        two_repos: tuple[Repo, Repo], tmp_path: Path) -> None:
    """The check and the apply resolved 'repo' each on its own: the flip landed the commit in 'other'."""
    served, other = two_repos
    link = tmp_path / "link"
    link.symlink_to(served.path)
    other_before = snapshot(other)
    with patcher.Client(served.path) as client:
        tools = _Tools(client, TYPES, allow_other_repos=False)
        checked_apply = client.apply

        def flip_then_apply(*args: Any, **kw: Any) -> Any:
            _flip(link, other.path)  # between the server's check and the apply
            try:
                return checked_apply(*args, **kw)
            finally:
                _flip(link, served.path)

        client.apply = flip_then_apply  # type: ignore[method-assign]
        for n in range(3):
            add = f"--- /dev/null\n+++ b/new{n}.txt\n@@ -0,0 +1 @@\n+{n}\n"
            res = tools.run("apply_patch", lambda p=add, k=f"k{n}": tools.apply_patch(p, k, str(link), None,
                                                                                     "auto", None))
            assert not res.isError, envelope(res)
            assert envelope(res)["commit"] == served.head()
    assert snapshot(other) == other_before
    assert served.git("rev-list", "--count", "main").strip() == "4"


def test_a_folder_of_the_served_worktree_turned_into_a_symlink_never_commits_elsewhere(
        two_repos: tuple[Repo, Repo]) -> None:
    """The agent's own apply_patch calls can turn a folder it named as 'repo' into a symlink to another repository."""
    served, other = two_repos
    other_before = snapshot(other)
    named = served.path / "docs"
    with patcher.Client(served.path) as client:
        tools = _Tools(client, TYPES, allow_other_repos=False)
        checked_apply = client.apply

        def swap_then_apply(*args: Any, **kw: Any) -> Any:
            (named / "guide.txt").unlink()
            named.rmdir()
            named.symlink_to(other.path)
            return checked_apply(*args, **kw)

        client.apply = swap_then_apply  # type: ignore[method-assign]
        res = tools.run("apply_patch", lambda: tools.apply_patch(EDIT, "k", str(named), None, "auto", None))
    assert snapshot(other) == other_before
    # In the served repository (its worktree changed by hand meanwhile, which the edit does not touch).
    assert not res.isError, envelope(res)
    assert envelope(res)["commit"] == served.head()


def test_a_repo_outside_the_served_one_is_refused(two_repos: tuple[Repo, Repo], tmp_path: Path) -> None:
    served, other = two_repos
    link = tmp_path / "link"
    link.symlink_to(other.path)
    before = snapshot(other)
    with patcher.Client(served.path) as client:
        tools = _Tools(client, TYPES, allow_other_repos=False)
        for repo in (str(other.path), str(link), str(tmp_path)):
            res = tools.run("apply_patch", lambda r=repo: tools.apply_patch(EDIT, "k", r, None, "auto", None))
            assert res.isError and envelope(res)["error"]["type"] == "usage", repo
            assert "serves" in envelope(res)["error"]["message"]
    assert snapshot(other) == before


def test_the_apply_checks_the_repository_it_opens_against_the_one_checked(two_repos: tuple[Repo, Repo]) -> None:
    """What the server passes along (common_dir): a path that names another repository by now does nothing."""
    served, other = two_repos
    before = snapshot(other)
    checked = os.path.realpath(served.path / ".git")
    with patcher.Client(served.path) as client:
        with pytest.raises(UsageError) as info:
            client.apply(EDIT, key="k", repo=other.path, common_dir=checked)
        assert "no longer the repository" in info.value.message
        # The same path, checked as itself, applies.
        res = client.apply(EDIT, key="k", repo=other.path, common_dir=os.path.realpath(other.path / ".git"))
    assert res.commit == other.head() and before["refs"] != snapshot(other)["refs"]


@pytest.mark.parametrize("fmt,patch", [
    ("str_replace", b'[{"path": "src/app.py", "old": "line 2", "new": "line two", "new": "line 2b"}]'),
    ("whole_file", b'[{"path": "README", "content": "a\\n", "content": "b\\n"}]'),
], ids=["str_replace", "whole_file"])
def test_a_json_patch_naming_a_field_twice_is_refused_and_nothing_changes(repo: Repo, fmt: str, patch: bytes) -> None:
    before = snapshot(repo)
    for given in (fmt, "auto"):
        r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", "--format", given, input=patch)
        assert r.code == 4, (r.out, r.err)
        err = r.json["error"]
        assert (err["type"], err["effect_status"], err["next_action"]) == ("parse_error", "not_started", "fix_input")
        assert "is given twice in one object" in err["message"], err
    assert snapshot(repo) == before

"""Loose matches never commit broken code, and always say they were loose (issue 24).

* A hunk matched ignoring indentation moves its added lines by the one delta
  every matched line is off by; unlike deltas are refused
  (``indentation_mismatch``, exit 4) with nothing changed.
* The result (CLI text and ``--json``, API, MCP) carries the grade of every
  hunk and a warning for each one below ``exact``; ``--strict`` / ``strict=``
  refuse them (``inexact_match``, exit 4).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from cas.errors import OncepatchError
from conftest import Repo, make_repo, run_cli, snapshot
from patcher.api import Client
from patcher.protocol import apply

# A Python file indented by 4, and a unified diff of it whose context uses 2 spaces
# (the patch of the issue: it used to commit "  if not items:" among 4-space lines).
PROGRAM = (
    "def total(items):\n"
    "    result = 0\n"
    "    for item in items:\n"
    "        result += item\n"
    "    return result\n"
)
TWO_SPACE_DIFF = (
    # 'def' off by 0 and the body by +2 together: no one delta
    "--- a/calc.py\n"
    "+++ b/calc.py\n"
    "@@ -1,3 +1,5 @@\n"
    " def total(items):\n"
    "-  result = 0\n"
    "+  if not items:\n"
    "+    return 0\n"
    "+  result = 0\n"
    "   for item in items:\n"
)
# Only 2-space body lines: every one off by +2.
TWO_SPACE_BODY = (
    "--- a/calc.py\n"
    "+++ b/calc.py\n"
    "@@ -2,2 +2,4 @@\n"
    "   result = 0\n"
    "+  if not items:\n"
    "+    return 0\n"
    "   for item in items:\n"
)


@pytest.fixture
def calc(tmp_path: Path) -> Repo:
    return make_repo(tmp_path / "repo", {"calc.py": PROGRAM})


def _parses(path: Path) -> str:
    text = path.read_text()
    ast.parse(text)
    return text


def test_two_space_body_on_a_four_space_file_commits_parseable_python(calc: Repo) -> None:
    r = run_cli("apply", "-", "--repo", str(calc.path), "--json", "--key", "k1", input=TWO_SPACE_BODY.encode())
    assert r.code == 0, r.out + r.err
    doc = r.json
    assert doc["status"] == "committed"
    assert doc["grades"] == {"calc.py": ["strip"]}
    assert len(doc["warnings"]) == 1 and "'calc.py' hunk 1 matched at grade strip" in doc["warnings"][0]
    committed = calc.git("show", "HEAD:calc.py")
    ast.parse(committed)
    assert committed == (
        "def total(items):\n"
        "    result = 0\n"
        "    if not items:\n"
        "      return 0\n"
        "    for item in items:\n"
        "        result += item\n"
        "    return result\n"
    )
    assert _parses(calc.path / "calc.py") == committed
    # the text output says it too
    calc.git("reset", "-q", "--hard", "HEAD^")
    r = run_cli("apply", "-", "--repo", str(calc.path), "--key", "k2", input=TWO_SPACE_BODY.encode())
    assert r.code == 0, r.err
    assert "grades calc.py: strip" in r.out
    assert "warning: 'calc.py' hunk 1 matched at grade strip" in r.out


def test_unlike_indentation_deltas_are_refused_with_nothing_changed(calc: Repo) -> None:
    before = snapshot(calc)
    r = run_cli("apply", "-", "--repo", str(calc.path), "--json", "--key", "k", input=TWO_SPACE_DIFF.encode())
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "indentation_mismatch"
    assert err["effect_status"] == "not_started" and err["next_action"] == "fix_input"
    assert [x["line"] for x in err["lines"]] == [1, 2, 3]
    assert {x["delta"] for x in err["lines"]} == {"0", "+2 space(s)"}
    assert "line(s) 1: off by 0" in err["message"]
    assert snapshot(calc) == before  # refs, HEAD, index, worktree and store, byte for byte


def test_tabs_against_spaces_is_a_mismatch(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"t.py": "if x:\n\ta = 1\n\tb = 2\n"})
    before = snapshot(repo)
    patch = b"--- a/t.py\n+++ b/t.py\n@@ -2,2 +2,3 @@\n     a = 1\n+    c = 3\n     b = 2\n"
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), patch)
    assert info.value.error_type == "indentation_mismatch" and "tabs against spaces" in info.value.message
    assert snapshot(repo) == before


@pytest.mark.parametrize("fmt", ["search_replace", "str_replace", "apply_patch"])
def test_every_loose_format_keeps_the_python_parseable(calc: Repo, fmt: str) -> None:
    old, new = "  result = 0\n  for item in items:", "  result = 0\n  if not items:\n    return 0\n  for item in items:"
    if fmt == "search_replace":
        patch = f"calc.py\n<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE\n"
    elif fmt == "str_replace":
        patch = json.dumps([{"path": "calc.py", "old": old, "new": new}])
    else:
        patch = ("*** Begin Patch\n*** Update File: calc.py\n@@\n   result = 0\n+  if not items:\n"
                 "+    return 0\n   for item in items:\n*** End Patch\n")
    res = apply(str(calc.path), patch, format=fmt)
    assert res.grades == {"calc.py": ["strip"]} and res.warnings
    text = _parses(calc.path / "calc.py")
    assert "    if not items:\n      return 0\n    for item" in text
    assert ast.parse(calc.git("show", "HEAD:calc.py"))


def test_a_one_line_str_replace_growing_to_several_lines_is_shifted_whole(calc: Repo) -> None:
    # 'result = 0' is a substring of its line; in place, only the first new line would be indented.
    patch = json.dumps([{"path": "calc.py", "old": "result = 0", "new": "result = 0\nseen = 0"}])
    res = apply(str(calc.path), patch)
    assert res.grades == {"calc.py": ["strip"]}
    assert "    result = 0\n    seen = 0\n" in _parses(calc.path / "calc.py")


def test_strict_refuses_a_loose_match_and_takes_an_exact_one(calc: Repo) -> None:
    before = snapshot(calc)
    r = run_cli("apply", "-", "--repo", str(calc.path), "--json", "--strict", "--key", "s",
                input=TWO_SPACE_BODY.encode())
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "inexact_match" and err["grade"] == "strip" and err["hunk"] == 1
    assert snapshot(calc) == before
    exact = TWO_SPACE_BODY.replace("   result", "     result").replace("   for", "     for") \
        .replace("+    return", "+        return").replace("+  if", "+    if")
    r = run_cli("apply", "-", "--repo", str(calc.path), "--json", "--strict", "--key", "s", input=exact.encode())
    assert r.code == 0, r.out + r.err
    assert r.json["grades"] == {"calc.py": ["exact"]} and "warnings" not in r.json


def test_strict_is_not_part_of_the_identity_a_strict_retry_replays(calc: Repo) -> None:
    first = apply(str(calc.path), TWO_SPACE_BODY, key="same")
    assert first.grades == {"calc.py": ["strip"]}
    head = calc.head()
    # The change is made: a strict call with the same key and patch replays it, and says how
    # loosely it matched (the receipt keeps the grades) instead of refusing what is done.
    again = apply(str(calc.path), TWO_SPACE_BODY, key="same", strict=True)
    assert again.replayed and again.commit == first.commit and calc.head() == head
    assert again.call_id == first.call_id
    assert again.grades == {"calc.py": ["strip"]}
    assert any("matched at grade strip" in w for w in again.warnings)


def test_client_strict_raises_inexact_match(calc: Repo) -> None:
    with Client(str(calc.path)) as client:
        with pytest.raises(OncepatchError) as info:
            client.apply(TWO_SPACE_BODY, key="c", strict=True)
        assert info.value.error_type == "inexact_match"
        res = client.apply(TWO_SPACE_BODY, key="c")
        doc: dict[str, Any] = res.to_json()
        assert doc["grades"] == {"calc.py": ["strip"]} and doc["warnings"]


def test_mcp_tool_body_takes_strict_and_returns_grades(calc: Repo) -> None:
    from patcher.mcp_server import _Tools

    with Client(str(calc.path)) as client:
        tools = _Tools(client, None, allow_other_repos=False)
        with pytest.raises(OncepatchError) as info:
            tools.apply_patch(TWO_SPACE_BODY, "m", None, None, "auto", None, True)
        assert info.value.error_type == "inexact_match"
        doc = tools.apply_patch(TWO_SPACE_BODY, "m", None, None, "auto", None)
        assert doc["grades"] == {"calc.py": ["strip"]} and doc["warnings"]

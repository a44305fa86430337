"""A value of megabytes an agent sends (a key, a branch, a format, a path) is quoted by its errors only in part.

Each refusal quotes at most ``cas.errors.SHOWN_CHARS`` characters of a value
(``SHOWN_PATH_CHARS`` of a path) and its size, through the CLI (``--json`` and
text), the Python API and the MCP server; the exit code is the contract's and
the repository, index, worktree and store are byte-for-byte as they were.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest

import patcher
from cas.errors import EXIT_USAGE, SHOWN_CHARS, OncepatchError, clip
from conftest import Repo, run_cli, snapshot
from patcher.mcp_server import _Tools

EDIT = "--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello world\n"
#: Under the kernel's limit on one argument (MAX_ARG_STRLEN, 128 KiB).
ARG = "k" * 100_000
#: Through the API and MCP: no such limit.
HUGE = "k" * (10 << 20)
#: An error that quotes a value in part (a few hundred characters of message and envelope around it).
SMALL = 2000

CLI_CASES = {
    "key": ["apply", "-", "--key", ARG],
    "branch": ["apply", "-", "--key", "k", "--branch", ARG],
    "branch_of_many_parts": ["apply", "-", "--key", "k", "--branch", "a/" * 30_000 + "b"],
    "format": ["apply", "-", "--key", "k", "--format", ARG],
    "contract_sha256": ["apply", "-", "--key", "k", "--contract-sha256", ARG],
    "attempt": ["apply", "-", "--key", "k", "--attempt", ARG],
    "remote": ["apply", "-", "--key", "k", "--remote", ARG],
    "unknown_argument": ["apply", "-", "--key", "k", ARG],
    "unknown_option_value": ["apply", "-", "--key", "k", "--lock-timeout=" + ARG],
    "status": ["status", ARG],
    "resolve": ["resolve", ARG, "--as", "committed", "--note", "n"],
    "quarantine": ["quarantine", ARG, "--note", "n"],
    "revert": ["revert", ARG, "--key", "new"],
    "command": [ARG],
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_the_cli_quotes_a_huge_argument_in_part_and_changes_nothing(repo: Repo, case: str) -> None:
    before = snapshot(repo)
    argv = [*CLI_CASES[case], "--repo", str(repo.path)]
    r = run_cli(*argv, "--json", input=EDIT.encode())
    assert r.code == EXIT_USAGE, (case, r.code, r.out[:500], r.err[:500])
    assert len(r.out) < SMALL and len(r.err) < SMALL, (case, r.out[:500])
    err = r.json["error"]
    assert err["type"] in ("usage", "not_found") and err["effect_status"] == "not_started", err
    assert re.search(r"\.\.\. \(\d{5,} bytes\)", r.out), err
    text = run_cli(*argv, input=EDIT.encode())
    assert text.code == EXIT_USAGE and len(text.out) + len(text.err) < SMALL, (case, text.err[:500])
    assert snapshot(repo) == before


def test_a_huge_key_is_clipped_in_the_envelopes_key_too(repo: Repo) -> None:
    before = snapshot(repo)
    r = run_cli("apply", "-", "--key", ARG, "--repo", str(repo.path), "--json", input=EDIT.encode())
    assert r.code == EXIT_USAGE
    assert r.json["error"]["key"] == "k" * SHOWN_CHARS + "... (100000 bytes)"
    # A key the store could hold (512 characters) is still given whole.
    assert OncepatchError("m", key="k" * 512).envelope()["key"] == "k" * 512
    assert snapshot(repo) == before


@pytest.mark.parametrize("argument", ["key", "branch", "format", "contract_sha256", "remote"])
def test_the_api_quotes_a_huge_argument_in_part_and_changes_nothing(repo: Repo, argument: str) -> None:
    before = snapshot(repo)
    kw: dict[str, Any] = {"key": "k", argument: HUGE}
    with patcher.Client(repo.path) as client:
        for apply in (client.apply, lambda patch, **k: patcher.apply(str(repo.path), patch, **k)):
            with pytest.raises(OncepatchError) as info:
                apply(EDIT, **kw)
            assert info.value.exit_code == EXIT_USAGE and info.value.effect_status == "not_started"
            assert len(str(info.value)) < SMALL
            assert len(json.dumps(info.value.envelope())) < SMALL
        with pytest.raises(OncepatchError) as info:
            client.status(HUGE)
        assert len(json.dumps(info.value.envelope())) < SMALL
    assert snapshot(repo) == before


def test_the_mcp_tool_names_at_most_a_few_unknown_arguments_each_in_part(repo: Repo) -> None:
    types = SimpleNamespace(CallToolResult=lambda **kw: SimpleNamespace(model_dump=lambda **_: kw, **kw),
                            TextContent=lambda **kw: SimpleNamespace(**kw))
    before = snapshot(repo)
    with patcher.Client(repo.path) as client:
        tools = _Tools(client, types, allow_other_repos=False)
        arguments: dict[str, Any] = {"patch": EDIT, "idempotency_key": "k", "a" + HUGE: 1}
        arguments.update({f"extra{i}": i for i in range(10_000)})
        doc = tools.unknown_arguments("apply_patch", frozenset({"patch", "idempotency_key"}), arguments)
        assert doc is not None
        err = doc["structuredContent"]["error"]
        assert err["type"] == "usage" and err["effect_status"] == "not_started"
        assert len(json.dumps(err)) < SMALL and "(and 9991 more)" in err["message"], err["message"][:300]
        assert clip("a" + HUGE) in err["unknown"]
        res = tools.run("apply_patch", lambda: tools.apply_patch(EDIT, "k", "/tmp/" + "d" * 100_000, None,
                                                                  "auto", None))
        assert res.isError and len(res.content[0].text) < 6000  # a path: clip(..., SHOWN_PATH_CHARS)
    assert snapshot(repo) == before

"""`oncepatch mcp` end to end: the real server as a child process, the official SDK's stdio client.

Skipped when the optional ``mcp`` package is not installed (``pip install
'oncepatch[mcp]'``; the ``dev`` extra includes it, so CI runs these).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, Repo, start_server

pytest.importorskip("mcp")

import anyio  # noqa: E402 - after the skip: a dependency of mcp
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

EDIT = """\
--- a/src/app.py
+++ b/src/app.py
@@ -1,5 +1,5 @@
 line 1
 line 2
-line 3
+line three
 line 4
 line 5
"""
OTHER_EDIT = EDIT.replace("+line three", "+line 3, changed otherwise")
STALE = """\
--- a/src/util.py
+++ b/src/util.py
@@ -1,2 +1,2 @@
 def g():
-    return 1
+    return 2
"""


def _attr(obj: Any, *names: str) -> Any:
    """Read a field under its SDK 2 (snake_case) or SDK 1 (camelCase) name."""
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    raise AttributeError(names)


def is_error(res: Any) -> bool:
    return bool(_attr(res, "is_error", "isError"))


def structured(res: Any) -> dict[str, Any]:
    doc = _attr(res, "structured_content", "structuredContent")
    text = json.loads(res.content[0].text)
    assert doc == text  # the text block carries the same envelope, for clients that read only text
    return dict(doc)


def hints(tool: Any) -> dict[str, Any]:
    a = tool.annotations
    return {"readOnly": _attr(a, "read_only_hint", "readOnlyHint"),
            "destructive": _attr(a, "destructive_hint", "destructiveHint"),
            "idempotent": _attr(a, "idempotent_hint", "idempotentHint"),
            "openWorld": _attr(a, "open_world_hint", "openWorldHint")}


#: The server_info of the last server started by :func:`with_server`.
SERVER_INFO: dict[str, Any] = {}


def with_server(repo: Repo | Path, errlog: Path,
                body: Callable[[ClientSession], Awaitable[None]], *extra: str,
                env_extra: dict[str, str] | None = None) -> None:
    path = repo if isinstance(repo, Path) else repo.path
    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "patcher.cli", "mcp", "--repo", str(path), *extra],
                                   env=env, cwd=str(path))

    async def main() -> None:
        with open(errlog, "w") as err:
            async with stdio_client(params, errlog=err) as (read, write):
                async with ClientSession(read, write) as session:
                    SERVER_INFO["last"] = _attr(await session.initialize(), "server_info", "serverInfo")
                    with anyio.fail_after(120):
                        await body(session)

    anyio.run(main)


def test_mcp_tools_apply_replay_and_errors(repo: Repo, tmp_path: Path) -> None:
    before = repo.count()
    seen: dict[str, Any] = {}

    async def body(s: ClientSession) -> None:
        tools = {t.name: t for t in (await s.list_tools()).tools}
        seen["tools"] = tools
        seen["apply"] = await s.call_tool("apply_patch", {"patch": EDIT, "idempotency_key": "issue-7/line-3"})
        seen["replay"] = await s.call_tool("apply_patch", {"patch": EDIT, "idempotency_key": "issue-7/line-3"})
        seen["conflict"] = await s.call_tool("apply_patch",
                                             {"patch": OTHER_EDIT, "idempotency_key": "issue-7/line-3"})
        seen["stale"] = await s.call_tool("apply_patch", {"patch": STALE, "idempotency_key": "issue-8"})
        seen["status"] = await s.call_tool("receipt_status", {"key": "issue-7/line-3"})
        seen["missing"] = await s.call_tool("receipt_status", {"key": "never-used"})
        seen["verify"] = await s.call_tool("verify", {})
        seen["recover"] = await s.call_tool("recover", {"dry_run": True})
        seen["elsewhere"] = await s.call_tool("apply_patch", {"patch": EDIT, "idempotency_key": "x",
                                                              "repo": str(tmp_path)})
        # A subfolder of the served repository is that repository, as the CLI's --repo takes it.
        seen["subfolder"] = await s.call_tool("apply_patch", {"patch": EDIT, "idempotency_key": "issue-7/line-3",
                                                              "repo": str(repo.path / "src")})

    errlog = tmp_path / "server.err"
    with_server(repo, errlog, body, "--log-level", "INFO")

    tools = seen["tools"]
    assert set(tools) == {"apply_patch", "receipt_status", "recover", "verify"}
    assert hints(tools["apply_patch"]) == {"readOnly": False, "destructive": False, "idempotent": True,
                                           "openWorld": False}
    assert hints(tools["receipt_status"])["readOnly"] is True
    assert hints(tools["verify"])["readOnly"] is True
    assert hints(tools["recover"]) == {"readOnly": False, "destructive": False, "idempotent": True,
                                       "openWorld": False}
    schema = _attr(tools["apply_patch"], "input_schema", "inputSchema")
    assert set(schema["required"]) == {"patch", "idempotency_key"}
    assert {"repo", "branch", "format", "strict", "remote"} <= set(schema["properties"])
    assert "remote:" in tools["apply_patch"].description
    # Every format is named, in the schema's enum and the description an agent reads.
    from patcher.formats import BUILTIN_NAMES
    from patcher.version import version

    enum = schema["properties"]["format"].get("enum") or schema["$defs"][
        schema["properties"]["format"]["$ref"].rsplit("/", 1)[1]]["enum"]
    assert sorted(enum) == sorted(["auto", *BUILTIN_NAMES])
    assert all(name in tools["apply_patch"].description for name in BUILTIN_NAMES)
    assert SERVER_INFO["last"].name == "oncepatch" and SERVER_INFO["last"].version == version() != ""

    first = seen["apply"]
    assert not is_error(first)
    doc = structured(first)
    assert doc["ok"] is True and doc["status"] == "committed" and doc["replayed"] is False
    assert doc["commit"] == repo.head("main")

    replay = structured(seen["replay"])
    assert not is_error(seen["replay"]) and replay["replayed"] is True and replay["commit"] == doc["commit"]

    assert is_error(seen["conflict"])
    err = structured(seen["conflict"])
    assert err["ok"] is False and err["error"]["type"] == "idempotency_conflict"
    assert err["error"]["key"] == "issue-7/line-3" and err["error"]["next_action"] == "new_key"

    assert is_error(seen["stale"])
    stale = structured(seen["stale"])["error"]
    assert stale["type"] == "context_not_found" and stale["effect_status"] == "not_started"
    assert stale["retryable"] is False

    status = structured(seen["status"])
    assert status["receipt"]["status"] == "committed" and status["receipt"]["commit"] == doc["commit"]
    assert is_error(seen["missing"]) and structured(seen["missing"])["error"]["type"] == "not_found"
    assert structured(seen["verify"])["ok"] is True
    assert structured(seen["recover"])["rows"] == []
    assert is_error(seen["elsewhere"]) and structured(seen["elsewhere"])["error"]["type"] == "usage"
    sub = structured(seen["subfolder"])
    assert not is_error(seen["subfolder"]) and sub["replayed"] is True and sub["commit"] == doc["commit"], sub

    # The repository shows exactly one new commit, and it is the one the receipt names.
    assert repo.count() == before + 1
    assert (repo.path / "src/app.py").read_text().splitlines()[2] == "line three"
    assert repo.git("status", "--porcelain") == ""
    repo.git("fsck", "--strict")
    # Nothing but the protocol went to stdout (the client would have failed to parse it);
    # the server's logs went to stderr.
    assert "context_not_found" in errlog.read_text()


def test_mcp_server_without_a_repository_fails_before_serving(tmp_path: Path) -> None:
    from conftest import run_cli

    r = run_cli("mcp", "--repo", str(tmp_path), "--json", input=b"")
    assert r.code == 2 and r.json["error"]["type"] == "usage"


def test_mcp_server_prints_nothing_after_the_protocol(repo: Repo) -> None:
    """Stdout is the protocol's: a client that closes stdin reads no stray JSON, with or without --json."""
    from conftest import run_cli

    for extra in ((), ("--json",)):
        r = run_cli("mcp", "--repo", str(repo.path), *extra, input=b"")
        assert r.code == 0, r.err
        assert r.out == ""


def test_mcp_lock_timeout_governs_the_index_lock(repo: Repo, tmp_path: Path) -> None:
    """``oncepatch mcp --lock-timeout 0.5``: a tool call meeting a held ``index.lock`` answers in_progress at once."""
    import subprocess
    import time

    lock = repo.path / ".git" / "index.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | "
                               "os.O_EXCL | os.O_WRONLY); print('held', flush=True); sys.stdin.read(); "
                               "os.unlink(sys.argv[1])", str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    seen: dict[str, Any] = {}

    async def body(s: ClientSession) -> None:
        t0 = time.monotonic()
        seen["held"] = await s.call_tool("apply_patch", {"patch": EDIT, "idempotency_key": "k"})
        seen["elapsed"] = time.monotonic() - t0

    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with_server(repo, tmp_path / "server.err", body, "--lock-timeout", "0.5")
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    assert is_error(seen["held"])
    err = structured(seen["held"])["error"]
    assert err["type"] == "in_progress" and err["lock_path"] == os.path.realpath(lock)
    assert seen["elapsed"] < 5  # the server's 0.5 s, not the 30 s default (nor the old 10 s)
    assert repo.count() == 1


def test_mcp_apply_patch_claims_its_key_on_a_git_remote(tmp_path: Path, short_tmp: Path) -> None:
    """``apply_patch``'s ``remote``: two machines' MCP servers (one through ``oncepatch serve``), one commit there.

    docs/REMOTE.md: machine A's call pushes the commit and the key's claim to
    the remote; machine B (another clone, another store) finds the key claimed
    there and replays it.  Without ``remote`` the call stays in A's clone.
    """
    import signal
    import subprocess

    from git_server import GitServer
    from remote_cluster import key_patch, make_cluster, make_server_repo, remote_git

    from receipts.identity import key_hash

    git = GitServer(make_server_repo(tmp_path)).start()
    serve_pid = None
    try:
        c = make_cluster(tmp_path, git.url("server.git"), 2)
        a, b = c.machines
        before = remote_git(c, "rev-parse", "main").strip()
        seen: dict[str, Any] = {}

        async def on_a(s: ClientSession) -> None:
            seen["a"] = await s.call_tool("apply_patch", {"patch": key_patch(0), "idempotency_key": "k0",
                                                          "remote": "origin"})
            seen["local"] = await s.call_tool("apply_patch", {"patch": key_patch(1), "idempotency_key": "k1"})
            seen["nowhere"] = await s.call_tool("apply_patch", {"patch": key_patch(2), "idempotency_key": "k2",
                                                                "remote": "nowhere"})

        with_server(a, tmp_path / "a.err", on_a)
        pushed = structured(seen["a"])
        assert not is_error(seen["a"]) and pushed["replayed"] is False, pushed
        assert pushed["commit"] == remote_git(c, "rev-parse", "main").strip() != before
        assert remote_git(c, "rev-parse", f"refs/oncepatch/keys/{key_hash('k0')}").strip() == pushed["commit"]
        local = structured(seen["local"])
        assert not is_error(seen["local"]) and local["commit"] != pushed["commit"]
        assert remote_git(c, "rev-parse", "main").strip() == pushed["commit"]  # the local call pushed nothing
        nowhere = structured(seen["nowhere"])
        assert is_error(seen["nowhere"]) and nowhere["error"]["type"] == "usage"
        assert "'nowhere'" in nowhere["error"]["message"]

        # Machine B's MCP server sends its calls through an 'oncepatch serve' server: 'remote' goes along.
        folder = short_tmp / "serve"
        serve_pid = start_server(folder, "--idle", "120")
        through = {"ONCEPATCH_SERVER": "require", "ONCEPATCH_SERVER_DIR": str(folder)}

        async def on_b(s: ClientSession) -> None:
            seen["b"] = await s.call_tool("apply_patch", {"patch": key_patch(0), "idempotency_key": "k0",
                                                          "remote": "origin"})
            seen["verify"] = await s.call_tool("verify", {})

        with_server(b, tmp_path / "b.err", on_b, env_extra=through)
        replay = structured(seen["b"])
        assert not is_error(seen["b"]), replay
        assert replay["replayed"] is True and replay["commit"] == pushed["commit"]
        assert structured(seen["verify"])["ok"] is True
        log = remote_git(c, "log", "--format=%H", f"--grep=Oncepatch-Key: {key_hash('k0')}", "main").split()
        assert log == [pushed["commit"]]
        # B's clone did not commit locally: its branch is where the clone left it.
        assert subprocess.run(["git", "-C", str(b), "rev-parse", "main"], capture_output=True,
                              check=True).stdout.decode().strip() == before
    finally:
        if serve_pid is not None:
            try:
                os.killpg(serve_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        git.close()

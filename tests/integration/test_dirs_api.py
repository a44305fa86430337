"""Directory targets through the Python API (``dir=``) and the MCP server's ``apply_patch`` (docs/DIRECTORIES.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, run_cli
from dirs_helpers import patch_between, tree_of, view_of_folder, write_tree

from patcher.api import Client

BASE: dict[str, str | bytes] = {"index.html": "<h1>old</h1>\n", "css/site.css": "body {}\n"}
AFTER: dict[str, str | bytes] = {"index.html": "<h1>new</h1>\n", "css/site.css": "body {}\n", "js/app.js": "x()\n"}


def _site(tmp_path: Path) -> tuple[Path, bytes]:
    site = tmp_path / "site"
    site.mkdir()
    write_tree(site, BASE)
    assert run_cli("init", "--dir", str(site)).code == 0
    return site, patch_between(tmp_path / "scratch", BASE, AFTER)


def _view(files: dict[str, str | bytes]) -> dict[str, str]:
    import hashlib

    return {k: hashlib.sha256(v.encode() if isinstance(v, str) else v).hexdigest() for k, v in files.items()}


def test_client_applies_to_a_directory_and_recovers_it(tmp_path: Path) -> None:
    site, patch = _site(tmp_path)
    objects = Path(str(site) + ".oncepatch/objects.git")
    # A crash after the branch moved, before the folder switched: recover(dir=) finishes it.
    pf = tmp_path / "p.diff"
    pf.write_bytes(patch)
    crashed = run_cli("apply", str(pf), "--dir", str(site), "--key", "k", env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert crashed.code == 137
    assert view_of_folder(site) == _view(BASE)
    with Client(server="never") as client:
        report = client.recover(dir=str(site), tmp_age=0)
        assert [row.to for row in report.rows] == ["committed"]
        assert view_of_folder(site) == _view(AFTER)
        assert os.readlink(site) == f"site.oncepatch/generations/{tree_of(objects)}"
        res = client.apply(patch, key="k", dir=str(site))
        assert res.replayed and res.tree == tree_of(objects)


def test_mcp_apply_patch_takes_a_directory(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    import anyio
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    site, patch = _site(tmp_path)
    objects = Path(str(site) + ".oncepatch/objects.git")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    params = StdioServerParameters(command=sys.executable, args=["-m", "patcher.cli", "mcp", "--repo", str(objects)],
                                   env=env, cwd=str(tmp_path))
    seen: dict[str, Any] = {}

    async def main() -> None:
        with open(tmp_path / "server.err", "w") as err:
            async with stdio_client(params, errlog=err) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    with anyio.fail_after(120):
                        seen["apply"] = await session.call_tool(
                            "apply_patch", {"patch": patch.decode(), "idempotency_key": "mcp-1", "dir": str(site)})

    anyio.run(main)
    res = seen["apply"]
    doc = getattr(res, "structured_content", None) or getattr(res, "structuredContent")
    assert doc["ok"] is True and doc["tree"] == tree_of(objects), doc
    assert view_of_folder(site) == _view(AFTER)


def test_client_verify_of_a_directory_names_a_path_written_outside_oncepatch(tmp_path: Path) -> None:
    site, patch = _site(tmp_path)
    with Client(server="never") as client:
        client.apply(patch, key="k", dir=str(site))
        clean = client.verify(dir=str(site), grace=0)
        assert clean.ok and clean.receipts == 1, [f.to_json() for f in clean.failures]
        target = site / "css/site.css"  # unchanged by the patch: a hard link shared with generation one
        os.chmod(target, 0o644)
        target.write_text("body { color: red }\n")
        report = client.verify(dir=str(site), grace=0)
        assert not report.ok
        assert [f.path for f in report.failures] == [str(site)] * len(report.failures)
        assert any("'css/site.css'" in f.reason and "outside oncepatch" in f.reason for f in report.failures)
        assert client.verify(repo=str(Path(str(site) + ".oncepatch/objects.git")), grace=0).ok  # receipts alone

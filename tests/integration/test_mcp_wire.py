"""`oncepatch mcp` against hostile bytes on its stdin: every line answered, nothing changed, still serving.

A raw JSON-RPC client (no SDK on the client's side: the point is to send what
an SDK would never send).  Each refusal is checked for its answer (JSON-RPC's
error, or the tool error with the envelope), for the repository, index,
worktree and store left byte-for-byte as they were, and for the server
answering the next request.  patcher/mcp_wire.py says why each check exists.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import forgeries
from conftest import ROOT, Repo, snapshot

pytest.importorskip("mcp")

EDIT = ("--- a/src/app.py\n+++ b/src/app.py\n@@ -1,3 +1,3 @@\n line 1\n-line 2\n+line two\n line 3\n")
INIT = {"jsonrpc": "2.0", "id": "init", "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}
WAIT = 120.0  # an answer the server owes: generous, the machine is shared; a test only waits this on failure


def line(doc: Any) -> bytes:
    return json.dumps(doc).encode() + b"\n"


def call(rid: Any, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}


class Raw:
    """``oncepatch mcp --repo REPO`` on pipes, written to and read from byte by byte."""

    def __init__(self, repo: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        e = dict(os.environ)
        e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "mcp", "--repo", str(repo), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=e, cwd=str(repo))
        self.buf = b""

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any] | None:
        """The next line the server writes, parsed; None at its end of stdout."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + WAIT
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no answer in {WAIT} s"
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                assert not self.buf.strip(), self.buf
                return None
            self.buf += chunk
        one, self.buf = self.buf.split(b"\n", 1)
        doc: dict[str, Any] = json.loads(one)
        return doc

    def ask(self, doc: dict[str, Any]) -> dict[str, Any]:
        self.send(line(doc))
        got = self.recv()
        assert got is not None
        return got

    def start(self) -> None:
        assert self.ask(INIT)["id"] == "init"
        self.send(line(INITIALIZED))

    def serving(self) -> bool:
        """The server still answers a request after what came before."""
        got = self.ask({"jsonrpc": "2.0", "id": "alive", "method": "tools/list"})
        return got["id"] == "alive" and "apply_patch" in {t["name"] for t in got["result"]["tools"]}

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        code = self.proc.wait(WAIT)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code


@pytest.fixture
def raw(repo: Repo) -> Any:
    servers: list[Raw] = []

    def make(*extra: str, env: dict[str, str] | None = None) -> Raw:
        servers.append(Raw(repo.path, *extra, env=env))
        return servers[-1]

    yield make
    for s in servers:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def tool_error(answer: dict[str, Any]) -> dict[str, Any]:
    result = answer["result"]
    assert result["isError"] is True
    doc = json.loads(result["content"][0]["text"])
    assert doc == result["structuredContent"] and doc["ok"] is False
    err: dict[str, Any] = doc["error"]
    return err


NOT_MESSAGES: list[tuple[str, bytes, int]] = [
    ("not JSON", b"{not json\n", -32700),
    ("a truncated object", b'{"jsonrpc": "2.0", "id": 3, "method": "tools/list"\n', -32700),
    ("nested past any parser's depth", b'{"jsonrpc":"2.0","id":4,"method":"ping","params":{"a":'
     + b"[" * 100_000 + b"]" * 100_000 + b"}}\n", -32700),
    ("a batch", line([{"jsonrpc": "2.0", "id": 5, "method": "tools/list"}]), -32600),
    ("an id that is an object", line({"jsonrpc": "2.0", "id": {"a": 1}, "method": "tools/list"}), -32600),
    ("an id that is a float", line({"jsonrpc": "2.0", "id": 1.5, "method": "tools/list"}), -32600),
    ("an id that is a boolean", line({"jsonrpc": "2.0", "id": True, "method": "tools/list"}), -32600),
    ("an id that is null", line({"jsonrpc": "2.0", "id": None, "method": "tools/list"}), -32600),
    ("a string", line("tools/list"), -32600),
    ("no jsonrpc member", line({"id": 6, "method": "tools/list"}), -32600),
]


def test_a_line_that_is_no_message_is_answered_and_the_server_reads_on(repo: Repo, raw: Any) -> None:
    s = raw()
    s.start()
    before = snapshot(repo)
    for name, data, code in NOT_MESSAGES:
        s.send(data)
        got = s.recv()
        assert got is not None and got["jsonrpc"] == "2.0", name
        assert got["error"]["code"] == code and got["error"]["message"], (name, got)
        # JSON-RPC: an id that cannot be read is answered as null; an invalid request's readable id is echoed.
        assert got["id"] == (6 if name == "no jsonrpc member" else None), (name, got)
        assert s.serving(), name
    s.send(b"\n   \n")  # blank lines between messages are no messages: nothing to answer
    assert s.serving()
    assert snapshot(repo) == before
    assert s.close() == 0


def test_a_patch_with_bytes_that_are_not_utf8_is_refused_not_committed(repo: Repo, raw: Any) -> None:
    """The SDK decodes stdin with errors='replace': the commit would have held U+FFFD, another change."""
    s = raw()
    s.start()
    before = snapshot(repo)
    data = line(call(7, "apply_patch", {"patch": "--- /dev/null\n+++ b/latin.txt\n@@ -0,0 +1 @@\n+caf@\n",
                                         "idempotency_key": "latin-1"})).replace(b"caf@", b"caf\xe9")
    s.send(data)
    got = s.recv()
    assert got is not None and got["id"] == 7 and got["error"]["code"] == -32700, got
    assert "UTF-8" in got["error"]["message"]
    assert s.serving()
    assert snapshot(repo) == before
    status = tool_error(s.ask(call(8, "receipt_status", {"key": "latin-1"})))
    assert status["type"] == "not_found"  # nothing was prepared under the key either
    assert s.close() == 0


def test_a_request_before_initialize_is_answered_not_dropped(repo: Repo, raw: Any) -> None:
    s = raw()
    before = snapshot(repo)
    got = s.ask(call(1, "apply_patch", {"patch": EDIT, "idempotency_key": "early"}))
    assert got["id"] == 1 and got["error"]["code"] == -32600 and "initialize" in got["error"]["message"], got
    got = s.ask({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
    assert got["id"] == 2 and "initialize" in got["error"]["message"], got
    assert s.ask({"jsonrpc": "2.0", "id": 3, "method": "ping"}) == {"jsonrpc": "2.0", "id": 3, "result": {}}
    assert snapshot(repo) == before
    s.start()
    assert s.serving()
    assert s.close() == 0


def test_an_argument_the_tool_does_not_take_is_refused_before_anything_runs(repo: Repo, raw: Any) -> None:
    """A misspelt 'branch' would otherwise commit to the checked-out branch."""
    repo.git("branch", "feature")
    s = raw()
    s.start()
    before = snapshot(repo)
    err = tool_error(s.ask(call(1, "apply_patch", {"patch": EDIT, "idempotency_key": "typo", "brnach": "feature"})))
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and err["next_action"] == "fix_input"
    assert err["key"] == "typo" and err["unknown"] == ["brnach"] and "'brnach'" in err["message"], err
    assert not err["message"].endswith(".")
    err = tool_error(s.ask(call(2, "recover", {"dryrun": True})))
    assert err["unknown"] == ["dryrun"] and err["key"] is None
    assert snapshot(repo) == before
    ok = s.ask(call(3, "apply_patch", {"patch": EDIT, "idempotency_key": "typo", "branch": "feature"}))
    assert ok["result"]["structuredContent"]["commit"] == repo.head("feature") != repo.head("main")
    assert s.close() == 0


def test_a_line_over_the_limit_is_refused_without_holding_it(repo: Repo, raw: Any) -> None:
    s = raw(env={"ONCEPATCH_MAX_PATCH_BYTES": "1000"})  # the limit: 6 bytes a patch byte, and 64 KiB
    s.start()
    before = snapshot(repo)
    huge = call(1, "apply_patch", {"patch": "--- /dev/null\n+++ b/big\n@@ -0,0 +1 @@\n+" + "x" * 300_000 + "\n",
                                   "idempotency_key": "huge"})
    s.send(line(huge))
    got = s.recv()
    assert got is not None and got["id"] is None and got["error"]["code"] == -32600, got
    assert "over the limit of" in got["error"]["message"]
    assert snapshot(repo) == before
    # Under the wire's limit but over the patch's: the apply's own refusal, with the envelope.
    err = tool_error(s.ask(call(2, "apply_patch", {"patch": "--- /dev/null\n+++ b/big\n@@ -0,0 +1 @@\n+"
                                                   + "x" * 2000 + "\n", "idempotency_key": "big"})))
    assert err["type"] == "too_large" and err["effect_status"] == "not_started"
    assert snapshot(repo) == before
    assert s.serving()
    assert s.close() == 0


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_call_in_flight_when_stdin_closes_is_still_answered(repo: Repo, raw: Any) -> None:
    """A client that writes its requests and closes stdin reads every outcome; the call is never cut short."""
    s = raw(env={"ONCEPATCH_PAUSE_AT": "before-ref"})
    s.start()
    s.send(line(call(1, "apply_patch", {"patch": EDIT, "idempotency_key": "closing"})))
    deadline = time.monotonic() + WAIT
    while not _stopped(s.proc.pid):  # the call stopped itself inside its window
        assert time.monotonic() < deadline and s.proc.poll() is None
        time.sleep(0.01)
    assert s.proc.stdin is not None
    s.proc.stdin.close()  # the client has nothing more to say, while the call is in flight
    os.kill(s.proc.pid, signal.SIGCONT)
    got = s.recv()
    assert got is not None and got["id"] == 1, got
    doc = got["result"]["structuredContent"]
    assert doc["ok"] is True and doc["status"] == "committed" and doc["commit"] == repo.head("main")
    assert s.recv() is None  # then the server ends
    assert s.proc.wait(WAIT) == 0
    assert repo.git("status", "--porcelain") == ""


def test_the_same_key_through_two_servers_at_once_commits_once(repo: Repo, raw: Any) -> None:
    a, b = raw(), raw()
    a.start()
    b.start()
    before = repo.count()
    a.send(line(call(1, "apply_patch", {"patch": EDIT, "idempotency_key": "race"})))
    b.send(line(call(1, "apply_patch", {"patch": EDIT, "idempotency_key": "race"})))
    docs = [s.recv() for s in (a, b)]
    results = [d["result"]["structuredContent"] for d in docs if d is not None]
    assert [r["ok"] for r in results] == [True, True], results
    assert sorted(r["replayed"] for r in results) == [False, True]
    assert results[0]["commit"] == results[1]["commit"] == repo.head("main")
    assert repo.count() == before + 1
    assert a.close() == 0 and b.close() == 0


OTHER_EDIT = EDIT.replace("-line 2\n+line two\n", "-line 2\n+line 2\n").replace(
    "@@ -1,3 +1,3 @@\n line 1\n-line 2\n+line 2\n line 3\n", "@@ -9,3 +9,3 @@\n line 9\n-line 10\n+line ten\n line 11\n")


def _copied_under_another_name(store: Path) -> str:
    forgeries.receipt_file(store, "one").write_bytes(forgeries.receipt_file(store, "two").read_bytes())
    return "key does not match the file name"


def _resealed_with_another_commit(store: Path) -> str:
    two = json.loads(forgeries.receipt_file(store, "two").read_text())
    forgeries.reseal(store, "one", commit=two["commit"], tree=two["tree"], outputs=two["outputs"])
    return "key ref"


def _byte_flipped(store: Path) -> str:
    path = forgeries.receipt_file(store, "one")
    data = bytearray(path.read_bytes())
    at = data.index(b'"tree":') + data[data.index(b'"tree":'):].index(b'"', 7) + 1  # the tree id's first digit
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    path.write_bytes(bytes(data))
    return "receipt_sha256 does not match"


@pytest.mark.parametrize("edit", [_copied_under_another_name, _resealed_with_another_commit, _byte_flipped],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_receipt_edited_by_hand_is_refused_through_mcp_and_never_replayed(repo: Repo, raw: Any, edit: Any) -> None:
    s = raw()
    s.start()
    for rid, (key, patch) in enumerate((("one", EDIT), ("two", OTHER_EDIT))):
        ok = s.ask(call(rid, "apply_patch", {"patch": patch, "idempotency_key": key}))
        assert ok["result"]["structuredContent"]["status"] == "committed", ok
    reason = edit(repo.store)
    before = snapshot(repo)
    for rid, (tool, arguments) in enumerate((("receipt_status", {"key": "one"}),
                                             ("apply_patch", {"patch": EDIT, "idempotency_key": "one"})), 10):
        err = tool_error(s.ask(call(rid, tool, arguments)))
        assert err["type"] == "corrupt_receipt" and err["effect_status"] == "unknown", err
        # ('none': git contradicts it; 'recover': it does not read as a receipt, and recover names it too)
        assert err["next_action"] in ("none", "recover") and reason in err["message"], err
        assert "commit" not in err and "outputs" not in err  # nothing answered from it
    report = s.ask(call(20, "verify", {}))["result"]["structuredContent"]
    assert report["ok"] is False and any(reason in f["reason"] for f in report["failures"]), report
    assert snapshot(repo) == before  # no commit, no ledger note, no receipt rewritten
    ok = s.ask(call(21, "apply_patch", {"patch": OTHER_EDIT, "idempotency_key": "two"}))
    assert ok["result"]["structuredContent"]["replayed"] is True  # the other key is untouched
    assert s.close() == 0


def test_a_call_cancelled_in_flight_lands_once_and_its_receipt_says_so(repo: Repo, raw: Any) -> None:
    """Cancelling cannot cut a commit in half: the call runs to its end, is not answered, and its receipt is true."""
    s = raw(env={"ONCEPATCH_PAUSE_AT": "before-ref"})
    s.start()
    s.send(line(call(1, "apply_patch", {"patch": EDIT, "idempotency_key": "cancelled"})))
    deadline = time.monotonic() + WAIT
    while not _stopped(s.proc.pid):
        assert time.monotonic() < deadline and s.proc.poll() is None
        time.sleep(0.01)
    s.send(line({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}))
    os.kill(s.proc.pid, signal.SIGCONT)
    got = s.ask(call(2, "receipt_status", {"key": "cancelled"}))
    while got["id"] != 2:  # (the cancelled call's answer, if the SDK had sent one before reading the cancel)
        got = s.recv() or {}
    receipt = got["result"]["structuredContent"]["receipt"]
    # Asked while the call may still be finishing: prepared or committed, never rejected; then committed once.
    assert receipt["status"] in ("prepared", "committed"), receipt
    s.send(b"")
    assert s.close() == 0  # stdin ended: nothing pending, the cancelled call is not waited for an answer
    status = Raw(repo.path)
    status.start()
    final = status.ask(call(3, "receipt_status", {"key": "cancelled"}))["result"]["structuredContent"]["receipt"]
    assert final["status"] == "committed" and final["commit"] == repo.head("main")
    assert repo.count() == 2
    status.close()


def test_ids_past_64_bits_are_answered_and_stdins_end_does_not_wait_for_them(repo: Repo, raw: Any) -> None:
    """JSON allows any integer: one that orjson reads as a float never matched its answer, and the end hung."""
    s = raw()
    s.start()
    for rid in (2**70, -(2**70), 2**53 + 1, "2"):
        assert s.ask({"jsonrpc": "2.0", "id": rid, "method": "ping"}) == {"jsonrpc": "2.0", "id": rid, "result": {}}
    s.send(b'{"jsonrpc": "2.0", "id": 7, "method": "ping"')  # a last line cut short, then the end
    assert s.proc.stdin is not None
    s.proc.stdin.close()
    got = s.recv()
    assert got is not None and got["id"] is None and got["error"]["code"] == -32700, got
    assert s.recv() is None
    assert s.proc.wait(WAIT) == 0


def test_a_request_of_the_handshake_free_protocol_is_served_without_initialize(repo: Repo, raw: Any) -> None:
    """The 2026-07-28 protocol has no 'initialize': each request carries its version, and the SDK serves it."""
    s = raw()
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}
    got = s.ask({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta}})
    assert "apply_patch" in {t["name"] for t in got["result"]["tools"]}, got
    assert s.close() == 0


def test_a_member_given_twice_is_refused_not_read_as_the_last(repo: Repo, raw: Any) -> None:
    """The SDK's reader kept the last "branch" of two: the call ran on whichever the agent wrote last."""
    repo.git("branch", "feature")
    s = raw()
    s.start()
    before = snapshot(repo)
    args = (b'{"patch": ' + json.dumps(EDIT).encode() + b', "idempotency_key": "twice", '
            b'"branch": "feature", "branch": "main"}')
    s.send(b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "apply_patch", '
           b'"arguments": ' + args + b"}}\n")
    got = s.recv()
    assert got is not None and got["id"] == 1
    err = tool_error(got)
    assert (err["type"], err["effect_status"], err["next_action"]) == ("usage", "not_started", "fix_input"), err
    assert err["member"] == "branch" and err["key"] == "twice" and "'branch' is given twice" in err["message"]
    s.send(b'{"jsonrpc": "2.0", "id": 2, "id": 3, "method": "tools/list"}\n')  # outside a tool's arguments
    got = s.recv()
    assert got is not None and got["error"]["code"] == -32600 and "'id' is given twice" in got["error"]["message"]
    assert s.serving()
    assert snapshot(repo) == before
    status = tool_error(s.ask(call(4, "receipt_status", {"key": "twice"})))
    assert status["type"] == "not_found"  # nothing was prepared under the key either
    assert s.close() == 0

"""The generic effect ledger (receipts.effects) with real side effects, real crashes and real processes.

Each test counts how often the tool's side effect actually happened — lines
in a counter file, requests seen by a server, the inode of a written file —
because "effectively once" is about the world, not the receipt.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import receipts
from conftest import ROOT, run_cli
from receipts.adapters import builtin_adapters
from receipts.effects import EffectRejected, EffectUnknown, InvalidEffectArgs, effect, effectful, perform
from receipts.errors import IdempotencyConflict
from receipts.recovery import recover
from receipts.store import ReceiptStore
from receipts.verifier import verify


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_py(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], env=child_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def events(store: Path) -> list[dict[str, Any]]:
    return list(ReceiptStore(str(store)).ledger.events())


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


# -- file_write: queryable -----------------------------------------------------------------


def test_file_write_happens_once_and_a_repeat_replays(tmp_path: Path, store: Path) -> None:
    target = tmp_path / "out.txt"
    first = receipts.write_file(target, b"hello\n", key="greeting", store=store)
    assert first.status == "committed" and not first.replayed
    assert first.result == {"path": str(target), "sha256": receipts.status("greeting", store=store).args["sha256"],
                            "size": 6}
    inode = target.stat().st_ino
    second = receipts.write_file(target, b"hello\n", key="greeting", store=store)
    assert second.replayed and second.result == first.result
    assert target.stat().st_ino == inode  # not written again
    with pytest.raises(IdempotencyConflict):
        receipts.write_file(target, b"other\n", key="greeting", store=store)
    assert target.read_bytes() == b"hello\n"
    assert [e["event"] for e in events(store)] == ["prepared", "committed", "replayed"]


CRASH_FILE = r"""
import os, signal, sys
from receipts.adapters import file_write
real = file_write.write_durable
def write_then_die(path, data, **kw):
    if sys.argv[3] == "after":
        real(path, data, **kw)     # the side effect happened ...
    os.kill(os.getpid(), signal.SIGKILL)   # ... and the process dies before 'committed'
file_write.write_durable = write_then_die
file_write.write_file(sys.argv[1], b"new content\n", key="crashy", store=sys.argv[2])
"""


def test_crash_after_the_side_effect_is_settled_by_query_in_recover(tmp_path: Path, store: Path) -> None:
    target = tmp_path / "config.txt"
    target.write_bytes(b"old content\n")
    res = run_py(CRASH_FILE, str(target), str(store), "after")
    assert res.returncode == -9, res.stderr
    assert target.read_bytes() == b"new content\n"
    assert receipts.status("crashy", store=store).status == "prepared"

    report = recover(ReceiptStore(str(store)), builtin_adapters())
    assert [(r.key, r.from_, r.to, r.reason) for r in report.rows] == [
        ("crashy", "prepared", "committed", "digest_matches")]
    receipt = receipts.status("crashy", store=store)
    assert receipt.status == "committed" and receipt.result and receipt.result["size"] == 12
    assert verify(ReceiptStore(str(store)), builtin_adapters(), grace=0).ok
    assert not recover(ReceiptStore(str(store)), builtin_adapters()).changed  # idempotent

    inode = target.stat().st_ino
    again = receipts.write_file(target, b"new content\n", key="crashy", store=store)
    assert again.replayed and target.stat().st_ino == inode


def test_crash_before_the_side_effect_is_not_applied_and_a_repeat_runs_it_once(tmp_path: Path,
                                                                              store: Path) -> None:
    target = tmp_path / "config.txt"
    target.write_bytes(b"old content\n")
    res = run_py(CRASH_FILE, str(target), str(store), "before")
    assert res.returncode == -9, res.stderr
    assert target.read_bytes() == b"old content\n"
    # No explicit recover: the repeat call settles the dead owner's receipt through query first.
    again = receipts.write_file(target, b"new content\n", key="crashy", store=store)
    assert not again.replayed and again.fencing_token == 2
    assert target.read_bytes() == b"new content\n"
    assert [e["event"] for e in events(store)] == ["prepared", "recovered", "prepared", "committed"]


# -- command: not queryable ---------------------------------------------------------------------

CRASH_COMMAND = r"""
import sys
from receipts.adapters.command import run_command
run_command(["sh", "-c", 'echo ran >> "$0"; kill -KILL $PPID; sleep 0.2', sys.argv[1]],
            key="deploy-1", store=sys.argv[2])
"""


def test_without_query_a_crash_stays_unknown_and_verify_fails_until_resolved(tmp_path: Path,
                                                                             store: Path) -> None:
    counter = tmp_path / "ran.txt"
    res = run_py(CRASH_COMMAND, str(counter), str(store))
    assert res.returncode == -9, res.stderr
    assert lines(counter) == 1
    argv = ["sh", "-c", 'echo ran >> "$0"; kill -KILL $PPID; sleep 0.2', str(counter)]

    rstore = ReceiptStore(str(store))
    report = recover(rstore, builtin_adapters())
    assert [(r.from_, r.to) for r in report.rows] == [("prepared", "unknown")]
    assert receipts.status("deploy-1", store=store).status == "unknown"
    failures = verify(rstore, builtin_adapters()).failures
    assert [f.key for f in failures] == ["deploy-1"] and "unknown" in failures[0].reason
    r = run_cli("verify", "--store", str(store), "--json")
    assert r.code == 6 and r.json["failures"][0]["key"] == "deploy-1"

    # A repeat does not run the command again: the outcome is still unknown.
    with pytest.raises(EffectUnknown) as info:
        receipts.run_command(argv, key="deploy-1", store=store)
    assert info.value.envelope()["effect_status"] == "unknown"
    assert lines(counter) == 1

    r = run_cli("resolve", "deploy-1", "--as", "committed", "--note", "saw it in the deploy log",
                "--store", str(store), "--json")
    assert r.code == 0, r.err
    last = events(store)[-1]
    assert last["event"] == "resolved" and last["note"] == "saw it in the deploy log"
    assert last["status"] == "committed" and last["key"] == "deploy-1"
    assert verify(rstore, builtin_adapters()).ok
    assert run_cli("verify", "--store", str(store), "--json").code == 0
    r = run_cli("status", "deploy-1", "--store", str(store), "--json")
    assert r.code == 0 and r.json["receipt"]["status"] == "committed"

    again = receipts.run_command(argv, key="deploy-1", store=store)
    assert again.replayed and lines(counter) == 1


def test_a_timeout_is_unknown_not_failed_and_is_not_run_again(tmp_path: Path, store: Path) -> None:
    counter = tmp_path / "ran.txt"
    argv = ["sh", "-c", 'echo ran >> "$0"; sleep 5', str(counter)]
    t0 = time.monotonic()
    with pytest.raises(EffectUnknown) as info:
        receipts.run_command(argv, key="slow", store=store, timeout=0.3)
    env = info.value.envelope()
    assert env["type"] == "timeout" and env["effect_status"] == "unknown" and env["retryable"] is False
    assert env["next_action"] == "query_before_retry"
    receipt = receipts.status("slow", store=store)
    assert receipt.status == "unknown" and receipt.error and receipt.error["type"] == "timeout"
    assert lines(counter) == 1

    with pytest.raises(EffectUnknown):
        receipts.run_command(argv, key="slow", store=store, timeout=0.3)
    assert lines(counter) == 1 and time.monotonic() - t0 < 4  # the second call ran nothing

    # A person says it did not take effect: the next call executes it, once.
    assert run_cli("resolve", "slow", "--as", "rejected", "--note", "no trace of it",
                   "--store", str(store)).code == 0
    quick = ["sh", "-c", 'echo ran >> "$0"', str(counter)]
    assert receipts.run_command(quick, key="slow-2", store=store).status == "committed"
    with pytest.raises(IdempotencyConflict):  # the key names the slow command, not another one
        receipts.run_command(quick, key="slow", store=store)


# -- classification -------------------------------------------------------------------------------


class Validating:
    tool = "create_ticket"

    def __init__(self) -> None:
        self.prepared = 0

    def prepare(self, args: dict[str, Any]) -> dict[str, Any]:
        self.prepared += 1
        if not args["title"].strip():
            raise ValueError("title is empty")
        return {}

    def query(self, receipt: Any) -> Any:
        raise AssertionError("never asked: nothing was sent")

    def settle(self, receipt: Any) -> list[str]:
        return []


def test_a_validation_error_is_rejected_and_not_retried(store: Path) -> None:
    adapter = Validating()
    sent: list[int] = []

    def create(call: Any) -> dict[str, Any]:
        sent.append(1)
        return {"ticket": 1}

    with pytest.raises(InvalidEffectArgs) as info:
        perform("create_ticket", {"title": " "}, create, key="t-1", adapter=adapter, store=store)
    env = info.value.envelope()
    assert env["type"] == "validation_error" and env["retryable"] is False and env["next_action"] == "fix_input"
    receipt = receipts.status("t-1", store=store)
    assert receipt.status == "rejected" and receipt.retryable is False

    with pytest.raises(InvalidEffectArgs) as again:
        perform("create_ticket", {"title": " "}, create, key="t-1", adapter=adapter, store=store)
    assert again.value.details.get("replayed") is True
    assert adapter.prepared == 1 and sent == []  # neither validated nor sent again

    # The same inside before_send(): a ValueError there is a validation error too.
    def build_then_send(call: Any) -> dict[str, Any]:
        with call.before_send():
            int("not a number")
        sent.append(1)
        return {}

    with pytest.raises(InvalidEffectArgs):
        perform("create_ticket", {"title": "x"}, build_then_send, key="t-2", store=store)
    with pytest.raises(InvalidEffectArgs):
        perform("create_ticket", {"title": "x"}, build_then_send, key="t-2", store=store)
    assert sent == []


def test_an_error_after_sending_is_unknown_and_a_stated_rejection_may_be_retried(store: Path) -> None:
    calls: list[str] = []

    def lost_answer(call: Any) -> dict[str, Any]:
        calls.append("lost")
        raise RuntimeError("response could not be parsed")

    with pytest.raises(EffectUnknown) as info:
        perform("charge", {"cents": 500}, lost_answer, key="c-1", store=store)
    assert info.value.envelope()["type"] == "failed_after_send"
    assert isinstance(info.value.__cause__, RuntimeError)
    assert receipts.status("c-1", store=store).status == "unknown"

    def busy_then_ok(call: Any) -> dict[str, Any]:
        calls.append("busy")
        if calls.count("busy") == 1:
            raise EffectRejected("rate limited", retryable=True)
        return {"charge": "ch_1"}

    with pytest.raises(EffectRejected) as rej:
        perform("charge", {"cents": 700}, busy_then_ok, key="c-2", store=store)
    assert rej.value.retryable and rej.value.next_action == "retry"
    ok = perform("charge", {"cents": 700}, busy_then_ok, key="c-2", store=store)
    assert ok.result == {"charge": "ch_1"} and ok.fencing_token == 2
    assert calls == ["lost", "busy", "busy"]


def test_context_manager_and_decorator(store: Path) -> None:
    sent: list[str] = []
    for _ in range(2):
        with effect("send_email", {"to": "a@example.com", "template": "welcome"}, key="welcome:a",
                    store=store) as call:
            if not call.replayed:
                sent.append("a")
                call.commit({"message_id": "m-1"})
        assert call.result == {"message_id": "m-1"}
    assert sent == ["a"]

    @effectful("send_sms", store=store)
    def send_sms(number: str, text: str) -> dict[str, Any]:
        sent.append(number)
        return {"sid": f"s-{len(sent)}"}

    first = send_sms("+100", "hi", idempotency_key="sms-1")
    assert send_sms("+100", "hi", idempotency_key="sms-1") == first
    with pytest.raises(IdempotencyConflict):
        send_sms("+100", "bye", idempotency_key="sms-1")
    assert sent == ["a", "+100"]


CONTEND = r"""
import json, os, sys, time
from receipts.effects import perform
def book(call):
    with open(sys.argv[1], "a") as fh:
        fh.write("booked\n")
    time.sleep(0.3)
    return {"by": os.getpid()}
r = perform("book_room", {"room": 7}, book, key="room-7", store=sys.argv[2])
print(json.dumps({"replayed": r.replayed, "result": r.result}))
"""


def test_processes_racing_on_one_key_run_the_tool_once(tmp_path: Path, store: Path) -> None:
    counter = tmp_path / "booked.txt"
    procs = [subprocess.Popen([sys.executable, "-c", CONTEND, str(counter), str(store)], env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            outs.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert lines(counter) == 1
    assert sum(not o["replayed"] for o in outs) == 1
    assert len({o["result"]["by"] for o in outs}) == 1


# -- the HTTP example of docs/EFFECTS.md --------------------------------------------------------------


def load_http_example() -> dict[str, Any]:
    text = (ROOT / "docs" / "EFFECTS.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if b.startswith("# example: http_effect.py"))
    ns: dict[str, Any] = {"__name__": "http_effect"}
    exec(compile(code, "docs/EFFECTS.md", "exec"), ns)
    return ns


class Shop:
    """A server that honours Idempotency-Key: executes each key once, answers repeats from memory."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.responses: dict[str, tuple[int, dict[str, Any]]] = {}
        self.executed = 0
        self.requests = 0
        self.slow: set[str] = set()


@pytest.fixture
def shop() -> Iterator[tuple[Shop, str]]:
    state = Shop()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            key = self.headers.get("Idempotency-Key")
            with state.lock:
                state.requests += 1
                if not key:
                    return self._answer(400, {"error": "Idempotency-Key required"})
                if body.get("qty", 0) <= 0:
                    return self._answer(422, {"error": "qty must be positive"})
                stored = state.responses.get(key)
                slow = False
                if stored is None:
                    state.executed += 1
                    stored = state.responses[key] = (201, {"order": state.executed, "sku": body["sku"]})
                    slow = key in state.slow
            if slow:
                time.sleep(1.0)
            self._answer(*stored)

        def _answer(self, code: int, doc: dict[str, Any]) -> None:
            data = json.dumps(doc).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}/orders"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_http_example_sends_once_and_replays(shop: tuple[Shop, str], store: Path) -> None:
    state, url = shop
    ex = load_http_example()
    first = ex["post_once"](url, {"sku": "A-1", "qty": 2}, key="order-7", store=str(store))
    assert first.result == {"status": 201, "body": {"order": 1, "sku": "A-1"}}
    again = ex["post_once"](url, {"sku": "A-1", "qty": 2}, key="order-7", store=str(store))
    assert again.replayed and again.result == first.result
    assert (state.requests, state.executed) == (1, 1)

    with pytest.raises(EffectRejected) as info:
        ex["post_once"](url, {"sku": "A-1", "qty": 0}, key="order-8", store=str(store))
    assert info.value.retryable is False
    with pytest.raises(EffectRejected):
        ex["post_once"](url, {"sku": "A-1", "qty": 0}, key="order-8", store=str(store))
    assert state.requests == 2  # the stored rejection was replayed without a request


def test_http_example_timeout_is_unknown_then_query_resends_the_key(shop: tuple[Shop, str],
                                                                   store: Path) -> None:
    state, url = shop
    ex = load_http_example()
    state.slow.add("order-9")
    with pytest.raises(EffectUnknown) as info:
        ex["post_once"](url, {"sku": "B-2", "qty": 1}, key="order-9", store=str(store), timeout=0.3)
    assert info.value.envelope()["type"] == "timeout"
    assert receipts.status("order-9", store=store).status == "unknown"
    assert state.executed == 1  # the server did act: the receipt must not say "failed"

    report = recover(ReceiptStore(str(store)), {ex["TOOL"]: ex["IdempotentHttpAdapter"](timeout=5)})
    assert [(r.from_, r.to) for r in report.rows] == [("unknown", "committed")]
    receipt = receipts.status("order-9", store=store)
    assert receipt.result == {"status": 201, "body": {"order": 1, "sku": "B-2"}}
    again = ex["post_once"](url, {"sku": "B-2", "qty": 1}, key="order-9", store=str(store))
    assert again.replayed and state.executed == 1 and state.requests == 2


def test_http_example_connection_refused_is_a_retryable_rejection(store: Path) -> None:
    ex = load_http_example()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/orders"
    with pytest.raises(EffectRejected) as info:
        ex["post_once"](url, {"sku": "C-3", "qty": 1}, key="order-10", store=str(store), timeout=2)
    assert info.value.retryable is True
    receipt = receipts.status("order-10", store=store)
    assert receipt.status == "rejected" and receipt.retryable is True

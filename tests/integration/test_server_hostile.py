"""``oncepatch serve`` (and so ``--broker``) against a peer that does not speak its wire as the thin client does.

A broker serves other users: whatever one of them sends must cost the
broker little and leave nothing behind in the worker that read it.  The
path is the same with and without ``--broker`` (``patcher/cli/server.py``,
``_read_frame``), so these run as the test's own user; test_broker.py
runs real users through the same code.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, run_cli, snapshot
from test_broker import box  # noqa: F401 - the fixture: real users from useradd
from test_server import Server, children_of

WAIT = 60.0  # the server's deadline for a request is 10 s; this only runs out on failure


@pytest.fixture
def server(short_tmp: Path) -> Iterator[Server]:
    srv = Server(short_tmp / "srv", "--no-watch")
    yield srv
    srv.stop()


def connect(srv: Server) -> socket.socket:
    (sock,) = [p for p in srv.folder.iterdir() if p.name.endswith(".sock")]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock))
    s.settimeout(WAIT)
    return s


def answer(s: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        more = s.recv(4096)
        if not more:
            break
        data += more
    return data


def test_connections_that_send_nothing_are_let_go_and_the_server_still_serves(server: Server, repo: Repo) -> None:
    """Each silent connection held a worker (a process) for ever: enough of them took the machine's memory."""
    idle = [connect(server) for _ in range(4)]
    t0 = time.monotonic()
    for s in idle:
        got = answer(s)
        assert got.startswith(b"R") and b"no whole request" in got, got
        s.close()
    assert time.monotonic() - t0 < WAIT
    # The workers are free again: a real call goes through the server, and the idle pool is back to its size.
    before = snapshot(repo)
    r = run_cli("status", "never-used", "--repo", str(repo.path), "--json", env=server.env)
    assert r.code == 2 and r.json["error"]["type"] == "not_found", r.out + r.err
    assert snapshot(repo) == before
    deadline = time.monotonic() + WAIT
    while len(server.children()) > 4:  # 2 idle workers, the next call's spare, the one finishing: no one per connection
        assert time.monotonic() < deadline, server.children()
        time.sleep(0.05)


def test_descriptors_passed_with_a_request_that_never_ends_are_not_kept(server: Server) -> None:
    """A peer that passes its four descriptors and stops left them open in the worker, four more each time."""
    marker = Path(tempfile.mkdtemp(prefix="op-fds-")) / "passed-by-the-peer"
    marker.write_bytes(b"")
    for _ in range(3):
        s = connect(server)
        fds = [os.open(marker, os.O_RDONLY) for _ in range(4)]
        try:
            socket.send_fds(s, [(1000).to_bytes(4, "big") + b"oncepatch-serve/1\0"], fds)  # 1000 bytes promised
        finally:
            for fd in fds:
                os.close(fd)
        s.shutdown(socket.SHUT_WR)  # ... and never sent
        got = answer(s)
        assert got.startswith(b"R") and b"ended early" in got, got
        s.close()
    held = []
    for pid in [server.pid, *children_of(server.pid)]:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                if os.readlink(f"/proc/{pid}/fd/{name}") == str(marker):
                    held.append((pid, name))
            except OSError:
                continue
    assert held == [], held
    marker.unlink()
    marker.parent.rmdir()


AGENT_PEER = r"""
import os, socket, sys
(sock,) = [os.path.join(sys.argv[1], n) for n in os.listdir(sys.argv[1]) if n.endswith(".sock")]
null = os.open(os.devnull, os.O_RDWR)


def ask(payload, fds=()):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock)
    s.settimeout(60)
    if payload is not None:
        socket.send_fds(s, [payload], list(fds)) if fds else s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
    data = b""
    while not data.endswith(b"\n"):
        more = s.recv(4096)
        if not more:
            break
        data += more
    s.close()
    return data


def frame(*fields):
    body = b"\0".join(fields)
    return len(body).to_bytes(4, "big") + body


for name, payload, fds in [
    ("silent", None, ()),
    ("garbage", b"\x00\x00\x00\x10" + bytes(range(16)), ()),
    ("too large", (1 << 31).to_bytes(4, "big") + b"x", (null,) * 4),
    ("ended early", (1000).to_bytes(4, "big") + b"oncepatch-serve/1\0", (null,) * 4),
    ("another protocol", frame(b"http/1.1", b"x"), (null,) * 4),
    ("another version", frame(b"oncepatch-serve/1", b"0" * 16, b"18", b"1", b"status"), (null,) * 4),
    ("no fields", frame(b"oncepatch-serve/1"), (null,) * 4),
    ("fields cut short", frame(b"oncepatch-serve/1", sys.argv[2].encode(), b"18"), (null,) * 4),
    ("a command run in process", frame(b"oncepatch-serve/1", sys.argv[2].encode(), b"18", b"2", b"resolve", b"k"),
     (null,) * 4),
]:
    print(name + "|" + ascii(ask(payload, fds)))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root and useradd to create the test's users (CI runs as root)")
def test_a_brokers_other_user_sending_what_the_client_never_sends_is_refused_and_changes_nothing(box: Any) -> None:
    from patcher.connect import version_token
    from test_broker import PATCH, _broker_repo, _start_broker

    repo = _broker_repo(box)
    _start_broker(box)
    before = snapshot(repo)
    res = box.run(box.agent, box.python, "-c", AGENT_PEER, str(box.base / "sock"), version_token(), cwd=repo.path)
    assert res.returncode == 0, res
    answers = dict(line.split("|", 1) for line in res.stdout.decode().splitlines())
    assert len(answers) == 9, answers
    for name, got in answers.items():
        assert got.startswith("b'R"), (name, got)  # refused, with the reason
    assert "no whole request" in answers["silent"] and "ended early" in answers["ended early"]
    assert "too large" in answers["too large"] and "another version" in answers["another version"]
    for name in ("no fields", "fields cut short"):  # not a worker killed by an IndexError (answered 'D1')
        assert "not an oncepatch-serve/1 request" in answers[name], (name, answers[name])
    assert snapshot(repo) == before
    # And the broker serves the agent's real call, as the agent.
    res = box.oncepatch(box.agent, "apply", "--json", "-", "--key", "after-the-noise", input=PATCH, cwd=repo.path,
                        env={"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"})
    assert res.returncode == 0, res
    assert repo.git("log", "-1", "--format=%an").strip() == "Agent"


def test_calls_past_a_peers_limit_are_refused_and_run_in_process(short_tmp: Path, repo: Repo,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each connection took a worker, a whole process: one peer connecting in a loop forked without end."""
    monkeypatch.setenv("ONCEPATCH_MAX_CALLS_PER_PEER", "2")  # (the server's and its clients' version token alike)
    srv = Server(short_tmp / "srv", "--no-watch")
    try:
        held = [connect(srv) for _ in range(2)]  # two calls under way (their requests not sent yet)
        refused = connect(srv)
        got = answer(refused)
        assert got.startswith(b"R") and b"has 2 calls running" in got and b"ONCEPATCH_MAX_CALLS_PER_PEER=2" in got, got
        refused.close()
        before = snapshot(repo)
        r = run_cli("status", "never-used", "--repo", str(repo.path), "--json", env=srv.env)  # require
        assert r.code == 5, r.out + r.err
        err = r.json["error"]
        assert (err["type"], err["effect_status"], err["next_action"]) == ("io_error", "not_started", "retry"), err
        assert "has 2 calls running" in err["message"], err
        assert snapshot(repo) == before
        r = run_cli("status", "never-used", "--repo", str(repo.path), "--json", env={**srv.env, "ONCEPATCH_SERVER": "auto"})
        assert r.code == 2 and r.json["error"]["type"] == "not_found", r.out + r.err  # ran in process
        for s in held:
            s.close()
    finally:
        srv.stop()

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

import pytest

from conftest import Repo, run_cli, snapshot
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

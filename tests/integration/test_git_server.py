"""The test git server goes down and comes back on the same port, deterministically (tests/git_server.py)."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from git_server import GitServer, _group_members, wait_group_gone
from remote_cluster import make_server_repo


def _ls_remote(server: GitServer) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "ls-remote", server.url("server.git")], capture_output=True, timeout=60,
                          check=False)


def test_the_port_is_held_from_creation_to_close(tmp_path: Path) -> None:
    """Before the daemon runs (and between runs) the port refuses connects and no other process can bind it.

    Checked before any connection to the port, so no TIME_WAIT of an earlier
    connection holds it instead; stopped and started again, it serves each time.
    """
    server = GitServer(make_server_repo(tmp_path))
    try:
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect((server.host, server.port))
        with socket.socket() as thief, pytest.raises(OSError) as taken:
            thief.bind((server.host, server.port))
        assert taken.value.errno == errno.EADDRINUSE
        thief_proc = subprocess.run(  # another process, as another test would try it
            [sys.executable, "-c", f"import socket; socket.socket().bind(('{server.host}', {server.port}))"],
            capture_output=True, check=False)
        assert thief_proc.returncode != 0 and b"Address already in use" in thief_proc.stderr
        for _round in range(3):
            server.start()
            assert server.startup is not None and server.startup > 0
            assert _ls_remote(server).returncode == 0, server.log[-5:]
            server.stop()
            with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
                probe.connect((server.host, server.port))
    finally:
        server.close()
    assert server._reservation is None and server.proc is None


def test_a_port_in_use_is_tried_again_within_the_measured_bound(tmp_path: Path) -> None:
    """A foreign listener on the port: each start fails, until the bound derived from the start-up runs out."""
    server = GitServer(make_server_repo(tmp_path)).start()
    try:
        server.stop()
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((server.host, server.port))
        squatter.listen()
        try:
            with pytest.raises(RuntimeError, match="still in use"):
                server.start()
            assert sum("in use" in line for line in server.log) >= 2  # tried again, not given up at once
        finally:
            squatter.close()
        server.start()
        assert _ls_remote(server).returncode == 0
    finally:
        server.close()


def test_stop_returns_once_every_process_of_the_group_has_exited() -> None:
    """A forked child of the group is waited for too, not only the reaped leader."""
    proc = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600 & echo started; wait"], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    assert len(_group_members(proc.pid)) == 3
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_group_gone(proc.pid)
    assert _group_members(proc.pid) == []

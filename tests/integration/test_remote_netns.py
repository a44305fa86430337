"""Remote mode across network namespaces: three machines, each in its own namespace (docs/REMOTE.md).

Each machine's namespace has its own loopback and one end of a veth pair; the
other end, in the server's (the test's) namespace, carries the server's
address, so every machine names the server by one URL.  Needs root and
``ip netns``: skipped, with the reason, where the kernel or the user does not
allow them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_cli
from git_server import GitServer
from remote_cluster import Cluster, key_patch, make_cluster, make_server_repo, remote_git
from test_remote_mode import apply_argv, env_with, remote_commits_with

from receipts.identity import key_hash


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess[bytes]:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.run([*prefix, "ip", *args], capture_output=True, check=False)


def _must(res: subprocess.CompletedProcess[bytes]) -> None:
    assert res.returncode == 0, res.stderr.decode()


class Namespaces:
    """One namespace per machine, each reaching ``server_ip`` through its own veth pair."""

    def __init__(self, machines: int) -> None:
        tag = f"op{os.getpid() % 100000}"
        octet = 100 + os.getpid() % 100
        self.server_ip = f"10.{octet}.0.1"
        self.names = [f"{tag}n{m}" for m in range(machines)]
        self.host_ends = [f"{tag}h{m}" for m in range(machines)]
        self.inner_ends = [f"{tag}p{m}" for m in range(machines)]
        self.addrs = [f"10.{octet}.{m + 1}.2" for m in range(machines)]

    def create(self) -> None:
        for ns, host, inner, addr in zip(self.names, self.host_ends, self.inner_ends, self.addrs):
            _must(_ip("netns", "add", ns))
            _must(_ip("link", "add", host, "type", "veth", "peer", "name", inner))
            _must(_ip("link", "set", inner, "netns", ns))
            _must(_ip("addr", "add", f"{self.server_ip}/32", "dev", host))
            _must(_ip("link", "set", host, "up"))
            _must(_ip("route", "add", f"{addr}/32", "dev", host))
            _must(_ip("link", "set", "lo", "up", ns=ns))
            _must(_ip("addr", "add", f"{addr}/32", "dev", inner, ns=ns))
            _must(_ip("link", "set", inner, "up", ns=ns))
            _must(_ip("route", "add", f"{self.server_ip}/32", "dev", inner, ns=ns))

    def cut(self, m: int) -> None:
        _must(_ip("link", "set", self.inner_ends[m], "down", ns=self.names[m]))

    def mend(self, m: int) -> None:
        _must(_ip("link", "set", self.inner_ends[m], "up", ns=self.names[m]))
        _ip("route", "add", f"{self.server_ip}/32", "dev", self.inner_ends[m], ns=self.names[m])

    def destroy(self) -> None:
        for ns, host in zip(self.names, self.host_ends):
            _ip("netns", "del", ns)  # (takes its veth end, and so the pair, with it)
            _ip("link", "del", host)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2)"
    probe = f"opprobe{os.getpid() % 100000}"
    res = _ip("netns", "add", probe)
    if res.returncode != 0:
        return f"'ip netns add' is not allowed here: {res.stderr.decode().strip()}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture
def spread(tmp_path: Path) -> Iterator[tuple[Namespaces, GitServer, Cluster]]:
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    spaces = Namespaces(3)
    try:
        spaces.create()
        server = GitServer(make_server_repo(tmp_path), host=spaces.server_ip).start()
        try:
            yield spaces, server, make_cluster(tmp_path, server.url("server.git"), 3)
        finally:
            server.close()
    finally:
        spaces.destroy()


def _in(spaces: Namespaces, m: int, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["ip", "netns", "exec", spaces.names[m], *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_with(**env))
    return proc


def _send(proc: subprocess.Popen[bytes], data: bytes) -> None:
    assert proc.stdin is not None
    proc.stdin.write(data)
    proc.stdin.close()
    proc.stdin = None


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_same_key_from_three_namespaces_lands_once(spread: tuple[Namespaces, GitServer, Cluster]) -> None:
    spaces, _server, c = spread
    procs = [_in(spaces, m, apply_argv(machine, 0), ONCEPATCH_PAUSE_AT="before-push")
             for m, machine in enumerate(c.machines)]
    try:
        for p in procs:
            _send(p, key_patch(0).encode())
        for p in procs:
            _pid, status = os.waitpid(p.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), status
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        docs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    finally:
        _reap(procs)
    assert [p.returncode for p in procs] == [0, 0, 0], docs
    assert sorted(d["replayed"] for d in docs) == [False, True, True]
    assert len(remote_commits_with(c, "key-0")) == 1


def test_a_namespace_cut_off_during_a_call(spread: tuple[Namespaces, GitServer, Cluster]) -> None:
    """Machine 0's link goes down while its call waits before the push: nothing lands, a retry lands once."""
    spaces, _server, c = spread
    before = remote_git(c, "rev-parse", "main").strip()
    proc = _in(spaces, 0, apply_argv(c.machines[0], 0), ONCEPATCH_PAUSE_AT="before-push")
    try:
        _send(proc, key_patch(0).encode())
        _pid, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        spaces.cut(0)
        os.kill(proc.pid, signal.SIGCONT)
        out, _err = proc.communicate(timeout=120)
    finally:
        _reap([proc])
    assert proc.returncode == 4, out
    err = json.loads(out)["error"]
    assert (err["type"], err["effect_status"], err["retryable"]) == ("remote_unreachable", "not_applied", True)
    assert remote_git(c, "rev-parse", "main").strip() == before
    # Another machine takes the key meanwhile; the cut-off one, back, replays it.
    other = _in(spaces, 1, apply_argv(c.machines[1], 0))
    try:
        _send(other, key_patch(0).encode())
        doc_b = json.loads(other.communicate(timeout=120)[0])
    finally:
        _reap([other])
    assert doc_b["ok"] and doc_b["replayed"] is False, doc_b
    spaces.mend(0)
    back = _in(spaces, 0, apply_argv(c.machines[0], 0))
    try:
        _send(back, key_patch(0).encode())
        doc_a = json.loads(back.communicate(timeout=120)[0])
    finally:
        _reap([back])
    assert doc_a["ok"] and doc_a["replayed"] is True and doc_a["commit"] == doc_b["commit"], doc_a
    assert remote_commits_with(c, "key-0") == [doc_b["commit"]]
    assert remote_git(c, "rev-parse", f"refs/oncepatch/keys/{key_hash('key-0')}").strip() == doc_b["commit"]
    for m in c.machines:  # verify reaches the server from the test's namespace (it holds the server's address)
        ver = run_cli("verify", "--json", "--repo", str(m), "--grace", "0")
        assert ver.code == 0, ver.out + ver.err

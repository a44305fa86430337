"""Remote mode (``apply --remote``, docs/REMOTE.md) against a real ``git daemon`` on 127.0.0.1.

Three "machines" are three clones, each with its own store.  What must hold:
one key claimed once on the remote whichever machine asks (the others
replay, checked); distinct keys from every machine all land, once each, the
tree equal to applying them serially; a client killed at each crash point,
or the server killed mid-push, leaves each key landed once or not at all,
and after ``recover`` every machine's ``verify`` agrees with the remote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, run_cli
from git_server import GitServer
from remote_cluster import Cluster, drive, key_patch, make_cluster, make_server_repo, remote_git, serial_tree

from receipts.identity import key_hash


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[GitServer, Cluster]]:
    """A ``git daemon`` on 127.0.0.1 serving ``server.git``, and three clones of it ("machines")."""
    server = GitServer(make_server_repo(tmp_path)).start()
    try:
        yield server, make_cluster(tmp_path, server.url("server.git"), 3)
    finally:
        server.stop()


def apply_argv(machine: Path, i: int, key: str | None = None) -> list[str]:
    return [sys.executable, "-m", "patcher.cli", "apply", "-", "--json", "--repo", str(machine), "--key",
            key or f"key-{i}", "--remote", "origin"]


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def remote_commits_with(cluster: Cluster, key: str) -> list[str]:
    out = remote_git(cluster, "log", "--format=%H", f"--grep=Oncepatch-Key: {key_hash(key)}", "main")
    return out.split()


def remote_ref(cluster: Cluster, ref: str) -> str | None:
    res = subprocess.run(["git", "rev-parse", "-q", "--verify", ref], cwd=cluster.server_repo, capture_output=True,
                         check=False)
    return res.stdout.decode().strip() or None


def cli_apply(machine: Path, i: int, key: str | None = None, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(apply_argv(machine, i, key), input=key_patch(i).encode(), capture_output=True,
                          env=env_with(**env), timeout=120, check=False)


def verify_all(cluster: Cluster) -> None:
    for m in cluster.machines:
        ver = run_cli("verify", "--json", "--repo", str(m), "--grace", "0")
        assert ver.code == 0, ver.out + ver.err


def test_same_key_from_three_machines_at_once_lands_once(cluster: tuple[GitServer, Cluster]) -> None:
    """All three staged on the same head and paused before the push, then let go: one push, two replays."""
    _server, c = cluster
    before = remote_git(c, "rev-parse", "main").strip()
    procs = [subprocess.Popen(apply_argv(m, 0), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env_with(ONCEPATCH_PAUSE_AT="before-push"))
             for m in c.machines]
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(key_patch(0).encode())
            p.stdin.close()
            p.stdin = None  # (communicate() must not flush it)
        for p in procs:  # each stops itself (SIGSTOP) right before its push
            _pid, status = os.waitpid(p.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), status
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        docs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], docs
    assert sorted(d["replayed"] for d in docs) == [False, True, True]
    assert len({d["commit"] for d in docs}) == 1
    assert all(d["remote"]["answered_from_remote"] for d in docs if d["replayed"])
    # One commit on the remote, on top of the head all three staged on.
    assert remote_git(c, "rev-list", "--count", f"{before}..main").strip() == "1"
    assert remote_commits_with(c, "key-0") == [docs[0]["commit"]]
    assert remote_ref(c, f"refs/oncepatch/keys/{key_hash('key-0')}") == docs[0]["commit"]
    # Another call under the same key from another machine: a conflict, nothing pushed.
    other = cli_apply(c.machines[1], 1, key="key-0")
    assert other.returncode == 3, other.stdout
    assert json.loads(other.stdout)["error"]["type"] == "idempotency_conflict"
    assert remote_git(c, "rev-list", "--count", f"{before}..main").strip() == "1"
    verify_all(c)


def _distinct_keys(tmp_path: Path, c: Cluster, n: int) -> list[dict[str, Any]]:
    before = remote_git(c, "rev-parse", "main").strip()
    keys = {m: list(range(m * n, (m + 1) * n)) for m in range(len(c.machines))}
    procs = [drive(machine, keys[m], env_with()) for m, machine in enumerate(c.machines)]
    docs: list[dict[str, Any]] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err.decode()
            docs += [json.loads(line) for line in out.decode().splitlines()]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    total = n * len(c.machines)
    assert all(d["ok"] and not d["replayed"] for d in docs), [d for d in docs if not d.get("ok")]
    assert len(docs) == total
    # Every commit landed once, on one line of history, no update lost.
    assert remote_git(c, "rev-list", "--count", f"{before}..main").strip() == str(total)
    assert remote_git(c, "rev-list", "--merges", "--count", "main").strip() == "0"
    for i in range(total):
        assert len(remote_commits_with(c, f"key-{i}")) == 1, i
    assert remote_git(c, "rev-parse", "main^{tree}").strip() == serial_tree(tmp_path, list(range(total)))
    landed = set(remote_git(c, "rev-list", "main").split())
    assert {d["commit"] for d in docs} <= landed
    verify_all(c)
    return docs


def test_distinct_keys_from_three_machines_all_land_once(tmp_path: Path,
                                                         cluster: tuple[GitServer, Cluster]) -> None:
    docs = _distinct_keys(tmp_path, cluster[1], 5)
    assert sum(d["remote"]["restages"] for d in docs) >= 0


@pytest.mark.slow
def test_thirty_keys_from_each_of_three_machines(tmp_path: Path, cluster: tuple[GitServer, Cluster]) -> None:
    _distinct_keys(tmp_path, cluster[1], 30)

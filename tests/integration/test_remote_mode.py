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
        server.close()


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
    for d in docs:  # the re-stages a call needed, in its result and in its receipt alike
        receipt = json.loads(Path(d["receipt"]).read_text())
        assert receipt["remote"]["restages"] == d["remote"]["restages"]
        assert receipt["remote"]["url"] == cluster[0].url("server.git")


@pytest.mark.slow
def test_thirty_keys_from_each_of_three_machines(tmp_path: Path, cluster: tuple[GitServer, Cluster]) -> None:
    _distinct_keys(tmp_path, cluster[1], 30)


def _receipt_of(machine: Path, key: str) -> dict[str, Any] | None:
    res = run_cli("status", "--json", "--repo", str(machine), "--", key)
    return res.json["receipt"] if res.code == 0 else None


#: Remote mode's crash points (cas/crash.py) and whether the key has landed on the remote there.
CRASH_POINTS = {"after-stage": False, "after-prepare": False, "after-push": True, "before-receipt-replace": True}


@pytest.mark.parametrize("point", sorted(CRASH_POINTS))
def test_client_killed_at_each_crash_point_then_recover_everywhere(point: str,
                                                                    cluster: tuple[GitServer, Cluster]) -> None:
    _server, c = cluster
    a, b, _c = c.machines
    before = remote_git(c, "rev-parse", "main").strip()
    crashed = cli_apply(a, 0, ONCEPATCH_CRASH_AT=point)
    assert crashed.returncode == 137, crashed.stderr
    landed = CRASH_POINTS[point]
    assert len(remote_commits_with(c, "key-0")) == int(landed)
    for m in c.machines:
        rec = run_cli("recover", "--json", "--repo", str(m), "--tmp-age", "0")
        assert rec.code == 0, rec.out + rec.err
    receipt = _receipt_of(a, "key-0")
    key_ref = remote_ref(c, f"refs/oncepatch/keys/{key_hash('key-0')}")
    if landed:
        # Settled from the remote: its key ref and receipt are the truth.
        assert receipt is not None and receipt["status"] == "committed"
        assert receipt["commit"] == key_ref == remote_git(c, "rev-parse", "main").strip()
        assert subprocess.run(["git", "-C", str(a), "rev-parse", f"refs/oncepatch/keys/{key_hash('key-0')}"],
                              capture_output=True, check=True).stdout.decode().strip() == key_ref
    else:
        assert key_ref is None and remote_git(c, "rev-parse", "main").strip() == before
        assert receipt is None or (receipt["status"] == "rejected" and receipt["retryable"])
    verify_all(c)
    # The key again, from another machine and from the crashed one: landed once, whatever happened.
    again_b = cli_apply(b, 0)
    again_a = cli_apply(a, 0)
    assert (again_b.returncode, again_a.returncode) == (0, 0), (again_b.stdout, again_a.stdout)
    doc_b, doc_a = json.loads(again_b.stdout), json.loads(again_a.stdout)
    assert doc_b["replayed"] is landed and doc_a["replayed"] is True
    assert doc_a["commit"] == doc_b["commit"]
    assert remote_commits_with(c, "key-0") == [doc_b["commit"]]
    assert remote_git(c, "rev-list", "--count", f"{before}..main").strip() == "1"
    verify_all(c)


def test_server_killed_mid_push_is_unknown_until_recover_asks_the_remote(tmp_path: Path,
                                                                        cluster: tuple[GitServer, Cluster]) -> None:
    """The daemon (and its receive-pack) killed while the push waits in the server's pre-receive hook."""
    server, c = cluster
    a = c.machines[0]
    ready, go = tmp_path / "hook-ready", tmp_path / "hook-go"
    os.mkfifo(ready)
    os.mkfifo(go)
    hook = c.server_repo / "hooks" / "pre-receive"
    hook.write_text(f"#!/bin/sh\ncat >/dev/null\necho reached > '{ready}'\nread x < '{go}'\n")
    hook.chmod(0o755)
    before = remote_git(c, "rev-parse", "main").strip()
    proc = subprocess.Popen(apply_argv(a, 0), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_with())
    try:
        assert proc.stdin is not None
        proc.stdin.write(key_patch(0).encode())
        proc.stdin.close()
        proc.stdin = None
        with open(ready) as fh:  # blocks until the push's pack is in and the hook runs
            assert fh.read().strip() == "reached"
        server.stop()  # the daemon's whole group: receive-pack and its hook die mid-push
        out, _err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, out
    err = json.loads(out)["error"]
    assert err["effect_status"] == "unknown" and err["next_action"] == "recover"
    receipt = _receipt_of(a, "key-0")
    assert receipt is not None and receipt["status"] == "unknown"
    # Server down: recover cannot tell either, and says so.
    rec = run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0")
    assert rec.code != 0
    assert _receipt_of(a, "key-0")["status"] == "unknown"  # type: ignore[index]
    # Server back (same port), without the hook: the remote says the push never landed.
    hook.unlink()
    server.start()  # the same port, held while down
    try:
        rec = run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0")
        assert rec.code == 0, rec.out + rec.err
        receipt = _receipt_of(a, "key-0")
        assert receipt is not None and receipt["status"] == "rejected" and receipt["retryable"]
        assert remote_git(c, "rev-parse", "main").strip() == before
        verify_all(c)
        again = cli_apply(a, 0)
        assert again.returncode == 0, again.stdout
        assert remote_commits_with(c, "key-0") == [json.loads(again.stdout)["commit"]]
        verify_all(c)
    finally:
        server.stop()


def test_server_down_before_the_call_changes_nothing(cluster: tuple[GitServer, Cluster]) -> None:
    server, c = cluster
    a = c.machines[0]
    server.stop()
    res = cli_apply(a, 0)
    assert res.returncode == 4, res.stdout
    err = json.loads(res.stdout)["error"]
    assert (err["type"], err["effect_status"], err["next_action"]) == ("remote_unreachable", "not_started", "retry")
    assert _receipt_of(a, "key-0") is None
    server.start()  # the same port, held while down
    try:
        again = cli_apply(a, 0)
        assert again.returncode == 0, again.stdout
        assert json.loads(again.stdout)["replayed"] is False
    finally:
        server.stop()


def _forge_remote_receipt(c: Cluster, key: str, **changes: Any) -> None:
    """Replace the remote's receipt of ``key`` by a well-formed one with ``changes`` (a forged claim)."""
    from receipts.receipt import parse_receipt, receipt_bytes

    h = key_hash(key)
    data = remote_git(c, "cat-file", "blob", f"refs/oncepatch/receipts/{h}:receipt.json").encode()
    forged = receipt_bytes(parse_receipt(data, path="remote", expected_key_hash=h).evolve(**changes))
    blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=c.server_repo, input=forged,
                          capture_output=True, check=True).stdout.decode().strip()
    tree = subprocess.run(["git", "mktree"], cwd=c.server_repo, input=f"100644 blob {blob}\treceipt.json\n".encode(),
                          capture_output=True, check=True).stdout.decode().strip()
    commit = remote_git(c, "commit-tree", tree, "-m", "forged").strip()
    remote_git(c, "update-ref", f"refs/oncepatch/receipts/{h}", commit)


def test_a_replay_from_the_remote_checks_its_receipt_first(cluster: tuple[GitServer, Cluster]) -> None:
    """A receipt on the remote that names another commit than the key ref is not answered from."""
    _server, c = cluster
    a, b, _c = c.machines
    first = cli_apply(a, 0)
    assert first.returncode == 0, first.stdout
    base = remote_git(c, "rev-parse", "main~1").strip()
    _forge_remote_receipt(c, "key-0", commit=base)
    forged = cli_apply(b, 0)
    assert forged.returncode == 6, forged.stdout
    err = json.loads(forged.stdout)["error"]
    assert err["type"] == "corrupt_receipt" and "key ref points at" in err["message"]
    assert _receipt_of(b, "key-0") is None  # nothing answered, nothing recorded
    # verify on the machine that made it: its receipt disagrees with the remote's now.
    ver = run_cli("verify", "--json", "--repo", str(a), "--grace", "0")
    assert ver.code == 6 and "remote's receipt has another commit" in ver.out, ver.out


def test_verify_finds_a_key_claim_removed_from_the_remote(cluster: tuple[GitServer, Cluster]) -> None:
    _server, c = cluster
    a = c.machines[0]
    assert cli_apply(a, 0).returncode == 0
    verify_all(c)
    remote_git(c, "update-ref", "-d", f"refs/oncepatch/keys/{key_hash('key-0')}")
    ver = run_cli("verify", "--json", "--repo", str(a), "--grace", "0")
    assert ver.code == 6 and "has no claim of key 'key-0'" in ver.out, ver.out


def test_a_signed_store_checks_the_remote_receipts_signature(tmp_path: Path,
                                                            cluster: tuple[GitServer, Cluster]) -> None:
    """One signers list on several machines: a signed receipt replays, the same unsigned is refused there."""
    from receipts.signing import SIGNERS_FILE

    _server, c = cluster
    a, b, unsigned = c.machines
    d = tmp_path / "machine3"
    subprocess.run(["git", "clone", "-q", c.url, str(d)], check=True, capture_output=True)
    init = run_cli("keys", "init", "--repo", str(a), "--json")
    assert init.code == 0, init.out + init.err
    for m in (b, d):  # the same signers list (and, HOME being shared here, the same private key)
        (m / ".git" / "oncepatch").mkdir(parents=True, exist_ok=True)
        (m / ".git" / "oncepatch" / SIGNERS_FILE).write_bytes(
            (a / ".git" / "oncepatch" / SIGNERS_FILE).read_bytes())
    assert cli_apply(a, 0).returncode == 0
    h = key_hash("key-0")
    signed = json.loads(remote_git(c, "cat-file", "blob", f"refs/oncepatch/receipts/{h}:receipt.json"))
    assert signed.get("signature"), signed
    genuine = cli_apply(b, 0)
    assert genuine.returncode == 0 and json.loads(genuine.stdout)["replayed"] is True, genuine.stdout
    # The same receipt, its signature dropped (digest recomputed): a store that signs refuses it.
    _forge_remote_receipt(c, "key-0", updated_at=signed["updated_at"])
    refused = cli_apply(d, 0)
    assert refused.returncode == 6, refused.stdout
    assert json.loads(refused.stdout)["error"]["type"] == "corrupt_receipt"
    assert _receipt_of(d, "key-0") is None
    # An unsigned store has only the receipt's own consistency to go by: it replays it.
    replayed = cli_apply(unsigned, 0)
    assert replayed.returncode == 0 and json.loads(replayed.stdout)["replayed"] is True


def _paused_apply(machine: Path, i: int) -> subprocess.Popen[bytes]:
    """``apply`` of key ``i`` stopped (SIGSTOP) right before its push; the caller continues it."""
    proc = subprocess.Popen(apply_argv(machine, i), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_with(ONCEPATCH_PAUSE_AT="before-push"))
    assert proc.stdin is not None
    proc.stdin.write(key_patch(i).encode())
    proc.stdin.close()
    proc.stdin = None
    _pid, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status
    return proc


def _plain_push(c: Cluster, machine: Path, path: str, text: str) -> str:
    """A person's commit pushed with plain git from ``machine``: the remote's branch moves under a call."""
    subprocess.run(["git", "-C", str(machine), "pull", "-q", "--ff-only"], check=True, capture_output=True)
    target = machine / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    for argv in (["add", "-A"], ["commit", "-q", "-m", "by hand"], ["push", "-q", "origin", "HEAD:main"]):
        subprocess.run(["git", "-C", str(machine), *argv], check=True, capture_output=True)
    return remote_git(c, "rev-parse", "main").strip()


def test_a_push_rejected_by_the_lease_is_restaged_on_the_new_head(cluster: tuple[GitServer, Cluster]) -> None:
    _server, c = cluster
    a, b, _c = c.machines
    proc = _paused_apply(a, 0)
    try:
        moved = _plain_push(c, b, "elsewhere.txt", "a person's change\n")
        os.kill(proc.pid, signal.SIGCONT)
        out, _err = proc.communicate(timeout=120)
    finally:
        _reap([proc])
    assert proc.returncode == 0, out
    doc = json.loads(out)
    assert doc["remote"]["restages"] == 1 and doc["replayed"] is False
    assert remote_git(c, "rev-parse", "main").strip() == doc["commit"]
    assert remote_git(c, "rev-parse", f"{doc['commit']}^").strip() == moved  # on top of the person's commit
    assert remote_git(c, "show", "main:elsewhere.txt") == "a person's change\n"
    verify_all(c)


def test_a_lease_lost_to_an_overlapping_change_is_a_conflict(cluster: tuple[GitServer, Cluster]) -> None:
    _server, c = cluster
    a, b, _c = c.machines
    proc = _paused_apply(a, 0)
    try:
        shared = (b / "shared.txt").read_text().replace("line 5\n", "line 5 rewritten by hand\n")
        moved = _plain_push(c, b, "shared.txt", shared)
        os.kill(proc.pid, signal.SIGCONT)
        out, _err = proc.communicate(timeout=120)
    finally:
        _reap([proc])
    assert proc.returncode == 4, out  # rejected, as a local conflict: nothing changed
    err = json.loads(out)["error"]
    assert (err["type"], err["effect_status"], err["retryable"]) == ("conflict", "not_applied", True)
    assert remote_git(c, "rev-parse", "main").strip() == moved
    assert remote_ref(c, f"refs/oncepatch/keys/{key_hash('key-0')}") is None
    receipt = _receipt_of(a, "key-0")
    assert receipt is not None and receipt["status"] == "rejected"
    verify_all(c)


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_client_api_takes_remote_and_a_local_call_stays_local(cluster: tuple[GitServer, Cluster]) -> None:
    """``Client.apply(remote=...)`` claims on the remote; the same clone's call without it is a local call."""
    import patcher

    _server, c = cluster
    a = c.machines[0]
    before = remote_git(c, "rev-parse", "main").strip()
    with patcher.Client(str(a), server="never") as client:
        res = client.apply(key_patch(0), key="key-0", remote="origin")
        assert res.remote is not None and res.remote["name"] == "origin" and not res.replayed
        assert remote_git(c, "rev-parse", "main").strip() == res.commit
        local = client.apply(key_patch(1), key="key-1")  # no remote, no oncepatch.remote: this clone only
        assert local.remote is None
    assert remote_git(c, "rev-parse", "main").strip() == res.commit != before
    assert subprocess.run(["git", "-C", str(a), "rev-parse", "main"], capture_output=True,
                          check=True).stdout.decode().strip() == local.commit


def test_a_call_naming_no_remote_pays_no_git_process_nor_subprocess_import() -> None:
    """Remote mode's face is on every call's path (a replay's too): it reads the config file, no more."""
    code = "import sys, patcher.protocol; sys.exit('subprocess' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], env=env_with(), capture_output=True, check=False)
    assert res.returncode == 0, res.stderr


def test_verify_says_the_remote_could_not_be_reached_not_that_a_receipt_is_wrong(
        cluster: tuple[GitServer, Cluster]) -> None:
    """``verify`` with the server down: a check not made (exit 5, ``kind: unreachable``), not a corrupt receipt."""
    server, c = cluster
    a = c.machines[0]
    assert cli_apply(a, 0).returncode == 0
    verify_all(c)
    server.stop()
    ver = run_cli("verify", "--json", "--repo", str(a), "--grace", "0")
    assert ver.code == 5, ver.out + ver.err
    failures = ver.json["failures"]
    assert ver.json["ok"] is False and len(failures) == 1, failures
    assert failures[0]["kind"] == "unreachable" and failures[0]["key"] == "key-0"
    reason = failures[0]["reason"]
    assert "remote 'origin'" in reason and "could not be reached" in reason and "nothing was found wrong" in reason
    assert "corrupt" not in reason
    text = run_cli("verify", "--repo", str(a), "--grace", "0")
    assert text.code == 5 and "verification incomplete" in text.out and "could not be reached" in text.out
    assert "verification failed" not in text.out and "run 'oncepatch verify' again" in text.err
    server.start()  # the same port, held while down
    try:
        verify_all(c)
    finally:
        server.stop()


def test_a_push_the_server_finishes_after_recover_settled_it_rejected(tmp_path: Path,
                                                                      cluster: tuple[GitServer, Cluster]) -> None:
    """docs/REMOTE.md, "Limits": the client killed during its push, the server lands the push after ``recover``.

    The push waits in the server's pre-receive hook while the client is
    killed and ``recover`` settles the call ``rejected`` (the key is not
    claimed yet); then the hook lets the push through (its post-receive hook
    says when the refs moved).  ``verify`` then fails, naming the key and what
    to do; ``recover`` leaves the settled receipt alone; the same call again
    answers from the remote and records ``committed``.
    """
    _server, c = cluster
    a = c.machines[0]
    ready, go, landed = tmp_path / "hook-ready", tmp_path / "hook-go", tmp_path / "hook-landed"
    for fifo in (ready, go, landed):
        os.mkfifo(fifo)
    hooks = c.server_repo / "hooks"
    (hooks / "pre-receive").write_text(f"#!/bin/sh\ncat >/dev/null\necho reached > '{ready}'\nread x < '{go}'\n")
    (hooks / "post-receive").write_text(f"#!/bin/sh\ncat >/dev/null\necho landed > '{landed}'\n")
    for hook in ("pre-receive", "post-receive"):
        (hooks / hook).chmod(0o755)
    before = remote_git(c, "rev-parse", "main").strip()
    proc = subprocess.Popen(apply_argv(a, 0), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_with())
    released = False
    try:
        assert proc.stdin is not None
        proc.stdin.write(key_patch(0).encode())
        proc.stdin.close()
        proc.stdin = None
        with open(ready) as fh:  # blocks until the push's pack is in and the hook runs
            assert fh.read().strip() == "reached"
        proc.kill()  # kill -9 of the client; its 'git push' child lives on, waiting for the server
        proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        assert _receipt_of(a, "key-0")["status"] == "prepared"  # type: ignore[index]
        rec = run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0")
        assert rec.code == 0, rec.out + rec.err
        receipt = _receipt_of(a, "key-0")
        assert receipt is not None and receipt["status"] == "rejected" and receipt["retryable"]
        verify_all(c)  # nothing claimed on the remote yet: the rejected receipt is the truth so far
        with open(go, "w") as fh:  # the hook lets the push through
            fh.write("go\n")
        released = True
        with open(landed) as fh:  # blocks until the remote's refs moved (its post-receive hook)
            assert fh.read().strip() == "landed"
    finally:
        if not released:
            with open(go, "w") as fh:
                fh.write("go\n")
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    h = key_hash("key-0")
    claimed = remote_ref(c, f"refs/oncepatch/keys/{h}")
    assert claimed == receipt["candidate"] == remote_git(c, "rev-parse", "main").strip() != before
    # verify: a failure naming the key, the remote's key ref and what to do.
    ver = run_cli("verify", "--json", "--repo", str(a), "--grace", "0")
    assert ver.code == 6, ver.out + ver.err
    [failure] = ver.json["failures"]
    assert failure["key"] == "key-0" and "kind" not in failure
    assert "landed on remote 'origin' after this receipt was settled rejected" in failure["reason"]
    assert f"refs/oncepatch/keys/{h}" in failure["reason"] and "oncepatch recover" in failure["reason"]
    assert "send the same call again" in failure["reason"]
    # recover does not reopen a settled receipt (docs/REMOTE.md says so): it stays rejected.
    rec = run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0")
    assert rec.code == 0 and rec.json["rows"] == [], rec.out
    assert _receipt_of(a, "key-0")["status"] == "rejected"  # type: ignore[index]
    # The same call again answers from the remote: committed, the remote's commit, nothing pushed.
    for hook in ("pre-receive", "post-receive"):
        (hooks / hook).unlink()
    again = cli_apply(a, 0)
    assert again.returncode == 0, again.stdout
    doc = json.loads(again.stdout)
    assert doc["replayed"] is True and doc["commit"] == claimed
    assert remote_commits_with(c, "key-0") == [claimed]
    verify_all(c)
def test_a_re_pointed_remote_neither_settles_nor_vouches(cluster: tuple[GitServer, Cluster]) -> None:
    """recover and verify ask the URL the receipt recorded, never whatever the remote's name reaches today."""
    server, c = cluster
    a = c.machines[0]
    srv = c.server_repo.parent
    # Another repository behind the same server, as the remote was before the calls: no claims.
    subprocess.run(["git", "clone", "-q", "--mirror", str(c.server_repo), str(srv / "other.git")], check=True)
    assert cli_apply(a, 1).returncode == 0
    crashed = cli_apply(a, 0, ONCEPATCH_CRASH_AT="after-push")
    assert crashed.returncode == 137, crashed.stderr
    # And a copy of the remote as it is now: every claim there, but not the remote the receipts name.
    subprocess.run(["git", "clone", "-q", "--mirror", str(c.server_repo), str(srv / "copy.git")], check=True)

    def origin(url: str) -> None:
        subprocess.run(["git", "-C", str(a), "remote", "set-url", "origin", url], check=True)

    origin(server.url("other.git"))
    rec = run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0")
    assert rec.code != 0, rec.out + rec.err
    assert "remote_repointed" in rec.out + rec.err and c.url in rec.out + rec.err
    receipt = _receipt_of(a, "key-0")
    assert receipt is not None and receipt["status"] in ("prepared", "unknown"), receipt  # not settled 'rejected'
    ver = run_cli("verify", "--json", "--repo", str(a), "--grace", "0")
    assert ver.code == 6 and "not checked against another repository" in ver.out, ver.out + ver.err
    # Back to the recorded URL: the claim is found there and settled.
    origin(c.url)
    rec = run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    assert _receipt_of(a, "key-0")["status"] == "committed"  # type: ignore[index]
    assert run_cli("verify", "--json", "--repo", str(a), "--grace", "0").code == 0
    # A copy holding the same claims is still another repository: verify does not vouch from it.
    origin(server.url("copy.git"))
    ver = run_cli("verify", "--json", "--repo", str(a), "--grace", "0")
    assert ver.code == 6 and "not checked against another repository" in ver.out, ver.out + ver.err


def test_revert_of_a_remote_mode_key_goes_through_its_remote(cluster: tuple[GitServer, Cluster]) -> None:
    """``revert`` carries the original's remote over: the undo lands on the remote, once; a re-pointed one refuses."""
    server, c = cluster
    a, b = c.machines[0], c.machines[1]
    before = remote_git(c, "rev-parse", "main^{tree}").strip()
    assert cli_apply(a, 1).returncode == 0
    local_main = subprocess.run(["git", "-C", str(a), "rev-parse", "main"], capture_output=True,
                                check=True).stdout.decode().strip()
    srv = c.server_repo.parent
    subprocess.run(["git", "clone", "-q", "--mirror", str(c.server_repo), str(srv / "copy.git")], check=True)
    subprocess.run(["git", "-C", str(a), "remote", "set-url", "origin", server.url("copy.git")], check=True)
    refused = run_cli("revert", "key-1", "--key", "undo-1", "--repo", str(a), "--json")
    assert refused.code == 2 and c.url in refused.json["error"]["message"], refused.out + refused.err
    subprocess.run(["git", "-C", str(a), "remote", "set-url", "origin", c.url], check=True)
    r = run_cli("revert", "key-1", "--key", "undo-1", "--repo", str(a), "--json")
    assert r.code == 0, r.out + r.err
    assert r.json["compensates"] == "key-1" and r.json["remote"]["name"] == "origin"
    assert remote_git(c, "log", "-1", "--format=%s", "main").strip() == "Revert key-1"
    assert remote_git(c, "rev-parse", "main^{tree}").strip() == before
    assert remote_ref(c, f"refs/oncepatch/keys/{key_hash('undo-1')}") == r.json["commit"]
    # Remote mode moves no local branch; the same revert from another machine is a replay from the remote
    # only where that machine has the original's receipt: it has not, so it is refused there (not_found).
    assert subprocess.run(["git", "-C", str(a), "rev-parse", "main"], capture_output=True,
                          check=True).stdout.decode().strip() == local_main
    assert run_cli("revert", "key-1", "--key", "undo-1", "--repo", str(b), "--json").code == 2
    again = run_cli("revert", "key-1", "--key", "undo-1", "--repo", str(a), "--json")
    assert again.code == 0 and again.json["replayed"] is True and again.json["commit"] == r.json["commit"]
    verify_all(c)


def test_drift_checks_a_remote_mode_receipt_on_its_tracking_branch(cluster: tuple[GitServer, Cluster]) -> None:
    """A remote-mode receipt is checked (not skipped as unreadable, which drift counts as exit 6)."""
    _server, c = cluster
    a = c.machines[0]
    assert cli_apply(a, 1).returncode == 0
    r = run_cli("drift", "--json", "--repo", str(a))
    assert r.code == 0, r.out + r.err
    (row,) = r.json["receipts"]
    assert row["key"] == "key-1" and row["state"] == "unchanged" and row["branch"] == "refs/remotes/origin/main"
    assert r.json["unchecked"] == 0


def _clone_state(machine: Path) -> dict[str, bytes]:
    """The clone's worktree, index, HEAD and local branches, byte for byte (its store and caches aside)."""
    state = {str(p.relative_to(machine)): p.read_bytes() for p in machine.rglob("*")
             if p.is_file() and ".git" not in p.relative_to(machine).parts}
    state[".git/index"] = (machine / ".git" / "index").read_bytes()
    state[".git/HEAD"] = (machine / ".git" / "HEAD").read_bytes()
    state["refs/heads"] = subprocess.run(["git", "-C", str(machine), "for-each-ref", "refs/heads"],
                                         capture_output=True, check=True).stdout
    return state


@pytest.mark.parametrize("refusal", ["hook", "stale-lock"])
def test_a_push_the_server_refuses_is_remote_rejected_at_once(refusal: str, tmp_path: Path,
                                                               cluster: tuple[GitServer, Cluster]) -> None:
    """A pre-receive hook that declines, or a lock a crashed push left on the server: no lease was lost.

    Nothing moved there, so a re-stage would be refused again: the call stops after the one push,
    says what the server said, and claims no moved branch; the key stays open.
    """
    _server, c = cluster
    a = c.machines[0]
    before = remote_git(c, "rev-parse", "main").strip()
    pushes = tmp_path / "pushes"
    hook = c.server_repo / "hooks" / "pre-receive"
    lock = c.server_repo / "refs" / "heads" / "main.lock"
    if refusal == "hook":
        hook.write_text(f"#!/bin/sh\ncat >/dev/null\necho push >> '{pushes}'\n"
                        f"echo 'branch frozen for the release' >&2\nexit 1\n")
        hook.chmod(0o755)
    else:
        lock.write_text(before + "\n")
    local = _clone_state(a)
    res = cli_apply(a, 0)
    assert res.returncode == 4, res.stdout
    err = json.loads(res.stdout)["error"]
    assert (err["type"], err["effect_status"], err["retryable"]) == ("remote_rejected", "not_applied", True)
    assert "moved" not in err["message"]
    assert ("branch frozen for the release" if refusal == "hook" else "main.lock") in err["message"]
    if refusal == "hook":
        assert pushes.read_text() == "push\n"  # one push, not one per round
    assert remote_git(c, "rev-parse", "main").strip() == before
    assert remote_ref(c, f"refs/oncepatch/keys/{key_hash('key-0')}") is None
    assert _clone_state(a) == local
    receipt = _receipt_of(a, "key-0")
    assert receipt is not None and receipt["status"] == "rejected" and receipt["retryable"]
    verify_all(c)
    # The server accepts again: the same call lands, once.
    hook.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    again = cli_apply(a, 0)
    assert again.returncode == 0, again.stdout
    assert remote_commits_with(c, "key-0") == [json.loads(again.stdout)["commit"]]
    verify_all(c)


@pytest.mark.parametrize("when", ["from-the-start", "after-the-push"])
def test_a_busy_remote_tracking_ref_does_not_fail_the_call(when: str, cluster: tuple[GitServer, Cluster]) -> None:
    """``refs/remotes/origin/main`` locked by another git of the clone (a person's ``git fetch``, or
    another call's fetch: calls of different keys in one clone run at once).

    The call reads the remote's head from a fetch of its own and only moves the tracking ref when it
    can: before, a lock held during its fetch made it ``remote_unreachable``, and one held when the
    local refs followed a landed push made it end ``applied`` with an error, ``recover`` needed.
    """
    _server, c = cluster
    a = c.machines[0]
    lock = a / ".git" / "refs" / "remotes" / "origin" / "main.lock"
    tracking_before = subprocess.run(["git", "-C", str(a), "rev-parse", "refs/remotes/origin/main"],
                                     capture_output=True, check=True).stdout.decode().strip()
    if when == "from-the-start":
        lock.write_text(tracking_before + "\n")
        res = cli_apply(a, 0)
        out, code = res.stdout, res.returncode
    else:
        proc = subprocess.Popen(apply_argv(a, 0), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env_with(ONCEPATCH_PAUSE_AT="after-push"))
        try:
            assert proc.stdin is not None
            proc.stdin.write(key_patch(0).encode())
            proc.stdin.close()
            proc.stdin = None
            _pid, status = os.waitpid(proc.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), status
            lock.write_text(tracking_before + "\n")
            os.kill(proc.pid, signal.SIGCONT)
            out, _err = proc.communicate(timeout=120)
            code = proc.returncode
        finally:
            _reap([proc])
    assert code == 0, out
    doc = json.loads(out)
    assert doc["replayed"] is False and remote_commits_with(c, "key-0") == [doc["commit"]]
    assert _receipt_of(a, "key-0")["status"] == "committed"  # type: ignore[index]
    assert lock.read_text() == tracking_before + "\n"  # another's lock: never taken over nor removed
    lock.unlink()
    verify_all(c)
    again = cli_apply(a, 0)  # the tracking ref follows on the next call that can take it
    assert again.returncode == 0 and json.loads(again.stdout)["replayed"] is True
    assert cli_apply(a, 1).returncode == 0
    assert subprocess.run(["git", "-C", str(a), "rev-parse", "refs/remotes/origin/main"], capture_output=True,
                          check=True).stdout.decode().strip() == remote_git(c, "rev-parse", "main").strip()


def test_a_call_rejected_after_staging_keeps_its_remote_for_verify(cluster: tuple[GitServer, Cluster]) -> None:
    """A remote-mode receipt rejected in the call (here: the push refused) still names its remote and clone.

    Without them verify could not check the rejected receipt against the remote (its staged
    candidate must not have landed there), and passed with the remote out of reach.
    """
    server, c = cluster
    a = c.machines[0]
    hook = c.server_repo / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\ncat >/dev/null\nexit 1\n")
    hook.chmod(0o755)
    res = cli_apply(a, 0)
    assert res.returncode == 4, res.stdout
    receipt = _receipt_of(a, "key-0")
    assert receipt is not None and receipt["status"] == "rejected" and receipt["candidate"]
    named = receipt["remote"]
    assert (named["name"], named["url"], named["local"]) == ("origin", c.url, str(a))
    verify_all(c)
    server.stop()
    ver = run_cli("verify", "--json", "--repo", str(a), "--grace", "0")
    assert ver.code == 5, ver.out  # checked against the remote: it could not be reached
    assert [f["kind"] for f in ver.json["failures"]] == ["unreachable"]


def test_status_and_recover_with_the_remote_down_say_not_checked_not_corrupt(
        cluster: tuple[GitServer, Cluster]) -> None:
    """As verify does (exit 5): a committed receipt not checked, its remote out of reach, is not a corrupt one."""
    server, c = cluster
    a = c.machines[0]
    assert cli_apply(a, 0).returncode == 0
    server.stop()
    st = run_cli("status", "--json", "--repo", str(a), "--", "key-0")
    assert st.code == 5, st.out
    err = st.json["error"]
    assert (err["type"], err["retryable"]) == ("io_error", True) and "could not be reached" in err["message"]
    rec = run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0")
    assert rec.code == 5 and rec.json["corrupt"] == [], rec.out
    assert [s["key"] for s in rec.json["skipped"]] == ["key-0"]
    server.start()
    try:
        assert run_cli("status", "--json", "--repo", str(a), "--", "key-0").code == 0
        assert run_cli("recover", "--json", "--repo", str(a), "--tmp-age", "0").code == 0
        verify_all(c)
    finally:
        server.stop()

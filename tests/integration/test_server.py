"""``oncepatch serve`` and the CLI as its thin client: same answers, and a lifecycle that never lies.

Every call here goes through real processes: a server started with
``serve --background``, clients run as ``python -m patcher.cli``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, start_server
from maintenance_driver import tmp_leftovers, worktree_problems
from torture_driver import commits_with_trailer

from patcher import connect

PATCH = b"--- a/src/app.py\n+++ b/src/app.py\n@@ -6,3 +6,3 @@\n line 6\n-line 7\n+line seven\n line 8\n"
OTHER = b"--- a/src/app.py\n+++ b/src/app.py\n@@ -1,3 +1,3 @@\n line 1\n-line 2\n+line two\n line 3\n"
BAD = b"--- a/src/app.py\n+++ b/src/app.py\n@@ -1,3 +1,3 @@\n nope 1\n-nope 2\n+line two\n nope 3\n"
NEW = b"--- /dev/null\n+++ b/pkg/new.txt\n@@ -0,0 +1 @@\n+brand new\n"
FILES: dict[str, str | bytes] = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 21))}
#: Fixed dates: the same call in two repositories of the same content makes the same commit.
DATES = {"GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_DATE": "1700000000 +0000"}


class Server:
    def __init__(self, folder: Path, *extra: str) -> None:
        self.folder = folder
        self.pid = start_server(folder, "--idle", "120", *extra)
        self.env = {"ONCEPATCH_SERVER": "require", "ONCEPATCH_SERVER_DIR": str(folder)}

    def children(self) -> list[int]:
        return children_of(self.pid)

    def stop(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # its own session: the server, its spare, its calls
        except ProcessLookupError:
            pass


@pytest.fixture
def server(short_tmp: Path) -> Iterator[Server]:
    srv = Server(short_tmp / "srv")
    yield srv
    srv.stop()


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def wait_for(what: Callable[[], Any], message: str, deadline: float = 60.0) -> Any:
    """Poll ``what`` until it is true (an event another process makes happen), at most ``deadline`` s."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {message}")


def cwd_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def normal(doc: Any, repo: Path) -> Any:
    """A document without what differs between two runs: times, owners, digests over them, the repo path."""
    if isinstance(doc, dict):
        return {k: normal(v, repo) for k, v in doc.items()
                if k not in {"at", "created_at", "updated_at", "owner", "receipt_sha256", "prev"}}
    if isinstance(doc, list):
        return [normal(v, repo) for v in doc]
    if isinstance(doc, str):
        return doc.replace(str(repo), "<repo>")
    return doc


def test_the_answers_are_the_same_through_the_server(tmp_path: Path, server: Server,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DATES.items():  # the initial commits too
        monkeypatch.setenv(name, value)
    calls: list[tuple[tuple[str, ...], bytes | None]] = [
        (("apply", "--json", "-", "--key", "k1"), PATCH),
        (("apply", "--json", "-", "--key", "k1"), PATCH),  # replay
        (("apply", "--json", "-", "--key", "k1"), OTHER),  # conflict: exit 3
        (("apply", "--json", "-", "--key", "k2"), BAD),  # rejected: exit 4
        (("apply", "-", "--key", "k3"), NEW),  # human text
        (("apply", "--json", "patch.diff"), None),  # a file, relative to the working folder
        (("apply", "--json", "missing.diff"), None),  # unreadable: exit 2
        (("status", "--json", "k1"), None),
        (("status", "k1"), None),
        (("status", "--json", "nope"), None),
        (("log", "--json"), None),
        (("verify", "--json"), None),
        (("recover", "--json"), None),
        (("apply", "--json", "--bogus"), None),  # usage: exit 2
    ]
    runs = {}
    heads = {}
    for name, env in (("in-process", {"ONCEPATCH_SERVER": "never"}), ("server", server.env)):
        # One path for both (the repository's path is part of every call_id): the first moves aside.
        repo = make_repo(tmp_path / "repo", FILES)
        (repo.path / "patch.diff").write_bytes(OTHER)
        runs[name] = [run_cli(*argv, cwd=repo.path, input=data, env=env)
                      for argv, data in calls]
        heads[name] = repo.head()
        (tmp_path / "repo").rename(tmp_path / name)
    ra, rb = runs["in-process"], runs["server"]
    for (argv, _), x, y in zip(calls, ra, rb):
        assert x.code == y.code, (argv, x, y)
        if "--json" in argv:
            assert normal(x.json, tmp_path) == normal(y.json, tmp_path), argv
        else:
            assert x.out.split("updated")[0] == y.out.split("updated")[0], argv  # (status: a time last)
    assert [x.code for x in ra] == [0, 0, 3, 4, 0, 0, 2, 0, 0, 2, 0, 0, 0, 2]
    assert heads["in-process"] == heads["server"]  # the same commits, byte for byte
    # Without the server, require refuses: the answers above came through it.
    server.stop()
    res = run_cli("status", "--json", "k1", cwd=tmp_path / "server", env=server.env)
    assert res.code == 5 and res.json["error"]["type"] == "io_error", res


def test_the_call_takes_the_callers_identity_umask_and_folder(tmp_path: Path, server: Server) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    env = {**server.env, "GIT_AUTHOR_NAME": "Caller Person", "GIT_AUTHOR_EMAIL": "caller@example.com"}
    res = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", "--json", "-"], input=NEW,
                         cwd=repo.path / "src", env={**os.environ, **env}, capture_output=True,
                         preexec_fn=lambda: os.umask(0o077), check=False)
    assert res.returncode == 0, res.stderr
    assert repo.git("log", "-1", "--format=%an <%ae>").strip() == "Caller Person <caller@example.com>"
    assert (repo.path / "pkg/new.txt").stat().st_mode & 0o777 == 0o600
    # The server's own environment (another author) did not leak into the next call.
    res = run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path, env=server.env)
    assert res.code == 0
    assert repo.git("log", "-1", "--format=%an").strip() == "Test Author"


def test_a_server_of_another_version_is_never_asked(tmp_path: Path, server: Server) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    other = {"ONCEPATCH_MAX_PATCH_BYTES": str(1 << 20)}  # an import-time limit: part of the version
    res = run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path, env={**server.env, **other})
    assert res.code == 5 and res.json["error"]["effect_status"] == "not_started", res
    assert repo.count() == 1
    res = run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path,
                  env={**server.env, **other, "ONCEPATCH_SERVER": "auto"})
    assert res.code == 0 and res.json["status"] == "committed"  # in process
    # A request carrying another token is refused before anything runs.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(connect.socket_path(str(server.folder), connect.version_token()))
        payload = b"\0".join([connect.PROTOCOL, b"0" * 16, b"18", b"1", b"status"])
        socket.send_fds(s, [len(payload).to_bytes(4, "big") + payload], [0, 1, 2, 0])
        assert s.makefile("rb").readline().startswith(b"Ranother version")


def test_a_stale_socket_is_passed_over_then_replaced(tmp_path: Path, short_tmp: Path) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    folder = short_tmp / "srv"
    folder.mkdir(mode=0o700)
    path = connect.socket_path(str(folder), connect.version_token())
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens: a server that was killed
    env = {"ONCEPATCH_SERVER_DIR": str(folder)}
    res = run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path, env={**env, "ONCEPATCH_SERVER": "auto"})
    assert res.code == 0 and res.json["status"] == "committed"
    res = run_cli("status", "--json", res.json["key"], cwd=repo.path, env={**env, "ONCEPATCH_SERVER": "require"})
    assert res.code == 5 and res.json["error"]["type"] == "io_error"
    srv = Server(folder)
    try:
        res = run_cli("log", "--json", cwd=repo.path, env=srv.env)
        assert res.code == 0 and len(res.json["events"]) == 2
    finally:
        srv.stop()


def test_two_servers_racing_to_start_leave_one(tmp_path: Path, short_tmp: Path) -> None:
    folder = short_tmp / "srv"
    argv = [sys.executable, "-m", "patcher.cli", "serve", "--background", "--idle", "120", "--socket-dir", str(folder)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    said = sorted(p.communicate(timeout=120)[0].decode().split() for p in procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert [words[0] for words in said] == ["ready", "running"], said  # the lock lets one listen
    pid = int(said[0][said[0].index("pid") + 1])
    repo = make_repo(tmp_path / "repo", FILES)
    try:
        res = run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path,
                      env={"ONCEPATCH_SERVER": "require", "ONCEPATCH_SERVER_DIR": str(folder)})
        assert res.code == 0, res
    finally:
        os.killpg(pid, signal.SIGKILL)


def test_a_full_backlog_runs_the_call_here(tmp_path: Path, short_tmp: Path) -> None:
    srv = Server(short_tmp / "srv", "--backlog", "1")
    repo = make_repo(tmp_path / "repo", FILES)
    fillers: list[socket.socket] = []
    os.kill(srv.pid, signal.SIGSTOP)  # listening, accepting nothing
    try:
        path = connect.socket_path(str(srv.folder), connect.version_token())
        while True:
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            fillers.append(s)
            assert len(fillers) < 64
        res = run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path, env={**srv.env, "ONCEPATCH_SERVER": "auto"})
        assert res.code == 0 and res.json["status"] == "committed"  # in process, at once
        res = run_cli("status", "--json", res.json["key"], cwd=repo.path, env=srv.env)
        assert res.code == 5 and res.json["error"]["effect_status"] == "not_started"
    finally:
        os.kill(srv.pid, signal.SIGCONT)
        for s in fillers:
            s.close()
    # Served again once it runs: it has the fillers in its backlog to accept first, and until it has, a
    # call finds the backlog full (not started, retryable: nothing ran). The loaded machine decides when.
    def served() -> Any:
        r = run_cli("log", "--json", cwd=repo.path, env=srv.env)
        if r.code == 5 and r.json["error"]["effect_status"] == "not_started" and r.json["error"]["retryable"]:
            return None
        return r

    res = wait_for(served, "the resumed server to accept calls again")
    assert res.code == 0, res
    srv.stop()


@pytest.mark.parametrize("whole", [False, True], ids=["worker", "whole-server"])
@pytest.mark.parametrize("point", ["after-stage", "after-prepare", "after-index-ahead", "after-worktree-ahead",
                                   "after-ref", "after-materialise", "before-receipt-replace"])
def test_a_call_process_killed_at_a_crash_point_ends_in_one_commit_or_none(
        tmp_path: Path, server: Server, point: str, whole: bool) -> None:
    """On the checked-out branch: the worker dies at the point (and with ``whole``, the server with all its
    processes right after: ``recover`` then runs in process); worktree, index and HEAD agree afterwards."""
    repo = make_repo(tmp_path / "repo", FILES)
    res = run_cli("apply", "--json", "-", "--key", "k", input=PATCH, cwd=repo.path,
                  env={**server.env, "ONCEPATCH_CRASH_AT": point})
    assert res.code == 137 and res.out == "", res  # as the process would have in process
    assert "recover" in res.err
    env = server.env
    if whole:
        server.stop()
        env = {"ONCEPATCH_SERVER": "never"}
    rec = run_cli("recover", "--json", "--tmp-age", "0", cwd=repo.path, env=env)
    assert rec.code == 0, rec
    status = run_cli("status", "--json", "k", cwd=repo.path, env=env)
    landed = point in ("after-ref", "after-materialise", "before-receipt-replace")
    if landed:
        assert status.json["receipt"]["status"] == "committed"
        assert len(commits_with_trailer(repo.path, status.json["receipt"]["call_id"])) == 1
    else:
        assert repo.count() == 1 and status.code in (0, 2)
    assert worktree_problems(repo.path) == [] and tmp_leftovers(repo.path) == []
    again = run_cli("apply", "--json", "-", "--key", "k", input=PATCH, cwd=repo.path, env=env)
    assert again.code == 0 and repo.count() == 2
    assert run_cli("verify", cwd=repo.path, env=env).code == 0
    assert worktree_problems(repo.path) == []
    assert "line seven" in (repo.path / "src/app.py").read_text()


def _hold_the_key(repo: Repo) -> subprocess.Popen[bytes]:
    """An in-process apply of key 'k' stopped after its prepare, holding the key's lock."""
    env = {**os.environ, "ONCEPATCH_SERVER": "never", "ONCEPATCH_PAUSE_AT": "after-prepare"}
    holder = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", "--json", "-", "--key", "k"],
                              cwd=repo.path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert holder.stdin is not None
    holder.stdin.write(PATCH)
    holder.stdin.close()
    holder.stdin = None
    wait_for(lambda: _state(holder.pid) == "T", "the holder to stop after its prepare")
    return holder


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def _waiting_call(server: Server, repo: Repo) -> int:
    """The server's process running a call in ``repo``, waiting for the key's lock: it took the caller's
    working folder and sleeps between its tries of the lock, which only a call past its answer ``A``
    (the call runs) does."""
    def sleeping(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/wchan") as fh:
                return "nanosleep" in fh.read()
        except OSError:
            return False

    return int(wait_for(lambda: next((p for p in server.children()
                                      if cwd_of(p) == str(repo.path) and sleeping(p)), None),
                        "the server's call to wait for the key's lock"))


def _client(repo: Repo, env: dict[str, str]) -> subprocess.Popen[bytes]:
    client = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", "--json", "-", "--key", "k",
                               "--lock-timeout", "120"], cwd=repo.path, env={**os.environ, **env},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert client.stdin is not None
    client.stdin.write(PATCH)
    client.stdin.close()
    client.stdin = None  # (communicate() must not flush it)
    return client


def test_the_server_killed_while_a_client_waits_still_answers_truly(tmp_path: Path, server: Server) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    holder = _hold_the_key(repo)
    client = _client(repo, server.env)
    call = _waiting_call(server, repo)
    os.kill(server.pid, signal.SIGKILL)  # the listening process: the call's own process goes on
    os.kill(holder.pid, signal.SIGCONT)
    assert holder.wait(timeout=120) == 0
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err
    import json

    doc = json.loads(out)
    assert doc["replayed"] is True and doc["commit"] == repo.head() and repo.count() == 2
    wait_for(lambda: gone(call), "the call's process to end")


def test_the_whole_server_killed_mid_call_answers_unknown_then_recover_settles(
        tmp_path: Path, server: Server) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    holder = _hold_the_key(repo)
    client = _client(repo, server.env)
    call = _waiting_call(server, repo)
    os.killpg(server.pid, signal.SIGKILL)  # the server, its spare and the call's process
    out, err = client.communicate(timeout=120)
    import json

    doc = json.loads(out)
    assert client.returncode == 5, err
    assert doc["error"]["effect_status"] == "unknown" and doc["error"]["next_action"] == "recover"
    wait_for(lambda: gone(call), "the call's process to end")
    os.kill(holder.pid, signal.SIGCONT)
    assert holder.wait(timeout=120) == 0
    rec = run_cli("recover", "--json", "--tmp-age", "0", cwd=repo.path)
    assert rec.code == 0
    assert repo.count() == 2  # one commit for the key
    assert run_cli("verify", cwd=repo.path).code == 0


def test_a_client_killed_mid_call_does_not_stop_the_call(tmp_path: Path, server: Server) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    holder = _hold_the_key(repo)
    client = _client(repo, {**server.env})
    call = _waiting_call(server, repo)
    client.kill()
    client.wait()
    os.kill(holder.pid, signal.SIGCONT)
    assert holder.wait(timeout=120) == 0
    # It finished its call (a replay): its worker, which stays for the next call, left the caller's folder.
    wait_for(lambda: cwd_of(call) != str(repo.path), "the call to end")
    status = run_cli("status", "--json", "k", cwd=repo.path, env=server.env)
    assert status.code == 0 and status.json["receipt"]["status"] == "committed"
    assert repo.count() == 2
    assert run_cli("verify", cwd=repo.path, env=server.env).code == 0


def test_a_call_with_its_standard_input_closed_is_answered_not_left_reading_the_socket(
        tmp_path: Path, server: Server) -> None:
    """``oncepatch apply - <&-`` with a server: the client's socket took descriptor 0 and was passed as stdin.

    The call then read its patch from its own connection and never ended; it
    now runs in process, which refuses a closed standard input (exit 2).
    """
    repo = make_repo(tmp_path / "repo", FILES)
    before = repo.git("rev-parse", "HEAD").strip()
    command = Path(sys.executable).parent / "oncepatch"
    res = subprocess.run([str(command), "apply", "-", "--json", "--key", "k"], cwd=repo.path,
                         env={**os.environ, **server.env}, stdin=None, capture_output=True, check=False,
                         timeout=120, preexec_fn=lambda: os.close(0))
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = json.loads(res.stdout)["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and "closed" in err["message"], err
    assert repo.git("rev-parse", "HEAD").strip() == before and repo.count() == 1


def test_an_idle_server_exits_and_takes_its_socket_away(short_tmp: Path) -> None:
    folder = short_tmp / "srv"
    pid = start_server(folder, "--idle", "0.5")
    path = connect.socket_path(str(folder), connect.version_token())
    assert os.path.exists(path) and os.stat(folder).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o600
    wait_for(lambda: gone(pid), "the idle server to exit")
    assert not os.path.exists(path)


def test_a_served_call_loads_only_the_thin_client(tmp_path: Path, server: Server) -> None:
    """The installed ``oncepatch`` command, through a server: the thin client's modules and no more.

    ``PYTHONPROFILEIMPORTTIME`` names every module the process imports, the
    launcher's own included: pip before 25.2 wrote launchers that import
    ``re`` (and ``re`` imports ``enum``); scripts/_setup.sh installs with a
    newer pip, whose launcher imports neither, and then neither may be
    imported (docs/DECISIONS.md).  The process ends without the interpreter's
    finalization, so the list is read from stderr, not from ``sys.modules``.
    """
    repo = make_repo(tmp_path / "repo", FILES)
    command = Path(sys.executable).parent / "oncepatch"
    launcher = command.read_text()
    assert launcher.startswith("#!")
    res = subprocess.run([str(command), "log", "--json"], cwd=repo.path,
                         env={**os.environ, **server.env, "PYTHONPROFILEIMPORTTIME": "1"},
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert '"events":[]' in res.stdout.replace(" ", "")
    mods = {line.rsplit("|", 1)[1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert {"patcher", "patcher.cli", "patcher.connect"} <= mods, mods
    heavy = {m for m in mods if m.split(".")[0] in {"pygit2", "cas", "receipts", "orjson", "filelock", "json",
                                                     "argparse", "typing", "dataclasses", "socket", "selectors",
                                                     "importlib", "warnings"}}
    assert not heavy and "patcher.cli.run" not in mods, heavy
    if "import re" not in launcher:  # a launcher from pip >= 25.2 (scripts/_setup.sh)
        assert not {"re", "enum"} & mods, mods


def test_a_served_call_ends_with_its_answer_flushed_and_its_status(tmp_path: Path, server: Server) -> None:
    """The client leaves without finalizing: what it wrote itself still arrives, and the server's status is its own."""
    repo = make_repo(tmp_path / "repo", FILES)
    command = Path(sys.executable).parent / "oncepatch"
    env = {**os.environ, **server.env}
    res = subprocess.run([str(command), "status", "nope", "--json"], cwd=repo.path, env=env,
                         capture_output=True, check=False)
    assert res.returncode == 2 and json.loads(res.stdout)["error"]["type"] == "not_found", res
    # A refusal the client answers itself (under require) is written by this process: flushed before it ends.
    bad = {**env, "ONCEPATCH_SERVER_DIR": str(tmp_path / "none")}
    res = subprocess.run([str(command), "status", "nope", "--json"], cwd=repo.path, env=bad,
                         capture_output=True, check=False)
    assert res.returncode == 5 and json.loads(res.stdout)["error"]["type"] == "io_error", res


def test_start_runs_this_call_here_and_starts_a_server_for_the_next(tmp_path: Path, short_tmp: Path) -> None:
    repo = make_repo(tmp_path / "repo", FILES)
    folder = short_tmp / "srv"
    env = {"ONCEPATCH_SERVER_DIR": str(folder)}
    res = run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path, env={**env, "ONCEPATCH_SERVER": "start"})
    assert res.code == 0 and res.json["status"] == "committed"  # in process: no server was running
    path = connect.socket_path(str(folder), connect.version_token())
    try:
        wait_for(lambda: os.path.exists(path), "the server started for the next call")
        res = run_cli("log", "--json", cwd=repo.path, env={**env, "ONCEPATCH_SERVER": "require"})
        assert res.code == 0 and len(res.json["events"]) == 2
    finally:
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    mine = f"ONCEPATCH_SERVER_DIR={folder}".encode() in fh.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    serving = fh.read().split(b"\0")[-2:-1] == [b"serve"]
            except OSError:
                continue
            try:
                if mine and serving and os.getpgid(pid) == pid:  # the server (its spare is in its group)
                    os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _api_and_mcp_calls(repo: Path) -> list[Any]:
    """The API client's and the MCP tool's answers to a fixed series of calls: results, or errors as raised."""
    from cas.errors import OncepatchError
    from patcher.api import Client
    from patcher.mcp_server import _Tools

    types = pytest.importorskip("mcp.types")
    out: list[Any] = []
    with Client(repo) as client:
        tools = _Tools(client, types, allow_other_repos=False)
        for key, patch in (("k1", PATCH), ("k1", PATCH), ("k1", OTHER), ("k2", BAD), ("--k4", OTHER)):
            try:
                res = client.apply(patch, key=key)
                out.append(("ok", res, res.to_json()))
            except OncepatchError as exc:
                out.append((type(exc).__name__, exc.exit_code, exc.envelope()))
        for key in ("k1", "--k4"):  # (a key that looks like an option stays a key through the server)
            receipt = client.status(key)
            out.append(("status", receipt.status, receipt.commit, receipt.key, receipt.call_id))
        for key, patch in (("k3", NEW), ("k3", NEW), ("k2", BAD)):
            res = tools.run("apply_patch", lambda: tools.apply_patch(patch.decode(), key, str(repo), None,
                                                                     "auto", None))
            out.append(("mcp", getattr(res, "is_error", None) if hasattr(res, "is_error") else res.isError,
                        getattr(res, "structured_content", None) if hasattr(res, "structured_content")
                        else res.structuredContent, res.content[0].text))
        out.append(("owner", client.status("k3").owner.get("pid")))
    return out


def test_the_api_client_and_the_mcp_tool_answer_the_same_through_the_server(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DATES.items():
        monkeypatch.setenv(name, value)
    runs, heads = {}, {}
    for name, env in (("in-process", {"ONCEPATCH_SERVER": "never"}), ("server", server.env)):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        repo = make_repo(tmp_path / "repo", FILES)  # one path for both: the first moves aside
        runs[name] = _api_and_mcp_calls(repo.path)
        heads[name] = repo.head()
        (tmp_path / "repo").rename(tmp_path / name)
    ra, rb = runs["in-process"], runs["server"]
    assert [x[0] for x in ra] == ["ok", "ok", "IdempotencyConflict", "ContextNotFound", "ok", "status", "status",
                                  "mcp", "mcp", "mcp", "owner"]
    for x, y in zip(ra[:-1], rb[:-1]):
        assert normal(list(x[1:]) if x[0] != "ok" else x[2], tmp_path) == \
            normal(list(y[1:]) if y[0] != "ok" else y[2], tmp_path), (x, y)
        if x[0] == "ok":  # the very ApplyResult, rebuilt from the server's envelope
            assert normal(json.loads(json.dumps(dataclasses.asdict(x[1]))), tmp_path) == \
                normal(json.loads(json.dumps(dataclasses.asdict(y[1]))), tmp_path)
    assert [x[1] for x in ra[7:10]] == [False, False, True]  # MCP: committed, replayed, the rejection as a tool error
    assert heads["in-process"] == heads["server"]  # the same commits, byte for byte
    # The server's call process wrote the receipts, not this one; and without it, require refuses.
    assert ra[-1][1] == os.getpid() and rb[-1][1] != os.getpid()
    server.stop()
    from cas.errors import OncepatchError
    from patcher.api import Client

    with pytest.raises(OncepatchError) as err, Client(tmp_path / "server") as client:
        client.apply(PATCH, key="k9")
    assert err.value.error_type == "io_error" and err.value.effect_status == "not_started"


def test_the_api_clients_recover_and_verify_go_through_the_server_with_the_same_answers(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    from cas.errors import OncepatchError
    from patcher.api import Client

    for name, value in DATES.items():
        monkeypatch.setenv(name, value)
    reports: dict[str, list[Any]] = {}
    for name, env in (("in-process", {"ONCEPATCH_SERVER": "never"}), ("server", server.env)):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        repo = make_repo(tmp_path / "repo", FILES)  # one path for both: the first moves aside
        # An orphan to settle: a call killed after its branch moved (in process either way).
        crashed = run_cli("apply", "--json", "-", "--key", "k", input=PATCH, cwd=repo.path,
                          env={"ONCEPATCH_SERVER": "never", "ONCEPATCH_CRASH_AT": "after-ref"})
        assert crashed.code == 137, crashed
        # server="require": an answer can only come from the server (or an error says there was none).
        with Client(repo.path, server="never" if name == "in-process" else "require") as client:
            plan = client.recover(dry_run=True, tmp_age=0)
            done = client.recover(tmp_age=0)
            checked = client.verify(grace=0)
        # The dead call's leftovers are named after its pid (and a random tail).
        text = re.sub(r"-[0-9]+-[0-9a-f]{8}\b", "-<pid>", json.dumps([plan.to_json(), done.to_json(), checked.to_json()]))
        reports[name] = [*json.loads(text), done.changed, checked.ok]
        (tmp_path / "repo").rename(tmp_path / name)
    ra, rb = reports["in-process"], reports["server"]
    assert ra[0]["rows"][0]["from"] == "prepared" and ra[1]["rows"][0]["to"] == "committed" and ra[4] is True
    assert normal(ra, tmp_path / "repo") == normal(rb, tmp_path / "repo")
    server.stop()  # without a server, require refuses both
    with Client(tmp_path / "server", server="require") as client:
        for call in (client.verify, client.recover):
            with pytest.raises(OncepatchError) as err:
                call()
            assert err.value.error_type == "io_error" and err.value.effect_status == "not_started"


def test_an_api_call_whose_server_process_dies_is_unknown_and_says_recover(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's call process killed after the ref moved: the API never guesses, and recover settles it."""
    from cas.errors import OncepatchError
    from patcher.api import Client

    repo = make_repo(tmp_path / "repo", FILES)
    for k, v in {**server.env, "ONCEPATCH_CRASH_AT": "after-ref"}.items():
        monkeypatch.setenv(k, v)
    with Client(repo.path) as client:
        before = repo.head()
        with pytest.raises(OncepatchError) as err:
            client.apply(PATCH, key="k")
        assert (err.value.error_type, err.value.effect_status, err.value.next_action) == \
            ("unknown", "unknown", "recover"), err.value.envelope()
        assert "137" in err.value.message and repo.head() != before  # it had landed: only its record is missing
        monkeypatch.delenv("ONCEPATCH_CRASH_AT")
        client.recover(repo=repo.path)
        assert client.status("k").status == "committed"
        assert client.apply(PATCH, key="k").replayed


def test_a_worker_keeps_its_repository_open_and_never_answers_from_stale_state(
        tmp_path: Path, server: Server) -> None:
    """One worker serves call after call (no process forked per call) and sees what git did in between."""
    repo = make_repo(tmp_path / "repo", FILES)
    assert run_cli("apply", "--json", "-", "--key", "k1", input=PATCH, cwd=repo.path, env=server.env).code == 0
    workers = set(server.children())  # the worker that ran it (idle again) and a spare
    # Between two calls: a commit made with git itself (its objects loose, the branch moved) ...
    repo.write("README", "hello from git\n")
    by_git = repo.commit_all("by git")
    res = run_cli("apply", "--json", "-", "--key", "k2", input=OTHER, cwd=repo.path, env=server.env)
    assert res.code == 0, res
    assert repo.git("rev-parse", res.json["commit"] + "^").strip() == by_git  # built on git's commit
    assert (repo.path / "README").read_text() == "hello from git\n"
    # ... then every object repacked into one new pack, the old packs and loose objects deleted, refs packed.
    repo.git("repack", "-a", "-d")
    repo.git("gc", "--prune=now", "--quiet")
    res = run_cli("apply", "--json", "-", "--key", "k3", input=NEW, cwd=repo.path, env=server.env)
    assert res.code == 0, res
    assert repo.count() == 5 and (repo.path / "pkg/new.txt").read_text() == "brand new\n"
    replay = run_cli("apply", "--json", "-", "--key", "k2", input=OTHER, cwd=repo.path, env=server.env)
    assert replay.code == 0 and replay.json["replayed"] is True
    assert set(server.children()) == workers  # the same processes served every call
    repo.git("fsck", "--strict")
    assert run_cli("verify", cwd=repo.path, env=server.env).code == 0


def test_the_servers_watcher_flags_a_call_killed_after_its_prepare(tmp_path: Path, short_tmp: Path) -> None:
    from patcher.cli.server import WATCH_LOG

    srv = Server(short_tmp / "srv", "--watch-grace", "0", "--watch-rescan", "3600")
    try:
        repo = make_repo(tmp_path / "repo", FILES)
        assert run_cli("apply", "--json", "-", "--key", "k1", input=PATCH, cwd=repo.path, env=srv.env).code == 0
        res = run_cli("apply", "--json", "-", "--key", "k2", input=OTHER, cwd=repo.path,
                      env={**srv.env, "ONCEPATCH_CRASH_AT": "after-prepare"})
        assert res.code == 137, res
        log = srv.folder / WATCH_LOG

        def flags() -> list[dict[str, Any]]:
            lines = log.read_text().splitlines() if log.exists() else []
            return [doc for doc in map(json.loads, lines) if doc.get("flag") == "orphan_prepared"]

        found = wait_for(flags, "the server's watcher to flag the orphan")
        assert [(f["key"], f["next_action"]) for f in found] == [("k2", "recover")]
        assert found[0]["store"] == str(repo.path / ".git" / "oncepatch")
        status = run_cli("status", "--json", "k2", cwd=repo.path, env=srv.env)
        assert status.json["receipt"]["status"] == "prepared"  # flagged only: recover settles it
        assert run_cli("recover", "--json", "--tmp-age", "0", cwd=repo.path, env=srv.env).code == 0
        assert run_cli("status", "--json", "k2", cwd=repo.path, env=srv.env).json["receipt"]["status"] != "prepared"
    finally:
        srv.stop()


def test_the_servers_watcher_asks_only_for_the_events_it_reads_and_runs_behind_the_calls(
        tmp_path: Path, server: Server) -> None:
    """No inotify event for an open or a close (a call opens the store's folders dozens of times); niced."""
    from patcher.cli.server import _WATCH_NICE

    repo = make_repo(tmp_path / "repo", FILES)
    assert run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path, env=server.env).code == 0
    watched = f"ino:{os.stat(repo.store / 'receipts').st_ino:x} "

    def watch_line() -> tuple[int, str] | None:
        for pid in server.children():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                        continue
                    with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                        lines = [line for line in fh if watched in line]
                except OSError:
                    continue
                if lines:
                    return pid, lines[0]
        return None

    pid, line = wait_for(watch_line, "the watcher to watch the store")
    mask = int(line.split("mask:")[1].split()[0], 16)
    in_access, in_close_write, in_close_nowrite, in_open, in_moved_to = 0x1, 0x8, 0x10, 0x20, 0x80
    assert mask & in_moved_to  # a receipt lands by a rename
    assert not mask & (in_access | in_close_write | in_close_nowrite | in_open)
    with open(f"/proc/{pid}/stat") as fh:
        nice = int(fh.read().rsplit(")", 1)[1].split()[16])
    assert nice == min(19, os.nice(0) + _WATCH_NICE)


def test_the_servers_watcher_watches_the_newest_stores_within_a_bound(tmp_path: Path, server: Server) -> None:
    """Each watched store costs an inotify instance (128 per user): the oldest watcher stops for a new one."""
    from patcher.cli.server import _WATCHING

    repos = [make_repo(tmp_path / f"repo{i}", FILES) for i in range(_WATCHING + 2)]
    for repo in repos:
        assert run_cli("apply", "--json", "-", input=PATCH, cwd=repo.path, env=server.env).code == 0

    def inotify_of(pid: int) -> list[str]:
        """The inode numbers (hex) each inotify instance of ``pid`` watches, one string per instance."""
        found = []
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                    with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                        found.append(fh.read())
        except OSError:
            pass
        return found

    newest = f"ino:{os.stat(repos[-1].store / 'receipts').st_ino:x} "

    def watching_the_newest() -> list[str] | None:
        for pid in server.children():
            found = inotify_of(pid)
            if any(newest in info for info in found):
                return found
        return None

    found = wait_for(watching_the_newest, "the watcher to watch the newest store")
    assert len(found) <= _WATCHING


def test_a_worker_that_ends_takes_its_temporary_object_folder_with_it(tmp_path: Path, short_tmp: Path) -> None:
    """A worker keeps ``objects/tmp_objdir-oncepatch-<pid>-…`` for its calls' objects (cas.loose_objects) and
    ends by ``os._exit``, which runs no exit handler: it removes the folder itself, else every worker that
    ever served a repository would leave one there (an idle one beyond the spares, or at the server's end)."""
    repo = make_repo(tmp_path / "repo", FILES)
    srv = Server(short_tmp / "srv")
    try:
        res = run_cli("apply", "--json", "-", "--key", "k", input=PATCH, cwd=repo.path, env=srv.env)
        assert res.code == 0, res
        objects = repo.path / ".git" / "objects"
        (kept,) = [p for p in objects.iterdir() if p.name.startswith("tmp_objdir-oncepatch-")]
        worker = int(kept.name.split("-")[2])
        assert worker in srv.children()  # the worker that ran the call, alive: its folder is in use
        os.kill(srv.pid, signal.SIGTERM)  # the server ends; its idle workers read the end of their channel
        wait_for(lambda: gone(worker), "the worker to end")
        assert not kept.exists()
    finally:
        srv.stop()

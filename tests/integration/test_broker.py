"""``oncepatch serve --broker``: a store owned by its own user, callers told apart by the kernel.

Real users made with ``useradd`` (so: root only, as CI runs): the broker owns
the repository and the store; the agent calls through the broker's socket,
reads the receipts and runs ``verify``, and cannot write the store; a user
the broker does not allow is refused.  Issue 26's forgeries
(tests/integration/forgeries.py) are refused to the agent by the file system,
and fail ``verify`` when a writer without the broker's key makes them.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import signal
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import forgeries
from conftest import ROOT, Repo, make_repo, snapshot

from receipts.identity import key_hash

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd to create the test's users (CI runs as root)")

PATCH = b"--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: Path


@dataclass
class Box:
    base: Path
    python: str
    env: dict[str, str]
    broker: User
    agent: User
    stranger: User
    servers: list[int]

    def run(self, user: User, *argv: str, input: bytes | None = None, env: dict[str, str] | None = None,
            cwd: Path | None = None, groups: tuple[int, ...] = (), umask: int = -1) -> subprocess.CompletedProcess[bytes]:
        e = {**self.env, "HOME": str(user.home), **(env or {})}
        return subprocess.run(list(argv), input=input, env=e, cwd=cwd or self.base, capture_output=True,
                              user=user.uid, group=user.gid, extra_groups=list(groups), umask=umask, timeout=120,
                              check=False)

    def oncepatch(self, user: User, *argv: str, **kw: object) -> subprocess.CompletedProcess[bytes]:
        return self.run(user, self.python, "-m", "patcher.cli", *argv, **kw)  # type: ignore[arg-type]


def _make_user(prefix: str, base: Path) -> User:
    name = f"{prefix}{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                   check=True, capture_output=True)
    pw = pwd.getpwnam(name)
    home = base / f"home-{name}"
    home.mkdir()
    os.chown(home, pw.pw_uid, pw.pw_gid)
    return User(name, pw.pw_uid, pw.pw_gid, home)


@pytest.fixture
def box() -> Iterator[Box]:
    base = Path(tempfile.mkdtemp(prefix="oncepatch-broker-", dir="/tmp"))
    base.chmod(0o755)
    users: list[User] = []
    try:
        for prefix in ("opb", "opa", "opx"):
            users.append(_make_user(prefix, base))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
               "ONCEPATCH_SERVER": "require", "ONCEPATCH_SERVER_DIR": str(base / "sock"),
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{ROOT}:{sysconfig.get_paths()['purelib']}"}
        python = _python_for(users[1], base, env)
        box = Box(base, python, env, users[0], users[1], users[2], servers=[])
        try:
            yield box
        finally:
            for pid in box.servers:  # each in a session of its own: the server, its spare, its calls
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        for user in users:
            _wait_for_no_process_of(user.uid)  # userdel refuses a user whose processes still run
            subprocess.run(["userdel", user.name], capture_output=True, check=False)
            subprocess.run(["groupdel", user.name], capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)


def _wait_for_no_process_of(uid: int, deadline: float = 60.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        alive = False
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/status") as fh:
                    fields = dict(line.split(":", 1) for line in fh if ":" in line)
            except OSError:
                continue
            if int(fields.get("Uid", "-1 ").split()[0]) == uid and fields.get("State", "").split()[:1] != ["Z"]:
                alive = True
                break
        if not alive:
            return
        time.sleep(0.01)


def _python_for(user: User, base: Path, env: dict[str, str]) -> str:
    """An interpreter of this version that an unprivileged user can run with this checkout's packages."""
    tried = []
    for python in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        try:
            res = subprocess.run([python, "-c", "import pygit2, orjson, filelock, patcher.cli.run"], env=env,
                                 cwd=base, capture_output=True, user=user.uid, group=user.gid, extra_groups=[],
                                 check=False)
        except OSError as exc:  # not even executable by the user (a home folder it cannot enter)
            tried.append(f"{python}: {exc.strerror}")
            continue
        if res.returncode == 0:
            return python
        tried.append(f"{python}: {res.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
    pytest.skip(f"no interpreter the test's users can run: {tried}")


def _broker_repo(box: Box, name: str = "repo") -> Repo:
    """A repository the broker owns (libgit2 opens only its own user's repositories)."""
    repo = make_repo(box.base / name, {"a.txt": "a\nb\nc\n"})
    subprocess.run(["chown", "-R", f"{box.broker.uid}:{box.broker.gid}", str(repo.path)], check=True)
    repo.git("config", "--global", "--add", "safe.directory", str(repo.path))  # (the test's own git, as root)
    return repo


def _start_broker(box: Box, *allow: str, umask: int = -1) -> None:
    sock = box.base / "sock"
    sock.mkdir(mode=0o755)
    os.chown(sock, box.broker.uid, box.broker.gid)
    res = box.oncepatch(box.broker, "serve", "--background", "--broker", *(allow or ("--allow-user", box.agent.name)),
                        "--socket-dir", str(sock), "--idle", "120", umask=umask,
                        env={"GIT_COMMITTER_NAME": "Broker", "GIT_COMMITTER_EMAIL": "broker@example.com",
                             "GIT_AUTHOR_NAME": "Broker", "GIT_AUTHOR_EMAIL": "broker@example.com"})
    assert res.returncode == 0 and res.stdout.startswith(b"ready"), res
    words = res.stdout.decode().split()
    box.servers.append(int(words[words.index("pid") + 1]))


def test_the_agent_calls_the_broker_reads_and_verifies_and_cannot_write_the_store(box: Box) -> None:
    repo = _broker_repo(box)
    _start_broker(box)
    agent_env = {"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"}

    res = box.oncepatch(box.agent, "apply", "--json", "-", "--key", "k1", input=PATCH, env=agent_env, cwd=repo.path)
    assert res.returncode == 0, res
    assert repo.git("log", "-1", "--format=%an|%cn").strip() == "Agent|Broker"  # the agent's authorship only
    store = repo.store
    receipt = next(store.glob("receipts/*/*.json"))
    assert receipt.stat().st_uid == box.broker.uid and store.stat().st_uid == box.broker.uid

    for argv in (("status", "--json", "k1"), ("log", "--json"), ("verify", "--json")):
        res = box.oncepatch(box.agent, *argv, cwd=repo.path)
        assert res.returncode == 0, (argv, res)
    res = box.run(box.agent, box.python, "-c", f"print(open({str(receipt)!r}).read())")
    assert res.returncode == 0 and b'"committed"' in res.stdout  # receipts are readable

    before = snapshot(repo)
    for target in (receipt, store / "events.jsonl", receipt.parent / "forged.json"):
        res = box.run(box.agent, "sh", "-c", f"echo x >> '{target}'")
        assert res.returncode != 0, target  # the store is not writable by the agent
    # In its own process the agent cannot commit either, and changes nothing.
    res = box.oncepatch(box.agent, "apply", "--json", "--no-server", "-", "--key", "k2",
                        input=PATCH.replace(b"+B", b"+BB").replace(b"-b", b"-B"), cwd=repo.path)
    assert res.returncode != 0
    # Through the broker: no other store, no command run as the broker, no file read as it.
    for argv in (("--store", str(box.base / "elsewhere")), ("--check", "true")):
        res = box.oncepatch(box.agent, "apply", "--json", "-", "--key", "k3", *argv, input=PATCH, cwd=repo.path)
        assert res.returncode == 2, (argv, res)
    res = box.oncepatch(box.agent, "apply", "--json", str(receipt), cwd=repo.path)
    assert res.returncode == 2, res
    assert snapshot(repo) == before


def test_the_store_stays_unwritable_by_the_brokers_group_whatever_umask_it_was_started_with(box: Box) -> None:
    """A broker started with a group-writable umask (002, common with a group per user) serving its own
    group (the default of --allow-group): the store it makes is still writable by the broker only."""
    repo = _broker_repo(box)
    _start_broker(box, "--allow-group", box.broker.name, umask=0o002)
    member = (box.broker.gid,)  # the agent, a member of the group the broker serves
    res = box.oncepatch(box.agent, "apply", "--json", "-", "--key", "k1", input=PATCH, cwd=repo.path, groups=member,
                        env={"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"})
    assert res.returncode == 0, res
    store = repo.store
    writable = [str(p) for p in (store, *store.rglob("*")) if not p.is_symlink() and p.stat().st_mode & 0o022]
    assert writable == [], writable
    before = snapshot(repo)
    receipt = next(store.glob("receipts/*/*.json"))
    for target in (receipt, store / "events.jsonl", receipt.parent / "forged.json", store / "receipts" / "zz"):
        res = box.run(box.agent, "sh", "-c", f"echo x >> '{target}'", groups=member)
        assert res.returncode != 0, target
    assert snapshot(repo) == before


def test_the_broker_answers_only_about_stores_its_caller_could_read(box: Box) -> None:
    """A repository of the broker's the agent cannot read (its folder 0700): the broker must not read
    it, write it or apply to it for the agent, by its path or through a symlink the agent made."""
    repo = _broker_repo(box)
    private = _broker_repo(box, "private")
    env = {"GIT_AUTHOR_NAME": "Broker", "GIT_AUTHOR_EMAIL": "broker@example.com",
           "GIT_COMMITTER_NAME": "Broker", "GIT_COMMITTER_EMAIL": "broker@example.com", "ONCEPATCH_SERVER": "never"}
    res = box.oncepatch(box.broker, "apply", "-", "--key", "secret-task", input=PATCH, env=env, cwd=private.path)
    assert res.returncode == 0, res
    private.path.chmod(0o700)
    _start_broker(box)
    link = box.agent.home / "innocent"
    assert box.run(box.agent, "ln", "-s", str(private.path), str(link)).returncode == 0
    agent_env = {"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"}
    before = snapshot(private)
    for where in (str(private.path), str(link)):
        for argv in (("log", "--json"), ("status", "--json", "secret-task"), ("verify", "--json"),
                     ("recover", "--json"), ("apply", "--json", "-", "--key", "k")):
            res = box.oncepatch(box.agent, *argv, "--repo", where, input=PATCH.replace(b"+B", b"+X"), env=agent_env)
            assert res.returncode == 2 and b"secret-task" not in res.stdout + res.stderr, (where, argv, res)
            assert b"could read itself" in res.stdout, res
    assert snapshot(private) == before
    res = box.oncepatch(box.agent, "log", "--json", "--repo", str(repo.path))  # one it can read: answered
    assert res.returncode == 0, res


def test_a_repository_path_the_broker_cannot_resolve_is_refused_not_let_through(box: Box) -> None:
    """The agent's own git dir whose 'commondir' only the agent can read, naming the broker's private repository:
    the broker cannot tell which store the path names, so it refuses (exit 2) rather than answer unchecked."""
    private = _broker_repo(box, "private")
    private.path.chmod(0o700)
    _start_broker(box)
    fake = box.agent.home / "fake"
    made = box.run(box.agent, "sh", "-c", f"mkdir -p '{fake}/.git/objects' && echo 'ref: refs/heads/main' > "
                   f"'{fake}/.git/HEAD' && echo '{private.path / '.git'}' > '{fake}/.git/commondir' && "
                   f"chmod 000 '{fake}/.git/commondir'")
    assert made.returncode == 0, made
    before, before_fake = snapshot(private), sorted(str(p) for p in fake.rglob("*"))
    agent_env = {"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"}
    for argv in (("log", "--json"), ("status", "--json", "k"), ("verify", "--json"), ("recover", "--json"),
                 ("apply", "--json", "-", "--key", "k")):
        res = box.oncepatch(box.agent, *argv, "--repo", str(fake), input=PATCH, env=agent_env)
        assert res.returncode == 2, (argv, res)
        err = json.loads(res.stdout)["error"]
        assert err["type"] == "usage" and "cannot tell which store" in err["message"], (argv, err)
        assert err["effect_status"] == "not_started", (argv, err)
    assert snapshot(private) == before
    assert sorted(str(p) for p in fake.rglob("*")) == before_fake


def test_a_caller_the_broker_does_not_allow_is_refused(box: Box) -> None:
    repo = _broker_repo(box)
    _start_broker(box)
    before = snapshot(repo)
    res = box.oncepatch(box.stranger, "apply", "--json", "-", "--key", "k1", input=PATCH, cwd=repo.path)
    assert res.returncode == 5 and b"not allowed" in res.stdout, res
    assert snapshot(repo) == before


def test_the_call_receives_the_caller_the_kernel_reports(box: Box) -> None:
    """The hook an authorize step reads: ``caller=(uid, gid, groups)`` of the socket's peer."""
    sock = box.base / "sock"
    sock.mkdir(mode=0o755)
    os.chown(sock, box.broker.uid, box.broker.gid)
    probe = (
        "import sys\n"
        "from patcher.cli import parser, server\n"
        "args = parser.build_parser().parse_args(sys.argv[1:])\n"
        "def call(argv, *, caller, confined, stores):\n"
        "    groups = ','.join(map(str, sorted(caller.groups)))\n"
        "    print(f'caller {caller.uid} {caller.gid} {caller.peer} groups {groups} confined {confined}', flush=True)\n"
        "    return 0\n"
        "server.serve(args, call)\n"
    )
    proc = subprocess.Popen([box.python, "-c", probe, "serve", "--broker", "--allow-user", box.agent.name,
                             "--socket-dir", str(sock), "--idle", "120"], env={**box.env, "HOME": str(box.broker.home)},
                            cwd=box.base, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            user=box.broker.uid, group=box.broker.gid, extra_groups=[], start_new_session=True)
    box.servers.append(proc.pid)
    assert proc.stderr is not None
    assert b"ready" in proc.stderr.readline()
    # The caller's groups are the kernel's (SO_PEERGROUPS), not the group database's: here the
    # agent's process holds the stranger's group, which no database entry gives it.
    res = box.oncepatch(box.agent, "status", "anything", groups=(box.stranger.gid,))
    assert res.returncode == 0, res
    groups = ",".join(map(str, sorted({box.agent.gid, box.stranger.gid})))
    assert res.stdout.decode().split() == ["caller", str(box.agent.uid), str(box.agent.gid), "True",
                                           "groups", groups, "confined", "True"]


def _signed_broker(box: Box) -> tuple[Repo, Path, Path]:
    """A broker with its own key and a policy that allows the agent ``a.txt`` only: (repo, store, keys)."""
    repo = _broker_repo(box)
    store = repo.store
    keys = box.base / "broker-keys"
    keys.mkdir(mode=0o700)
    subprocess.run(["chown", "-R", f"{box.broker.uid}:{box.broker.gid}", str(keys)], check=True)
    res = box.oncepatch(box.broker, "keys", "init", "--note", "the broker's", cwd=repo.path,
                        env={"ONCEPATCH_KEY_DIR": str(keys), "ONCEPATCH_SERVER": "never"})
    assert res.returncode == 0, res
    (store / "policy.toml").write_text(
        'schema = "oncepatch.policy/1"\n'
        f'[[allow]]\nusers = ["{box.agent.name}"]\npaths = ["a.txt"]\n'
        f'[[allow]]\nusers = [{box.broker.uid}]\n')
    os.chown(store / "policy.toml", box.broker.uid, box.broker.gid)
    sock = box.base / "sock"
    sock.mkdir(mode=0o755)
    os.chown(sock, box.broker.uid, box.broker.gid)
    res = box.oncepatch(box.broker, "serve", "--background", "--broker", "--allow-user", box.agent.name,
                        "--socket-dir", str(sock), "--idle", "120",
                        env={"ONCEPATCH_KEY_DIR": str(keys), "GIT_COMMITTER_NAME": "Broker",
                             "GIT_COMMITTER_EMAIL": "broker@example.com"})
    assert res.returncode == 0 and res.stdout.startswith(b"ready"), res
    words = res.stdout.decode().split()
    box.servers.append(int(words[words.index("pid") + 1]))
    return repo, store, keys


def test_the_brokers_policy_judges_the_caller_the_kernel_names_and_its_store_is_signed(box: Box) -> None:
    """Authorize through the broker: the policy sees the socket's peer, and the broker signs what it writes."""
    repo, store, keys = _signed_broker(box)
    agent_env = {"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"}

    res = box.oncepatch(box.agent, "apply", "--json", "-", "--key", "ok", input=PATCH, env=agent_env, cwd=repo.path)
    assert res.returncode == 0, res
    before = snapshot(repo)
    other = b"--- /dev/null\n+++ b/b.txt\n@@ -0,0 +1 @@\n+b\n"
    res = box.oncepatch(box.agent, "apply", "--json", "-", "--key", "no", input=other, env=agent_env, cwd=repo.path)
    assert res.returncode == 4, res
    err = json.loads(res.stdout)["error"]
    assert (err["type"], err["retryable"], err["effect_status"], err["next_action"]) == \
        ("forbidden", False, "not_started", "none"), err
    assert "'b.txt' is outside the paths rule 1 allows" in err["message"] and err["caller"]["uid"] == box.agent.uid
    after = snapshot(repo)
    assert {k: v for k, v in after.items() if k != "store"} == {k: v for k, v in before.items() if k != "store"}
    assert {k: v for k, v in after["store"].items() if k != "events.jsonl"} == \
        {k: v for k, v in before["store"].items() if k != "events.jsonl"}  # only the refusal's event is new
    events = [line for line in (store / "events.jsonl").read_text().splitlines() if '"forbidden"' in line]
    assert len(events) == 1 and f'"uid":{box.agent.uid}' in events[0].replace(" ", ""), events
    # Signed by the broker: the agent's verify proves it, and the agent holds no key to forge with.
    res = box.oncepatch(box.agent, "verify", cwd=repo.path)
    assert res.returncode == 0 and b"signed store" in res.stdout, res
    assert not any(keys.iterdir()) or box.run(box.agent, "ls", str(keys)).returncode != 0


FORGER_SCRIPT = """
import json, os, sys
from pathlib import Path
import forgeries

store, head = Path(sys.argv[1]), sys.argv[2]
attempts = {
    "an event rewritten, the chain recomputed": lambda: forgeries.rewrite_an_event(store, "one"),
    "a receipt re-sealed": lambda: forgeries.reseal(store, "one", updated_at="2020-01-01T00:00:00.000000Z"),
    "a signature copied from another receipt": lambda: forgeries.copy_signature(store, "two", source="one"),
    "a receipt planted beside one":
        lambda: (forgeries.receipt_file(store, "one").parent / "forged.json").write_text("{}"),
    "a receipt planted in a new shard": lambda: forgeries.receipt_file(store, "ghost").parent.mkdir(),
    "the allowed-signers list replaced": lambda: (store / "allowed_signers.json").write_text("{}"),
    "the policy replaced": lambda: (store / "policy.toml").write_text('schema = "oncepatch.policy/1"\\n[[allow]]\\n'),
}
out = {}
for name, attempt in attempts.items():
    try:
        attempt()
        out[name] = "done"
    except PermissionError:
        out[name] = "refused"
print(json.dumps(out))
"""


def test_every_forgery_fails_in_broker_mode(box: Box, tmp_path: Path) -> None:
    """Issue 26's forgeries against a broker's signed store: the agent cannot make them (the file
    system refuses each write, git's too), and made by a writer of the store without the broker's
    key they fail the agent's ``verify``, through the broker and in its own process."""
    repo, store, keys = _signed_broker(box)
    agent_env = {"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"}
    again = PATCH.replace(b"@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n", b"@@ -1,3 +1,3 @@\n-a\n+A\n B\n c\n")
    for key, patch in (("one", PATCH), ("two", again)):
        res = box.oncepatch(box.agent, "apply", "--json", "-", "--key", key, input=patch, env=agent_env, cwd=repo.path)
        assert res.returncode == 0, res
    before = snapshot(repo)

    # As the agent: the forgeries' own code (tests/integration/forgeries.py), run with the agent's rights.
    helpers = {"PYTHONPATH": f"{box.env['PYTHONPATH']}:{ROOT / 'tests'}:{ROOT / 'tests' / 'integration'}"}
    res = box.run(box.agent, box.python, "-c", FORGER_SCRIPT, str(store), repo.head(), env=helpers)
    assert res.returncode == 0, res
    outcome = json.loads(res.stdout)
    assert set(outcome.values()) == {"refused"}, outcome
    ghost_ref = f"refs/oncepatch/keys/{key_hash('ghost')}"
    for argv in (["git", "-c", "safe.directory=*", "-C", str(repo.path), "update-ref", ghost_ref, repo.head()],
                 [box.python, "-m", "patcher.cli", "keys", "rotate", "--note", "mine now"],
                 [box.python, "-m", "patcher.cli", "quarantine", "one"]):
        res = box.run(box.agent, *argv, cwd=repo.path)
        assert res.returncode != 0, (argv, res)
    # The rotation is refused as a usage error naming the store, never an internal error.
    res = box.oncepatch(box.agent, "keys", "rotate", "--json", cwd=repo.path)
    err = json.loads(res.stdout)["error"]
    assert res.returncode == 2 and err["type"] == "usage" and err["effect_status"] == "not_started", res
    assert "cannot change the keys of the store" in err["message"], err
    assert snapshot(repo) == before
    res = box.oncepatch(box.agent, "verify", cwd=repo.path)
    assert res.returncode == 0 and b"signed store" in res.stdout, res

    # The same forgeries made by a writer of the store who does not hold the broker's key (root here,
    # standing in for a store left writable, or a copy restored over it): each fails verify.
    head = repo.head()
    ghost = b"--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n A\n B\n-c\n+C\n"
    forgeries.fabricate(repo, store, tmp_path / "forger-store", ghost)
    forgeries.reseal(store, "one", updated_at="2020-01-01T00:00:00.000000Z")
    forgeries.copy_signature(store, "two", source="one")
    forgeries.rewrite_an_event(store, "two")
    assert repo.git("rev-parse", ghost_ref).strip() != head
    for argv in (("verify", "--json"), ("verify", "--json", "--no-server")):
        res = box.oncepatch(box.agent, *argv, cwd=repo.path)
        assert res.returncode == 6, (argv, res)
        failures = json.loads(res.stdout)["failures"]
        assert {"one", "two", "ghost"} <= {f.get("key") for f in failures}, failures
        assert any("ledger line" in f["reason"] for f in failures), failures
    for key in ("ghost", "one", "two"):
        res = box.oncepatch(box.agent, "status", "--json", key, cwd=repo.path)
        assert res.returncode == 6 and b'"corrupt_receipt"' in res.stdout and b'"committed"' not in res.stdout, res


AGENT_SCRIPT = """
import json, sys
import mcp.types as types
from cas.errors import OncepatchError
from patcher.api import Client
from patcher.mcp_server import _Tools

repo, patch, again, other = sys.argv[1], *(a.encode().decode('unicode_escape') for a in sys.argv[2:5])
out = {}
with Client(repo) as client:
    out['api'] = client.apply(patch, key='api-ok').to_json()
    try:
        client.apply(other, key='api-no')
    except OncepatchError as exc:
        out['api_no'] = [type(exc).__name__, exc.exit_code, exc.envelope()]
    out['status'] = client.status('api-ok').to_doc()
    tools = _Tools(client, types, allow_other_repos=False)
    for key, text in (('mcp-ok', again), ('mcp-no', other)):
        res = tools.run('apply_patch', lambda: tools.apply_patch(text, key, repo, None, 'auto', None))
        out[key] = json.loads(res.content[0].text)
print(json.dumps(out))
"""


def test_the_agents_api_and_mcp_calls_go_through_the_broker_signed_and_judged_as_the_agent(box: Box) -> None:
    """The Python API and the MCP tool of the agent's process reach the broker: its key, its policy, its peer."""
    pytest.importorskip("mcp")
    repo, store, keys = _signed_broker(box)
    again = "--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n-a\n+A\n B\n c\n"
    other = "--- /dev/null\n+++ b/b.txt\n@@ -0,0 +1 @@\n+b\n"
    res = box.run(box.agent, box.python, "-c", AGENT_SCRIPT, str(repo.path), PATCH.decode().replace("\n", "\\n"),
                  again.replace("\n", "\\n"), other.replace("\n", "\\n"),
                  env={"GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@example.com"}, cwd=repo.path)
    assert res.returncode == 0, res
    out = json.loads(res.stdout)
    assert out["api"]["ok"] and out["mcp-ok"]["ok"] and not out["api"]["replayed"], out
    assert out["api_no"][:2] == ["Forbidden", 4] and out["api_no"][2]["type"] == "forbidden", out
    assert out["mcp-no"]["error"]["type"] == "forbidden", out
    assert out["status"]["status"] == "committed" and out["status"]["commit"] == out["api"]["commit"]
    # Written by the broker's user, authored by the agent, committed by the broker.
    assert {p.stat().st_uid for p in store.glob("receipts/*/*.json")} == {box.broker.uid}
    assert repo.git("log", "-2", "--format=%an|%cn").split() == ["Agent|Broker", "Agent|Broker"]
    # Each refusal is a ledger event naming the agent's uid, as the kernel reported it.
    events = [line for line in (store / "events.jsonl").read_text().splitlines() if '"forbidden"' in line]
    assert len(events) == 2 and all(f'"uid":{box.agent.uid}' in e.replace(" ", "") for e in events), events
    res = box.oncepatch(box.agent, "verify", cwd=repo.path)
    assert res.returncode == 0 and b"signed store" in res.stdout, res

"""Shared fixtures: hermetic environment, real git repositories, CLI runner, snapshots."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import forked_cli

ROOT = Path(__file__).resolve().parent.parent

#: ``ONCEPATCH_TEST_SERVER=1``: every ``oncepatch`` process of the tests goes through one
#: ``oncepatch serve`` of the session (ONCEPATCH_SERVER=require), the CLI contract run again
#: through the server (.ci/run picks the files); otherwise every one runs in process.
THROUGH_SERVER = os.environ.get("ONCEPATCH_TEST_SERVER") == "1"


def start_server(folder: Path, *extra: str, env: dict[str, str] | None = None) -> int:
    """``oncepatch serve --background`` in ``folder``: the server's pid (it prints it when ready)."""
    res = subprocess.run([sys.executable, "-m", "patcher.cli", "serve", "--background", "--socket-dir",
                          str(folder), *extra], capture_output=True, env=env, check=False, timeout=120)
    words = res.stdout.decode().split()
    assert res.returncode == 0 and words[:1] == ["ready"], (res.returncode, res.stdout, res.stderr)
    return int(words[words.index("pid") + 1])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private folder with a short path, for a server's Unix socket (``<folder>/oncepatch-<token>.sock``).

    A socket's path holds at most 107 bytes; ``tmp_path`` under a pytest-xdist worker
    (``/tmp/pytest-of-<user>/pytest-<n>/popen-gw<k>/<test name, up to 30>/``) leaves too few of them.
    """
    path = Path(tempfile.mkdtemp(prefix="op-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    if not THROUGH_SERVER:
        yield None
        return
    folder = tmp_path_factory.mktemp("server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEPATCH_")}
    pid = start_server(folder, "--idle", "0", env=env)
    yield folder
    os.kill(pid, 15)


@pytest.fixture(autouse=True)
def hermetic(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
             session_server: Path | None) -> None:
    """No developer's git config, store, crash point or running server leaks into a test, nor one test's
    server into another's."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    # The per-user server's default folder ($XDG_RUNTIME_DIR/oncepatch, else /tmp/oncepatch-<uid>) is
    # this test's own: a server a test starts there is never found, nor stopped, by another test
    # (the suite runs in several workers at once, and a developer's own server may be running).
    runtime = home / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    for name in list(os.environ):
        if name.startswith("GIT_") or name.startswith("ONCEPATCH_"):
            monkeypatch.delenv(name, raising=False)
    if session_server is None:
        monkeypatch.setenv("ONCEPATCH_SERVER", "never")
    else:
        monkeypatch.setenv("ONCEPATCH_SERVER", "require")
        monkeypatch.setenv("ONCEPATCH_SERVER_DIR", str(session_server))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Test Author")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "author@example.com")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Test Author")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "author@example.com")
    (home / ".gitconfig").write_text(
        "[user]\n\tname = Test Author\n\temail = author@example.com\n"
        "[init]\n\tdefaultBranch = main\n[core]\n\tautocrlf = false\n[advice]\n\tdetachedHead = false\n"
    )


def git(cwd: Path | str, *args: str, input: bytes | None = None, check: bool = True) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, check=False)
    if check and res.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed ({res.returncode}): {res.stderr.decode()}")
    return res.stdout.decode("utf-8", "surrogateescape")


@dataclass
class Repo:
    path: Path

    def git(self, *args: str, input: bytes | None = None, check: bool = True) -> str:
        return git(self.path, *args, input=input, check=check)

    def write(self, rel: str, data: bytes | str, mode: int | None = None) -> None:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        if mode is not None:
            p.chmod(mode)

    def commit_all(self, msg: str = "c") -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", msg)
        return self.head()

    def head(self, ref: str = "HEAD") -> str:
        return self.git("rev-parse", ref).strip()

    def count(self, ref: str = "HEAD") -> int:
        return int(self.git("rev-list", "--count", ref).strip())

    @property
    def store(self) -> Path:
        return self.path / ".git" / "oncepatch"


def make_repo(path: Path, files: dict[str, str | bytes] | None = None) -> Repo:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    repo = Repo(path)
    for rel, data in (files or {"README": "hello\n"}).items():
        repo.write(rel, data)
    repo.commit_all("initial")
    return repo


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return make_repo(
        tmp_path / "repo",
        {
            "README": "hello\n",
            "src/app.py": "".join(f"line {i}\n" for i in range(1, 21)),
            "src/util.py": "def f():\n    return 1\n",
            "docs/guide.txt": "guide\n",
        },
    )


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def json(self) -> Any:
        return json.loads(self.out)


def run_cli(*args: str, cwd: Path | str | None = None, input: bytes | None = None,
            env: dict[str, str] | None = None, timeout: float = 120) -> Run:
    """``python -m patcher.cli *args``: forked from a server that imported it (tests/forked_cli.py), or a
    fresh process where the fork could differ (a variable the imports read, ``ONCEPATCH_TEST_FORK=0``)."""
    e = dict(os.environ)
    if env:
        e.update(env)
    if forked_cli.can_fork(e):
        code, out, err = forked_cli.run(list(args), cwd=None if cwd is None else str(cwd), input=input, env=e,
                                        timeout=timeout)
        return Run(code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
    res = subprocess.run(
        [sys.executable, "-m", "patcher.cli", *args], cwd=cwd, input=input, capture_output=True,
        env=e, timeout=timeout, check=False,
    )
    return Run(res.returncode, res.stdout.decode("utf-8", "replace"), res.stderr.decode("utf-8", "replace"))


def pytest_sessionfinish() -> None:
    forked_cli.shutdown()


#: The files whose tests take longest in all (``--durations`` summed by file, longest first): a
#: worker starts them first. pytest-xdist's ``--dist loadfile`` hands out one file at a time, by
#: default the files with the most tests first; these have few tests each, so they came last, and
#: one worker ran the last of them alone while the other had nothing left (scripts/test passes
#: ``--no-loadscope-reorder`` and this order stands).
LONGEST_FILES = (
    "tests/test_docs.py",
    "tests/integration/test_broker.py",
    "tests/integration/test_server.py",
    "tests/integration/test_maintenance.py",
    "tests/integration/test_concurrency.py",
    "tests/test_scripts.py",
    "tests/unit/test_format_properties.py",
    "tests/integration/test_dirs_torture.py",
    "tests/integration/test_watch.py",
    "tests/integration/test_pack_refs_loop.py",
    "tests/integration/test_index_raw.py",
    "tests/integration/test_mcp.py",
    "tests/test_typing.py",
    "tests/integration/test_dirs_unreadable.py",
    "tests/integration/test_git_race.py",
    "tests/integration/test_cross_format_history.py",
    "tests/integration/test_server_hostile.py",
    "tests/integration/test_history_conformance.py",
    "tests/integration/test_remote_netns.py",
    "tests/integration/test_progress.py",
    "tests/integration/test_remote_mode.py",
    "tests/unit/test_detect.py",
    "tests/integration/test_forked_cli.py",
    "tests/integration/test_recover_parallel.py",
    "tests/integration/test_dirs_api.py",
    "tests/unit/test_branch_name.py",
    "tests/integration/test_lifecycle_drift.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker: the files of LONGEST_FILES first, in that order, then the others with
    the most tests first (what xdist's own reordering does); a file's tests keep their order."""
    if not hasattr(config, "workerinput"):
        return
    missing = [name for name in LONGEST_FILES if not (ROOT / name).is_file()]
    assert not missing, f"LONGEST_FILES names files that are not there: {missing}"
    counts: dict[str, int] = {}
    for item in items:
        name = item.nodeid.split("::", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    first_seen = {name: i for i, name in enumerate(counts)}

    def order(name: str) -> tuple[int, int, int]:
        if name in rank:
            return (0, rank[name], 0)
        return (1, -counts[name], first_seen[name])

    items.sort(key=lambda item: order(item.nodeid.split("::", 1)[0]))


@pytest.fixture
def cli() -> Any:
    return run_cli


def snapshot(repo: Repo, store: Path | None = None) -> dict[str, Any]:
    """Everything a rejection must leave byte-for-byte unchanged: refs, index, worktree, store."""
    state: dict[str, Any] = {}
    state["refs"] = repo.git("for-each-ref", "--format=%(refname) %(objectname)")
    state["head"] = (repo.path / ".git" / "HEAD").read_bytes()
    idx = repo.path / ".git" / "index"
    state["index"] = hashlib.sha256(idx.read_bytes()).hexdigest() if idx.exists() else None
    files: dict[str, str] = {}
    for p in sorted(repo.path.rglob("*")):
        rel = p.relative_to(repo.path).as_posix()
        if rel == ".git" or rel.startswith(".git/"):
            continue
        if p.is_symlink():
            files[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            files[rel] = f"{oct(p.stat().st_mode)}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
        else:
            files[rel] = "dir"
    state["worktree"] = files
    store = store if store is not None else repo.store
    sfiles: dict[str, str] = {}
    if store.exists():
        for p in sorted(store.rglob("*")):
            if p.is_file():
                sfiles[p.relative_to(store).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    state["store"] = sfiles
    return state


def wait_paused(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until ``proc`` has stopped itself (``/proc/<pid>/stat`` state T) at its pause point
    (``ONCEPATCH_PAUSE_AT``); fails with its output if it ends first or ``timeout`` seconds pass."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{proc.pid}/stat", "rb") as fh:
            if fh.read().rsplit(b")", 1)[1].split()[0] == b"T":
                return
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


def diff_of(repo: Repo, a: str, b: str) -> bytes:
    return subprocess.run(["git", "diff", "--full-index", "--binary", a, b], cwd=repo.path,
                          capture_output=True, check=True).stdout


#: Commits of the project's own history replayed by the default run (the history tests): its
#: length grows with every commit landed; ``scripts/test --all`` (the ``slow`` variants) takes them all.
HISTORY_SAMPLE = 40


def history_sample(items: list[Any], size: int = HISTORY_SAMPLE) -> list[Any]:
    """``size`` of a history's ``items`` (oldest first): the newest half, the rest spread evenly over the
    older ones, the oldest included. Deterministic: a failure names a commit the next run checks again."""
    newest, spread = size // 2, size - size // 2
    if len(items) <= size:
        return list(items)
    older = items[:-newest]
    picked = {round(i * (len(older) - 1) / (spread - 1)) for i in range(spread)}
    return [item for i, item in enumerate(older) if i in picked] + list(items[-newest:])


@pytest.fixture
def tmp_repo_factory(tmp_path: Path) -> Iterator[Any]:
    n = [0]

    def factory(files: dict[str, str | bytes] | None = None) -> Repo:
        n[0] += 1
        return make_repo(tmp_path / f"r{n[0]}", files)

    yield factory

"""The tests' CLI fork server (tests/forked_cli.py) gives what ``python -m patcher.cli`` gives.

run_cli forks most calls from a server that imported oncepatch once; these
tests hold it to a fresh interpreter: the same exit codes and bytes on
stdout and stderr for a commit, a replay and a rejection, stdin read as the
patch, the call's own environment (a crash point kills the call, not the
server; HOME is the one libgit2 reads the identity from), and a real process
wherever the fork could differ (a variable that the imports read).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import forked_cli
from conftest import Repo, Run, run_cli

pytestmark = pytest.mark.skipif(not forked_cli.enabled(), reason="ONCEPATCH_TEST_FORK=0: every call is a process")

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1,2 @@\n hello\n+forked\n"


def fresh(*args: str, input: bytes | None = None, env: dict[str, str] | None = None) -> Run:
    res = subprocess.run([sys.executable, "-m", "patcher.cli", *args], input=input, capture_output=True,
                         env={**os.environ, **(env or {})}, check=False)
    return Run(res.returncode, res.stdout.decode(), res.stderr.decode())


def forked(*args: str, input: bytes | None = None, env: dict[str, str] | None = None) -> Run:
    e = {**os.environ, **(env or {})}
    assert forked_cli.can_fork(e)
    code, out, err = forked_cli.run(list(args), cwd=None, input=input, env=e, timeout=120)
    return Run(code, out.decode(), err.decode())


def test_a_forked_call_answers_as_a_fresh_interpreter(repo: Repo, tmp_path: Path) -> None:
    (tmp_path / "p.diff").write_bytes(PATCH)
    for args in (["--help"], ["apply", "--help"], ["status", "nope", "--repo", str(repo.path)],
                 ["apply", "--repo", str(tmp_path / "missing"), str(tmp_path / "p.diff")]):
        a, b = forked(*args), fresh(*args)
        assert (a.code, a.out, a.err) == (b.code, b.out, b.err), args
    first = forked("apply", "-", "--repo", str(repo.path), "--key", "K", "--json", input=PATCH)
    assert first.code == 0 and first.json["replayed"] is False, first.err
    again = fresh("apply", "-", "--repo", str(repo.path), "--key", "K", "--json", input=PATCH)
    third = forked("apply", "-", "--repo", str(repo.path), "--key", "K", "--json", input=PATCH)
    assert again.code == third.code == 0 and again.json == third.json and again.json["replayed"] is True
    assert (repo.path / "README").read_bytes() == b"hello\nforked\n"
    assert repo.git("log", "-1", "--format=%an <%ae>") == "Test Author <author@example.com>\n"


def test_a_crash_point_ends_the_call_and_the_server_goes_on(repo: Repo) -> None:
    crashed = forked("apply", "-", "--repo", str(repo.path), "--key", "K", input=PATCH,
                     env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    assert crashed.code == 137 and crashed.out == ""
    assert fresh("status", "K", "--repo", str(repo.path)).out == forked("status", "K", "--repo", str(repo.path)).out
    assert forked("status", "K", "--repo", str(repo.path)).out.startswith("prepared")


def test_the_calls_home_gives_the_commit_identity(repo: Repo, tmp_path: Path) -> None:
    home = tmp_path / "other-home"
    home.mkdir()
    (home / ".gitconfig").write_text("[user]\n\tname = Other Home\n\temail = other@example.com\n")
    e = {k: v for k, v in os.environ.items() if not k.startswith("GIT_AUTHOR") and not k.startswith("GIT_COMMITTER")}
    e["HOME"] = str(home)
    code, out, err = forked_cli.run(["apply", "-", "--repo", str(repo.path), "--key", "H"], cwd=None, input=PATCH,
                                    env=e, timeout=120)
    assert code == 0, err
    assert repo.git("log", "-1", "--format=%an <%ae> %cn").strip() == "Other Home <other@example.com> Other Home"


def test_a_variable_the_imports_read_makes_a_fresh_process(repo: Repo, tmp_path: Path) -> None:
    env = {**os.environ, "ONCEPATCH_MAX_PATCH_BYTES": "10"}
    assert not forked_cli.can_fork(env)
    assert not forked_cli.can_fork({**os.environ, "PYTHONHASHSEED": "7"})
    assert forked_cli.can_fork({**os.environ, "ONCEPATCH_CRASH_AT": "after-ref"})  # read per call
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "K", input=PATCH,
                env={"ONCEPATCH_MAX_PATCH_BYTES": "10"})
    assert r.code != 0 and (repo.path / "README").read_bytes() == b"hello\n"  # the limit held

"""Progress on stderr for long work (issue 31): shown past two seconds when asked (or on a terminal),
nothing when stderr is a pipe and nobody asked; ``watch`` says it started."""

from __future__ import annotations

from pathlib import Path

from conftest import make_repo, run_cli

from patcher.cli.progress import AFTER

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"


def test_a_long_check_shows_what_runs_when_asked_and_nothing_otherwise(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    slow = f"sleep {AFTER + 2:g}"  # the work itself: longer than AFTER, so the line is due
    asked = run_cli("apply", "-", "--repo", str(repo.path), "--key", "a", "--check", slow, input=PATCH,
                    env={"ONCEPATCH_PROGRESS": "1"})
    assert asked.code == 0, asked.err
    assert f"oncepatch: running the check '{slow}'" in asked.err, asked.err
    repo.git("reset", "-q", "--hard", "HEAD~1")
    quiet = run_cli("apply", "-", "--repo", str(repo.path), "--key", "b", "--check", slow, input=PATCH)
    assert quiet.code == 0 and quiet.err == "", quiet.err  # a pipe, not asked: scripts see errors only


def test_watch_says_it_started(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    r = run_cli("watch", "--repo", str(repo.path), "--duration", "0.2", "--json")
    assert r.code == 0 and r.out.splitlines()[-1].startswith("{"), r.out
    assert "oncepatch watch: watching" in r.err and "Ctrl-C ends it" in r.err, r.err

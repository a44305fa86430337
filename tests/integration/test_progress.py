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


def test_on_a_terminal_the_line_is_redrawn_in_place_and_cleared(tmp_path: Path) -> None:
    """stderr a terminal (a pty), nothing asked: one line redrawn with ``\\r`` and erased when the work ends."""
    import os
    import pty
    import subprocess
    import sys
    import threading

    repo = make_repo(tmp_path / "repo")
    slow = f"sleep {AFTER + 2:g}"
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "ONCEPATCH_PROGRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", "-", "--repo", str(repo.path),
                             "--key", "t", "--check", slow], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=slave, env=env)
    os.close(slave)
    seen = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer of the pty is gone
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out, _ = proc.communicate(PATCH, timeout=120)
    reader.join(60)
    os.close(master)
    assert proc.returncode == 0, (out, bytes(seen))
    text = bytes(seen).decode(errors="replace")
    assert f"\r\x1b[Koncepatch: running the check '{slow}'" in text, text
    assert text.endswith("\r\x1b[K") or text.rstrip("\r\n").endswith("\r\x1b[K"), repr(text)  # erased at the end

"""Directory targets whose ``PATH`` or files a person changed around a call (docs/DIRECTORIES.md).

``PATH`` itself is the symlink oncepatch switches; what a person put in its
place (a file, a symlink of their own) is never renamed over: the apply
refuses before anything is written, and a switch that meets it during a call
is left undone (a warning, ``recover`` says the same) with the entry kept.
An entry of the current generation replaced after the apply's check (a fifo,
a folder, another inode) never enters the new generation, and ``verify``
names a fifo where a file was instead of waiting on it.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_cli, wait_paused
from dirs_helpers import snapshot_tree, tree_of
from dirs_helpers import view_of_folder
from test_dirs import LAYOUTS, adopt, expected_view, objects

PATCH = b"--- a/index.html\n+++ b/index.html\n@@ -1 +1 @@\n-<h1>old</h1>\n+<h1>new</h1>\n"
FILES = {"index.html": "<h1>old</h1>\n", "robots.txt": "User-agent: *\n", "css/site.css": "body {}\n"}
DEADLINE = 120.0


def _home(site: Path) -> Path:
    return Path(str(site) + ".oncepatch")


def _put_in_place_of(site: Path, what: str, tmp_path: Path) -> None:
    """Move the target's symlink away and put a person's own ``what`` at ``PATH``."""
    os.rename(site, tmp_path / "the-link-moved-away")
    if what == "file":
        site.write_bytes(b"a person's own file\n")
    else:
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "index.html").write_bytes(b"<h1>old</h1>\n")
        os.symlink(mine, site)


def _what_is_at(site: Path) -> tuple[str, str]:
    if site.is_symlink():
        return ("link", os.readlink(site))
    return ("file", site.read_text())


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _paused_apply(procs: list[subprocess.Popen[bytes]], site: Path, pf: Path, point: str,
                  key: str) -> subprocess.Popen[bytes]:
    """``oncepatch apply`` stopped at ``point`` (``ONCEPATCH_PAUSE_AT``: it SIGSTOPs itself there)."""
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "apply", str(pf), "--dir", str(site), "--key", key,
                             "--json", "--no-server"], env=dict(os.environ, ONCEPATCH_PAUSE_AT=point),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(proc)
    wait_paused(proc, DEADLINE)
    return proc


@pytest.mark.parametrize("what", ["file", "symlink"])
def test_an_apply_refuses_a_file_or_foreign_symlink_put_in_place_of_path_and_changes_nothing(
        tmp_path: Path, what: str) -> None:
    site = adopt(tmp_path, dict(FILES))
    pf = tmp_path / "p.diff"
    pf.write_bytes(PATCH)
    _put_in_place_of(site, what, tmp_path)
    at_path, home = _what_is_at(site), snapshot_tree(_home(site))

    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k", "--json")
    assert res.code == 2, res.out + res.err
    err = res.json["error"]
    assert (err["type"], err["effect_status"]) == ("usage", "not_started")
    assert "no longer the directory target" in err["message"]
    assert _what_is_at(site) == at_path and snapshot_tree(_home(site)) == home


@pytest.mark.parametrize("what", ["file", "symlink"])
def test_a_file_or_foreign_symlink_put_at_path_during_a_call_is_not_switched_over(
        tmp_path: Path, what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    site = adopt(tmp_path, dict(FILES))
    first = tree_of(objects(site))
    pf = tmp_path / "p.diff"
    pf.write_bytes(PATCH)
    proc = _paused_apply(procs, site, pf, "after-ref", "k")
    _put_in_place_of(site, what, tmp_path)
    at_path = _what_is_at(site)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=DEADLINE)

    assert proc.returncode == 0, out + err  # the branch moved: the call committed, its switch left undone
    res = json.loads(out)
    assert res["status"] == "committed" and tree_of(objects(site)) != first
    assert any("not switched" in w and "no longer the directory target" in w for w in res["warnings"]), res
    assert _what_is_at(site) == at_path
    rec = run_cli("recover", "--dir", str(site), "--json")
    assert rec.code == 2, rec.out + rec.err
    assert "no longer the directory target" in rec.json["error"]["message"]
    assert _what_is_at(site) == at_path


def _replace_entry(site: Path, rel: str, kind: str, tmp_path: Path) -> None:
    """Put ``kind`` in place of the file ``rel`` of the generation ``site`` shows (its folder made writable)."""
    full = Path(os.path.realpath(site / rel))
    os.chmod(full.parent, 0o755)
    full.unlink()
    if kind == "fifo":
        os.mkfifo(full)
    elif kind == "folder":
        full.mkdir()
    else:  # another file's inode, with other bytes
        other = tmp_path / "other.txt"
        other.write_bytes(b"not what the tree holds\n")
        os.link(other, full)
    os.chmod(full.parent, 0o555)


@pytest.mark.parametrize("kind", ["fifo", "folder", "other-inode"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_entry_replaced_after_the_check_never_enters_the_new_generation(
        tmp_path: Path, layout: str, kind: str, procs: list[subprocess.Popen[bytes]]) -> None:
    site = adopt(tmp_path, dict(FILES), layout)
    pf = tmp_path / "p.diff"
    pf.write_bytes(PATCH)
    proc = _paused_apply(procs, site, pf, "after-prepare", "k")  # (the check against the manifest has run)
    _replace_entry(site, "robots.txt", kind, tmp_path)  # (beside the patched file: linked by both layouts)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=DEADLINE)

    assert proc.returncode == 0, out + err
    res = json.loads(out)
    assert res["status"] == "committed", res
    # Said, not hidden: the edit is not carried into the new generation, which holds the tree's bytes.
    assert [w for w in res["warnings"] if "changed outside oncepatch during the call" in w and "'robots.txt'" in w], res
    assert os.readlink(site).endswith(res["tree"])
    assert stat.S_ISREG(os.lstat(site / "robots.txt").st_mode)  # (before reading: a fifo would be waited on)
    assert view_of_folder(site) == expected_view({**FILES, "index.html": "<h1>new</h1>\n"})
    ver = run_cli("verify", "--dir", str(site), "--json")
    assert ver.code == 0, ver.out + ver.err


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_verify_names_a_fifo_where_a_file_was_and_does_not_wait_on_it(tmp_path: Path, layout: str) -> None:
    site = adopt(tmp_path, dict(FILES), layout)
    _replace_entry(site, "css/site.css", "fifo", tmp_path)

    ver = run_cli("verify", "--dir", str(site), "--json", timeout=60)  # (a hang fails the test)
    assert ver.code == 6, ver.out + ver.err
    assert any("css/site.css" in f["reason"] for f in ver.json["failures"]), ver.json

"""A directory target's generation with an entry its own user can no longer read (docs/DIRECTORIES.md).

Generations are built 0555/0444; a folder or file made 0000 by hand is an
edit outside oncepatch like any other: ``verify --dir`` names it (exit 6) and
``apply --dir`` refuses with ``dirty_path`` (exit 4), changing nothing.  Both
used to end in libgit2's or the OS's ``PermissionError`` (exit 1, ``internal``).
Root reads through any mode, so the calls run as a user made with ``useradd``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT
from test_broker import User, _make_user, _python_for, _wait_for_no_process_of
from test_dirs import LAYOUTS

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd: root reads through a 0000 folder")

FILES = {"README": "r\n", "sub/deeper/f.txt": "a\n", "sub/g.txt": "g\n"}
# It runs through 'sub' (the shared layout compares only the folders a patch's paths run through).
PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-r\n+R\n--- a/sub/g.txt\n+++ b/sub/g.txt\n@@ -1 +1 @@\n-g\n+G\n"


class Owner:
    def __init__(self, base: Path, user: User, python: str, env: dict[str, str]) -> None:
        self.base, self.user, self.python, self.env = base, user, python, env

    def oncepatch(self, *argv: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([self.python, "-m", "patcher.cli", *argv], env={**self.env, "HOME": str(self.user.home)},
                              cwd=self.base, capture_output=True, user=self.user.uid, group=self.user.gid,
                              extra_groups=[], timeout=120, check=False)


@pytest.fixture
def owner() -> Iterator[Owner]:
    base = Path(tempfile.mkdtemp(prefix="oncepatch-unreadable-", dir="/tmp"))
    base.chmod(0o755)
    user = _make_user("opu", base)
    try:
        os.chown(base, user.uid, user.gid)  # the target's home folder is made beside it
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1", "ONCEPATCH_SERVER": "never",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{ROOT}:{sysconfig.get_paths()['purelib']}",
               "GIT_AUTHOR_NAME": "A", "GIT_AUTHOR_EMAIL": "a@example.com",
               "GIT_COMMITTER_NAME": "A", "GIT_COMMITTER_EMAIL": "a@example.com"}
        yield Owner(base, user, _python_for(user, base, env), env)
    finally:
        _wait_for_no_process_of(user.uid)
        subprocess.run(["userdel", user.name], capture_output=True, check=False)
        subprocess.run(["groupdel", user.name], capture_output=True, check=False)
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)


def _state(root: Path) -> dict[str, object]:
    """Every entry under ``root`` as root sees it: mode, a file's bytes, a link's text."""
    out: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            p = os.path.join(folder, name)
            st = os.lstat(p)
            body = os.readlink(p) if os.path.islink(p) else (Path(p).read_bytes() if os.path.isfile(p) else None)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_ino, body)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("what", ["sub", "sub/g.txt"])
def test_an_entry_made_unreadable_is_an_outside_edit_not_a_traceback(owner: Owner, layout: str, what: str) -> None:
    site = owner.base / "site"
    for rel, text in FILES.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    subprocess.run(["chown", "-R", f"{owner.user.uid}:{owner.user.gid}", str(site)], check=True)
    res = owner.oncepatch("init", "--dir", str(site), "--json", *LAYOUTS[layout])
    assert res.returncode == 0, res
    (owner.base / "p.diff").write_bytes(PATCH)
    home = Path(str(site) + ".oncepatch")
    generation = Path(os.path.realpath(site))
    # In the shared layout a sub-folder is its own tree's folder, entered through a link.
    entry = Path(os.path.realpath(generation / what))
    os.chmod(entry, 0)
    before = _state(home)

    res = owner.oncepatch("verify", "--dir", str(site), "--grace", "0", "--json")
    assert res.returncode == 6, res
    problems = " ".join(f["reason"] for f in json.loads(res.stdout)["failures"])
    assert f"'{what}" in problems and "Traceback" not in res.stderr.decode()
    res = owner.oncepatch("apply", "p.diff", "--dir", str(site), "--key", "k1", "--json")
    assert res.returncode == 4, res
    err = json.loads(res.stdout)["error"]
    assert (err["type"], err["effect_status"], err["reason"]) == ("dirty_path", "not_started", "edited_outside")
    assert any(p.startswith(what) for p in err["paths"]), err
    assert _state(home) == before and (site / "README").read_text() == "r\n"

    os.chmod(entry, 0o555 if entry.is_dir() else 0o444)  # put back: the call goes through
    res = owner.oncepatch("apply", "p.diff", "--dir", str(site), "--key", "k1", "--json")
    assert res.returncode == 0, res
    assert (site / "README").read_text() == "R\n" and (site / "sub/g.txt").read_text() == "G\n"
    assert owner.oncepatch("verify", "--dir", str(site), "--grace", "0").returncode == 0

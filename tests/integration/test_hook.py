"""The pre-commit hook: ``.pre-commit-hooks.yaml`` and ``oncepatch install-hook`` (docs/DESIGN.md section 5).

The installed ``.git/hooks/pre-commit`` runs inside a real ``git commit`` with a
PATH that has no ``oncepatch`` on it (as when a venv is not activated): it
must fall back to the interpreter that installed it, block the commit while
an orphaned ``prepared`` receipt exists (verify's default grace: an orphan's
call is gone, so it fails at once), and let it through after ``recover``.
A hook that was there before is moved aside and still runs first (its
failure blocks too); installing twice changes nothing.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, Repo, make_repo, run_cli

BASE: dict[str, str | bytes] = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 21))}
BARE_PATH = "/usr/bin:/bin"  # git is there; oncepatch and the venv are not


def git_commit(repo: Repo, name: str) -> subprocess.CompletedProcess[str]:
    """Stage a new file and ``git commit`` it, hooks enabled, with a PATH lacking oncepatch."""
    repo.write(name, f"{name}\n")
    repo.git("add", name)
    env = {**os.environ, "PATH": BARE_PATH}
    assert subprocess.run(["sh", "-c", "command -v oncepatch"], env=env, capture_output=True).returncode != 0
    return subprocess.run(["git", "commit", "-q", "-m", f"add {name}"], cwd=repo.path, env=env,
                          capture_output=True, text=True, check=False)


def orphan(repo: Repo, tmp_path: Path) -> None:
    """A prepared receipt whose call died (crash after-prepare)."""
    head = repo.head()
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace("line 4\n", "four\n"))
    pf = tmp_path / "change.diff"
    pf.write_bytes(repo.git("diff", "--full-index").encode())
    repo.git("reset", "-q", "--hard", head)
    r = run_cli("apply", "--repo", str(repo.path), "--key", "k", "--json", str(pf),
                env={"ONCEPATCH_CRASH_AT": "after-prepare"})
    assert r.code == 137


def install(repo: Repo) -> Any:
    r = run_cli("install-hook", "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err
    return r.json


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return make_repo(tmp_path / "repo", BASE)


def hook_path(repo: Repo) -> Path:
    return repo.path / ".git" / "hooks" / "pre-commit"


# -- .pre-commit-hooks.yaml ------------------------------------------------------------------------


def _parse_hooks_yaml(text: str) -> list[dict[str, Any]]:
    """The flat list-of-mappings subset of YAML this file uses (no yaml dependency)."""
    hooks: list[dict[str, Any]] = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        m = re.fullmatch(r"(- |  )([a-z_]+): (.*)", line)
        assert m, f"unexpected line {raw!r}"
        if m.group(1) == "- ":
            hooks.append({})
        value: Any = m.group(3)
        if value in ("true", "false"):
            value = value == "true"
        elif value.startswith('"'):
            value = value.strip('"')
        hooks[-1][m.group(2)] = value
    return hooks


def test_pre_commit_hooks_yaml_declares_oncepatch_verify() -> None:
    hooks = _parse_hooks_yaml((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert len(hooks) == 1
    (h,) = hooks
    assert h["id"] == "oncepatch-verify" and h["name"]
    assert h["entry"] == "oncepatch verify"
    assert h["language"] == "python"
    assert h["pass_filenames"] is False and h["always_run"] is True
    assert h["minimum_pre_commit_version"] == "3.2.0"
    # The entry is the command pyproject installs (a console script).
    assert 'oncepatch = "patcher.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_the_entry_runs_verify(repo: Repo, tmp_path: Path) -> None:
    """``oncepatch verify`` (the entry, as pre-commit runs it in the repo) passes clean, fails on an orphan."""
    exe = Path(sys.executable).parent / "oncepatch"
    if not exe.exists():
        pytest.skip("the oncepatch console script is not installed beside this interpreter")
    ok = subprocess.run([str(exe), "verify"], cwd=repo.path, capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    orphan(repo, tmp_path)
    bad = subprocess.run([str(exe), "verify"], cwd=repo.path, capture_output=True, text=True, check=False)
    assert bad.returncode == 6 and "unresolved prepared receipt" in bad.stdout


# -- install-hook ----------------------------------------------------------------------------------------


def test_hook_blocks_commit_while_an_orphan_exists_and_passes_after_recover(repo: Repo, tmp_path: Path) -> None:
    doc = install(repo)
    assert doc == {"ok": True, "hook": str(hook_path(repo)), "chained": False, "changed": True}
    assert hook_path(repo).stat().st_mode & stat.S_IXUSR
    assert git_commit(repo, "first.txt").returncode == 0  # a clean store lets commits through

    orphan(repo, tmp_path)
    head = repo.head()
    blocked = git_commit(repo, "second.txt")
    assert blocked.returncode != 0
    out = blocked.stdout + blocked.stderr
    assert "unresolved prepared receipt" in out and "oncepatch recover" in out, out
    assert repo.head() == head

    assert run_cli("recover", "--repo", str(repo.path)).code == 0
    passed = git_commit(repo, "second.txt")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert repo.head() != head


def test_live_call_does_not_block_a_commit(repo: Repo, tmp_path: Path) -> None:
    """A prepared receipt whose call still holds its key lock is in progress, not an orphan."""
    install(repo)
    orphan(repo, tmp_path)
    holder_code = ("import sys, filelock\nlk = filelock.FileLock(sys.argv[1], thread_local=False)\n"
                   "lk.acquire()\nprint('locked', flush=True)\nsys.stdin.read()\n")
    import hashlib

    lock = repo.store / "locks" / f"{hashlib.sha256(b'k').hexdigest()}.lock"
    holder = subprocess.Popen([sys.executable, "-c", holder_code, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        assert git_commit(repo, "during.txt").returncode == 0
        # ... unless it has been held past the grace (stuck): ONCEPATCH_VERIFY_GRACE.
        stuck = run_cli("verify", "--repo", str(repo.path), env={"ONCEPATCH_VERIFY_GRACE": "0"})
        assert stuck.code == 6 and "still holds the key lock" in stuck.out
    finally:
        holder.kill()
        holder.wait()
    assert git_commit(repo, "after.txt").returncode != 0  # its call died: now an orphan


def test_existing_hook_is_moved_aside_and_still_runs(repo: Repo, tmp_path: Path) -> None:
    hooks = repo.path / ".git" / "hooks"
    hooks.mkdir(exist_ok=True)
    ran = tmp_path / "old-hook-ran"
    old = f"#!/bin/sh\necho ran >> '{ran}'\nexit ${{OLD_HOOK_EXIT:-0}}\n"
    hook_path(repo).write_text(old)
    hook_path(repo).chmod(0o755)

    doc = install(repo)
    assert doc["chained"] is True and doc["changed"] is True
    assert (hooks / "pre-commit.before-oncepatch").read_text() == old

    assert git_commit(repo, "one.txt").returncode == 0
    assert ran.read_text() == "ran\n"

    # A failing old hook still blocks the commit, even with a clean store.
    head = repo.head()
    repo.write("two.txt", "two\n")
    repo.git("add", "two.txt")
    env = {**os.environ, "PATH": BARE_PATH, "OLD_HOOK_EXIT": "3"}
    r = subprocess.run(["git", "commit", "-q", "-m", "two"], cwd=repo.path, env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode != 0 and repo.head() == head
    assert ran.read_text() == "ran\nran\n"
    assert run_cli("verify", "--repo", str(repo.path)).code == 0  # it was the old hook that failed


def test_installing_twice_is_idempotent(repo: Repo) -> None:
    hook_path(repo).parent.mkdir(exist_ok=True)
    hook_path(repo).write_text("#!/bin/sh\nexit 0\n")
    hook_path(repo).chmod(0o755)
    first = install(repo)
    content = hook_path(repo).read_bytes()
    chained = (hook_path(repo).parent / "pre-commit.before-oncepatch").read_bytes()
    second = install(repo)
    assert first["changed"] is True and second == {**first, "changed": False}
    assert hook_path(repo).read_bytes() == content
    assert (hook_path(repo).parent / "pre-commit.before-oncepatch").read_bytes() == chained
    names = {p.name for p in hook_path(repo).parent.iterdir() if p.name.startswith("pre-commit")}
    assert names - {"pre-commit.sample"} == {"pre-commit", "pre-commit.before-oncepatch"}
    text = run_cli("install-hook", "--repo", str(repo.path))
    assert text.code == 0 and "already installed" in text.out


def test_core_hookspath_is_where_the_hook_goes(repo: Repo, tmp_path: Path) -> None:
    """git runs hooks from core.hooksPath (relative: from the worktree's top): the hook goes there."""
    repo.git("config", "core.hooksPath", ".githooks")
    doc = install(repo)
    assert doc["hook"] == str(repo.path / ".githooks" / "pre-commit") and doc["changed"]
    assert not hook_path(repo).exists()
    orphan(repo, tmp_path)
    head = repo.head()
    blocked = git_commit(repo, "second.txt")
    assert blocked.returncode != 0 and "oncepatch recover" in blocked.stdout + blocked.stderr
    assert repo.head() == head
    assert install(repo)["changed"] is False


def test_a_foreign_hook_under_core_hookspath_is_refused_and_left_alone(repo: Repo) -> None:
    hooks = repo.path / "tools" / "hooks"
    hooks.mkdir(parents=True)
    theirs = hooks / "pre-commit"
    theirs.write_text("#!/bin/sh\n. \"$(dirname \"$0\")/h\"\n")
    theirs.chmod(0o755)
    repo.git("config", "core.hooksPath", str(hooks))
    before = sorted(p.name for p in hooks.iterdir())
    r = run_cli("install-hook", "--repo", str(repo.path), "--json")
    assert r.code == 2
    assert "core.hooksPath" in r.json["error"]["message"] and "oncepatch verify" in r.json["error"]["message"]
    assert theirs.read_text() == "#!/bin/sh\n. \"$(dirname \"$0\")/h\"\n"
    assert sorted(p.name for p in hooks.iterdir()) == before
    assert not hook_path(repo).exists()


def test_a_hooks_path_that_is_a_file_is_a_usage_error(repo: Repo, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x\n")
    repo.git("config", "core.hooksPath", str(blocker))
    r = run_cli("install-hook", "--repo", str(repo.path), "--json")
    assert r.code == 2, r.out + r.err
    assert r.json["error"]["type"] == "usage" and "nothing was changed" in r.json["error"]["message"]
    assert blocker.read_text() == "x\n" and "Traceback" not in r.err


@pytest.mark.parametrize("kind", ["file", "dangling symlink"])
def test_install_hook_with_an_unusable_store_installs_nothing(repo: Repo, tmp_path: Path, kind: str) -> None:
    store = tmp_path / "store"
    if kind == "file":
        store.write_text("x\n")
    else:
        store.symlink_to(tmp_path / "nowhere")
    r = run_cli("install-hook", "--repo", str(repo.path), "--store", str(store), "--json")
    assert r.code == 2 and r.json["error"]["type"] == "usage", r.out + r.err
    assert not (repo.path / ".git/hooks/pre-commit").exists()


def test_installing_again_with_another_store_rewrites_the_hook(repo: Repo, tmp_path: Path) -> None:
    """The second install used to report 'already installed' and keep verifying the first store."""
    other = tmp_path / "other-store"
    first = run_cli("install-hook", "--repo", str(repo.path), "--store", str(other), "--json")
    assert first.code == 0 and first.json["changed"] is True
    hook = repo.path / ".git/hooks/pre-commit"
    assert str(other) in hook.read_text()
    second = run_cli("install-hook", "--repo", str(repo.path), "--json")
    assert second.code == 0 and second.json["changed"] is True, second.out
    assert str(other) not in hook.read_text()
    assert not (repo.path / ".git/hooks/pre-commit.before-oncepatch").exists()  # ours: rewritten, not chained
    third = run_cli("install-hook", "--repo", str(repo.path), "--json")
    assert third.code == 0 and third.json["changed"] is False

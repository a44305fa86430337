"""The policy (receipts/policy.py): authorize, then idempotency (issue 26, part 3).

A refusal is ``forbidden`` (exit 4, final, not retryable) and leaves the
repository, its index and worktree byte-for-byte as they were; the store gains
one ledger event naming the caller and what it asked, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, run_cli, snapshot

import patcher
from receipts.errors import Forbidden
from receipts.policy import Caller, may_read

POLICY = """\
schema = "oncepatch.policy/1"
deny_paths = [".github/workflows/**", ".git*"]

[[allow]]
users = [{uid}]
branches = ["main"]
paths = ["src/**", "docs"]
formats = ["unified"]
max_patch_bytes = 4096
max_files = 3
"""

ADD_WORKFLOW = (b"--- /dev/null\n+++ b/.github/workflows/ci.yml\n@@ -0,0 +1 @@\n+on: push\n")
EDIT_APP = b"--- a/src/app.py\n+++ b/src/app.py\n@@ -1,2 +1,2 @@\n-line 1\n+one\n line 2\n"


def with_policy(repo: Repo, text: str | None = None) -> Path:
    repo.store.mkdir(parents=True, exist_ok=True)
    path = repo.store / "policy.toml"
    path.write_text(text if text is not None else POLICY.format(uid=os.getuid()))
    return path


def apply_cli(repo: Repo, patch: bytes, *args: str) -> Any:
    return run_cli("apply", "--repo", str(repo.path), "--json", *args, "-", input=patch)


def events(repo: Repo) -> list[dict[str, Any]]:
    path = repo.store / "events.jsonl"
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def assert_only_a_refusal_event(repo: Repo, before: dict[str, Any], after: dict[str, Any]) -> None:
    for part in ("refs", "head", "index", "worktree"):
        assert after[part] == before[part], part
    changed = {p for p in set(before["store"]) | set(after["store"]) if before["store"].get(p) != after["store"].get(p)}
    assert changed <= {"events.jsonl", "locks/ledger.lock"} and "events.jsonl" in changed, changed
    assert not any(p.startswith("receipts/") for p in after["store"])


def test_a_refused_call_changes_nothing_but_one_ledger_event(repo: Repo) -> None:
    with_policy(repo)
    before = snapshot(repo)
    r = apply_cli(repo, ADD_WORKFLOW, "--key", "wf")
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "forbidden" and err["retryable"] is False and err["effect_status"] == "not_started"
    assert err["next_action"] == "none" and err["key"] == "wf"
    assert "'.github/workflows/ci.yml' is denied by the policy ('.github/workflows/**')" in err["message"]
    assert_only_a_refusal_event(repo, before, snapshot(repo))
    (event,) = events(repo)
    assert event["event"] == "forbidden" and event["caller"]["uid"] == os.getuid()
    assert event["request"]["key"] == "wf" and event["request"]["paths"] == [".github/workflows/ci.yml"]
    assert event["request"]["branch"] == "refs/heads/main" and "wf" not in event.get("key", "")
    v = run_cli("verify", "--repo", str(repo.path), "--json")
    assert v.code == 0, v.out  # a refusal event is no receipt's: verify expects no file for it


def test_a_retry_of_a_forbidden_call_is_still_forbidden(repo: Repo) -> None:
    with_policy(repo)
    first = apply_cli(repo, ADD_WORKFLOW, "--key", "wf")
    before = snapshot(repo)
    again = apply_cli(repo, ADD_WORKFLOW, "--key", "wf")
    assert first.code == again.code == 4 and again.json["error"]["type"] == "forbidden"
    assert_only_a_refusal_event(repo, before, snapshot(repo))
    assert [e["event"] for e in events(repo)] == ["forbidden", "forbidden"]


def test_an_allowed_call_commits(repo: Repo) -> None:
    with_policy(repo)
    r = apply_cli(repo, EDIT_APP, "--key", "ok")
    assert r.code == 0 and r.json["status"] == "committed", r.out
    assert (repo.path / "src/app.py").read_text().startswith("one\n")
    assert [e["event"] for e in events(repo)] == ["prepared", "committed"]


def test_authorize_runs_before_the_key_is_looked_up(repo: Repo) -> None:
    done = apply_cli(repo, EDIT_APP, "--key", "k")
    assert done.code == 0
    # The caller is no longer allowed this branch: its replay is refused too, never answered.
    with_policy(repo, POLICY.format(uid=os.getuid()).replace('branches = ["main"]', 'branches = ["agent/*"]'))
    r = apply_cli(repo, EDIT_APP, "--key", "k")
    assert r.code == 4 and r.json["error"]["type"] == "forbidden", r.out
    assert "branch 'refs/heads/main' is not one rule 1 allows" in r.json["error"]["message"]
    assert "commit" not in r.json


@pytest.mark.parametrize(("patch", "args", "caller", "why"), [
    (EDIT_APP, {}, "other", "no rule of the policy names uid 4242"),
    (EDIT_APP, {"branch": "side"}, "me", "branch 'refs/heads/side' is not one rule 1 allows"),
    (EDIT_APP.replace(b"src/app.py", b"README"), {}, "me", "'README' is outside the paths rule 1 allows"),
    (EDIT_APP.replace(b"src/app.py", b".gitattributes"), {}, "me", "'.gitattributes' is denied by the policy"),
    (EDIT_APP, {"format": "apply_patch"}, "me", "format 'apply_patch' is not one rule 1 allows"),
    (EDIT_APP + b"\n" * 5000, {}, "me", "over rule 1's 4096"),
], ids=["caller", "branch", "path", "dotgit", "format", "size"])
def test_each_limit_of_a_rule_refuses_through_the_api(repo: Repo, patch: bytes, args: dict[str, str], caller: str,
                                                      why: str) -> None:
    with_policy(repo)
    repo.git("branch", "side")
    who = Caller.of(4242, 4242) if caller == "other" else Caller.current()
    before = snapshot(repo)
    with pytest.raises(Forbidden) as err:
        patcher.apply(str(repo.path), patch, key="x", caller=who, **args)
    assert why in err.value.message and err.value.exit_code == 4 and not err.value.retryable
    assert_only_a_refusal_event(repo, before, snapshot(repo))
    assert events(repo)[-1]["caller"]["uid"] == who.uid


@pytest.mark.parametrize("source", ["config/secrets/db.txt", "README"], ids=["denied", "outside"])
def test_a_copy_from_a_path_the_policy_keeps_out_is_refused(repo: Repo, source: str) -> None:
    """A copy reads its source into the tree: copying a secret into an allowed folder is refused."""
    repo.write("config/secrets/db.txt", "hunter2\n")
    repo.commit_all("a secret")
    with_policy(repo, POLICY.format(uid=os.getuid()).replace('".git*"]', '".git*", "**/secrets/**"]'))
    copy = (f"diff --git a/{source} b/src/leak.txt\nsimilarity index 100%\n"
            f"copy from {source}\ncopy to src/leak.txt\n").encode()
    before = snapshot(repo)
    r = apply_cli(repo, copy, "--key", "leak")
    assert r.code == 4 and r.json["error"]["type"] == "forbidden", r.out
    why = "is denied by the policy ('**/secrets/**')" if source != "README" else "is outside the paths rule 1 allows"
    assert f"'{source}' {why}" in r.json["error"]["message"], r.out
    assert_only_a_refusal_event(repo, before, snapshot(repo))
    assert not (repo.path / "src/leak.txt").exists()
    assert events(repo)[-1]["request"]["paths"] == [source, "src/leak.txt"]


@pytest.mark.parametrize("allowed", ["repository", "remote", "neither"])
def test_a_remote_mode_call_is_judged_by_its_repository_or_its_remote(repo: Repo, tmp_path: Path,
                                                                      allowed: str) -> None:
    """docs/REMOTE.md: the call's key is claimed on a remote; its rule may name either."""
    bare = tmp_path / "remote.git"
    repo.git("init", "-q", "--bare", "-b", "main", str(bare))
    repo.git("remote", "add", "origin", str(bare))
    repo.git("push", "-q", "origin", "main")
    pattern = {"repository": str(repo.path), "remote": str(bare), "neither": str(tmp_path / "other*")}[allowed]
    with_policy(repo, f'schema = "oncepatch.policy/1"\n[[allow]]\nrepos = ["{pattern}"]\n')
    r = apply_cli(repo, EDIT_APP, "--key", "r", "--remote", "origin")
    if allowed != "neither":
        assert r.code == 0 and r.json["status"] == "committed", r.out
        return
    assert r.code == 4 and r.json["error"]["type"] == "forbidden", r.out
    assert f"repository '{repo.path}' (remote '{bare}') is not one rule 1 allows" in r.json["error"]["message"]
    assert events(repo)[-1]["request"]["remote"] == str(bare)


def test_a_policy_that_cannot_be_read_refuses_every_call(repo: Repo) -> None:
    with_policy(repo, POLICY.format(uid=os.getuid()).replace("deny_paths =", "deny_path ="))
    before = snapshot(repo)
    r = apply_cli(repo, EDIT_APP)
    assert r.code == 2 and "unknown keys: deny_path" in r.json["error"]["message"], r.out
    assert snapshot(repo) == before


def test_a_policy_named_by_the_environment_is_used_and_must_exist(repo: Repo, tmp_path: Path) -> None:
    outside = tmp_path / "policy.toml"
    outside.write_text(POLICY.format(uid=os.getuid()))
    r = run_cli("apply", "--repo", str(repo.path), "--json", "-", input=ADD_WORKFLOW,
                env={"ONCEPATCH_POLICY": str(outside)})
    assert r.code == 4 and r.json["error"]["policy"] == str(outside)
    r = run_cli("apply", "--repo", str(repo.path), "--json", "-", input=EDIT_APP,
                env={"ONCEPATCH_POLICY": str(tmp_path / "missing.toml")})
    assert r.code == 2 and "no such file" in r.json["error"]["message"]


def test_may_read_judges_each_folder_on_the_way_by_its_mode_bits(tmp_path: Path) -> None:
    """What a broker asks before it answers about a store for its caller (docs/SECURITY.md, the broker)."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # (pytest's own folder is its user's alone)
    try:
        base.chmod(0o755)
        group, other = Caller(54321, 54321, frozenset({54321, 4711})), Caller(54322, 54322, frozenset({54322}))
        store = base / "repo" / ".git" / "oncepatch"
        store.mkdir(parents=True)
        assert may_read(other, str(store)) and may_read(other, str(store / "not" / "made"))
        os.chown(base / "repo", 0, 4711)
        (base / "repo").chmod(0o750)  # the group's: a member reads it, no one else
        assert may_read(group, str(store)) and not may_read(other, str(store))
        link = base / "link"
        link.symlink_to(base / "repo")
        assert not may_read(other, str(link / ".git" / "oncepatch"))  # a symlink is judged where it leads
        (base / "repo").chmod(0o711)  # searchable, not listable: a store not made yet needs its folder read
        assert may_read(other, str(store)) and not may_read(other, str(base / "repo" / "new"))
        if os.geteuid() == 0:
            os.chown(store, 54322, 54322)
            store.chmod(0o700)
            assert may_read(other, str(store)) and not may_read(group, str(store))
    finally:
        shutil.rmtree(base)


def test_may_read_counts_the_callers_own_group(tmp_path: Path) -> None:
    """The kernel's peer groups are the supplementary ones: a folder of the caller's own group is still its to read."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        base.chmod(0o755)
        store = base / "repo" / ".git" / "oncepatch"
        store.mkdir(parents=True)
        os.chown(base / "repo", 0, 4711)
        (base / "repo").chmod(0o750)
        member, other = Caller(54323, 4711, frozenset()), Caller(54322, 54322, frozenset({54322}))
        assert may_read(member, str(store)) and not may_read(other, str(store))
    finally:
        shutil.rmtree(base)

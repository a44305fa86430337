"""`oncepatch apply` through the real CLI on real repositories: what one call leaves behind.

Each shape of change is made with the git CLI, turned into a patch with
`git diff --full-index -M`, and then applied twice from the same base: once by
`git apply --index` + `git commit` in a clone (the reference), once by
oncepatch.  The trees must be the same object, and the receipt, the worktree,
the index, the key ref, the commit trailer and `git fsck --strict` must all
agree with it.  The second half covers replays (docs/DESIGN.md sections 2 and 4).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, git, make_repo, run_cli, snapshot

BASE_FILES: dict[str, str | bytes] = {
    "README": "hello\n",
    "src/app.py": "".join(f"line {i}\n" for i in range(1, 21)),
    "src/util.py": "def f():\n    return 1\n",
    "docs/guide.txt": "guide\n",
    "crlf.txt": b"one\r\ntwo\r\nthree\r\nfour\r\n",
    "noeol.txt": b"alpha\nbeta\ngamma",
    "latin1.txt": b"caf\xe9\n\xff\xfe raw\nplain\n",
    "x": "x is a file\n",
    "folder/inner.txt": "inside\n",
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_ref(key: str) -> str:
    return "refs/oncepatch/keys/" + sha256(key.encode())


def ledger(repo: Repo, *extra: str) -> list[dict[str, Any]]:
    r = run_cli("log", "--repo", str(repo.path), "--json", *extra)
    assert r.code == 0, r.err
    events: list[dict[str, Any]] = r.json["events"]
    return events


# -- the shapes of change ------------------------------------------------------------------


def _modify(r: Repo) -> None:
    text = (r.path / "src/app.py").read_text().replace("line 3\n", "line three\n").replace("line 17\n", "")
    r.write("src/app.py", text)


def _add(r: Repo) -> None:
    r.write("new.txt", "brand new\nfile\n")


def _delete(r: Repo) -> None:
    r.git("rm", "-q", "docs/guide.txt")


def _rename(r: Repo) -> None:
    r.git("mv", "src/app.py", "src/main.py")


def _rename_edit(r: Repo) -> None:
    (r.path / "lib").mkdir()
    r.git("mv", "src/app.py", "lib/main.py")
    r.write("lib/main.py", (r.path / "lib/main.py").read_text().replace("line 10\n", "line ten\n"))


def _mode_exec(r: Repo) -> None:
    (r.path / "src/util.py").chmod(0o755)


def _mode_exec_and_edit(r: Repo) -> None:
    r.write("src/util.py", "#!/bin/sh\ndef f():\n    return 1\n", mode=0o755)


def _symlink_add(r: Repo) -> None:
    os.symlink("app.py", r.path / "src/link.py")


def _crlf(r: Repo) -> None:
    r.write("crlf.txt", b"one\r\nTWO\r\nthree\r\nfour\r\nfive\r\n")


def _noeol_keep(r: Repo) -> None:
    r.write("noeol.txt", b"alpha\nbeta\nGAMMA")


def _noeol_fix(r: Repo) -> None:
    r.write("noeol.txt", b"alpha\nbeta\ngamma\n")


def _noeol_make(r: Repo) -> None:
    r.write("README", b"hello\nworld")


def _non_utf8(r: Repo) -> None:
    r.write("latin1.txt", b"caf\xe9 cr\xe8me\n\xff\xfe raw\nplain\n\x80\x81\n")


def _empty_add(r: Repo) -> None:
    r.write("empty", b"")


def _nested(r: Repo) -> None:
    r.write("a/b/c/d/e.txt", "deep\n")
    r.write("a/b/other.txt", "other\n")


def _file_to_folder(r: Repo) -> None:
    r.git("rm", "-q", "x")
    r.write("x/y", "y now lives under x\n")


def _folder_to_file(r: Repo) -> None:
    r.git("rm", "-q", "-r", "folder")
    r.write("folder", "folder is a file now\n")


def _symlink_to_file(r: Repo) -> None:
    (r.path / "src/alias.py").unlink()
    r.write("src/alias.py", "now a regular file\n")


def _multi(r: Repo) -> None:
    _modify(r)
    _add(r)
    _delete(r)
    r.git("mv", "src/util.py", "src/helpers.py")
    _crlf(r)
    _nested(r)


CASES: dict[str, Callable[[Repo], None]] = {
    "modify": _modify,
    "add": _add,
    "delete": _delete,
    "rename": _rename,
    "rename_with_edit": _rename_edit,
    "mode_exec": _mode_exec,
    "mode_exec_and_edit": _mode_exec_and_edit,
    "symlink_add": _symlink_add,
    "crlf": _crlf,
    "no_newline_keep": _noeol_keep,
    "no_newline_fixed": _noeol_fix,
    "no_newline_made": _noeol_make,
    "non_utf8": _non_utf8,
    "empty_add": _empty_add,
    "nested_new_folders": _nested,
    "file_to_folder": _file_to_folder,
    "folder_to_file": _folder_to_file,
    "symlink_to_file": _symlink_to_file,
    "multi_file": _multi,
}
XFAIL: dict[str, str] = {}


def prepare(tmp_path: Path, change: Callable[[Repo], None]) -> tuple[Repo, bytes, str, str]:
    """A repo at the base commit, the patch of ``change``, the base oid and the target tree oid."""
    repo = make_repo(tmp_path / "repo", BASE_FILES)
    os.symlink("util.py", repo.path / "src/alias.py")
    base = repo.commit_all("base has a symlink")
    change(repo)
    target = repo.commit_all("target")
    target_tree = repo.head(f"{target}^{{tree}}")
    patch = git(repo.path, "diff", "--full-index", "-M", base, target).encode("utf-8", "surrogateescape")
    repo.git("reset", "-q", "--hard", base)
    assert repo.git("status", "--porcelain") == ""
    return repo, patch, base, target_tree


def reference_tree(tmp_path: Path, repo: Repo, patch_file: Path) -> str:
    """The tree `git apply --index` + `git commit` makes of the same patch on the same base."""
    clone = tmp_path / "reference"
    git(tmp_path, "clone", "-q", str(repo.path), str(clone))
    git(clone, "apply", "--index", str(patch_file))
    git(clone, "commit", "-q", "-m", "reference")
    return git(clone, "rev-parse", "HEAD^{tree}").strip()


def assert_outputs_match_commit(repo: Repo, workdir: Path, commit: str, base: str,
                                outputs: list[dict[str, Any]]) -> None:
    """Every output's digest, blob and mode are the commit's and the worktree's; deletions are gone."""
    changed = set(repo.git("diff", "--name-only", "--no-renames", "-z", base, commit).split("\0")) - {""}
    named: set[str] = set()
    for out in outputs:
        path = out["path"]
        named.add(path)
        if out["op"] == "delete":
            assert out["sha256"] is None and out["blob"] is None
            # Gone as a file (a folder may have taken its place).
            assert " blob " not in repo.git("ls-tree", commit, "--", path)
            assert not os.path.lexists(workdir / path) or (workdir / path).is_dir()
            continue
        if out["op"] == "rename":
            named.add(out["from"])
            assert repo.git("ls-tree", commit, "--", out["from"]) == ""
            assert not os.path.lexists(workdir / out["from"])
        mode, kind, blob = repo.git("ls-tree", commit, "--", path).split("\t")[0].split()
        assert kind == "blob"
        assert out["blob"] == blob
        assert out["mode"] == int(mode, 8)
        committed = git_bytes(repo.path, "cat-file", "blob", blob)
        assert out["sha256"] == sha256(committed)
        full = workdir / path
        if mode == "120000":
            assert full.is_symlink()
            assert os.fsencode(os.readlink(full)) == committed
        else:
            assert not full.is_symlink() and full.is_file()
            assert sha256(full.read_bytes()) == out["sha256"]
            assert bool(full.stat().st_mode & 0o100) == (mode == "100755")
    assert named == changed


def git_bytes(cwd: Path, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=True).stdout


def assert_clean_and_sound(repo: Repo, workdir: Path | None = None) -> None:
    wd = workdir or repo.path
    assert git(wd, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(wd, "diff", "--cached") == ""
    assert git(wd, "diff") == ""
    fsck = subprocess.run(["git", "fsck", "--strict", "--no-dangling"], cwd=repo.path, capture_output=True,
                          check=False)
    assert fsck.returncode == 0, fsck.stderr
    assert b"error" not in fsck.stderr.lower() and b"warning" not in fsck.stderr.lower(), fsck.stderr


def trailer_values(repo: Repo, commit: str, name: str) -> list[str]:
    out = repo.git("log", "-1", f"--format=%(trailers:key={name},valueonly,separator=%x00)", commit)
    return [v for v in out.strip("\n").split("\0") if v]


@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=XFAIL[name])) if name in XFAIL else name
     for name in CASES],
)
def test_apply_makes_one_commit_equal_to_git_apply(tmp_path: Path, case: str) -> None:
    repo, patch, base, target_tree = prepare(tmp_path, CASES[case])
    patch_file = tmp_path / "change.patch"
    patch_file.write_bytes(patch)
    expected_tree = reference_tree(tmp_path, repo, patch_file)
    assert expected_tree == target_tree

    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err
    doc = r.json
    assert doc["ok"] is True and doc["status"] == "committed" and doc["replayed"] is False
    assert doc["key"] == doc["call_id"] and doc["call_id"].startswith("opc1:")
    assert "warnings" not in doc, doc["warnings"]

    head = repo.head()
    assert repo.git("rev-list", f"{base}..{head}").split() == [head], "exactly one new commit"
    assert repo.head(f"{head}^") == base
    assert repo.head(f"{head}^{{tree}}") == expected_tree
    assert doc["commit"] == head and doc["tree"] == expected_tree

    receipt = json.loads(Path(doc["receipt"]).read_bytes())
    assert Path(doc["receipt"]).parent.parent.parent == repo.store
    assert receipt["status"] == "committed" and receipt["commit"] == head and receipt["tree"] == expected_tree
    assert receipt["key"] == doc["key"] and receipt["call_id"] == doc["call_id"]
    assert receipt["base"] == {"ref": "refs/heads/main", "commit": base}
    assert receipt["outputs"] == doc["outputs"]
    assert receipt["identity"]["args"]["patch_sha256"] == sha256(patch)
    assert_outputs_match_commit(repo, repo.path, head, base, receipt["outputs"])

    assert_clean_and_sound(repo)
    assert trailer_values(repo, head, "Oncepatch-Call") == [doc["call_id"]]
    assert repo.head(key_ref(doc["key"])) == head
    events = [json.loads(line) for line in (repo.store / "events.jsonl").read_bytes().splitlines()]
    assert [e["event"] for e in events] == ["prepared", "committed"]
    assert events[-1]["key"] == doc["key"]


def test_apply_to_branch_not_checked_out_leaves_worktree_and_index(tmp_path: Path) -> None:
    repo, patch, base, target_tree = prepare(tmp_path, _multi)
    repo.git("branch", "other", base)
    repo.write("src/app.py", "local edit that a write to 'other' must not touch\n")  # dirty, on purpose
    repo.commit_all("main moves on")
    repo.write("README", "uncommitted\n")
    main_before = repo.head("main")
    before = snapshot(repo)

    r = run_cli("apply", "-", "--repo", str(repo.path), "--branch", "other", "--json", input=patch)
    assert r.code == 0, r.out + r.err
    after = snapshot(repo)
    assert after["worktree"] == before["worktree"]
    assert after["index"] == before["index"]
    assert after["head"] == before["head"]
    assert repo.head("main") == main_before
    other = repo.head("other")
    assert repo.git("rev-list", f"{base}..other").split() == [other]
    assert repo.head("other^{tree}") == target_tree
    assert r.json["commit"] == other
    assert r.json["outputs"] and all(o["path"] for o in r.json["outputs"])
    assert repo.head(key_ref(r.json["key"])) == other
    receipt = json.loads(Path(r.json["receipt"]).read_bytes())
    assert receipt["base"] == {"ref": "refs/heads/other", "commit": base}


def test_apply_updates_linked_worktree_that_has_the_branch(tmp_path: Path) -> None:
    repo, patch, base, target_tree = prepare(tmp_path, _multi)
    wt = tmp_path / "wt"
    repo.git("worktree", "add", "-q", "-b", "feature", str(wt), base)
    main_before = snapshot(repo)

    # Run from inside the linked worktree: the branch defaults to its HEAD.
    r = run_cli("apply", "-", "--json", cwd=wt, input=patch)
    assert r.code == 0, r.out + r.err
    feature = repo.head("feature")
    assert r.json["commit"] == feature and repo.head("feature^") == base
    assert repo.head("feature^{tree}") == target_tree
    # The store is the shared one in the common dir, not inside the linked worktree's git dir.
    assert Path(r.json["receipt"]).is_relative_to(repo.store)
    assert_outputs_match_commit(repo, wt, feature, base, r.json["outputs"])
    assert_clean_and_sound(repo, wt)
    assert git(wt, "rev-parse", "HEAD").strip() == feature
    after = snapshot(repo)
    assert after["worktree"] == main_before["worktree"] and after["index"] == main_before["index"]
    assert repo.head("main") == base


def test_apply_from_main_repo_targets_branch_of_linked_worktree(tmp_path: Path) -> None:
    repo, patch, base, target_tree = prepare(tmp_path, _modify)
    wt = tmp_path / "wt"
    repo.git("worktree", "add", "-q", "-b", "feature", str(wt), base)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--branch", "feature", "--json", input=patch)
    assert r.code == 0, r.out + r.err
    assert (wt / "src/app.py").read_bytes() == git_bytes(repo.path, "show", "feature:src/app.py")
    assert_clean_and_sound(repo, wt)
    assert git(repo.path, "status", "--porcelain") == ""


def test_apply_updates_every_worktree_on_the_branch(tmp_path: Path) -> None:
    repo, patch, base, target_tree = prepare(tmp_path, _multi)
    wt = tmp_path / "second"
    repo.git("worktree", "add", "-q", "-f", str(wt), "main")  # 'main' checked out twice
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", input=patch)
    assert r.code == 0, r.out + r.err
    head = repo.head("main")
    for workdir in (repo.path, wt):
        assert_outputs_match_commit(repo, workdir, head, base, r.json["outputs"])
        assert_clean_and_sound(repo, workdir)


# -- replay -------------------------------------------------------------------------------


@pytest.fixture
def applied(tmp_path: Path) -> tuple[Repo, Path, dict[str, Any]]:
    repo = make_repo(tmp_path / "repo", BASE_FILES)
    base = repo.head()
    _modify(repo)
    target = repo.commit_all("target")
    patch_file = tmp_path / "p.patch"
    patch_file.write_bytes(git(repo.path, "diff", "--full-index", base, target).encode())
    repo.git("reset", "-q", "--hard", base)
    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err
    return repo, patch_file, r.json


def test_replay_returns_stored_outcome_without_writing(applied: tuple[Repo, Path, dict[str, Any]]) -> None:
    repo, patch_file, first = applied
    receipt = Path(first["receipt"])
    st = receipt.stat()
    data = receipt.read_bytes()
    events = ledger(repo)
    count = repo.count()
    time.sleep(0.05)  # a rewrite would now show a new mtime as well as a new inode

    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err
    assert r.json["replayed"] is True
    assert {k: v for k, v in r.json.items() if k != "replayed"} == {k: v for k, v in first.items() if k != "replayed"}
    assert repo.count() == count and repo.head() == first["commit"]
    st2 = receipt.stat()
    assert receipt.read_bytes() == data
    assert (st2.st_mtime_ns, st2.st_ino) == (st.st_mtime_ns, st.st_ino)
    after = ledger(repo)
    assert after[: len(events)] == events and len(after) == len(events) + 1
    assert after[-1]["event"] == "replayed" and after[-1]["key"] == first["key"]
    assert after[-1]["call_id"] == first["call_id"] and after[-1]["status"] == "committed"

    # Human output says so too.
    r = run_cli("apply", str(patch_file), "--repo", str(repo.path))
    assert r.code == 0 and r.out.startswith("replayed: committed")


def test_same_key_other_patch_is_conflict_and_changes_nothing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", BASE_FILES)
    base = repo.head()
    _add(repo)
    t1 = repo.commit_all("t1")
    p1 = git(repo.path, "diff", "--full-index", base, t1).encode()
    repo.git("reset", "-q", "--hard", base)
    _empty_add(repo)
    t2 = repo.commit_all("t2")
    p2 = git(repo.path, "diff", "--full-index", base, t2).encode()
    repo.git("reset", "-q", "--hard", base)

    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "ticket-42", "--json", input=p1)
    assert r.code == 0, r.out + r.err
    first = r.json
    repo.git("branch", "side", base)
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "ticket-42", "--json", input=p2)
    assert r.code == 3, r.out + r.err
    err = r.json["error"]
    assert r.json["ok"] is False
    assert err["type"] == "idempotency_conflict"
    assert err["key"] == "ticket-42"
    assert err["retryable"] is False
    assert err["effect_status"] == "not_started"
    assert err["next_action"] == "new_key"
    assert err["differs"] == ["args.patch_sha256"]
    assert "args.patch_sha256 differs" in err["message"] and "new key" in err["message"]
    assert err["existing_call_id"] == first["call_id"]
    assert snapshot(repo) == before  # not even a ledger line

    # Another branch is another intent too.
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "ticket-42", "--branch", "side", "--json", input=p1)
    assert r.code == 3 and r.json["error"]["type"] == "idempotency_conflict"
    assert snapshot(repo) == before
    assert repo.head("side") == base


def test_retry_after_branch_moved_replays(applied: tuple[Repo, Path, dict[str, Any]]) -> None:
    repo, patch_file, first = applied
    repo.write("later.txt", "someone else's commit\n")
    moved = repo.commit_all("later work")
    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--json")
    assert r.code == 0, r.out + r.err
    assert r.json["replayed"] is True and r.json["commit"] == first["commit"]
    assert repo.head() == moved and repo.count() == 3
    assert repo.git("log", "--format=%H", "--grep", "Oncepatch-Call").split() == [first["commit"]]


def test_next_attempt_is_new_call_and_sees_change_already_applied(
    applied: tuple[Repo, Path, dict[str, Any]],
) -> None:
    repo, patch_file, first = applied
    head = repo.head()
    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--attempt", "2", "--json")
    assert r.code == 0, r.out + r.err
    doc = r.json
    assert doc["call_id"] != first["call_id"] and doc["key"] == doc["call_id"]
    assert doc["replayed"] is False and doc["already_applied"] is True
    assert doc["commit"] == head and repo.head() == head and repo.count() == 2
    receipt = json.loads(Path(doc["receipt"]).read_bytes())
    assert receipt["status"] == "committed" and receipt["already_applied"] is True
    assert receipt["identity"]["attempt"] == 2 and receipt["candidate"] is None
    assert doc["outputs"] == first["outputs"]
    # No key ref: no commit was made for this key.
    assert repo.git("rev-parse", "--verify", "-q", key_ref(doc["key"]), check=False) == ""
    # And attempt 2 replays from now on.
    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--attempt", "2", "--json")
    assert r.code == 0 and r.json["replayed"] is True and r.json["already_applied"] is True
    assert repo.count() == 2


def test_next_attempt_after_revert_applies_again(applied: tuple[Repo, Path, dict[str, Any]]) -> None:
    repo, patch_file, first = applied
    repo.git("revert", "--no-edit", first["commit"])
    reverted = repo.head()
    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--json")
    assert r.code == 0 and r.json["replayed"] is True and repo.head() == reverted
    r = run_cli("apply", str(patch_file), "--repo", str(repo.path), "--attempt", "2", "--json")
    assert r.code == 0, r.out + r.err
    assert r.json["replayed"] is False and "already_applied" not in r.json
    assert repo.head("HEAD^") == reverted
    assert repo.head("HEAD^{tree}") == repo.head(f"{first['commit']}^{{tree}}")


def test_log_prints_a_hand_edited_ledger_line_it_cannot_read_as_an_event(repo: Repo, cli: Any) -> None:
    """A line that is a JSON object without the fields of an event: listed, not a crash (verify judges it)."""
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"
    assert cli("apply", "-", "--repo", str(repo.path), "--json", input=patch).code == 0
    with open(repo.store / "events.jsonl", "ab") as fh:
        fh.write(b'{"bogus":1}\n{"seq":5,"event":null}\n')
    text = cli("log", "--repo", str(repo.path))
    assert text.code == 0, text.err
    assert len(text.out.splitlines()) == 1 + 4  # the header, then one row per line
    js = cli("log", "--repo", str(repo.path), "--json")
    assert js.code == 0 and js.json["events"][-2] == {"bogus": 1}
    assert cli("log", "--repo", str(repo.path), "--limit", "-1").code == 2
    assert cli("verify", "--repo", str(repo.path)).code == 6


def test_an_abbreviated_option_is_a_usage_error(repo: Repo, cli: Any) -> None:
    """'--js' is not '--json': argparse took it for --json while the output was chosen as text."""
    r = cli("log", "--repo", str(repo.path), "--js")
    assert r.code == 2 and "--js" in r.err


@pytest.mark.parametrize("args", [
    ("apply", "-", "--attempt", "0"), ("apply", "-", "--attempt", "-2"), ("apply", "-", "--lock-timeout", "-1"),
    ("apply", "-", "--lock-timeout", "nan"), ("apply", "-", "--check-timeout", "0"), ("apply", "-", "--store", ""),
    ("apply", "-", "--repo", ""), ("verify", "--jobs", "0"), ("verify", "--grace", "-5"),
    ("watch", "--once", "--rescan", "0"), ("recover", "--store", ""), ("recover", "--jobs", "0"),
])
def test_options_no_call_can_mean_are_usage_errors_and_change_nothing(repo: Repo, cli: Any,
                                                                      args: tuple[str, ...]) -> None:
    """An empty store path used to mean the default store, a negative lock timeout or 0 jobs were taken."""
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"
    before = snapshot(repo)
    cwd_args = () if "--repo" in args else ("--repo", str(repo.path))
    r = cli(*args, *cwd_args, "--json", input=patch)
    assert r.code == 2, r.out + r.err
    assert r.json["error"]["type"] == "usage" and r.json["error"]["effect_status"] == "not_started"
    assert snapshot(repo) == before


def test_the_api_refuses_options_no_call_can_mean(repo: Repo) -> None:
    from cas.errors import UsageError
    from patcher.protocol import apply

    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"
    before = snapshot(repo)
    for kw in ({"attempt": 0}, {"attempt": True}, {"lock_timeout": -1.0}, {"lock_timeout": float("nan")},
               {"check_timeout": 0.0}, {"store": ""}):
        with pytest.raises(UsageError):
            apply(str(repo.path), patch, key="k", **kw)  # type: ignore[arg-type]
    assert snapshot(repo) == before


def test_status_of_a_key_a_running_call_holds_is_in_progress(repo: Repo, cli: Any) -> None:
    """Before its receipt exists, a call holds its key's lock; a rival told 'in_progress, ask (status)' used to
    get 'not_found' from status. Nothing is created by asking."""
    from receipts.flock import file_lock
    from receipts.store import ReceiptStore

    rstore = ReceiptStore(str(repo.store))
    assert cli("status", "k", "--repo", str(repo.path), "--json").code == 2  # no call, no receipt
    assert not os.path.exists(rstore.lock_path("k"))
    os.makedirs(os.path.dirname(rstore.lock_path("k")), exist_ok=True)
    lock = file_lock(rstore.lock_path("k"))
    lock.acquire(timeout=1)
    try:
        r = cli("status", "k", "--repo", str(repo.path), "--json")
        assert r.code == 5 and r.json["error"]["type"] == "in_progress", r.out
    finally:
        lock.release()
    assert cli("status", "k", "--repo", str(repo.path), "--json").code == 2


@pytest.mark.parametrize("point", ["after-stage", "check-running"])
def test_status_of_a_call_killed_before_it_prepared_says_a_retry_is_safe(repo: Repo, cli: Any, point: str) -> None:
    """Killed before its receipt existed, a call did nothing a retry could double: status says so (exit 2,
    not_found, as docs/DESIGN.md's table has it, with next_action retry, not fix_input)."""
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"
    extra = ["--check", "true"] if point == "check-running" else []
    r = cli("apply", "-", "--repo", str(repo.path), "--key", "k", *extra, input=patch,
            env={"ONCEPATCH_CRASH_AT": point})
    assert r.code == 137
    js = cli("status", "k", "--repo", str(repo.path), "--json")
    assert js.code == 2, js.out
    err = js.json["error"]
    assert (err["type"], err["effect_status"], err["next_action"], err["retryable"]) == (
        "not_found", "not_started", "retry", True)
    text = cli("status", "k", "--repo", str(repo.path))
    assert text.code == 2 and "a retry is safe" in text.err and "(next: retry)" in text.err, text.err
    again = cli("apply", "-", "--repo", str(repo.path), "--key", "k", input=patch)
    assert again.code == 0, again.err  # and it was


def test_already_applied_never_names_another_keys_commit_as_this_keys(repo: Repo, cli: Any) -> None:
    """k2 finds k1's edit on the branch: its text and the log say the commit is an earlier one, not k2's."""
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"
    first = cli("apply", "-", "--repo", str(repo.path), "--key", "k1", "--json", input=patch).json
    for _ in range(2):  # the call, then its replay
        r = cli("apply", "-", "--repo", str(repo.path), "--key", "k2", input=patch)
        assert r.code == 0, r.err
        assert "already applied" in r.out and "not this key's" in r.out and "no commit made for this key" in r.out
        assert "already applied in" not in r.out
    rows = cli("log", "--repo", str(repo.path)).out.splitlines()
    assert rows[0].split() == ["seq", "at", "event", "status", "commit", "key"]
    mine = [row for row in rows[1:] if row.split()[5] == "k1"]
    theirs = [row for row in rows[1:] if row.split()[5] == "k2"]
    assert mine and all("not this key's" not in row for row in mine)
    assert len(theirs) == 2 and all(first["commit"][:12] in row and "not this key's" in row for row in theirs)

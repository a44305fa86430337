"""The CLI contract driven as an outside user drives it: hostile options and inputs that once got past it.

Each test names what it guards against; every refusal is checked to leave the repository (its git
dir included, where the refusal is about the git dir) and the store as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Repo, git, make_repo, run_cli, snapshot

PATCH = b"--- /dev/null\n+++ b/added.txt\n@@ -0,0 +1 @@\n+x\n"


def git_dir_files(repo: Repo) -> list[str]:
    """Every path under ``.git``: a refusal must not add one (a receipt where git reads refs or objects)."""
    gd = repo.path / ".git"
    return sorted(p.relative_to(gd).as_posix() for p in gd.rglob("*"))


@pytest.mark.parametrize("inside", ["", "refs", "refs/heads", "objects", "logs", "hooks", "info"])
def test_a_store_inside_the_git_dir_but_outside_its_oncepatch_folder_is_refused(tmp_path: Path, inside: str) -> None:
    # A store in `.git/refs` made `refs/events.jsonl` and `refs/receipts/..` refs to git: `git gc`
    # then failed ("bad object refs/events.jsonl") and `git fsck` reported broken refs.
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    store = repo.path / ".git" / inside if inside else repo.path / ".git"
    before, files = snapshot(repo), git_dir_files(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", "--store", str(store), input=PATCH)
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started", err
    assert "inside the git directory" in err["message"]
    assert snapshot(repo) == before and git_dir_files(repo) == files
    # The same through the environment.
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", input=PATCH,
                env={"ONCEPATCH_STORE": str(store)})
    assert r.code == 2 and "inside the git directory" in r.json["error"]["message"], r.out + r.err
    assert snapshot(repo) == before and git_dir_files(repo) == files
    git(repo.path, "gc", "-q")
    git(repo.path, "fsck", "--full", "--strict")


def test_the_default_store_and_a_folder_under_it_are_accepted(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    for key, extra in (("k1", []), ("k2", ["--store", str(repo.path / ".git" / "oncepatch" / "other")])):
        patch = PATCH.replace(b"added.txt", key.encode())
        r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", key, *extra, input=patch)
        assert r.code == 0, r.out + r.err
    git(repo.path, "gc", "-q")
    git(repo.path, "fsck", "--full", "--strict")


def test_a_store_in_the_git_dir_of_a_linked_worktree_is_refused(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    repo.git("worktree", "add", "-q", "-b", "side", str(tmp_path / "wt"))
    store = repo.path / ".git" / "worktrees" / "wt" / "store"
    r = run_cli("apply", "-", "--repo", str(tmp_path / "wt"), "--json", "--key", "k", "--store", str(store),
                input=PATCH)
    assert r.code == 2 and "inside the git directory" in r.json["error"]["message"], r.out + r.err
    assert not store.exists()
    assert sorted(os.listdir(tmp_path / "wt")) == [".git", "README"]


BAD = os.fsdecode(b"a\xffb")  # not UTF-8: the shell passes such bytes through, Python's argv escapes them


def _committed(tmp_path: Path) -> Repo:
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "done", input=PATCH)
    assert r.code == 0, r.out + r.err
    return repo


@pytest.mark.parametrize("argv", [
    ["status", BAD],
    ["resolve", BAD, "--as", "committed", "--note", "x"],
    ["quarantine", BAD],
    ["revert", BAD, "--key", "undo"],
    ["revert", "done", "--key", BAD],
    # A note that cannot be written into the ledger: quarantine moved the receipt aside, then failed to
    # record it (internal, exit 1), and verify then said the ledger's receipt file was missing.
    ["quarantine", "done", "--note", os.fsdecode(b"n\xff")],
    ["resolve", "done", "--as", "committed", "--note", os.fsdecode(b"n\xff")],
    ["keys", "init", "--note", os.fsdecode(b"n\xff")],
], ids=["status", "resolve", "quarantine", "revert-key", "revert-new-key", "quarantine-note", "resolve-note",
        "keys-note"])
def test_an_argument_that_is_not_utf8_is_a_usage_error_that_changes_nothing(tmp_path: Path, argv: list[str]) -> None:
    repo = _committed(tmp_path)
    before = snapshot(repo)
    r = run_cli(*argv, "--repo", str(repo.path), "--json")
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and "UTF-8" in err["message"], err
    assert snapshot(repo) == before
    r = run_cli(*argv, "--repo", str(repo.path))  # text: one line on stderr, no traceback
    assert r.code == 2 and "Traceback" not in r.err and r.out == "", r.err
    assert run_cli("verify", "--repo", str(repo.path)).code == 0


@pytest.mark.parametrize("argv", [
    ["apply", os.fsdecode(b"/nonexistent/\xff.diff")],
    ["apply", "-", "--contract-sha256", BAD],
    ["apply", "-", "--format", BAD],
], ids=["patch-path", "contract", "format"])
def test_an_error_naming_bytes_that_are_not_utf8_is_still_one_json_envelope(tmp_path: Path, argv: list[str]) -> None:
    # The message quoted the argument, and writing the envelope failed on it: a traceback, nothing on stdout.
    repo = _committed(tmp_path)
    before = snapshot(repo)
    r = run_cli(*argv, "--repo", str(repo.path), "--json", "--key", "k2", input=PATCH)
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and "\\xff" in err["message"], err
    assert "Traceback" not in r.err
    assert snapshot(repo) == before


def test_a_binary_patch_claiming_a_size_past_64_bits_is_too_large_in_one_envelope(tmp_path: Path) -> None:
    # The refusal's `size` detail could not be written as JSON: a traceback and an empty stdout (exit 1).
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    before = snapshot(repo)
    size = 10 ** 20 - 1  # 20 digits: past 64 bits (more digits are cut to the limit by the parser)
    patch = (b"diff --git a/README b/README\nindex 1..2 100644\nGIT binary patch\nliteral %d\nzcmV?d00001\n\n"
             b"literal 0\nHcmV?d00001\n\n" % size)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", input=patch)
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "too_large" and err["effect_status"] == "not_started" and str(size) in err["message"], err
    assert "Traceback" not in r.err
    assert snapshot(repo) == before


def test_apply_from_a_closed_standard_input_is_a_usage_error(tmp_path: Path) -> None:
    # `oncepatch apply - <&-`: Python's sys.stdin is None, and reading it was an internal error (exit 1).
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    before = snapshot(repo)
    res = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", "-", "--repo", str(repo.path), "--json",
                          "--key", "k"], stdin=None, capture_output=True, check=False, timeout=120,
                         preexec_fn=lambda: os.close(0))
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = json.loads(res.stdout)["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and "closed" in err["message"], err
    assert snapshot(repo) == before


def test_apply_with_a_closed_standard_output_commits_and_exits_0(tmp_path: Path) -> None:
    # `oncepatch apply ... >&-`: Python's sys.stdout is None; writing the envelope of the committed call
    # failed with a traceback and exit 1 (internal) though the change had landed.
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    res = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", "-", "--repo", str(repo.path), "--json",
                          "--key", "k"], input=PATCH, stdout=None, stderr=subprocess.PIPE, check=False, timeout=120,
                         preexec_fn=lambda: os.close(1))
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr
    r = run_cli("status", "k", "--repo", str(repo.path), "--json")
    assert r.code == 0 and r.json["receipt"]["status"] == "committed", r.out + r.err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("json_out", [True, False], ids=["json", "text"])
def test_standard_output_that_takes_no_bytes_keeps_the_calls_exit_status(tmp_path: Path, json_out: bool) -> None:
    # `oncepatch apply ... > /dev/full` (stdout on a full disk, a reader gone): writing the envelope
    # failed with ENOSPC, a traceback and exit 1 (internal, "unknown") though the change had landed;
    # a conflict said 1, not 3.
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})

    def apply(patch: bytes) -> subprocess.CompletedProcess[bytes]:
        with open("/dev/full", "wb") as full:
            return subprocess.run([sys.executable, "-m", "patcher.cli", "apply", "-", "--repo", str(repo.path),
                                   "--key", "k", "--no-server", *(["--json"] if json_out else [])],
                                  input=patch, stdout=full, stderr=subprocess.PIPE, check=False, timeout=120)

    res = apply(PATCH)
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr
    assert b"cannot write to standard output" in res.stderr, res.stderr
    assert repo.count() == 2
    r = run_cli("status", "k", "--repo", str(repo.path), "--json")
    assert r.code == 0 and r.json["receipt"]["status"] == "committed", r.out + r.err
    other = apply(b"--- /dev/null\n+++ b/other.txt\n@@ -0,0 +1 @@\n+y\n")
    assert other.returncode == 3 and b"Traceback" not in other.stderr, other.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_the_clients_own_refusal_to_a_full_standard_output_keeps_its_exit_status(tmp_path: Path) -> None:
    # ONCEPATCH_SERVER=require with no server: the thin client answers by itself (exit 5, io_error).
    # Written to a standard output that takes no bytes, that answer was a traceback and exit 1.
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    env = {**os.environ, "ONCEPATCH_SERVER": "require", "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    with open("/dev/full", "wb") as full:
        res = subprocess.run([sys.executable, "-m", "patcher.cli", "status", "--repo", str(repo.path), "--json"],
                             stdout=full, stderr=subprocess.PIPE, env=env, check=False, timeout=120)
    assert res.returncode == 5 and b"Traceback" not in res.stderr, res.stderr
    assert b"cannot write to standard output" in res.stderr, res.stderr


def test_a_refusal_with_a_closed_standard_error_keeps_its_exit_status(tmp_path: Path) -> None:
    # `oncepatch apply ... 2>&-`: sys.stderr is None; writing the refusal failed and the exit status
    # became 1 (internal, outcome unknown) instead of the refusal's own.
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    before = snapshot(repo)
    bad = b"--- a/missing.txt\n+++ b/missing.txt\n@@ -1 +1 @@\n-a\n+b\n"
    res = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", "-", "--repo", str(repo.path), "--key", "k"],
                         input=bad, capture_output=False, stdout=subprocess.DEVNULL, check=False, timeout=120,
                         preexec_fn=lambda: os.close(2))
    r = run_cli("apply", "-", "--repo", str(repo.path), "--key", "k2", input=bad)
    assert r.code not in (0, 1) and res.returncode == r.code, (res.returncode, r.err)
    assert {k: v for k, v in snapshot(repo).items() if k != "store"} == {
        k: v for k, v in before.items() if k != "store"}


def test_a_committed_receipt_whose_key_ref_was_deleted_is_corrupt_for_the_replay_as_for_status(
        tmp_path: Path) -> None:
    # `git update-ref -d refs/oncepatch/keys/<h>`: status, verify and recover said corrupt (exit 6), while
    # the replay walked the branch instead, answered the receipt (exit 0) and logged a `replayed` event.
    repo = _committed(tmp_path)
    h = hashlib.sha256(b"done").hexdigest()
    repo.git("update-ref", "-d", f"refs/oncepatch/keys/{h}")
    before = snapshot(repo)
    answers = {}
    for argv in (["apply", "-", "--key", "done"], ["status", "done"]):
        r = run_cli(*argv, "--repo", str(repo.path), "--json", input=PATCH)
        assert r.code == 6, (argv, r.out + r.err)
        err = r.json["error"]
        assert err["type"] == "corrupt_receipt" and f"refs/oncepatch/keys/{h}" in err["reason"], err
        assert "commit" not in err and "outputs" not in err
        answers[argv[0]] = err["reason"]
    assert answers["apply"] == answers["status"]
    assert run_cli("verify", "--repo", str(repo.path)).code == 6
    assert snapshot(repo) == before


@pytest.mark.parametrize("line", [b"garbage line\n", b"{}\n", b'{"seq": "x"}\n'])
def test_a_ledger_whose_last_whole_line_is_no_event_refuses_the_call_before_it_writes(tmp_path: Path,
                                                                                      line: bytes) -> None:
    # The check before the first write looked only for a torn (unterminated) last line: with a whole
    # line added by hand the call wrote its `prepared` receipt, then failed to append (exit 6) and left
    # that receipt for recover, which refuses a broken ledger.
    repo = _committed(tmp_path)
    with open(repo.store / "events.jsonl", "ab") as fh:
        fh.write(line)
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "next",
                input=PATCH.replace(b"added.txt", b"next.txt"))
    assert r.code == 6, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "corrupt_receipt" and err["effect_status"] == "not_started", err
    assert "quarantine --ledger" in err["message"]
    assert snapshot(repo) == before  # no receipt, no lock file, no ledger line


@pytest.mark.parametrize("path", [b"x" * 300, b"/".join([b"d"] * 3000), b"/".join([b"y" * 200] * 30)],
                         ids=["long-component", "deep", "long-path"])
def test_a_path_no_checkout_can_write_is_unsafe_not_an_internal_error(tmp_path: Path, path: bytes) -> None:
    # ENAMETOOLONG from the worktree checks came out as `internal` (exit 1) with `next_action: retry`,
    # which could never help: the patch is what has to change.
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    before = snapshot(repo)
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k",
                input=b"--- /dev/null\n+++ b/" + path + b"\n@@ -0,0 +1 @@\n+x\n")
    assert r.code == 4, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "unsafe_path" and err["effect_status"] == "not_started", err
    assert err["next_action"] == "fix_input" and "longer than" in err["reason"], err
    assert snapshot(repo) == before


@pytest.mark.parametrize("line", [b"garbage line\n", b"garbage, no newline"], ids=["whole-line", "foreign-torn-tail"])
def test_doctor_names_a_ledger_that_refuses_every_call(tmp_path: Path, line: bytes) -> None:
    # doctor said "nothing pending" (exit 0, next: install-hook) while every apply, recover and verify
    # refused the store (exit 6) and pointed at doctor for what to do.
    repo = _committed(tmp_path)
    with open(repo.store / "events.jsonl", "ab") as fh:
        fh.write(line)
    before = snapshot(repo)
    r = run_cli("doctor", "--repo", str(repo.path), "--json")
    assert r.code == 6, r.out + r.err
    doc = r.json
    assert doc["ok"] is False and doc["next"] == "oncepatch quarantine --ledger", doc
    assert [c["receipt"] for c in doc["corrupt"]] == [str(repo.store / "events.jsonl")], doc
    assert snapshot(repo) == before
    r = run_cli("doctor", "--repo", str(repo.path))
    assert r.code == 6 and "next: oncepatch quarantine --ledger" in r.out, r.out
    # The command it names is the way out: afterwards a call goes through.
    assert run_cli("quarantine", "--ledger", "--repo", str(repo.path)).code == 0
    assert run_cli("doctor", "--repo", str(repo.path), "--json").json["corrupt"] == []
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "after",
                input=PATCH.replace(b"added.txt", b"after.txt"))
    assert r.code == 0, r.out + r.err


@pytest.mark.parametrize("name", ["ONCEPATCH_MAX_PATCH_BYTES", "ONCEPATCH_MAX_RECEIPT_BYTES",
                                  "ONCEPATCH_MAX_BINARY_BYTES", "ONCEPATCH_MAX_MATCH_WORK",
                                  "ONCEPATCH_REMOTE_ROUNDS", "ONCEPATCH_REMOTE_TIMEOUT"])
def test_a_limit_in_the_environment_that_is_not_a_number_leaves_the_default(tmp_path: Path, name: str) -> None:
    # Read with a bare int()/float() at import: every command crashed with a traceback (exit 1, no JSON).
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello world\n"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", input=patch, env={name: "abc"})
    assert r.code == 0, r.out + r.err
    assert "Traceback" not in r.err and r.json["status"] == "committed"
    assert (repo.path / "README").read_text() == "hello world\n"


def test_a_crash_point_name_that_is_no_point_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    # A misspelt point was ignored: the call committed and a crash test passed without crashing.
    repo = make_repo(tmp_path / "repo", {"README": "hello\n"})
    before = snapshot(repo)
    patch = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello world\n"
    r = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "k", input=patch,
                env={"ONCEPATCH_CRASH_AT": "after-reff"})
    assert r.code == 2, r.out + r.err
    err = r.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and "after-reff" in err["message"], err
    assert "after-ref" in err["message"]  # the known points are named
    assert snapshot(repo) == before

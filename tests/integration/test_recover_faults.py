"""``recover`` under injected I/O faults (strace ``-e inject``): an envelope that tells the truth, then a clean run.

A call is killed at a crash point (``ONCEPATCH_CRASH_AT``); ``recover --json``
then runs with one syscall failing (EIO, ENOSPC, EACCES): picked from a clean
run's trace by what it touches (the ledger's append, the branch's ref, a
leftover's removal, the store's folder), and injected at its count in the
process (the imports done before a marker, so the count is the same run to
run). Each faulted run ends with a JSON document and an exit code of the
contract (never a traceback, never ``internal``) saying what was done and what
was not; ``recover`` again without a fault finishes the job: the receipt
settled, ``verify`` passes, ``git fsck`` is clean.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import ROOT, make_repo, run_cli, snapshot
from test_fsync_order import strace  # noqa: F401 - the fixture: strace, or a skip saying why not
from torture_driver import fsck

BASE = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 21))}
TRACED = "openat,write,fsync,rename,renameat,renameat2,unlink,unlinkat,mkdir,link"
MARKER = "/nonexistent-oncepatch-recover-fault-marker"
# Everything recover imports, imported before the marker: the counts after it are recover's own.
RUNNER = f"""
import os, sys
import pygit2, filelock, orjson
import patcher.cli.run, patcher.cli.recovery, patcher.cli.parser, patcher.git_adapter, receipts.recovery
patcher.cli.parser.the_parser()
try:
    os.open({MARKER!r}, os.O_RDONLY)
except FileNotFoundError:
    pass
sys.exit(patcher.cli.run.main(sys.argv[1:]))
"""
LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)")


class Crashed:
    """A repository whose apply was killed at ``point``, kept as a template and put back before each run.

    The receipt names the repository's path, so each run uses the same folder.
    """

    def __init__(self, tmp_path: Path, point: str) -> None:
        self.work, self.template = tmp_path / "work", tmp_path / "template"
        repo = make_repo(self.work / "repo", BASE)
        repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace("line 7\n", "line seven\n"))
        repo.write("pkg/new.txt", "brand new\n")
        repo.git("add", "-A")
        patch = repo.git("diff", "--cached", "--full-index").encode()
        repo.git("reset", "-q", "--hard")
        repo.git("clean", "-qfd")
        crashed = run_cli("apply", "-", "--repo", str(repo.path), "--json", "--key", "K", input=patch,
                          env={"ONCEPATCH_CRASH_AT": point})
        assert crashed.code == 137, (crashed.code, crashed.out, crashed.err)
        self.repo = repo
        shutil.copytree(self.work, self.template, symlinks=True)

    def reset(self) -> None:
        shutil.rmtree(self.work)
        shutil.copytree(self.template, self.work, symlinks=True)

    def recover(self, strace: str, inject: str | None = None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        out = self.work.parent / "trace.txt"
        cmd = [strace, "-f", "-qq", "-s", "512", "-o", str(out), "-e", f"trace={TRACED}"]
        if inject:
            cmd += ["-e", f"inject={inject}"]
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1", ONCEPATCH_SERVER="never")
        res = subprocess.run([*cmd, sys.executable, "-c", RUNNER, "recover", "--json", "--repo", str(self.repo.path),
                              "--tmp-age", "0"], env=env, capture_output=True, text=True, timeout=120, check=False)
        return res, out.read_text(errors="replace").splitlines()


def _nth(trace: list[str], name: str, touches: Callable[[str], bool],
         since: Callable[[str, str], bool] | None = None) -> int:
    """The count (1-based, in its thread, as strace's ``when=`` counts) of the first ``name`` call after the
    marker, and after the first call ``since`` picks by its name and arguments, whose arguments ``touches`` picks."""
    counts: dict[tuple[str, str], int] = {}
    marked = started = False
    for line in trace:
        m = LINE.match(line)
        if m is None:
            continue
        tid, call, args = m.groups()
        counts[(tid, call)] = counts.get((tid, call), 0) + 1
        if not marked:
            marked = started = MARKER in args
            started = marked and since is None
        elif not started:
            started = since is not None and since(call, args)
        elif call == name and touches(args):
            return counts[(tid, call)]
    raise AssertionError(f"no {name} call picked after the marker")


def _faulted(case: Crashed, strace: str, name: str, touches: Callable[[str], bool], err: str,
             since: Callable[[str, str], bool] | None = None) -> tuple[int, dict[str, Any]]:
    """recover with the picked call failing with ``err``: its exit code and document (checked to be one)."""
    case.reset()
    _res, trace = case.recover(strace)
    n = _nth(trace, name, touches, since)
    case.reset()
    res, trace = case.recover(strace, f"{name}:error={err}:when={n}")
    injected = [line for line in trace if "(INJECTED)" in line]
    assert injected and all(touches(LINE.match(line).groups()[2]) for line in injected  # type: ignore[union-attr]
                            if LINE.match(line)), injected
    assert "Traceback" not in res.stderr, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    assert (doc.get("error") or {}).get("type") != "internal", doc
    assert res.returncode in (0, 2, 4, 5, 6), (res.returncode, doc)
    return res.returncode, doc


def _receipt_status(case: Crashed) -> str:
    [path] = (case.repo.store / "receipts").rglob("*.json")
    return str(json.loads(path.read_bytes())["status"])


def _finishes(case: Crashed, status: str, *, ledger_repaired: bool = False) -> dict[str, Any]:
    """recover without a fault settles the rest; verify passes, fsck is clean."""
    rec = run_cli("recover", "--repo", str(case.repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    assert rec.json["skipped"] == [] and rec.json["corrupt"] == []
    assert (rec.json["ledger_repaired"] == ["K"]) is ledger_repaired, rec.json
    assert _receipt_status(case) == status
    ver = run_cli("verify", "--repo", str(case.repo.path), "--grace", "0")
    assert ver.code == 0, ver.out + ver.err
    clean, out = fsck(case.repo.path)
    assert clean, out
    again = run_cli("recover", "--repo", str(case.repo.path), "--json", "--tmp-age", "0")
    assert again.code == 0 and again.json["changed"] is False, again.out
    doc: dict[str, Any] = rec.json
    return doc


def test_the_ledger_append_failing_leaves_the_settled_receipt_for_the_next_run(strace: str,
                                                                                 tmp_path: Path) -> None:
    """ENOSPC appending the ledger event after the receipt was settled: skipped, naming the receipt's status."""
    case = Crashed(tmp_path, "after-prepare")
    code, doc = _faulted(case, strace, "write", lambda a: '{\\"at\\":' in a and 'recovered' in a, "ENOSPC")
    assert code == 5 and doc["ok"] is True and doc["rows"] == []
    [skipped] = doc["skipped"]
    assert skipped["key"] == "K" and "No space left on device" in skipped["reason"]
    assert "its receipt is 'rejected'" in skipped["reason"] and "run 'oncepatch recover' again" in skipped["reason"]
    assert _receipt_status(case) == "rejected"
    _finishes(case, "rejected", ledger_repaired=True)


def test_the_branch_unreadable_while_querying_leaves_the_receipt_prepared(strace: str, tmp_path: Path) -> None:
    """EIO opening the branch's ref file in the query: nothing settled, the receipt still prepared."""
    case = Crashed(tmp_path, "after-ref")
    code, doc = _faulted(case, strace, "openat", lambda a: a.split(",")[1].strip().endswith('/refs/heads/main"'),
                         "EIO")
    assert code == 5 and doc["ok"] is True and doc["rows"] == []
    [skipped] = doc["skipped"]
    assert "Input/output error" in skipped["reason"] and "its receipt is 'prepared'" in skipped["reason"]
    assert _receipt_status(case) == "prepared"
    done = _finishes(case, "committed")
    assert [(r["from"], r["to"]) for r in done["rows"]] == [("prepared", "committed")]


def test_a_leftover_that_cannot_be_removed_stops_recover_after_it_settled(strace: str, tmp_path: Path) -> None:
    """EACCES removing the committed receipt's tmp file: recover stops, says what it finished, effect unknown."""
    case = Crashed(tmp_path, "before-receipt-replace")
    code, doc = _faulted(case, strace, "unlinkat", lambda a: ".json.optmp-" in a, "EACCES")
    err = doc["error"]
    assert code == 5 and doc["ok"] is False
    assert (err["type"], err["retryable"], err["effect_status"], err["next_action"]) == (
        "io_error", True, "unknown", "recover")
    assert "Permission denied" in err["message"] and err["errno"] == 13
    assert [(r["from"], r["to"]) for r in err["done"]["rows"]] == [("prepared", "committed")]
    assert _receipt_status(case) == "committed"
    done = _finishes(case, "committed")
    assert any(".json.optmp-" in p for p in done["removed"])


def test_the_store_unreadable_before_anything_changes_nothing(strace: str, tmp_path: Path) -> None:
    """EIO opening the ledger first: recover wrote nothing and says so (``not_started``, retry)."""
    case = Crashed(tmp_path, "after-prepare")
    case.reset()
    before = snapshot(case.repo)
    code, doc = _faulted(case, strace, "openat", lambda a: "events.jsonl" in a, "EIO")
    err = doc["error"]
    assert code == 5 and doc["ok"] is False
    assert (err["type"], err["retryable"], err["effect_status"], err["next_action"]) == (
        "io_error", True, "not_started", "retry")
    assert "changed nothing" in err["message"] and err["done"]["rows"] == []
    assert snapshot(case.repo) == before
    _finishes(case, "rejected")


def test_the_locks_folder_unopenable_after_the_receipt_was_settled_says_so(strace: str, tmp_path: Path) -> None:
    """EACCES opening the store's locks folder for the ledger's lock, the receipt already written: skipped, and
    the reason says the receipt is settled (never a usage error saying nothing was started)."""
    case = Crashed(tmp_path, "after-index-ahead")
    code, doc = _faulted(case, strace, "openat", lambda a: '"locks"' in a, "EACCES",
                         since=lambda call, a: call == "renameat" and '.json"' in a and "receipts" not in a)
    assert code == 5 and doc["ok"] is True and doc["rows"] == [], doc
    [skipped] = doc["skipped"]
    assert "Permission denied" in skipped["reason"] and "its receipt is 'rejected'" in skipped["reason"], skipped
    assert _receipt_status(case) == "rejected"
    _finishes(case, "rejected", ledger_repaired=True)


def test_a_worktree_head_unreadable_while_putting_files_back_leaves_the_receipt_prepared(strace: str,
                                                                                         tmp_path: Path) -> None:
    """EACCES reading the worktree's HEAD, to learn whether it has the branch checked out, while the files a call
    wrote ahead are put back: never read as "not checked out" (which left them and said ``rejected``)."""
    case = Crashed(tmp_path, "after-worktree-ahead")
    case.reset()
    ahead = snapshot(case.repo)
    code, doc = _faulted(case, strace, "openat", lambda a: a.split(",")[1].strip().endswith('/.git/HEAD"'),
                         "EACCES", since=lambda call, a: "multi-pack-index" in a)
    assert code == 5 and doc["ok"] is True and doc["rows"] == [], doc
    [skipped] = doc["skipped"]
    assert "Permission denied" in skipped["reason"] and "its receipt is 'prepared'" in skipped["reason"], skipped
    assert _receipt_status(case) == "prepared"
    assert {k: v for k, v in snapshot(case.repo).items() if k != "store"} == {
        k: v for k, v in ahead.items() if k != "store"}  # the files written ahead: left for the next run
    done = _finishes(case, "rejected")
    assert any("put back" in n for r in done["rows"] for n in r["notes"]), done
    assert case.repo.git("status", "--porcelain", "--untracked-files=all") == ""


def test_the_signers_list_unreadable_now_is_no_usage_error(strace: str, tmp_path: Path) -> None:
    """EIO opening the store's allowed_signers.json (looked for on every open of the store): a read that may
    pass, so ``io_error`` (retry, nothing started), not a usage error telling the person to fix the list."""
    case = Crashed(tmp_path, "after-prepare")
    code, doc = _faulted(case, strace, "openat", lambda a: "allowed_signers.json" in a, "EIO")
    err = doc["error"]
    assert code == 5 and (err["type"], err["effect_status"], err["next_action"]) == ("io_error", "not_started", "retry")
    assert "allowed_signers.json" in err["message"] and "Input/output error" in err["message"]
    assert _receipt_status(case) == "prepared"
    _finishes(case, "rejected")


def test_the_git_dir_unlistable_while_looking_for_the_kept_index_leaves_the_receipt_prepared(
        strace: str, tmp_path: Path) -> None:
    """EIO listing the git dir for the index a crashed call kept (its staged one written ahead): never read as
    "none kept", which left the staged index and the files in place and said ``rejected``."""
    case = Crashed(tmp_path, "after-index-ahead")
    code, doc = _faulted(case, strace, "openat",
                         lambda a: a.split(",")[1].strip().endswith('/.git"') and "O_DIRECTORY" in a, "EIO",
                         since=lambda call, a: "multi-pack-index" in a)
    assert code == 5 and doc["rows"] == [], doc
    assert _receipt_status(case) == "prepared"
    _finishes(case, "rejected")
    assert case.repo.git("status", "--porcelain", "--untracked-files=all") == ""

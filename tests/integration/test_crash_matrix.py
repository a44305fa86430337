"""Crash matrix: every named crash point of ``apply`` × every kind of edit, through real processes.

For each case: ``apply`` with ``ONCEPATCH_CRASH_AT=<point>`` dies with 137;
``recover --json --tmp-age 0`` brings the store to exactly the predicted
outcome (docs/DESIGN.md section 4: one commit for the key or none, and a receipt
that says which); the same ``apply`` again exits 0; in the end exactly one
commit carries the call's ``Oncepatch-Call:`` trailer, ``verify`` passes and
``git fsck --strict`` is clean.

Predicted outcomes:

* ``after-stage``   — not done: branch, refs, index and worktree as before, no
  receipt (staging wrote only unreferenced objects); the key's lock file is
  an orphan that ``--tmp-age 0`` removes.
* ``after-prepare`` — not done: as above, the receipt ``rejected`` with
  ``retryable: true`` (``crashed_before_commit``).
* ``after-worktree-ahead`` — not done, as ``after-prepare``: killed under the
  branch's lock with the touched files written for the candidate; recover
  removes the branch's lock and writes the base's files back (bytes, modes,
  added, deleted and renamed paths): the worktree is as before.
* ``after-index-ahead`` — not done, as ``after-worktree-ahead``, and the index
  staged for the candidate too; as recover breaks the dead call's
  ``index.lock``, it puts back the index the staged one replaced, byte for byte.
* ``after-ref``, ``after-materialise``, ``before-receipt-replace`` — done: the
  branch is one commit ahead with the target tree, the key ref points at it,
  the receipt is ``committed`` naming it, and worktree + index match the commit
  (``after-ref`` crashed with files and index already written ahead).
  ``before-receipt-replace`` leaves the committed receipt's tmp file beside
  the prepared one: recover removes it.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot
from torture_driver import commits_with_trailer, fsck

from receipts.store import ReceiptStore

BASE: dict[str, str | bytes] = {
    "README": "hello\n",
    "src/app.py": "".join(f"line {i}\n" for i in range(1, 21)),
    "src/util.py": "def f():\n    return 1\n",
    "docs/guide.txt": "guide\n",
}


def _new_file(r: Repo) -> None:
    r.write("pkg/new/added.txt", "brand new\n")


def _modify(r: Repo) -> None:
    r.write("src/app.py", (r.path / "src/app.py").read_text().replace("line 7\n", "line seven\n"))


def _delete(r: Repo) -> None:
    r.git("rm", "-q", "docs/guide.txt")


def _rename(r: Repo) -> None:
    r.git("mv", "src/util.py", "src/helpers.py")


def _multi(r: Repo) -> None:
    _new_file(r)
    _modify(r)
    _delete(r)
    _rename(r)


EDITS: dict[str, Callable[[Repo], None]] = {
    "new_file": _new_file,
    "modify": _modify,
    "delete": _delete,
    "rename": _rename,
    "multi_file": _multi,
}
#: crash point -> does the commit land?
POINTS: dict[str, bool] = {
    "after-stage": False,
    "after-prepare": False,
    "after-worktree-ahead": False,
    "after-index-ahead": False,
    "after-ref": True,
    "after-materialise": True,
    "before-receipt-replace": True,
}


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def prepare(tmp_path: Path, edit: Callable[[Repo], None]) -> tuple[Repo, Path, str, str]:
    """A clean repo at its base commit, the patch file of ``edit``, the base oid and the target tree."""
    repo = make_repo(tmp_path / "repo", BASE)
    base = repo.head()
    edit(repo)
    repo.git("add", "-A")
    patch = repo.git("diff", "--cached", "--full-index", "-M").encode()
    target_tree = repo.git("write-tree").strip()
    repo.git("reset", "-q", "--hard", base)
    assert repo.git("status", "--porcelain") == ""
    pf = tmp_path / "change.diff"
    pf.write_bytes(patch)
    return repo, pf, base, target_tree


def store_tmp_files(store: Path) -> list[str]:
    return sorted(p.name for p in store.rglob("*") if p.is_file() and ".optmp-" in p.name)


def receipts_in(store: Path) -> list[Any]:
    found = list(ReceiptStore(str(store)).scan())
    assert all(item.receipt is not None for item in found), [i.error for i in found]
    return [item.receipt for item in found]


def worktree_view(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "store"}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("point", list(POINTS))
def test_crash_then_recover_then_retry_lands_once(tmp_path: Path, point: str, edit: str) -> None:
    repo, pf, base, target_tree = prepare(tmp_path, EDITS[edit])
    store = repo.store
    before = snapshot(repo)
    argv = ("apply", "--repo", str(repo.path), "--json", str(pf))

    crashed = run_cli(*argv, env={"ONCEPATCH_CRASH_AT": point})
    assert crashed.code == 137, (crashed.code, crashed.out, crashed.err)
    assert crashed.out == ""  # died before printing anything
    if point == "before-receipt-replace":
        assert len(store_tmp_files(store)) == 1, "the committed receipt's tmp file should be left behind"
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.err
    report = rec.json
    assert report["ok"] is True and report["corrupt"] == [] and report["skipped"] == []
    assert store_tmp_files(store) == []
    lands = POINTS[point]
    receipts = receipts_in(store)

    if lands:
        head = repo.head("main")
        assert repo.git("rev-parse", f"{head}^").strip() == base
        assert repo.head(f"{head}^{{tree}}") == target_tree
        assert len(receipts) == 1
        (r,) = receipts
        assert (r.status, r.commit, r.tree) == ("committed", head, target_tree)
        assert [(row["from"], row["to"], row["commit"]) for row in report["rows"]] == [("prepared", "committed", head)]
        assert repo.git("rev-parse", "refs/oncepatch/keys/" + key_hash(r.key)).strip() == head
        # Worktree and index are the commit's (written ahead of the move), the entries with their
        # files' stat data: git's plumbing, which refreshes nothing, sees no change either.
        quiet = subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd=repo.path, check=False)
        assert quiet.returncode == 0, repo.git("diff-index", "--name-status", "HEAD", "--")
        assert repo.git("status", "--porcelain", "--untracked-files=all") == ""
        assert repo.git("diff-index", "--cached", "HEAD") == ""
    else:
        assert repo.head("main") == base
        assert worktree_view(snapshot(repo)) == worktree_view(before)
        if point == "after-stage":
            assert receipts == [] and report["rows"] == []
            # The key's lock file was the only trace in the store; an orphan past --tmp-age 0.
            assert any(p.endswith(".lock") and "/locks/" in p for p in report["removed"]), report
            assert not [p for p in (store / "locks").iterdir() if len(p.name) == 69]
        else:
            assert len(receipts) == 1
            (r,) = receipts
            assert (r.status, r.retryable, r.commit) == ("rejected", True, None)
            assert r.error["type"] == "crashed_before_commit" and r.error["next_action"] == "retry"
            assert [(row["from"], row["to"], row["reason"]) for row in report["rows"]] == [
                ("prepared", "rejected", "crashed_before_commit")]
            assert repo.git("for-each-ref", "refs/oncepatch/") == ""

    again = run_cli(*argv)
    assert again.code == 0, (again.out, again.err)
    doc = again.json
    assert doc["status"] == "committed" and doc["replayed"] is lands
    head = repo.head("main")
    assert doc["commit"] == head
    assert repo.git("rev-parse", f"{head}^").strip() == base
    assert repo.head(f"{head}^{{tree}}") == target_tree
    assert commits_with_trailer(repo.path, doc["call_id"]) == [head]
    assert commits_with_trailer(repo.path, doc["call_id"], "--reflog") == [head]
    assert repo.git("status", "--porcelain", "--untracked-files=all") == ""

    ver = run_cli("verify", "--repo", str(repo.path), "--grace", "0")
    assert ver.code == 0, ver.out + ver.err
    clean, out = fsck(repo.path)
    assert clean, out


def test_matrix_covers_every_crash_point_of_the_apply_protocol() -> None:
    """Every crash point the apply protocol arms is a row here.

    The protocol is ``patcher/protocol.py`` and ``patcher/execute.py`` (git's
    steps) on ``receipts/engine.py`` (every tool's steps; its ``recover-*``
    points are recovery's, tested with it).  A new one needs its prediction.
    """
    import re

    from cas.crash import POINTS as DEFINED

    root = Path(__file__).resolve().parents[2]
    source = "".join((root / name).read_text()
                     for name in ("patcher/protocol.py", "patcher/execute.py", "receipts/engine.py"))
    armed = {p for p in re.findall(r"crash_(?:point|hook)\(\"([a-z-]+)\"\)", source) if not p.startswith("recover-")}
    assert armed == set(POINTS)
    assert armed <= DEFINED


def test_a_write_ahead_killed_half_way_leaves_no_tmp_file_in_the_worktree(tmp_path: Path) -> None:
    """A call killed while writing a touched file ahead of its move leaves the durable write's tmp file
    (``.<name>.optmp-<pid>-<rand>``) beside it, the file itself not yet renamed: ``recover`` settles the
    call ``rejected`` and removes the tmp file, which would otherwise stay untracked in the worktree."""
    repo, pf, base, _ = prepare(tmp_path, _modify)
    before = snapshot(repo)
    crashed = run_cli("apply", "--repo", str(repo.path), "--json", str(pf),
                      env={"ONCEPATCH_CRASH_AT": "after-index-ahead"})
    assert crashed.code == 137, (crashed.code, crashed.out, crashed.err)
    # Where the kill lands a moment later: the touched file's tmp file written, not renamed.
    # (The crash point's own process is gone; its pid is the one the tmp file names.)
    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = repo.path / "src" / f".app.py.optmp-{gone.pid}-2c4ce900"
    tmp.write_text((repo.path / "src/app.py").read_text().replace("line 7\n", "line seven\n"))
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    assert [row["to"] for row in rec.json["rows"]] == ["rejected"], rec.json
    assert not tmp.exists(), rec.json
    assert any(str(tmp) in n for n in rec.json["rows"][0]["notes"]), rec.json
    assert worktree_view(snapshot(repo)) == worktree_view(before)
    assert repo.head("main") == base

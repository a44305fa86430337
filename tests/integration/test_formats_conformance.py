"""Conformance: every fixture case in tests/formats through the real apply protocol on a real repo.

A case is a folder: ``before/`` (the files of the first commit), ``patch`` (the
bytes sent), ``case.json`` (``format``, ``expect`` = ``ok`` or an error type,
optional ``already_applied`` and ``grades``), and for ``ok`` cases ``after/``: the
whole expected tree.  A file whose name ends in ``.fixture`` in ``before/`` or
``after/`` stands for the same name without it (``util.py.fixture`` is
``util.py``), so fixture data is never taken for a test module.  An ``ok`` case must commit exactly that tree (or, when
already applied, commit nothing and name the base commit), materialise it in
the worktree, and record the grades in the receipt.  An error case must raise
that error type and leave refs, index, worktree and store byte for byte as
they were.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cas.errors import OncepatchError
from conftest import Repo, make_repo, snapshot
from patcher.protocol import apply

FIXTURES = Path(__file__).resolve().parent.parent / "formats"
CASES = sorted(p for p in FIXTURES.iterdir() if p.is_dir())


FIXTURE_SUFFIX = ".fixture"  # stored as 'x.py.fixture' so no tool takes fixture data for a test module


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix().removesuffix(FIXTURE_SUFFIX): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def committed_tree(repo: Repo, rev: str = "HEAD") -> dict[str, bytes]:
    import subprocess

    names = repo.git("ls-tree", "-r", "-z", "--name-only", rev).split("\0")
    out: dict[str, bytes] = {}
    for name in filter(None, names):
        out[name] = subprocess.run(["git", "cat-file", "blob", f"{rev}:{name}"], cwd=repo.path,
                                   capture_output=True, check=True).stdout
    return out


def worktree(repo: Repo) -> dict[str, bytes]:
    return {p.relative_to(repo.path).as_posix(): p.read_bytes() for p in sorted(repo.path.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(repo.path).parts}


def test_there_are_enough_cases_for_every_format() -> None:
    formats: dict[str, int] = {}
    for case in CASES:
        prefix = case.name.split("_", 2)[1]
        formats[prefix] = formats.get(prefix, 0) + 1
    assert len(CASES) >= 40
    assert formats["env"] >= 25 and formats["sr"] >= 5 and formats["str"] >= 5 and formats["wf"] >= 5


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case: Path, tmp_path: Path) -> None:
    meta: dict[str, Any] = json.loads((case / "case.json").read_text())
    before = read_tree(case / "before")
    repo = make_repo(tmp_path / "repo", dict(before))
    base = repo.head()
    patch = (case / "patch").read_bytes()
    if meta["expect"] != "ok":
        state = snapshot(repo)
        with pytest.raises(OncepatchError) as info:
            apply(str(repo.path), patch, format=meta["format"])
        assert info.value.error_type == meta["expect"], info.value.message
        assert snapshot(repo) == state
        return
    result = apply(str(repo.path), patch, format=meta["format"])
    assert result.status == "committed"
    expected = read_tree(case / "after")
    if meta.get("already_applied"):
        assert result.already_applied and result.commit == base and repo.head() == base
    else:
        assert not result.already_applied and repo.head() == result.commit != base
        assert repo.git("rev-parse", "HEAD^").strip() == base
    assert committed_tree(repo) == expected
    assert worktree(repo) == expected
    assert repo.git("status", "--porcelain") == ""
    receipt = json.loads(Path(result.receipt).read_text())
    assert receipt["status"] == "committed"
    if "grades" in meta:
        assert receipt["grades"] == meta["grades"]


# --------------------------------------------------------------------------- all or nothing, replays, receipts

THREE_FILES_THIRD_FAILS = b"""*** Begin Patch
*** Add File: notes/new.txt
+brand new
*** Update File: src/util.py
@@ def f():
-    return 1
+    return 2
*** Update File: src/app.py
@@
 line 3
-line 4 (not in the file)
+line four
*** End Patch
"""


def test_multi_file_envelope_whose_third_file_fails_changes_nothing(repo: Repo, cli: Any) -> None:
    before = snapshot(repo)
    count = repo.count()
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), THREE_FILES_THIRD_FAILS, key="agent-call-7")
    err = info.value
    assert err.error_type == "context_not_found" and err.details["path"] == "src/app.py"
    assert err.details["hunk"] == 1 and err.details["closest"]["line"] == 3
    assert snapshot(repo) == before and repo.count() == count
    # through the CLI: the same, with the envelope an agent can act on
    r = cli("apply", "--repo", str(repo.path), "--json", "-", input=THREE_FILES_THIRD_FAILS)
    assert r.code == 4
    error = r.json["error"]
    assert error["type"] == "context_not_found" and error["effect_status"] == "not_started"
    assert error["next_action"] == "fix_input" and error["closest"]["diff"][:2] == [" line 3", "-line 4 (not in the file)"]
    assert snapshot(repo) == before
    # nothing was recorded for the key, so the fixed patch may use it
    fixed = THREE_FILES_THIRD_FAILS.replace(b"-line 4 (not in the file)", b"-line 4")
    done = apply(str(repo.path), fixed, key="agent-call-7")
    assert repo.count() == count + 1 and done.commit == repo.head()
    assert sorted(o["path"] for o in done.outputs) == ["notes/new.txt", "src/app.py", "src/util.py"]


def test_replaying_a_successful_envelope_adds_nothing(repo: Repo) -> None:
    # (Hunks with context: a context-free hunk is never found present without line numbers.)
    patch = THREE_FILES_THIRD_FAILS.replace(b"-line 4 (not in the file)", b"-line 4").replace(
        b"@@ def f():\n-    return 1", b"@@\n def f():\n-    return 1")
    first = apply(str(repo.path), patch, key="k1")
    after_first = snapshot(repo)
    count = repo.count()
    again = apply(str(repo.path), patch, key="k1")
    assert again.replayed and again.commit == first.commit and repo.count() == count
    after_replay = snapshot(repo)
    changed = {p for p in after_replay["store"] if after_first["store"].get(p) != after_replay["store"][p]}
    assert {k: v for k, v in after_replay.items() if k != "store"} == {
        k: v for k, v in after_first.items() if k != "store"}
    assert changed == {"events.jsonl"}  # only the ledger's 'replayed' event
    # a new key with the same patch: the change is already there, no second commit (codex would
    # add 'brand new' again: its Add File overwrites and its pure insertions re-apply)
    other = apply(str(repo.path), patch, key="k2")
    assert other.already_applied and not other.replayed and other.commit == first.commit
    assert repo.count() == count


def test_receipt_records_the_grade_of_every_hunk(repo: Repo) -> None:
    repo.write("q.txt", "say \u201chi\u201d\nplain\n")
    repo.write("ws.txt", "a   \nb\t\nc\n")
    repo.commit_all("fuzzy targets")
    patch = (
        "*** Begin Patch\n*** Update File: q.txt\n@@\n-say \"hi\"\n+say \"bye\"\n"
        "*** Update File: ws.txt\n@@\n a\n-b\n+B\n@@\n-c\n+C\n*** End Patch\n"
    ).encode()
    result = apply(str(repo.path), patch)
    receipt = json.loads(Path(result.receipt).read_text())
    assert receipt["grades"] == {"q.txt": ["punct"], "ws.txt": ["rstrip", "exact"]}
    blocks = (b"src/util.py\n<<<<<<< SEARCH\nreturn 1\n=======\nreturn 3\n>>>>>>> REPLACE\n"
              b"<<<<<<< SEARCH\ndef f():\nreturn 3\n=======\ndef g():\n    return 3\n>>>>>>> REPLACE\n")
    # Issue 24: 'def f():' is off by 0, 'return 3' by +4: no one delta, refused (it used to commit)
    with pytest.raises(OncepatchError) as info:
        apply(str(repo.path), blocks)
    assert info.value.error_type == "indentation_mismatch"
    blocks = (b"src/util.py\n<<<<<<< SEARCH\nreturn 1\n=======\nreturn 3\n>>>>>>> REPLACE\n"
              b"<<<<<<< SEARCH\n  def f():\n      return 3\n=======\n  def g():\n      return 3\n>>>>>>> REPLACE\n")
    receipt = json.loads(Path(apply(str(repo.path), blocks).receipt).read_text())
    assert receipt["grades"] == {"src/util.py": ["substring", "strip"]}
    assert (repo.path / "src/util.py").read_text() == "def g():\n    return 3\n"


def test_cli_reads_heredoc_wrapped_envelope_and_refuses_ambiguity(repo: Repo, cli: Any) -> None:
    repo.write("twice.txt", "x\nsame\ny\nsame\n")
    repo.commit_all("twice")
    ambiguous = b"apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: twice.txt\n@@\n-same\n+other\n*** End Patch\nEOF\n"
    r = cli("apply", "--repo", str(repo.path), "--json", "--format", "auto", "-", input=ambiguous)
    assert r.code == 4 and r.json["error"]["type"] == "ambiguous_match"
    assert r.json["error"]["candidates"] == [2, 4]
    scoped = ambiguous.replace(b"@@\n-same", b"@@ y\n-same")
    r = cli("apply", "--repo", str(repo.path), "--json", "-", input=scoped)
    assert r.code == 0 and r.json["status"] == "committed"
    assert (repo.path / "twice.txt").read_text() == "x\nsame\ny\nother\n"


def test_a_new_file_without_dev_null_sent_again_is_already_applied(repo: Repo) -> None:
    """Created from a -0,0 hunk on a missing path; sent again under a new key it is that file, not an insertion."""
    patch = b"--- a/brand/new.py\n+++ b/brand/new.py\n@@ -0,0 +1,2 @@\n+def f():\n+    return 1\n"
    first = apply(str(repo.path), patch, key="k1")
    count = repo.count()
    again = apply(str(repo.path), patch, key="k2")
    assert again.already_applied and again.commit == first.commit and repo.count() == count
    assert (repo.path / "brand/new.py").read_text() == "def f():\n    return 1\n"

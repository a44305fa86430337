"""Cross-format equivalence over real histories.

For every non-merge commit C (with parent P) of a history, the change P → C is
taken as a unified diff (``git diff --full-index -M``) and converted to the
``apply_patch`` envelope by :func:`tests.convert.unified_to_envelope` (which
sees P's contents, grows context until each hunk is unique and checks its own
output).  Both are applied through the real protocol to branches at P; the two
commits must have the same tree oid, which must be C's tree when nothing was
skipped (else C's blob at every converted path).  What the envelope cannot say
(symlinks, mode changes, binary files) is skipped and counted.

Histories: this project's own (cloned; skipped if it has fewer than two
commits; in the default run a sample of ``HISTORY_SAMPLE`` commits, the newest
ones and a spread over the older ones, every commit under ``scripts/test --all``) and a generated one with renames, CRLF, missing final
newlines, deletes, empty files, repeated blocks (so context must grow),
non-UTF-8 bytes, trailing whitespace, and the unsupported kinds.
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import HISTORY_SAMPLE, Repo, git, history_sample, make_repo
from tests.convert import unified_to_envelope
from patcher.protocol import apply

PROJECT = Path(__file__).resolve().parents[2]


@dataclass
class Tally:
    commits: int = 0
    compared: int = 0
    skipped_commits: int = 0
    skipped_files: list[tuple[str, str, str]] = field(default_factory=list)


def _out(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, check=True).stdout


def _blob(repo: Path, rev: str, path: str) -> bytes | None:
    res = subprocess.run(["git", "cat-file", "blob", f"{rev}:{path}"], cwd=repo, capture_output=True)
    return res.stdout if res.returncode == 0 else None


def check_history(repo: Path, commits: int | None = None) -> Tally:
    """Every commit of the history, or a sample of ``commits`` of them (:func:`conftest.history_sample`)."""
    tally = Tally()
    lines = [ln for ln in _out(repo, "rev-list", "--reverse", "--no-merges", "--parents", "HEAD").decode().split("\n")
             if ln]
    if commits is not None:
        lines = history_sample(lines, commits)
    for n, line in enumerate(lines):
        commit, *parents = line.split()
        if not parents:
            continue
        parent = parents[0]
        tally.commits += 1
        diff = _out(repo, "diff", "--full-index", "--binary", "-M", parent, commit)
        conv = unified_to_envelope(diff, read_old=lambda p, rev=parent: _blob(repo, rev, p),
                                   skip_unsupported=True)
        tally.skipped_files += [(commit[:12], path, why) for path, why in conv.skipped]
        if conv.files == 0:
            tally.skipped_commits += 1
            continue
        for kind in ("u", "e"):
            git(repo, "branch", "-f", f"x{kind}{n}", parent)
        unified = apply(str(repo), conv.unified, branch=f"x{'u'}{n}", format="unified", key=f"u-{commit}")
        envelope = apply(str(repo), conv.text, branch=f"x{'e'}{n}", format="apply_patch", key=f"e-{commit}")
        assert unified.tree == envelope.tree, f"{commit}: unified and envelope trees differ"
        if not conv.skipped:
            assert unified.tree == _out(repo, "rev-parse", f"{commit}^{{tree}}").decode().strip()
        else:
            for out in envelope.outputs:
                if out["op"] != "delete":
                    assert _blob(repo, commit, out["path"]) == _blob(repo, envelope.commit or "", out["path"])
        tally.compared += 1
    return tally


@pytest.mark.parametrize("commits", [
    HISTORY_SAMPLE,
    pytest.param(None, marks=pytest.mark.slow, id="all"),
], ids=str)
def test_project_history_converts_to_the_same_trees(tmp_path: Path, commits: int | None) -> None:
    count = int(_out(PROJECT, "rev-list", "--count", "HEAD").strip() or 0)
    if count < 2:
        pytest.skip("the project history has fewer than two commits")
    clone = tmp_path / "self"
    git(tmp_path, "clone", "-q", "--no-hardlinks", str(PROJECT), str(clone))
    tally = check_history(clone, commits)
    assert tally.compared >= 1
    if commits is not None and count > 2 * commits:
        assert tally.commits >= commits - 1  # the whole sample ran (the root, if drawn, has no parent)
    # Only what the envelope cannot say may be skipped (never a mismatch, offset or ambiguity).
    allowed = {"mode", "symlink", "binary", "mixed line endings", "marker line"}
    assert {why for _, _, why in tally.skipped_files} <= allowed, tally.skipped_files


# --------------------------------------------------------------------------- a generated history

WORDS = ["alpha", "beta", "gamma", "}", "", "return x", "    pass", "end"]


def _text(rng: random.Random, n: int, eol: str = "\n", final: bool = True) -> bytes:
    lines = [rng.choice(WORDS) for _ in range(n)]
    body = eol.join(lines)
    return (body + (eol if final else "")).encode()


def _mutate(rng: random.Random, data: bytes, eol: bytes) -> bytes:
    final = data.endswith(eol)
    lines = (data[: -len(eol)] if final else data).split(eol)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(lines) + 1)
        op = rng.random()
        if op < 0.4 and i < len(lines):
            lines[i] = (rng.choice(WORDS) + " changed").encode()
        elif op < 0.7:
            lines.insert(i, rng.choice(WORDS).encode())
        elif i < len(lines) and len(lines) > 2:
            del lines[i]
    return eol.join(lines) + (eol if final else b"")


def generated_history(path: Path) -> Repo:
    rng = random.Random(20240605)
    repo = make_repo(path, {
        "lf.txt": _text(rng, 30),
        "crlf.txt": _text(rng, 25, "\r\n"),
        "noeol.txt": _text(rng, 12, final=False),
        "blocks.py": b"".join(b"def f%d():\n    x = 1\n    return x\n\n" % (i % 3) for i in range(12)),
        "keep/ws.txt": b"trailing   \nspaces\t\nhere\n",
        "latin1.txt": b"caf\xe9\n\xff\xfe raw\nplain\n",
    })

    def commit(msg: str) -> None:
        repo.git("add", "-A")
        repo.git("commit", "-q", "--allow-empty", "-m", msg)

    for i in range(6):  # random edits, repeated content: context must grow to be unique
        for name, eol in (("lf.txt", b"\n"), ("crlf.txt", b"\r\n")):
            full = path / name
            full.write_bytes(_mutate(rng, full.read_bytes(), eol))
        commit(f"random edits {i}")
    blocks = (path / "blocks.py").read_bytes().split(b"    x = 1\n")
    (path / "blocks.py").write_bytes(b"    x = 1\n".join(blocks[:7]) + b"    x = 2\n" + b"    x = 1\n".join(blocks[7:]))
    commit("the seventh of twelve periodic blocks: context must grow to an end of the file")
    (path / "noeol.txt").write_bytes((path / "noeol.txt").read_bytes() + b" more")
    commit("edit the unterminated last line")
    (path / "noeol.txt").write_bytes((path / "noeol.txt").read_bytes() + b"\n")
    commit("add the final newline")
    (path / "lf.txt").write_bytes((path / "lf.txt").read_bytes().rstrip(b"\n"))
    commit("drop the final newline")
    crlf = path / "crlf.txt"
    crlf.write_bytes(crlf.read_bytes().rstrip(b"\r\n"))
    commit("crlf without final newline")
    crlf.write_bytes(crlf.read_bytes().replace(b"\r\n", b"\r\nnew\r\n", 1) + b" tail\r\n")
    commit("crlf edit and final newline back")
    (path / "moved").mkdir()
    repo.git("mv", "lf.txt", "moved/lf.txt")
    commit("pure rename")
    repo.git("mv", "moved/lf.txt", "lf2.txt")
    (path / "lf2.txt").write_bytes(b"head\n" + (path / "lf2.txt").read_bytes())
    commit("rename with edit")
    repo.git("rm", "-q", "keep/ws.txt")
    (path / "empty").write_bytes(b"")
    (path / "new_noeol").write_bytes(b"one\ntwo")
    (path / "new_crlf").write_bytes(b"a\r\nb\r\n")
    commit("delete, add empty, add without newline, add crlf")
    (path / "empty").write_bytes(b"now\n")
    (path / "new_noeol").write_bytes(b"")
    (path / "latin1.txt").write_bytes(b"caf\xe9 cr\xe8me\n\xff\xfe raw\nplain\n")
    commit("empty gets content, content becomes empty, non-UTF-8 edit")
    (path / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (path / "run.sh").chmod(0o755)
    commit("an executable file: skipped (mode)")
    os.symlink("lf2.txt", path / "link")
    (path / "img.bin").write_bytes(bytes(range(256)))
    (path / "lf2.txt").write_bytes((path / "lf2.txt").read_bytes() + b"\nlast")
    commit("symlink and binary (skipped) next to a text edit (kept)")
    (path / "run.sh").chmod(0o644)
    commit("mode change only: skipped")
    repo.git("rm", "-q", "link", "img.bin", "new_crlf")
    commit("deletes of a symlink, a binary and a crlf file")
    return repo


def test_generated_history_converts_to_the_same_trees(tmp_path: Path) -> None:
    repo = generated_history(tmp_path / "gen")
    tally = check_history(repo.path)
    assert tally.commits == 20
    assert tally.skipped_commits == 2  # the executable add and the mode-only change
    reasons = sorted((path, why) for _, path, why in tally.skipped_files)
    assert reasons == [("img.bin", "binary"), ("img.bin", "binary"), ("link", "symlink"),
                       ("run.sh", "mode"), ("run.sh", "mode")]
    assert tally.compared == 18

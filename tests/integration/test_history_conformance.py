"""History conformance: replaying every commit of a history as a patch rebuilds its exact tree.

For every non-merge, non-root commit C, `git diff --full-index --binary -M -C C^ C` is
applied by oncepatch onto a branch created at C^ (not checked out, so no
worktree is written) and the new commit's tree must be C's tree, object for
object.  Two histories: this project's own (cloned to a temp folder; in the
default run a sample of its commits, every one under ``scripts/test --all``), and one
generated here with the git CLI that walks through the shapes git diff can
produce (renames, modes, CRLF, missing final newlines, non-UTF-8 bytes, empty
files, symlinks, new folders, a file replaced by a folder, quoted names, binary
literals and deltas, copies).

Most commits go through the in-process API (`patcher.protocol.apply`) for
speed; a handful go through the real CLI.  Root commits are skipped (there is
no parent to branch from).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import HISTORY_SAMPLE, ROOT, Repo, git, history_sample, make_repo, run_cli
from patcher.protocol import apply



@dataclass(frozen=True)
class Commit:
    oid: str
    tree: str
    parent: str
    subject: str


def history(repo_path: Path) -> list[Commit]:
    """Non-merge commits with exactly one parent, oldest first."""
    out = git(repo_path, "log", "--no-merges", "--reverse", "--format=%H %T %P%x00%s%x00")
    commits: list[Commit] = []
    for rec in out.split("\x00\n"):
        if not rec.strip():
            continue
        head, subject = rec.split("\x00")[:2]
        oid, tree, *parents = head.split()
        if len(parents) == 1:
            commits.append(Commit(oid, tree, parents[0], subject))
    return commits


def patch_between(repo_path: Path, a: str, b: str) -> bytes:
    return subprocess.run(["git", "diff", "--full-index", "--binary", "-M", "-C", a, b], cwd=repo_path,
                          capture_output=True, check=True).stdout


def make_branches(repo_path: Path, commits: list[Commit], prefix: str) -> dict[str, Commit]:
    """One branch per commit at its parent, created in one ref transaction."""
    branches = {f"{prefix}/{i}": c for i, c in enumerate(commits)}
    stdin = "".join(f"create refs/heads/{b} {c.parent}\n" for b, c in branches.items()).encode()
    git(repo_path, "update-ref", "--stdin", input=stdin)
    return branches


def check_conformance(repo_path: Path, commits: list[Commit], prefix: str, *, via_cli: int = 0) -> list[str]:
    """Apply each commit's patch onto a branch at its parent; return the mismatches (empty: all conform).

    The last ``via_cli`` commits go through the real CLI, the rest through the API.
    """
    branches = make_branches(repo_path, commits, prefix)
    problems: list[str] = []
    cli_from = len(branches) - via_cli
    for i, (branch, c) in enumerate(branches.items()):
        patch = patch_between(repo_path, c.parent, c.oid)
        if i >= cli_from:
            r = run_cli("apply", "-", "--repo", str(repo_path), "--branch", branch, "--json", input=patch)
            if r.code != 0:
                problems.append(f"{c.oid[:12]} {c.subject!r}: exit {r.code} {r.out.strip()}")
                continue
            tree, commit = r.json["tree"], r.json["commit"]
        else:
            try:
                res = apply(str(repo_path), patch, branch=branch)
            except Exception as exc:  # noqa: BLE001 - collected and reported per commit
                problems.append(f"{c.oid[:12]} {c.subject!r}: {type(exc).__name__}: {exc}")
                continue
            tree, commit = res.tree, res.commit
        if tree != c.tree:
            problems.append(f"{c.oid[:12]} {c.subject!r}: tree {tree} != {c.tree}")
    # What the refs say, independently of what apply returned: one new commit on C^, with C's tree.
    out = git(repo_path, "for-each-ref", "--format=%(refname:strip=2) %(objectname) %(tree)",
              f"refs/heads/{prefix}/")
    tips = {name: (oid, tree) for name, oid, tree in (line.split() for line in out.splitlines())}
    for branch, c in branches.items():
        oid, tree = tips[branch]
        if any(p.startswith(c.oid[:12]) for p in problems):
            continue
        parents = git(repo_path, "rev-list", "--parents", "-n", "1", oid).split()[1:]
        if parents != [c.parent] or tree != c.tree:
            problems.append(f"{c.oid[:12]} {c.subject!r}: branch {branch} at {oid} parents {parents} tree {tree}")
    return problems


# -- this project's own history -----------------------------------------------------------


@pytest.mark.parametrize("sample", [
    HISTORY_SAMPLE,
    pytest.param(None, marks=pytest.mark.slow, id="all"),
], ids=str)
def test_own_history_conforms(tmp_path: Path, sample: int | None) -> None:
    """Every commit under ``--all``; in the default run ``HISTORY_SAMPLE`` of them (conftest.history_sample)."""
    clone = tmp_path / "self"
    git(tmp_path, "clone", "-q", "--no-checkout", str(ROOT), str(clone))
    all_commits = git(clone, "rev-list", "--no-merges", "HEAD").split()
    if len(all_commits) < 2:
        pytest.skip(f"the project's history has {len(all_commits)} non-merge commit(s): nothing to replay")
    commits = history(clone)
    assert commits
    if sample is not None:
        commits = history_sample(commits, sample)
        assert len(commits) == min(sample, len(history(clone)))
    problems = check_conformance(clone, commits, "conf", via_cli=1)
    print(f"history conformance: {len(commits)} commits (own history)")
    assert problems == []
    assert len(commits) > 0


# -- a generated history ------------------------------------------------------------------


LINES = "".join(f"row {i}\n" for i in range(1, 61))
BLOCK = "begin\n    value = {}\nend\n"


def _w(r: Repo, rel: str, data: bytes | str, mode: int | None = None) -> None:
    r.write(rel, data, mode)


def _read(r: Repo, rel: str) -> str:
    return (r.path / rel).read_text()


def _mv(r: Repo, src: str, dst: str) -> None:
    (r.path / dst).parent.mkdir(parents=True, exist_ok=True)
    r.git("mv", src, dst)


def _spread(r: Repo) -> None:
    _w(r, "text.txt", LINES)
    _w(r, "crlf.txt", b"a\r\nb\r\nc\r\nd\r\n")
    _w(r, "noeol.txt", b"x\ny\nz")
    _w(r, "latin1.txt", b"na\xefve caf\xe9\n\xff\xfe\n")
    _w(r, "empty.txt", b"")
    _w(r, "run.sh", "#!/bin/sh\necho hi\n", 0o755)
    _w(r, "dup.txt", BLOCK.format(1) * 6)


def _many_hunks(r: Repo) -> None:
    rows = _read(r, "text.txt").splitlines(keepends=True)
    _w(r, "text.txt", "".join(f"changed {i}\n" if i % 7 == 0 else row for i, row in enumerate(rows)))


def _rename_edit(r: Repo) -> None:
    _mv(r, "renamed.txt", "text2.txt")
    _w(r, "text2.txt", _read(r, "text2.txt") + "tail\n")


def _file_to_folder(r: Repo) -> None:
    r.git("rm", "-q", "latin1.txt")
    _w(r, "latin1.txt/inside.txt", "was a file\n")


def _folder_to_file(r: Repo) -> None:
    r.git("rm", "-q", "-r", "pkg/b")
    _w(r, "pkg/b", "was a folder\n")


def _retarget(r: Repo) -> None:
    (r.path / "link").unlink()
    os.symlink("text2.txt", r.path / "link")


def _typechange(r: Repo) -> None:
    (r.path / "link").unlink()
    _w(r, "link", "a regular file now\n")


def _repeated_context(r: Repo) -> None:
    # Six identical blocks; only the fourth changes: the hunk's line number is what places it.
    _w(r, "dup.txt", BLOCK.format(1) * 3 + BLOCK.format(2) + BLOCK.format(1) * 2)


def _odd_names(r: Repo) -> None:
    _w(r, "with space.txt", "s\n")
    _w(r, "ünï cödé.txt", "u\n")
    _w(r, 'q"uote.txt', "q\n")  # git quotes it; tabs and other control characters are refused by design


def _multi(r: Repo) -> None:
    _w(r, "text2.txt", "short now\n")
    r.git("rm", "-q", "with space.txt")
    _w(r, "new/one.txt", "1\n")
    _mv(r, "run.sh", "bin/run.sh")
    _w(r, "crlf.txt", b"a\nB\nc\nd\ne\nf\n")


def _rename_across(r: Repo) -> None:
    _mv(r, "dup.txt", "deep/dup.txt")
    _w(r, "deep/dup.txt", _read(r, "deep/dup.txt") + "end of dup\n")


BLOB = bytes(range(256)) * 64  # 16 KiB that no text heuristic takes for text


def _binary_edit(r: Repo) -> None:
    data = bytearray((r.path / "img.bin").read_bytes())
    data[5000:5016] = b"sixteen new byte"
    _w(r, "img.bin", bytes(data) + b"\0tail")


def _binary_rename_edit(r: Repo) -> None:
    _mv(r, "img.bin", "assets/img.bin")
    data = bytearray((r.path / "assets/img.bin").read_bytes())
    data[100:104] = b"\1\2\3\4"
    _w(r, "assets/img.bin", bytes(data))


def _copy_with_edit(r: Repo) -> None:
    _w(r, "many/f19.txt", "19\n" * 19 + "changed\n")  # -C finds copies of modified files
    _w(r, "many/copy-of-f19.txt", "19\n" * 20 + "copied, then edited\n")


def _steps() -> list[tuple[str, Callable[[Repo], object]]]:
    return [
        ("add a spread of files", _spread),
        ("edit the middle", lambda r: _w(r, "text.txt", LINES.replace("row 30\n", "row thirty\n"))),
        ("edit first and last lines", lambda r: _w(
            r, "text.txt", _read(r, "text.txt").replace("row 1\n", "ROW 1\n").replace("row 60\n", ""))),
        ("many hunks", _many_hunks),
        ("pure rename", lambda r: _mv(r, "text.txt", "renamed.txt")),
        ("rename with edit", _rename_edit),
        ("exec bit on", lambda r: (r.path / "text2.txt").chmod(0o755)),
        ("exec bit off", lambda r: (r.path / "run.sh").chmod(0o644)),
        ("exec bit and content", lambda r: _w(r, "run.sh", "#!/bin/sh\necho bye\n", 0o755)),
        ("crlf edit", lambda r: _w(r, "crlf.txt", b"a\r\nB\r\nc\r\nd\r\ne\r\n")),
        ("crlf to lf", lambda r: _w(r, "crlf.txt", b"a\nB\nc\nd\ne\n")),
        ("no-eol: change last line", lambda r: _w(r, "noeol.txt", b"x\ny\nZZ")),
        ("no-eol: add final newline", lambda r: _w(r, "noeol.txt", b"x\ny\nZZ\n")),
        ("no-eol: lines added, none at the end", lambda r: _w(r, "noeol.txt", b"x\ny\nZZ\nmore")),
        ("non-utf8 edit", lambda r: _w(r, "latin1.txt", b"na\xefve caf\xe9 cr\xe8me\n\xff\xfe\n\x80\n")),
        ("empty file gets content", lambda r: _w(r, "empty.txt", "now full\n")),
        ("file emptied", lambda r: _w(r, "empty.txt", b"")),
        ("add another empty file", lambda r: _w(r, "also-empty", b"")),
        ("delete an empty file", lambda r: r.git("rm", "-q", "also-empty")),
        ("move into new nested folders", lambda r: _mv(r, "noeol.txt", "deep/er/still/noeol.txt")),
        ("add files in new folders", lambda r: (
            _w(r, "pkg/a/__init__.py", ""), _w(r, "pkg/a/mod.py", "X = 1\n"), _w(r, "pkg/b/c/data.txt", "d\n"))),
        ("file replaced by folder", _file_to_folder),
        ("folder replaced by file", _folder_to_file),
        ("add a symlink", lambda r: os.symlink("run.sh", r.path / "link")),
        ("add a symlink to a folder", lambda r: os.symlink("pkg/a", r.path / "dirlink")),
        ("retarget a symlink", _retarget),
        ("typechange: symlink becomes a file", _typechange),
        ("delete a symlink", lambda r: r.git("rm", "-q", "dirlink")),
        ("repeated context", _repeated_context),
        ("names with spaces, unicode and a quote", _odd_names),
        ("rename a quoted name", lambda r: _mv(r, "ünï cödé.txt", "dir with space/ü.txt")),
        ("multi-file change", _multi),
        ("delete a whole folder", lambda r: r.git("rm", "-q", "-r", "pkg")),
        ("rename across folders with edit", _rename_across),
        ("add many files", lambda r: [_w(r, f"many/f{i:02}.txt", f"{i}\n" * (i + 1)) for i in range(20)]),
        ("edit some of them", lambda r: [_w(r, f"many/f{i:02}.txt", f"{i}\n" * i + "x\n") for i in range(0, 20, 3)]),
        ("add binary files", lambda r: (_w(r, "img.bin", BLOB), _w(r, "other.bin", b"\0" * 100 + b"x"))),
        ("binary edit (a delta)", _binary_edit),
        ("binary rename with edit", _binary_rename_edit),
        ("binary rewritten whole (a literal)", lambda r: _w(r, "assets/img.bin", bytes(reversed(BLOB)) + b"\x00")),
        ("binary exec bit and content", lambda r: _w(r, "assets/img.bin", b"\0\1\2" * 999, 0o755)),
        ("copy with edit", _copy_with_edit),
        ("binary becomes text", lambda r: _w(r, "assets/img.bin", "text at last\n", 0o755)),
        ("delete a binary", lambda r: r.git("rm", "-q", "other.bin")),
    ]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Repo, list[Commit]]:
    # Built once per module, before the per-test hermetic fixture runs: make it hermetic here.
    home = tmp_path_factory.mktemp("genhome")
    (home / ".gitconfig").write_text("[user]\n\tname = Gen\n\temail = gen@example.com\n[core]\n\tautocrlf = false\n")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(("GIT_", "ONCEPATCH_")):
                mp.delenv(name)
        mp.setenv("HOME", str(home))
        mp.setenv("GIT_CONFIG_NOSYSTEM", "1")
        repo = make_repo(tmp_path_factory.mktemp("gen") / "repo", {"README": "generated history\n"})
        for subject, step in _steps():
            step(repo)
            repo.git("add", "-A")
            repo.git("commit", "-q", "-m", subject)
    commits = history(repo.path)
    assert len(commits) >= 30
    assert_covers_the_shapes(repo, commits)
    return repo, commits


def assert_covers_the_shapes(repo: Repo, commits: list[Commit]) -> None:
    """The generated history really contains what it claims (a guard on the generator, not the product)."""
    raw = git(repo.path, "log", "--raw", "-M", "--format=")
    statuses = {line.split("\t")[0].split()[-1][0] for line in raw.splitlines() if line.startswith(":")}
    assert {"A", "M", "D", "R", "T"} <= statuses
    modes = {m for line in raw.splitlines() if line.startswith(":") for m in line[1:].split()[:2]}
    assert {"100644", "100755", "120000"} <= modes
    diffs = b"".join(patch_between(repo.path, c.parent, c.oid) for c in commits)
    for needle in (b"\\ No newline at end of file", b"\r\n", b"\xff\xfe", b"new mode 100755", b"old mode 100755",
                   b"rename from", b"similarity index 100%", b"new file mode 120000", b'"b/q\\"uote.txt"',
                   b'rename to "dir with space/\\303\\274.txt"', b"GIT binary patch\ndelta ",
                   b"GIT binary patch\nliteral ", b"copy from many/f19.txt",
                   b"index 0000000000000000000000000000000000000000..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"):
        assert needle in diffs, needle


def test_generated_history_conforms(generated: tuple[Repo, list[Commit]]) -> None:
    repo, commits = generated
    checked = list(commits)
    problems = check_conformance(repo.path, checked, "gen", via_cli=4)
    print(f"history conformance: {len(checked)} commits (generated history)")
    assert problems == []
    assert len(checked) >= 30


def test_generated_history_typechange_commit_conforms(generated: tuple[Repo, list[Commit]]) -> None:
    repo, commits = generated
    subset = [c for c in commits if c.subject.startswith("typechange")]
    assert len(subset) == 1
    assert check_conformance(repo.path, subset, "tc") == []

#!/usr/bin/env python3
"""Run oncepatch over OpenAI Codex's own ``apply_patch`` test cases and print agreement per case.

Usage: ``scripts/codex_cases.py [CASES.json] [-v]`` (run with the project's
``.venv/bin/python``).  The cases (codex's fixture scenarios and unit tests as
data, Apache-2.0, their provenance inside) are not part of this repository:
by default they are read from ``../shared/peers/codex-apply-patch-cases.json``
relative to the repository root; when absent, the script says so and exits 0.

Each case is a tree of input files, one envelope (or several, applied in
turn) and codex's answer: success with the final tree, or failure.  The case
is run through :func:`patcher.protocol.apply` on a fresh git repository, and
judged:

``agree``     same outcome (and, on success, the same bytes in every file);
``binary``    codex's ported test says otherwise, but oncepatch does what the
              real codex binary does (the case's ``binary`` field);
``declared``  the case is named in ``docs/FORMATS.md``'s table of codex
              cases that do not agree (and, when the case's ``design``
              field gives the outcome that page announces, oncepatch's is it);
``DIFFERS``   none of these: a difference no document explains.

The exit status is 1 when a case differs, else 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT.parent / "shared" / "peers" / "codex-apply-patch-cases.json"
sys.path.insert(0, str(ROOT))

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "cases", "GIT_AUTHOR_EMAIL": "cases@example.invalid",
    "GIT_COMMITTER_NAME": "cases", "GIT_COMMITTER_EMAIL": "cases@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, **_GIT_ENV, "HOME": str(repo.parent)})


def _tree(repo: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for path in sorted(repo.rglob("*")):
        rel = path.relative_to(repo).as_posix()
        if rel == ".git" or rel.startswith(".git/") or not path.is_file():
            continue
        out[rel] = path.read_bytes()
    return out


def _run(case: dict[str, Any], work: Path) -> tuple[bool, dict[str, bytes] | str]:
    """oncepatch's outcome: ``(True, final tree)`` or ``(False, error type)``."""
    from cas.errors import OncepatchError
    from patcher.protocol import apply

    repo = work / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    for rel, text in case["input"].items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "input")
    patches = case["patch"] if isinstance(case["patch"], list) else [case["patch"]]
    old_home = os.environ.get("HOME")
    os.environ.update({**_GIT_ENV, "HOME": str(work)})
    try:
        for n, patch in enumerate(patches):
            try:
                apply(str(repo), patch.replace("{ROOT}", str(repo)), key=f"case-{n}")
            except OncepatchError as exc:
                return False, exc.error_type
    finally:
        if old_home is not None:
            os.environ["HOME"] = old_home
    return True, _tree(repo)


def _same(outcome: tuple[bool, dict[str, bytes] | str], answer: dict[str, Any], error: str = "*") -> bool:
    ok, got = outcome
    if ok != answer.get("ok", answer.get("op") == "files"):
        return False
    if not ok:
        return error in ("*", got)
    want = {k: v.encode("utf-8") for k, v in answer["files"].items()}
    return got == want


def _listed(name: str) -> bool:
    """Whether docs/FORMATS.md's table of codex cases names ``name``."""
    return f"| `{name}` |" in (ROOT / "docs" / "FORMATS.md").read_text()


def judge(case: dict[str, Any], work: Path) -> tuple[str, str]:
    outcome = _run(case, work)
    if _same(outcome, case["codex"]):
        return "agree", ""
    if case.get("binary") and _same(outcome, case["binary"]):
        return "binary", case["binary"].get("why", "")
    design = case.get("design")
    if not _listed(case["name"]):
        pass
    elif not design:
        return "declared", "docs/FORMATS.md"
    else:
        if design["op"] == "refuse" and _same(outcome, {"ok": False}, design.get("error", "*")):
            return "declared", design["ref"]
        if design["op"] == "files" and _same(outcome, {"ok": True, "files": design["files"]}):
            return "declared", design["ref"]
    ok, got = outcome
    shown = got if not ok else {k: v.decode("utf-8", "replace") for k, v in got.items()}  # type: ignore[union-attr]
    return "DIFFERS", f"oncepatch {'ok' if ok else 'refused'}: {shown!r}"


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    source = Path(args[0]) if args else DEFAULT
    if not source.is_file():
        print(f"skipped: no codex cases at '{source}'")
        return 0
    cases = json.loads(source.read_text())["cases"]
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="codex-cases-") as tmp:
        for k, case in enumerate(cases):
            work = Path(tmp) / str(k)
            work.mkdir()
            verdict, why = judge(case, work)
            counts[verdict] = counts.get(verdict, 0) + 1
            if verbose or verdict != "agree":
                print(f"{verdict:9} {case['name']}" + (f"  ({why})" if why else ""))
            else:
                print(f"{verdict:9} {case['name']}")
    print(f"\n{len(cases)} cases: " + ", ".join(f"{counts.get(v, 0)} {v}"
                                              for v in ("agree", "binary", "declared", "DIFFERS")))
    return 1 if counts.get("DIFFERS") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

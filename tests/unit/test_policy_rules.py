"""The policy's rules and patterns (receipts/policy.py), pure: no repository (one test reads the doc's example)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cas.errors import UsageError
from receipts.policy import Caller, PathPattern, Request, parse_policy

ME = Caller(1000, 1000, frozenset({1000, 50}), "agent", frozenset({"agent", "agents"}))


def req(*paths: str, branch: str = "refs/heads/main", fmt: str = "unified", size: int = 10,
        repo: str = "/srv/repos/app") -> Request:
    return Request("apply_patch", repo, branch, fmt, size, paths=paths or None)


@pytest.mark.parametrize(("pattern", "path", "hit"), [
    (".github/workflows/**", ".github/workflows/ci.yml", True),
    (".github/workflows/**", ".github/workflows/sub/ci.yml", True),
    (".github/workflows/**", ".github/ci.yml", False),
    (".git*", ".gitattributes", True),
    (".git*", "sub/dir/.gitmodules", True),  # no slash: a name at any depth
    (".git*", ".github/workflows/ci.yml", True),  # a folder that matches: all inside it
    (".git*", "src/git.py", False),
    ("src/*.py", "src/app.py", True),
    ("src/*.py", "src/pkg/app.py", False),  # '*' stays within a folder
    ("src/**/*.py", "src/app.py", True),
    ("src/**/*.py", "src/pkg/deep/app.py", True),
    ("docs", "docs/guide.txt", True),
    ("/docs", "sub/docs/guide.txt", False),  # a leading slash anchors at the root
    ("secret?.txt", "secret1.txt", True),
    ("[ab].txt", "c.txt", False),
    ("a+b(c).txt", "a+b(c).txt", True),  # regex characters are literal
    ("**/secrets/**", "secrets/db.txt", True),
    ("**/secrets/**", "config/secrets/prod/db.txt", True),
    ("**/secrets/**", "src/secrets.py", False),
    ("*.pem", "deploy/keys/site.pem", True),
    (".husky/**", ".husky/pre-commit", True),
])
def test_path_patterns_follow_gits_ignore_globs(pattern: str, path: str, hit: bool) -> None:
    assert PathPattern.parse(pattern).matches(path) is hit


def policy(text: str):  # type: ignore[no-untyped-def]
    return parse_policy("p.toml", 'schema = "oncepatch.policy/1"\n' + text)


def test_a_rule_names_its_callers_by_name_uid_group_or_gid() -> None:
    for who in ('users = ["agent"]', "users = [1000]", 'groups = ["agents"]', "groups = [50]", ""):
        assert policy(f"[[allow]]\n{who}\n").refusal(ME, req("a")) is None, who
    assert policy('[[allow]]\nusers = ["root"]\n').refusal(ME, req("a")) == \
        "no rule of the policy names user 'agent' (uid 1000)"
    assert policy("").refusal(ME, req("a")) == "no rule of the policy names user 'agent' (uid 1000)"


def test_any_rule_that_allows_it_is_enough_and_the_first_refusal_is_named() -> None:
    p = policy('[[allow]]\npaths = ["src/**"]\n[[allow]]\npaths = ["docs/**"]\n')
    assert p.refusal(ME, req("docs/a.md")) is None
    assert p.refusal(ME, req("README")) == "'README' is outside the paths rule 1 allows"


def test_top_level_denials_win_over_every_rule() -> None:
    p = policy('deny_paths = [".github/workflows/**"]\n[[allow]]\n')
    assert p.refusal(ME, req(".github/workflows/ci.yml")) == \
        "'.github/workflows/ci.yml' is denied by the policy ('.github/workflows/**')"
    # Before the paths are known, the rest is judged alone.
    assert p.refusal(ME, req()) is None


def test_branches_repos_formats_and_sizes() -> None:
    p = policy('[[allow]]\nbranches = ["agent/*"]\nrepos = ["/srv/repos/*"]\nformats = ["unified"]\n'
               "max_patch_bytes = 100\nmax_files = 1\n")
    assert p.refusal(ME, req("a", branch="refs/heads/agent/x")) is None
    assert "branch 'refs/heads/main'" in str(p.refusal(ME, req("a")))
    assert "repository '/elsewhere'" in str(p.refusal(ME, req("a", branch="refs/heads/agent/x", repo="/elsewhere")))
    assert "format 'apply_patch'" in str(p.refusal(ME, req("a", branch="refs/heads/agent/x", fmt="apply_patch")))
    assert "101 bytes" in str(p.refusal(ME, req("a", branch="refs/heads/agent/x", size=101)))
    assert "touches 2 files" in str(p.refusal(ME, req("a", "b", branch="refs/heads/agent/x")))


@pytest.mark.parametrize(("text", "why"), [
    ("[[allow]]\nuser = [1]\n", "unknown keys: user"),
    ("deny_path = []\n", "unknown keys: deny_path"),
    ("[[allow]]\nmax_files = -1\n", "whole number"),
    ("[[allow]]\npaths = [1]\n", "list of strings"),
    ("[[allow]\n", "not TOML"),
])
def test_a_policy_it_cannot_read_is_refused_whole(text: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        policy(text)
    with pytest.raises(UsageError, match="schema"):
        parse_policy("p.toml", "[[allow]]\n")


def test_the_documented_policy_parses_and_keeps_out_workflows_git_files_hooks_and_secrets() -> None:
    """docs/SECURITY.md's example policy, as written: what issue 26 names (CI workflows, git's own
    config files, hooks, secrets) is refused to every caller it allows."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "SECURITY.md").read_text()
    p = parse_policy("SECURITY.md", doc.split("```toml\n", 1)[1].split("```", 1)[0])
    agent = Caller(1001, 1001, frozenset({1001}), "agent", frozenset({"agent"}))
    allowed = req("src/app.py", branch="refs/heads/agent/fix", fmt="unified", repo="/srv/repos/app")
    assert p.refusal(agent, allowed) is None
    for path in (".github/workflows/ci.yml", ".gitattributes", ".gitmodules", "sub/.gitignore",
                 ".githooks/pre-commit", ".husky/pre-push", ".pre-commit-config.yaml", "src/secrets/token",
                 "src/config/secrets/db.txt"):
        assert "denied by the policy" in str(p.refusal(agent, req(path, branch="refs/heads/agent/fix",
                                                                   repo="/srv/repos/app"))), path
        # one such path refuses the whole call
        assert p.refusal(agent, req("src/app.py", path, branch="refs/heads/agent/fix", repo="/srv/repos/app"))


def test_a_remote_mode_call_is_judged_by_its_repository_or_its_remotes_url() -> None:
    """docs/REMOTE.md: the key is claimed on a remote; a rule may name the local repository or that URL."""
    remote = Request("apply_patch", "/srv/repos/app", "refs/heads/main", "unified", 10, paths=("a",),
                     remote="https://git.example.com/org/app.git")
    for repos in ('["/srv/repos/*"]', '["https://git.example.com/org/*"]'):
        assert policy(f"[[allow]]\nrepos = {repos}\n").refusal(ME, remote) is None, repos
    why = policy('[[allow]]\nrepos = ["https://git.example.com/other/*"]\n').refusal(ME, remote)
    assert why == "repository '/srv/repos/app' (remote 'https://git.example.com/org/app.git') is not one rule 1 allows"
    assert policy('[[allow]]\nrepos = ["git@git.example.com:org/*"]\n').refusal(
        ME, Request("apply_patch", "/srv/repos/app", "refs/heads/main", "unified", 10,
                    remote="git@git.example.com:org/app.git")) is None

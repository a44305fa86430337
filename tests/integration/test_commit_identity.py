"""Commits and reflog lines carry the identity git would use (environment, then configuration)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cas.errors import UsageError
from cas.signature import IdentityUnknown, Signature, git_identity, parse_git_date, signature_line
from conftest import Repo, make_repo, run_cli, snapshot
from patcher.protocol import apply

PATCH = b"--- a/README\n+++ b/README\n@@ -1 +1 @@\n-hello\n+hello there\n"
FORMAT = "%an|%ae|%at|%ad|%cn|%ce|%ct|%cd"


def _log(repo: Repo) -> list[str]:
    return repo.git("log", "-1", f"--format={FORMAT}", "--date=raw").strip().split("|")


def test_environment_identities_and_dates_as_git_uses_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Ann Author")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "ann@example.com")
    monkeypatch.setenv("GIT_AUTHOR_DATE", "1700000000 +0200")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Cy Committer")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "cy@example.com")
    monkeypatch.setenv("GIT_COMMITTER_DATE", "@1700000100 -0130")
    res = apply(str(repo.path), PATCH, key="k1")
    assert res.status == "committed"
    an, ae, at, ad, cn, ce, ct, cd = _log(repo)
    assert (an, ae, at, ad) == ("Ann Author", "ann@example.com", "1700000000", "1700000000 +0200")
    assert (cn, ce, ct, cd) == ("Cy Committer", "cy@example.com", "1700000100", "1700000100 -0130")
    # The same commit git would have made from the same tree, parent, identities and message.
    env_commit = repo.git("commit-tree", repo.git("rev-parse", "HEAD^{tree}").strip(), "-p", "HEAD~1",
                          input=repo.git("log", "-1", "--format=%B").encode()[:-1]).strip()
    assert env_commit == repo.head()
    reflog = (repo.path / ".git" / "logs" / "refs" / "heads" / "main").read_text().splitlines()[-1]
    assert " Cy Committer <cy@example.com> " in reflog


def test_configuration_by_kind_then_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo")
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.delenv(name, raising=False)
    repo.git("config", "user.name", "Una User")
    repo.git("config", "user.email", "una@example.com")
    repo.git("config", "author.name", "Ada Config")
    repo.git("config", "committer.email", "committer@example.com")
    assert apply(str(repo.path), PATCH, key="k1").status == "committed"
    an, ae, _at, _ad, cn, ce, _ct, _cd = _log(repo)
    assert (an, ae, cn, ce) == ("Ada Config", "una@example.com", "Una User", "committer@example.com")


def test_a_date_git_documents_no_form_for_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo.path / "p.diff").write_bytes(PATCH)
    before = snapshot(repo)
    r = run_cli("apply", "p.diff", "--key", "k1", "--json", cwd=repo.path, env={"GIT_COMMITTER_DATE": "yesterday"})
    assert r.code == 2, r.err
    assert r.json["error"]["type"] == "usage" and "GIT_COMMITTER_DATE" in r.json["error"]["message"]
    assert snapshot(repo) == before
    assert not repo.store.exists() or not any(repo.store.rglob("*.json"))


@pytest.mark.parametrize("text, expected", [
    ("1700000000 +0200", (1700000000, 120)),
    ("@1700000000 -0130", (1700000000, -90)),
    ("1700000000 +02:00", (1700000000, 120)),
    ("Mon, 3 Jul 2006 17:18:43 +0200", (1151939923, 120)),
    ("2006-07-03T17:18:43+02:00", (1151939923, 120)),
    ("2006-07-03 15:18:43Z", (1151939923, 0)),
])
def test_git_date_forms(text: str, expected: tuple[int, int]) -> None:
    assert parse_git_date(text) == expected


@pytest.mark.parametrize("text", ["yesterday", "3 days ago", "", "17000 +02", "2006-13-40", "12345",
                                  "1700000000 +2500", "1700000000 +0099"])
def test_git_date_forms_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_git_date(text)


def _no_identity(home: Path, monkeypatch: pytest.MonkeyPatch, config: str = "") -> None:
    """No name or email anywhere git looks (and ``config`` in the global configuration)."""
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(name, raising=False)
    (home / ".gitconfig").write_text("[init]\n\tdefaultBranch = main\n" + config)


def _tree_bytes(root: Path) -> dict[str, str]:
    """Every file under ``root`` (the git dir with its store included) by content."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_no_identity_is_refused_with_gits_advice_and_changes_nothing(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo.path / "p.diff").write_bytes(PATCH)
    # user.useConfigOnly: git refuses whatever the host's name (a host with a domain lets git guess an email).
    _no_identity(Path(os.environ["HOME"]), monkeypatch, "[user]\n\tuseConfigOnly = true\n")
    git_says = subprocess.run(["git", "commit", "--allow-empty", "-m", "x"], cwd=repo.path, capture_output=True,
                              text=True, check=False)
    assert git_says.returncode != 0 and "*** Please tell me who you are." in git_says.stderr
    before, git_files = snapshot(repo), _tree_bytes(repo.path / ".git")
    r = run_cli("apply", "p.diff", "--key", "k1", "--json", cwd=repo.path)
    assert r.code == 2, (r.out, r.err)
    err = r.json["error"]
    assert err["type"] == "usage" and err["next_action"] == "fix_input"
    assert "*** Please tell me who you are." in err["message"]
    assert 'git config --global user.email "you@example.com"' in err["message"]
    assert 'git config --global user.name "Your Name"' in err["message"]
    assert "no email was given and auto-detection is disabled" in err["message"]
    assert snapshot(repo) == before and _tree_bytes(repo.path / ".git") == git_files
    human = run_cli("apply", "p.diff", "--key", "k1", cwd=repo.path)
    assert human.code == 2 and "*** Please tell me who you are." in human.err
    assert "oncepatch@localhost" not in r.out + human.err
    # Once configured, the same call commits with that identity.
    repo.git("config", "user.name", "Now Known")
    repo.git("config", "user.email", "known@example.com")
    assert run_cli("apply", "p.diff", "--key", "k1", "--json", cwd=repo.path).code == 0
    assert _log(repo)[:2] == ["Now Known", "known@example.com"]


def _git_var(kind: str, cwd: Path, env: dict[str, str]) -> tuple[str, str] | None:
    """(name, email) as ``git var GIT_<KIND>_IDENT`` (git's strict reading) gives it; ``None``: git refuses."""
    res = subprocess.run(["git", "var", f"GIT_{kind.upper()}_IDENT"], cwd=cwd, env=env, capture_output=True,
                         text=True, check=False)
    if res.returncode != 0:
        assert "*** Please tell me who you are." in res.stderr or "not allowed" in res.stderr, res.stderr
        return None
    name, _, rest = res.stdout.partition(" <")
    return name, rest.split(">", 1)[0]


@pytest.mark.parametrize("env, config", [
    ({}, ""),
    ({"GIT_AUTHOR_NAME": "Only Name"}, ""),
    ({"GIT_AUTHOR_EMAIL": "only@example.com"}, ""),
    ({"GIT_AUTHOR_NAME": "A", "GIT_AUTHOR_EMAIL": "a@example.com"}, ""),
    ({"GIT_COMMITTER_NAME": "C", "GIT_COMMITTER_EMAIL": "c@example.com"}, ""),
    ({"EMAIL": "from-env@example.com"}, ""),
    ({}, "[user]\n\tname = Config Name\n"),
    ({}, "[user]\n\temail = config@example.com\n"),
    ({"EMAIL": "from-env@example.com"}, "[user]\n\tuseConfigOnly = true\n"),
    ({}, "[user]\n\tuseConfigOnly = true\n\tname = N\n\temail = n@example.com\n"),
    ({}, "[user]\n\tuseConfigOnly = true\n\temail = n@example.com\n"),
])
def test_identity_found_or_refused_as_git_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               env: dict[str, str], config: str) -> None:
    """Against ``git var``: where git commits, the same name and email; where git refuses, a refusal.

    (Not matched: with only ``author.email`` configured git 2.39 gives the committer an empty email.)
    """
    repo = make_repo(tmp_path / "repo")
    _no_identity(Path(os.environ["HOME"]), monkeypatch, config)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def config_value(name: str) -> str | None:  # read by git (libgit2 keeps the first HOME it saw in a process)
        return repo.git("config", "--get", name, check=False).strip() or None

    for kind in ("author", "committer"):
        expected = _git_var(kind, repo.path, dict(os.environ))
        if expected is None:
            with pytest.raises(IdentityUnknown) as exc:
                git_identity(kind, config_value, os.environ)
            assert "*** Please tell me who you are." in str(exc.value)
            assert "oncepatch" not in f"{exc.value.guess}"
        else:
            sig = git_identity(kind, config_value, os.environ)
            assert (sig.name, sig.email) == expected, kind


@pytest.fixture(params=["Europe/Berlin", "America/St_Johns", "UTC"])
def zone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.delenv("TZ")
    time.tzset()


def _git_ident(env: dict[str, str]) -> str:
    e = {**os.environ, "GIT_COMMITTER_NAME": "n", "GIT_COMMITTER_EMAIL": "e", **env}
    return subprocess.run(["git", "var", "GIT_COMMITTER_IDENT"], env=e, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize("date", ["1700000000 +0200", "@1700000000", "Mon, 3 Jul 2006 17:18:43 +0200",
                                  "Mon, 3 Jul 2006 17:18:43", "Jul 3, 2006 17:18", "2006-07-03T17:18:43",
                                  "2006-07-03 17:18:43 -0330"])
def test_dates_read_as_git_reads_them(zone: str, date: str) -> None:
    """Against git's own reading (``git var GIT_COMMITTER_IDENT``): a date without a zone is local time."""
    ours = signature_line(Signature("n", "e", parse_git_date(date))).decode()
    assert ours == _git_ident({"GIT_COMMITTER_DATE": date}), (zone, date)


@pytest.mark.parametrize("name, email", [("John Doe Jr.", "jd@example.com."), ("Ann <ann>", "<ann@example.com>"),
                                         (" 'Quoted' ", "q@example.com;"), ("Line\nBreak", "lb@example.com")])
def test_names_and_emails_cleaned_as_git_cleans_them(name: str, email: str) -> None:
    env = {"GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email, "GIT_COMMITTER_DATE": "1700000000 +0000"}
    sig = git_identity("committer", lambda _name: None, env)
    assert signature_line(sig).decode() == _git_ident(env)


def test_a_configured_name_with_angle_brackets_commits_as_git_would(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo")
    for name in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.delenv(name, raising=False)
    repo.git("config", "user.name", "Ann <ann>")
    assert apply(str(repo.path), PATCH, key="k1").status == "committed"
    assert _log(repo)[0] == "Ann ann" == _log(repo)[4]


def test_a_long_lived_caller_reads_the_identity_at_every_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "repo")
    stores: dict[str, object] = {}
    names = []
    for i, who in enumerate(["First Agent", "Second Agent"]):
        monkeypatch.setenv("GIT_AUTHOR_NAME", who)
        monkeypatch.setenv("GIT_COMMITTER_NAME", who)
        patch = f"--- /dev/null\n+++ b/n{i}.txt\n@@ -0,0 +1 @@\n+{i}\n".encode()
        assert apply(str(repo.path), patch, key=f"k{i}", _stores=stores).status == "committed"
        names.append(_log(repo)[0] + "/" + _log(repo)[4])
    assert names == ["First Agent/First Agent", "Second Agent/Second Agent"]
    monkeypatch.setenv("GIT_AUTHOR_DATE", "yesterday")
    with pytest.raises(UsageError):
        apply(str(repo.path), b"--- /dev/null\n+++ b/n9.txt\n@@ -0,0 +1 @@\n+9\n", key="k9", _stores=stores)

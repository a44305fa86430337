"""The lifecycle commands on a store whose ledger fails its check (docs/LIFECYCLE.md).

``stats``, ``replay`` and ``gc`` refuse such a store before they read or write
anything else: exit 6, ``corrupt_receipt``, and an envelope that says the
command's own effect truthfully (``not_started``: nothing was changed), with
the repository and the store byte for byte as they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_repo, run_cli, snapshot

PATCH = b"--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-a\n+A\n"
PATCH2 = b"--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-b\n+B\n"


@pytest.mark.parametrize("command", [["stats"], ["stats", "--prometheus", "m.prom"], ["replay"],
                                     ["gc", "--policy", "policy.toml"],
                                     ["gc", "--policy", "policy.toml", "--dry-run"]],
                         ids=["stats", "stats-prometheus", "replay", "gc", "gc-dry-run"])
def test_a_broken_ledger_is_refused_before_anything_with_a_truthful_envelope(
        tmp_path: Path, command: list[str]) -> None:
    repo = make_repo(tmp_path / "repo", {"a.txt": "a\n", "b.txt": "b\n"})
    for key, patch in (("k1", PATCH), ("k2", PATCH2)):
        pf = tmp_path / f"{key}.diff"
        pf.write_bytes(patch)
        assert run_cli("apply", str(pf), "--repo", str(repo.path), "--key", key).code == 0
    (repo.path / "policy.toml").write_text('schema = "oncepatch.retention/1"\n[remove]\nolder_than_days = 0\n')
    ledger = repo.path / ".git/oncepatch/events.jsonl"
    lines = ledger.read_bytes().splitlines(keepends=True)
    ledger.write_bytes(b"".join(lines[:1] + lines[2:]))  # one event taken out: the chain breaks at line 2
    before = snapshot(repo)

    res = run_cli(*command, "--repo", str(repo.path), "--json", cwd=repo.path)
    assert res.code == 6, res.out + res.err
    err = res.json["error"]
    assert (err["type"], err["effect_status"]) == ("corrupt_receipt", "not_started"), err
    assert snapshot(repo) == before
    assert not (repo.path / "m.prom").exists()

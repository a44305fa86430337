"""Directory targets against planted entries (docs/DIRECTORIES.md, "Entries oncepatch did not make").

A symlink or a folder planted under a generation's name is never shown nor
followed: it is moved aside (``generations/.quarantine-...``) and the
generation built anew; ``gc`` and ``recover`` unlink a planted symlink and
never change anything it points at; ``init --dir`` refuses a git directory,
a store, a target's own folder, ``/`` and the home folder, changing nothing.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import git, run_cli
from dirs_helpers import patch_between, snapshot_tree, tree_of, view_of_folder, write_tree
from test_dirs import BASE, EDITS, adopt, expected_view, objects

A40 = "a" * 40


def gens(site: Path) -> Path:
    return Path(str(site) + ".oncepatch") / "generations"


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (itself included): type and mode, a file's bytes, a link's text; no link followed."""
    return snapshot_tree(root, mtimes=False)


def victim(tmp_path: Path, name: str = "victim") -> Path:
    """A folder outside every target, its folders 0700: nothing of oncepatch's may change it."""
    v = tmp_path / name
    (v / "sub").mkdir(parents=True)
    (v / "sub/keep.txt").write_text("not oncepatch's\n")
    os.chmod(v / "sub", 0o700)
    os.chmod(v, 0o700)
    return v


def dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(gone.stdout)


def quarantined(site: Path, tree: str) -> list[Path]:
    return sorted(p for p in gens(site).iterdir() if p.name.startswith(f".quarantine-{tree}-"))


def shows_its_own_generation(site: Path, tree: str) -> bool:
    real = gens(site).resolve() / tree
    return os.readlink(site) == f"site.oncepatch/generations/{tree}" and os.path.realpath(site) == str(real) \
        and stat.S_ISDIR(os.lstat(real).st_mode)


def _patch_file(tmp_path: Path, edit: str) -> tuple[Path, dict[str, str | bytes]]:
    """``tmp_path/<edit>.diff``, the patch that does ``EDITS[edit]`` to ``BASE``, and the files it makes."""
    after = dict(BASE)
    EDITS[edit](after)
    pf = tmp_path / f"{edit}.diff"
    pf.write_bytes(patch_between(tmp_path / "scratch", BASE, after))
    return pf, after


# -- 1. an entry under a generation's name is not trusted --------------------------------------


def test_a_symlink_planted_under_a_pruned_generation_is_moved_aside_and_the_generation_rebuilt(
        tmp_path: Path) -> None:
    site = adopt(tmp_path)
    first = tree_of(objects(site))
    pf, after = _patch_file(tmp_path, "modify")
    assert run_cli("apply", str(pf), "--dir", str(site), "--key", "k1").code == 0
    gc = run_cli("gc", "--dir", str(site), "--json")
    assert gc.code == 0 and gc.json["generations"] == [first], gc.out + gc.err
    outside = tmp_path / "outside"
    write_tree(outside, {"README": "another folder's content\n"})
    before = snapshot(outside)
    os.symlink(outside, gens(site) / first)

    rb = run_cli("rollback", "--dir", str(site), "--to", first, "--key", "rb1", "--json")
    assert rb.code == 0, rb.out + rb.err
    assert shows_its_own_generation(site, first)
    assert view_of_folder(site) == expected_view(BASE)
    moved = quarantined(site, first)
    assert len(moved) == 1 and os.readlink(moved[0]) == str(outside)  # kept as it was, for its owner to see
    assert snapshot(outside) == before
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0
    rec = run_cli("recover", "--dir", str(site), "--tmp-age", "0")
    assert rec.code == 0 and quarantined(site, first) == moved  # never removed by recover or gc
    assert run_cli("gc", "--dir", str(site)).code == 0 and quarantined(site, first) == moved


def test_a_folder_planted_under_the_next_generation_name_is_moved_aside(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    after = dict(BASE)
    EDITS["multi_file"](after)
    scratch = tmp_path / "scratch"
    pf = tmp_path / "multi.diff"
    pf.write_bytes(patch_between(scratch, BASE, after))
    nxt = git(scratch, "write-tree").strip()  # what the patch makes is predictable
    planted = gens(site) / nxt
    write_tree(planted, {**{k: v for k, v in after.items()}, "README": "planted, in no receipt\n"})

    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k1", "--json")
    assert res.code == 0, res.out + res.err
    assert res.json["tree"] == nxt
    assert shows_its_own_generation(site, nxt)
    assert view_of_folder(site) == expected_view(after)
    moved = quarantined(site, nxt)
    assert len(moved) == 1 and (moved[0] / "README").read_text() == "planted, in no receipt\n"
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


def test_a_generation_folder_edited_after_it_was_built_is_rebuilt_before_it_is_shown_again(
        tmp_path: Path) -> None:
    site = adopt(tmp_path)
    first = tree_of(objects(site))
    pf, after = _patch_file(tmp_path, "add")
    assert run_cli("apply", str(pf), "--dir", str(site), "--key", "k1").code == 0
    old = gens(site) / first
    os.chmod(old, 0o755)
    (old / "planted.txt").write_text("not from any patch\n")  # in the old generation only: no file shared
    os.chmod(old, 0o555)

    rb = run_cli("rollback", "--dir", str(site), "--to", first, "--key", "rb1")
    assert rb.code == 0, rb.out + rb.err
    assert shows_its_own_generation(site, first) and view_of_folder(site) == expected_view(BASE)
    moved = quarantined(site, first)
    assert len(moved) == 1 and (moved[0] / "planted.txt").exists()


def test_a_symlink_in_place_of_the_current_generation_is_refused_then_recover_rebuilds_it(
        tmp_path: Path) -> None:
    site = adopt(tmp_path)
    first = tree_of(objects(site))
    pf, after = _patch_file(tmp_path, "modify")
    os.rename(gens(site) / first, tmp_path / "moved-away")  # the generation's own folder, elsewhere now
    outside = tmp_path / "outside"
    write_tree(outside, {"README": "another folder's content\n"})
    os.symlink(outside, gens(site) / first)
    before = snapshot(outside)

    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k", "--json")
    assert res.code == 4, res.out + res.err
    err = res.json["error"]
    assert (err["type"], err["reason"], err["effect_status"]) == ("dirty_path", "generation_replaced", "not_started")
    assert tree_of(objects(site)) == first
    rec = run_cli("recover", "--dir", str(site))
    assert rec.code == 0, rec.out + rec.err
    assert shows_its_own_generation(site, first) and view_of_folder(site) == expected_view(BASE)
    assert len(quarantined(site, first)) == 1 and snapshot(outside) == before
    assert run_cli("apply", str(pf), "--dir", str(site), "--key", "k").code == 0
    assert view_of_folder(site) == expected_view(after)


# -- 2. removal never reaches through a symlink ---------------------------------------------------


def test_gc_unlinks_a_planted_generation_symlink_and_leaves_what_it_points_at_alone(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    v = victim(tmp_path)
    before = snapshot(v)
    os.symlink(v, gens(site) / A40)
    gc = run_cli("gc", "--dir", str(site), "--json")
    assert gc.code == 0 and gc.json["generations"] == [A40], gc.out + gc.err
    assert snapshot(v) == before  # modes (0700) and content as they were
    assert not [n for n in os.listdir(gens(site)) if A40 in n]  # the link itself is gone, not left as .tmp-


def test_recover_removes_planted_leftovers_without_following_them(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    dead = dead_pid()
    v1, v2 = victim(tmp_path, "victim1"), victim(tmp_path, "victim2")
    before = (snapshot(v1), snapshot(v2))
    as_link = gens(site) / f".tmp-{A40}-{dead}-x"
    os.symlink(v1, as_link)
    holding = gens(site) / f".tmp-{'b' * 40}-{dead}-y"
    (holding / "deep").mkdir(parents=True)
    os.symlink(v2, holding / "deep/into")
    os.symlink(v2 / "sub", holding / "sub")
    os.chmod(holding / "deep", 0o555)
    os.chmod(holding, 0o555)
    rec = run_cli("recover", "--dir", str(site), "--json")
    assert rec.code == 0, rec.out + rec.err
    assert not os.path.lexists(as_link) and not os.path.lexists(holding)
    assert (snapshot(v1), snapshot(v2)) == before


def test_remove_tree_never_chmods_through_a_link(tmp_path: Path) -> None:
    from cas.generations import remove_tree

    v = victim(tmp_path)
    before = snapshot(v)
    link = tmp_path / "link"
    os.symlink(v, link)
    remove_tree(str(link))
    assert not os.path.lexists(link) and snapshot(v) == before
    folder = tmp_path / "folder"
    (folder / "a").mkdir(parents=True)
    os.symlink(v, folder / "a/v")
    os.symlink(v / "sub", folder / "s")
    os.chmod(folder / "a", 0o555)
    os.chmod(folder, 0o555)
    remove_tree(str(folder))
    assert not os.path.lexists(folder) and snapshot(v) == before


# -- 3. init --dir refuses what must not become a generation --------------------------------------


def _repo(at: Path) -> Path:
    at.mkdir(parents=True)
    git(at, "init", "-q")
    (at / "f.txt").write_text("tracked\n")
    git(at, "add", "-A")
    git(at, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return at


def _case(tmp_path: Path, case: str) -> Path:
    """The folder to adopt; everything the refusal must leave as it was lies under ``tmp_path``."""
    if case == "a_dot_git":
        return _repo(tmp_path / "repo") / ".git"
    if case == "a_worktree":
        return _repo(tmp_path / "repo")
    if case == "a_bare_repository":
        bare = tmp_path / "bare.git"
        git(tmp_path, "init", "-q", "--bare", str(bare))
        return bare
    if case == "a_git_file_deep_below":
        write_tree(tmp_path / "site", {"index.html": "x\n", "vendor/lib/.git": "gitdir: /elsewhere\n"})
        return tmp_path / "site"
    if case == "a_git_dir_deep_below":
        site = tmp_path / "site"
        write_tree(site, {"index.html": "x\n"})
        git(tmp_path, "init", "-q", "--bare", str(site / "a/b/mirror"))
        return site
    if case == "a_store":
        site = tmp_path / "store"
        write_tree(site, {"receipts/ab/x.json": "{}\n", "locks/ledger.lock": "", "events.jsonl": ""})
        return site
    if case == "a_store_below":
        site = tmp_path / "site"
        write_tree(site, {"index.html": "x\n", "state/locks/ledger.lock": "", "state/receipts/ab/x.json": "{}\n"})
        return site
    if case == "inside_a_git_dir":
        return _repo(tmp_path / "repo") / ".git" / "refs"
    if case in ("inside_a_target_home", "a_target_home"):
        site = tmp_path / "site"
        write_tree(site, BASE)
        assert run_cli("init", "--dir", str(site)).code == 0
        home = Path(str(site) + ".oncepatch")
        return home / "adopted" if case == "inside_a_target_home" else home
    if case == "the_home_folder":
        write_tree(tmp_path / "home", {"notes.txt": "mine\n"})
        return tmp_path / "home"
    if case == "a_folder_holding_home":
        write_tree(tmp_path / "users/me", {"notes.txt": "mine\n"})
        return tmp_path / "users"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["a_dot_git", "a_worktree", "a_bare_repository", "a_git_file_deep_below",
                                  "a_git_dir_deep_below", "a_store", "a_store_below", "inside_a_git_dir",
                                  "inside_a_target_home", "a_target_home", "the_home_folder",
                                  "a_folder_holding_home"])
def test_init_refuses_and_changes_nothing(tmp_path: Path, case: str) -> None:
    folder = _case(tmp_path, case)
    home = {"the_home_folder": tmp_path / "home", "a_folder_holding_home": tmp_path / "users/me"}.get(case)
    before = snapshot(tmp_path)
    res = run_cli("init", "--dir", str(folder), "--json", env=None if home is None else {"HOME": str(home)})
    assert res.code == 2, (res.code, res.out, res.err)
    assert "cannot adopt" in res.json["error"]["message"], res.json
    assert snapshot(tmp_path) == before
    assert not os.path.lexists(str(folder) + ".oncepatch")


def test_init_refuses_the_root_folder() -> None:
    res = run_cli("init", "--dir", "/", "--json")
    assert res.code == 2 and not os.path.lexists("/.oncepatch"), res.out + res.err


def test_a_folder_with_a_symlink_to_a_repository_is_still_adopted(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    site = tmp_path / "site"
    write_tree(site, {"index.html": "x\n"})
    os.symlink(repo, site / "code")  # kept as a link, never entered: no git directory is adopted
    res = run_cli("init", "--dir", str(site), "--json")
    assert res.code == 0, res.out + res.err
    assert os.readlink(site / "code") == str(repo)


def test_a_folder_holding_symlinks_is_adopted_and_they_stay_links(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_tree(site, {"index.html": "x\n"})
    os.symlink("index.html", site / "latest")
    os.symlink("/nowhere/at/all", site / "dangling")
    res = run_cli("init", "--dir", str(site), "--json")  # (a symlink was fsynced by path: ELOOP)
    assert res.code == 0, res.out + res.err
    assert (os.readlink(site / "latest"), os.readlink(site / "dangling")) == ("index.html", "/nowhere/at/all")


def test_a_rollback_key_that_is_not_utf8_is_a_usage_error_that_changes_nothing(tmp_path: Path) -> None:
    # The key reached the store's lookup as it was: an internal error whose envelope said "unknown".
    site = adopt(tmp_path)
    first = tree_of(objects(site))
    pf, after = _patch_file(tmp_path, "modify")
    assert run_cli("apply", str(pf), "--dir", str(site), "--key", "k1").code == 0
    home = Path(str(site) + ".oncepatch")
    before = snapshot(home)
    rb = run_cli("rollback", "--dir", str(site), "--to", first, "--key", os.fsdecode(b"r\xff"), "--json")
    assert rb.code == 2, rb.out + rb.err
    err = rb.json["error"]
    assert err["type"] == "usage" and err["effect_status"] == "not_started" and "UTF-8" in err["message"], err
    assert snapshot(home) == before and view_of_folder(site) == expected_view(after)

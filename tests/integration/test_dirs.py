"""Directory targets (docs/DIRECTORIES.md): adopt, apply, replay, log, rollback, gc, outside edits, crash matrix.

The crash matrix: every named crash point of ``apply`` (and the directory's own
``after-generation``) × add / modify / delete / rename / multi-file, through
real processes.  After the crash the folder shows the old generation or the
new one, complete; ``recover --dir`` ends in the predicted one; the retry
lands the change exactly once; ``verify --dir`` passes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from conftest import git, run_cli
from dirs_helpers import patch_between, snapshot_dir, tree_of, tree_views, view_of_folder, write_tree
from torture_driver import commits_with_trailer

BASE: dict[str, str | bytes] = {
    "README": "hello\n",
    "src/app.py": "".join(f"line {i}\n" for i in range(1, 21)),
    "src/util.py": "def f():\n    return 1\n",
    "docs/guide.txt": "guide\n",
    "bin/logo.png": bytes(range(256)) * 4,
}


def _add(f: dict[str, str | bytes]) -> None:
    f["pkg/new/added.txt"] = "brand new\n"


def _modify(f: dict[str, str | bytes]) -> None:
    f["src/app.py"] = str(f["src/app.py"]).replace("line 7\n", "line seven\n")


def _delete(f: dict[str, str | bytes]) -> None:
    del f["docs/guide.txt"]


def _rename(f: dict[str, str | bytes]) -> None:
    f["src/helpers.py"] = f.pop("src/util.py")


def _multi(f: dict[str, str | bytes]) -> None:
    _add(f)
    _modify(f)
    _delete(f)
    _rename(f)


EDITS = {"add": _add, "modify": _modify, "delete": _delete, "rename": _rename, "multi_file": _multi}
#: crash point -> does the new generation land?
POINTS = {"after-stage": False, "after-prepare": False, "after-index-ahead": False, "after-ref": True,
          "after-materialise": True, "after-generation": True, "before-receipt-replace": True}


#: The two layouts (docs/DIRECTORIES.md, "Sharing folders"): ``init --dir``'s options for each.
LAYOUTS = {"whole": (), "shared": ("--share-folders",)}


def adopt(tmp_path: Path, files: dict[str, str | bytes] | None = None, layout: str = "whole") -> Path:
    site = tmp_path / "site"
    site.mkdir()
    write_tree(site, BASE if files is None else files)
    res = run_cli("init", "--dir", str(site), "--json", *LAYOUTS[layout])
    assert res.code == 0, res.out + res.err
    assert res.json["layout"] == layout
    return site


def folder_name(site: Path) -> str:
    """``generations`` (a whole folder per generation) or ``trees`` (the shared layout)."""
    return "trees" if (Path(str(site) + ".oncepatch") / "trees").is_dir() else "generations"


def objects(site: Path) -> Path:
    return Path(str(site) + ".oncepatch") / "objects.git"


def change(tmp_path: Path, edit: str) -> tuple[Path, dict[str, str | bytes]]:
    after = dict(BASE)
    EDITS[edit](after)
    pf = tmp_path / f"{edit}.diff"
    pf.write_bytes(patch_between(tmp_path / f"scratch-{edit}", BASE, after))
    return pf, after


def expected_view(files: dict[str, str | bytes]) -> dict[str, str]:
    import hashlib

    return {k: hashlib.sha256(v.encode() if isinstance(v, str) else v).hexdigest() for k, v in files.items()}


def generation_folders(site: Path) -> list[str]:
    """The generations' folders (and any dot-entry beside them); in the shared layout not the sub-trees' own."""
    names = os.listdir(Path(str(site) + ".oncepatch") / folder_name(site))
    if folder_name(site) == "generations":
        return sorted(names)
    roots = set(git(objects(site), "log", "--format=%T", "refs/heads/generations").split())
    return sorted(n for n in names if n in roots or n.startswith("."))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_apply_replay_log_rollback_gc(tmp_path: Path, layout: str) -> None:
    site = adopt(tmp_path, layout=layout)
    folder = folder_name(site)
    assert site.is_symlink()
    first = tree_of(objects(site))
    assert os.readlink(site) == f"site.oncepatch/{folder}/{first}"
    assert view_of_folder(site) == expected_view(BASE)
    assert (Path(str(site) + ".oncepatch") / "adopted" / "README").read_text() == "hello\n"  # the original, kept

    pf, after = change(tmp_path, "multi_file")
    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k1", "--json")
    assert res.code == 0, res.out + res.err
    doc = res.json
    second = doc["tree"]
    assert os.readlink(site) == f"site.oncepatch/{folder}/{second}"
    assert view_of_folder(site) == expected_view(after)
    assert {o["path"]: o["op"] for o in doc["outputs"]} == {
        "pkg/new/added.txt": "add", "src/app.py": "modify", "docs/guide.txt": "delete", "src/helpers.py": "rename"}
    # Read-only, and the unchanged files shared with the first generation (one inode).
    gen1, gen2 = Path(str(site) + f".oncepatch/{folder}/{first}"), site.resolve()
    assert stat.S_IMODE((gen2 / "README").stat().st_mode) == 0o444
    assert stat.S_IMODE(gen2.stat().st_mode) == 0o555
    assert (gen1 / "README").stat().st_ino == (gen2 / "README").stat().st_ino
    assert (gen1 / "src/app.py").stat().st_ino != (gen2 / "src/app.py").stat().st_ino

    again = run_cli("apply", str(pf), "--dir", str(site), "--key", "k1", "--json")
    assert again.code == 0 and again.json["replayed"] is True and again.json["tree"] == second
    st = run_cli("status", "k1", "--dir", str(site), "--json")
    assert st.code == 0 and (st.json["receipt"]["status"], st.json["receipt"]["tree"]) == ("committed", second)

    log = run_cli("log", "--dir", str(site), "--json").json["generations"]
    assert [(g["generation"], g["key"], g["current"]) for g in log] == [(second, "k1", True), (first, None, False)]

    rb = run_cli("rollback", "--dir", str(site), "--to", first[:10], "--key", "rb", "--json")
    assert rb.code == 0, rb.out + rb.err
    assert rb.json["tree"] == first and os.readlink(site) == f"site.oncepatch/{folder}/{first}"
    assert view_of_folder(site) == expected_view(BASE)
    rb2 = run_cli("rollback", "--dir", str(site), "--to", first[:10], "--key", "rb", "--json")
    assert rb2.code == 0 and rb2.json["replayed"] is True, rb2.out + rb2.err
    log = run_cli("log", "--dir", str(site), "--json").json["generations"]
    assert [(g["generation"], g["key"]) for g in log] == [(first, "rb"), (second, "k1"), (first, None)]
    assert int(git(objects(site), "rev-list", "--count", "refs/heads/generations")) == 3  # history kept

    same = run_cli("rollback", "--dir", str(site), "--to", first, "--key", "rb-same", "--json")
    assert same.code == 2 and "nothing to roll back" in same.json["error"]["message"]
    # k1's receipt names the second generation (its tree): while the receipt stays, so does the folder.
    dry = run_cli("gc", "--dir", str(site), "--dry-run", "--json")
    assert dry.code == 0 and dry.json["generations"] == []
    gc = run_cli("gc", "--dir", str(site), "--json")
    assert gc.code == 0 and gc.json["generations"] == []
    assert generation_folders(site) == sorted([first, second])
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


def test_gc_removes_a_generation_once_gc_removed_its_receipt_and_keeps_one_whose_receipt_stays(
        tmp_path: Path) -> None:
    site = adopt(tmp_path)
    first = tree_of(objects(site))  # adopted: no receipt names it
    trees = {}
    now = dict(BASE)
    for key, edit in (("old/k1", _add), ("keep/k2", _modify), ("keep/k3", _delete)):
        before = dict(now)
        edit(now)
        pf = tmp_path / f"{key.replace('/', '-')}.diff"
        pf.write_bytes(patch_between(tmp_path / f"scratch-{key.replace('/', '-')}", before, now))
        res = run_cli("apply", str(pf), "--dir", str(site), "--key", key, "--json")
        assert res.code == 0, res.out + res.err
        trees[key] = res.json["tree"]
    assert generation_folders(site) == sorted([first, *trees.values()])

    plain = run_cli("gc", "--dir", str(site), "--json")  # every receipt stays: only the adopted one goes
    assert plain.code == 0 and plain.json["generations"] == [first], plain.out + plain.err
    policy = tmp_path / "old.toml"
    policy.write_text('schema = "oncepatch.retention/1"\n[remove]\nkey_prefixes = ["old/"]\n')
    dry = run_cli("gc", "--dir", str(site), "--policy", str(policy), "--dry-run", "--json")
    assert dry.code == 0, dry.out + dry.err
    assert [r["key"] for r in dry.json["remove"]] == ["old/k1"] and dry.json["generations"] == [trees["old/k1"]]
    assert trees["old/k1"] in generation_folders(site)  # a dry run: nothing removed
    gc = run_cli("gc", "--dir", str(site), "--policy", str(policy), "--json")
    assert gc.code == 0, gc.out + gc.err
    assert [r["key"] for r in gc.json["removed"]] == ["old/k1"] and gc.json["generations"] == [trees["old/k1"]]
    # keep/k2's generation is neither current nor the tip's: its receipt alone keeps it.
    assert generation_folders(site) == sorted([trees["keep/k2"], trees["keep/k3"]])
    assert run_cli("gc", "--dir", str(site), "--json").json["generations"] == []
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0
    # A rollback to a pruned generation builds it again from the object database.
    rb = run_cli("rollback", "--dir", str(site), "--to", trees["old/k1"], "--key", "rb", "--json")
    assert rb.code == 0, rb.out + rb.err
    assert trees["old/k1"] in generation_folders(site) and site.resolve().name == trees["old/k1"]


def test_an_edit_outside_oncepatch_is_reported_and_refused(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    pf, _after = change(tmp_path, "add")
    target = site / "README"
    os.chmod(target, 0o644)  # what another program (or root) can do to a read-only hard link
    target.write_text("edited by hand\n")
    ver = run_cli("verify", "--dir", str(site), "--grace", "0", "--json")
    assert ver.code == 6 and ver.json["ok"] is False
    assert any("'README'" in p for p in ver.json["dir"]["problems"]), ver.json
    before = snapshot_dir(site)
    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k1", "--json")
    assert res.code == 4, res.out + res.err
    err = res.json["error"]
    assert (err["type"], err["effect_status"], err["reason"], err["paths"]) == (
        "dirty_path", "not_started", "edited_outside", ["README"])
    assert snapshot_dir(site) == before  # nothing written: objects, receipts, locks, generations, the symlink


def test_a_file_added_into_the_generation_is_refused(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    pf, _after = change(tmp_path, "modify")
    os.chmod(site / "docs", 0o755)
    (site / "docs/planted.txt").write_text("not from any patch\n")
    before = snapshot_dir(site)
    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k1", "--json")
    assert res.code == 4 and res.json["error"]["reason"] == "edited_outside", res.out + res.err
    assert set(res.json["error"]["paths"]) == {"docs/", "docs/planted.txt"}
    assert snapshot_dir(site) == before
    ver = run_cli("verify", "--dir", str(site), "--grace", "0", "--json")
    assert ver.code == 6 and any("planted.txt" in p for p in ver.json["dir"]["problems"])


def test_a_folder_not_adopted_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    res = run_cli("apply", "-", "--dir", str(plain), "--key", "k", "--json", input=b"")
    assert res.code == 2 and "oncepatch init --dir" in res.json["error"]["message"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("point", list(POINTS))
def test_crash_then_recover_then_retry_lands_once(tmp_path: Path, point: str, edit: str, layout: str) -> None:
    site = adopt(tmp_path, layout=layout)
    base_tree = tree_of(objects(site))
    pf, after = change(tmp_path, edit)
    argv = ("apply", str(pf), "--dir", str(site), "--key", "k", "--json")

    crashed = run_cli(*argv, env={"ONCEPATCH_CRASH_AT": point})
    assert crashed.code == 137, (crashed.code, crashed.out, crashed.err)
    # Whatever the point, the folder shows a whole generation: the old one, or the new one.
    assert view_of_folder(site) in (expected_view(BASE), expected_view(after))
    views = tree_views(objects(site))
    for name in generation_folders(site):
        if not name.startswith(".tmp-"):  # a complete generation under its final name is exactly its tree
            assert view_of_folder(Path(str(site) + f".oncepatch/{folder_name(site)}") / name) == views[name]

    rec = run_cli("recover", "--dir", str(site), "--json", "--tmp-age", "0")
    assert rec.code == 0, rec.out + rec.err
    assert not [n for n in generation_folders(site) if n.startswith(".")]
    assert not [n for n in os.listdir(tmp_path) if ".oncepatch-link-" in n]
    lands = POINTS[point]
    now = tree_of(objects(site))
    assert os.readlink(site) == f"site.oncepatch/{folder_name(site)}/{now}"
    assert view_of_folder(site) == expected_view(after if lands else BASE)
    assert (now != base_tree) is lands

    again = run_cli(*argv)
    assert again.code == 0, again.out + again.err
    assert again.json["replayed"] is lands
    assert view_of_folder(site) == expected_view(after)
    assert commits_with_trailer(objects(site), again.json["call_id"], "refs/heads/generations") == [
        again.json["commit"]]
    assert int(git(objects(site), "rev-list", "--count", "refs/heads/generations")) == 2
    ver = run_cli("verify", "--dir", str(site), "--grace", "0")
    assert ver.code == 0, ver.out + ver.err


def test_the_matrix_covers_the_directory_step() -> None:
    from cas.crash import POINTS as DEFINED

    assert set(POINTS) <= DEFINED and "after-generation" in POINTS


def test_recover_removes_what_a_dead_build_left_and_nothing_live(tmp_path: Path) -> None:
    import subprocess
    import sys

    site = adopt(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)
    gens = Path(str(site) + ".oncepatch/generations")
    left = gens / f".tmp-{'a' * 40}-{dead}-0badf00d"
    (left / "sub").mkdir(parents=True)
    (left / "sub/file").write_text("half built\n")
    os.chmod(left / "sub", 0o555)
    live = gens / f".tmp-{'b' * 40}-{os.getpid()}-0badf00d"  # this process lives: its build is not touched
    live.mkdir()
    stray = tmp_path / f".site.oncepatch-link-{dead}-0badf00d"
    os.symlink("site.oncepatch/generations/nothing", stray)
    before = os.readlink(site)
    dry = run_cli("recover", "--dir", str(site), "--dry-run", "--json")
    assert dry.code == 0 and left.exists() and os.path.lexists(stray)
    assert sorted(dry.json["dir"]["done"]) == sorted([f"removed '{left}' left by a crashed call",
                                                      f"removed '{stray}' left by a crashed call"])
    rec = run_cli("recover", "--dir", str(site), "--json")
    assert rec.code == 0, rec.out + rec.err
    assert not left.exists() and not os.path.lexists(stray) and live.exists()
    assert os.readlink(site) == before


def test_gc_with_a_policy_and_a_dir_also_removes_the_generations_nothing_needs(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    first = tree_of(objects(site))
    pf, _ = change(tmp_path, "multi_file")
    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k1", "--json")
    assert res.code == 0, res.out + res.err
    assert generation_folders(site) == sorted([first, res.json["tree"]]) or len(generation_folders(site)) == 2
    policy = tmp_path / "keep-all.toml"
    policy.write_text('schema = "oncepatch.retention/1"\n[remove]\nkey_prefixes = ["nothing-has-this/"]\n')
    gc = run_cli("gc", "--dir", str(site), "--policy", str(policy), "--json")
    assert gc.code == 0, gc.out + gc.err
    assert gc.json["removed"] == [] and gc.json["generations"] == [first]  # no receipt needs the first
    assert generation_folders(site) == [res.json["tree"]]
    assert run_cli("status", "k1", "--dir", str(site)).code == 0  # its receipt stayed
    none = run_cli("gc")
    assert none.code == 2 and "--policy" in none.err and "--dir" in none.err


def test_init_again_finishes_an_adoption_cut_between_its_renames(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    link = os.readlink(site)
    os.unlink(site)  # as a crash after the folder was moved aside, before the symlink was made
    res = run_cli("init", "--dir", str(site), "--json")
    assert res.code == 0 and res.json["adopted"] is False, res.out + res.err
    assert os.readlink(site) == link and view_of_folder(site) == expected_view(BASE)


def test_a_removed_current_generation_is_refused_then_recover_builds_it(tmp_path: Path) -> None:
    import shutil

    site = adopt(tmp_path)
    pf, after = change(tmp_path, "modify")
    gen = site.resolve()
    for folder, _dirs, _files in os.walk(gen):
        os.chmod(folder, 0o755)
    shutil.rmtree(gen)
    res = run_cli("apply", str(pf), "--dir", str(site), "--key", "k", "--json")
    assert res.code == 4 and res.json["error"]["reason"] == "generation_missing", res.out + res.err
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 6
    assert run_cli("recover", "--dir", str(site)).code == 0
    assert view_of_folder(site) == expected_view(BASE)
    assert run_cli("apply", str(pf), "--dir", str(site), "--key", "k").code == 0
    assert view_of_folder(site) == expected_view(after)

"""The shared layout of a directory target (docs/DIRECTORIES.md, "Sharing folders"); ``init`` and ``verify``'s gaps.

``init --dir --share-folders`` keeps one read-only folder per git tree under
``PATH.oncepatch/trees/``; an unchanged sub-folder of a new generation is a
relative symlink to the folder of its tree.  Shown here: a change builds only
the folders on its paths; content symlinks that climb with ``..`` still
resolve; ``gc`` keeps every folder a kept generation reaches; planted entries
are moved aside and never followed; what the apply's check and ``verify``
each catch.  Then: ``init`` that fails changes nothing, ``verify --dir``'s
envelope, and a symlink in place of the current generation is not followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from conftest import git, run_cli
from dirs_helpers import patch_between, snapshot_tree, tree_of, tree_views, view_of_folder, write_tree
from test_dirs import BASE, LAYOUTS, adopt, change, expected_view, objects

NESTED: dict[str, str | bytes] = {
    "index.html": "<h1>home</h1>\n",
    "a/b/c/deep.txt": "deep\n",
    "a/b/c/other.txt": "other\n",
    "a/b/sibling.txt": "sibling\n",
    "x/y/z.txt": "z\n",
    "x/w.txt": "w\n",
}


def trees(site: Path) -> Path:
    return Path(str(site) + ".oncepatch") / "trees"


def folders(site: Path) -> set[str]:
    return {n for n in os.listdir(trees(site)) if not n.startswith(".")}


def subtree(objects_dir: Path, tree: str, path: str) -> str:
    return git(objects_dir, "rev-parse", f"{tree}:{path}").strip()


def apply(site: Path, patch: Path, key: str) -> dict[str, object]:
    res = run_cli("apply", str(patch), "--dir", str(site), "--key", key, "--json")
    assert res.code == 0, res.out + res.err
    return res.json


def patch_file(tmp_path: Path, name: str, before: dict[str, str | bytes], after: dict[str, str | bytes]) -> Path:
    pf = tmp_path / f"{name}.diff"
    pf.write_bytes(patch_between(tmp_path / f"scratch-{name}", before, after))
    return pf


# -- cost: only the folders on the changed paths -------------------------------------------------


def test_a_one_file_change_builds_only_the_folders_on_its_path(tmp_path: Path) -> None:
    site = adopt(tmp_path, NESTED, layout="shared")
    first = tree_of(objects(site))
    before = folders(site)
    assert os.readlink(site) == f"site.oncepatch/trees/{first}"
    after_files = dict(NESTED, **{"a/b/c/deep.txt": "deeper\n"})
    doc = apply(site, patch_file(tmp_path, "deep", NESTED, after_files), "k1")
    second = str(doc["tree"])
    assert view_of_folder(site) == expected_view(after_files)
    # Exactly the trees on the changed path are new: the root, a, a/b, a/b/c.
    made = folders(site) - before
    assert made == {second} | {subtree(objects(site), second, p) for p in ("a", "a/b", "a/b/c")}
    # The untouched sub-folder is the same folder in both generations, shared by a relative link.
    x = subtree(objects(site), second, "x")
    assert os.readlink(trees(site) / second / "x") == f"../{x}"
    assert os.path.realpath(site / "x") == os.path.realpath(trees(site) / first / "x") == str(trees(site) / x)
    # In a rebuilt folder, the unchanged file is a hard link to the old one; the changed one is new.
    old_c = trees(site) / subtree(objects(site), first, "a/b/c")
    new_c = trees(site) / subtree(objects(site), second, "a/b/c")
    assert (old_c / "other.txt").stat().st_ino == (new_c / "other.txt").stat().st_ino
    assert (old_c / "deep.txt").read_text() == "deep\n" and (new_c / "deep.txt").read_text() == "deeper\n"
    assert stat.S_IMODE(new_c.stat().st_mode) == 0o555 and stat.S_IMODE((new_c / "deep.txt").stat().st_mode) == 0o444
    # Programs that follow links read the whole generation: cat, open(), os.walk(followlinks=True).
    assert (site / "a/b/c/deep.txt").read_text() == "deeper\n"
    walked = {os.path.relpath(os.path.join(d, f), site) for d, _s, fs in os.walk(site, followlinks=True) for f in fs}
    assert walked == set(after_files)
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


def test_content_symlinks_that_climb_still_resolve(tmp_path: Path) -> None:
    files = dict(NESTED)
    site = adopt(tmp_path, files, layout="shared")
    gen = site.resolve()
    # Added by a patch (a git diff can carry symlinks): links that climb out of their folder.
    scratch_before = dict(files)
    pf = tmp_path / "links.diff"
    scratch = tmp_path / "scratch-links"
    scratch.mkdir()
    git(scratch, "init", "-q")
    write_tree(scratch, scratch_before)
    git(scratch, "add", "-A")
    git(scratch, "commit", "-qm", "before")
    os.symlink("../../index.html", scratch / "a/b/home.html")  # climbs 2 from a/b: a and a/b stay real folders
    os.symlink("../w.txt", scratch / "x/y/w-link")  # climbs 1 from x/y
    git(scratch, "add", "-A")
    pf.write_bytes(git(scratch, "diff", "--cached", "--full-index", "--binary").encode())
    doc = apply(site, pf, "links")
    second = str(doc["tree"])
    assert (site / "a/b/home.html").read_text() == NESTED["index.html"]
    assert (site / "x/y/w-link").read_text() == NESTED["x/w.txt"]
    root = trees(site) / second
    assert stat.S_ISDIR(os.lstat(root / "a").st_mode) and stat.S_ISDIR(os.lstat(root / "a/b").st_mode)
    assert os.path.islink(root / "a/b/c")  # a/b/c holds no climbing link: shared
    # x/y's link climbs into x only: y is a real folder inside x's own folder, and x is shared.
    assert os.path.islink(root / "x") and stat.S_ISDIR(os.lstat((root / "x").resolve() / "y").st_mode)
    assert gen.exists() and run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


def test_a_link_that_climbs_after_it_descended_makes_the_generation_whole(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_tree(site, NESTED)
    os.symlink("a/../index.html", site / "round-trip")  # through a, then up: a must be a real folder
    res = run_cli("init", "--dir", str(site), "--json", "--share-folders")
    assert res.code == 0, res.out + res.err
    root = site.resolve()
    assert (site / "round-trip").read_text() == NESTED["index.html"]
    assert all(stat.S_ISDIR(os.lstat(root / p).st_mode) for p in ("a", "a/b", "a/b/c", "x", "x/y"))
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


# -- retention --------------------------------------------------------------------------------------


def test_gc_keeps_every_folder_a_kept_generation_reaches(tmp_path: Path) -> None:
    site = adopt(tmp_path, NESTED, layout="shared")
    first = tree_of(objects(site))
    now = dict(NESTED)
    made = {}
    for key, path in (("old/k1", "x/w.txt"), ("keep/k2", "a/b/sibling.txt")):
        before = dict(now)
        now[path] = f"changed by {key}\n"
        made[key] = str(apply(site, patch_file(tmp_path, key.replace("/", "-"), before, now), key)["tree"])
    x_first = subtree(objects(site), first, "x/y")  # built by init, still reached by every generation
    policy = tmp_path / "old.toml"
    policy.write_text('schema = "oncepatch.retention/1"\n[remove]\nkey_prefixes = ["old/"]\n')
    gc = run_cli("gc", "--dir", str(site), "--policy", str(policy), "--json")
    assert gc.code == 0, gc.out + gc.err
    gone = set(gc.json["generations"])
    # The first and old/k1's generations go; what keep/k2's (current) reaches stays, x/y built by init included.
    assert {first, made["old/k1"]} <= gone and made["keep/k2"] not in gone and x_first not in gone
    views = tree_views(objects(site))
    assert view_of_folder(site) == views[made["keep/k2"]]
    from cas.generations import layout_of
    from cas.tree_folders import reachable

    import pygit2

    kept = reachable(pygit2.Repository(str(objects(site))), layout_of(str(site)), [made["keep/k2"]])
    assert kept <= folders(site) and not gone & kept
    assert folders(site) == kept  # and nothing else is left
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0
    rb = run_cli("rollback", "--dir", str(site), "--to", first, "--key", "rb", "--json")
    assert rb.code == 0, rb.out + rb.err
    assert view_of_folder(site) == expected_view(NESTED)


# -- planted entries --------------------------------------------------------------------------------


def _next_subtree(tmp_path: Path, after: dict[str, str | bytes], path: str) -> str:
    scratch = tmp_path / "predict"
    scratch.mkdir()
    git(scratch, "init", "-q")
    write_tree(scratch, after)
    git(scratch, "add", "-A")
    return git(scratch, "rev-parse", f"{git(scratch, 'write-tree').strip()}:{path}").strip()


@pytest.mark.parametrize("planted", ["folder", "symlink"])
def test_an_entry_planted_under_a_tree_name_is_moved_aside_never_followed(tmp_path: Path, planted: str) -> None:
    site = adopt(tmp_path, NESTED, layout="shared")
    after = dict(NESTED, **{"a/b/c/deep.txt": "deeper\n"})
    oid = _next_subtree(tmp_path, after, "a/b/c")
    victim = tmp_path / "victim"
    write_tree(victim, {"deep.txt": "not oncepatch's\n", "other.txt": "other\n"})
    before_victim = snapshot_tree(victim)
    if planted == "folder":
        write_tree(trees(site) / oid, {"deep.txt": "planted\n", "other.txt": "other\n"})
    else:
        os.symlink(victim, trees(site) / oid)
    apply(site, patch_file(tmp_path, "deep", NESTED, after), "k1")
    assert view_of_folder(site) == expected_view(after)
    aside = [n for n in os.listdir(trees(site)) if n.startswith(f".quarantine-{oid}-")]
    assert len(aside) == 1 and stat.S_ISDIR(os.lstat(trees(site) / oid).st_mode)
    assert snapshot_tree(victim) == before_victim
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


def test_a_shared_link_replaced_by_one_to_a_copy_is_caught(tmp_path: Path) -> None:
    site = adopt(tmp_path, NESTED, layout="shared")
    root = site.resolve()
    copy = tmp_path / "copy"
    write_tree(copy, {"z.txt": "z\n"})
    x = root / "x"
    os.chmod(x, 0o755)
    os.unlink(x / "y")
    os.symlink(copy, x / "y")  # same bytes, but not the tree's folder
    os.chmod(x, 0o555)
    ver = run_cli("verify", "--dir", str(site), "--grace", "0", "--json")
    assert ver.code == 6 and "x/y/" in " ".join(ver.json["dir"]["problems"]), ver.out
    res = run_cli("apply", str(patch_file(tmp_path, "xw", NESTED, dict(NESTED, **{"x/w.txt": "w2\n"}))),
                  "--dir", str(site), "--key", "k", "--json")
    assert res.code == 4 and res.json["error"]["reason"] == "edited_outside" and "x/y" in res.json["error"]["paths"]


# -- what the apply's check and verify each catch ---------------------------------------------------


def test_an_edit_is_refused_where_the_change_runs_and_verify_finds_it_anywhere(tmp_path: Path) -> None:
    site = adopt(tmp_path, NESTED, layout="shared")
    target = site / "x/y/z.txt"
    os.chmod(target, 0o644)
    target.write_text("edited by hand\n")
    # A change through x/ meets the edit: refused, nothing written.
    near = dict(NESTED, **{"x/y/new.txt": "new\n"})
    res = run_cli("apply", str(patch_file(tmp_path, "near", NESTED, near)), "--dir", str(site), "--key", "near",
                  "--json")
    assert res.code == 4 and res.json["error"]["paths"] == ["x/y/z.txt"], res.out + res.err
    # A change elsewhere does not look into x/y (its cost is the change's): it lands, sharing x/ as it is ...
    far = dict(NESTED, **{"a/b/c/deep.txt": "deeper\n"})
    apply(site, patch_file(tmp_path, "far", NESTED, far), "far")
    # ... and verify, which reads every byte, names the edit.
    ver = run_cli("verify", "--dir", str(site), "--grace", "0", "--json")
    assert ver.code == 6 and any("'x/y/z.txt'" in p for p in ver.json["dir"]["problems"]), ver.out


# -- init changes nothing when it fails; verify's envelope; a planted current generation -----------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_that_fails_part_way_changes_nothing(tmp_path: Path, layout: str) -> None:
    site = tmp_path / "site"
    write_tree(site, BASE)
    os.mkfifo(site / "src/pipe")  # met by the commit of the folder's files, after the checks that read only
    before = snapshot_tree(site)
    res = run_cli("init", "--dir", str(site), "--json", *LAYOUTS[layout])
    assert res.code == 2 and "neither a file" in res.json["error"]["message"], res.out + res.err
    assert res.json["error"]["effect_status"] == "not_started"
    assert snapshot_tree(site) == before
    assert sorted(os.listdir(tmp_path)) == ["site"]  # no site.oncepatch, no link file


def test_verify_dir_reports_the_folder_in_verify_contract(tmp_path: Path) -> None:
    site = adopt(tmp_path)
    target = site / "README"
    os.chmod(target, 0o644)
    target.write_text("edited\n")
    ver = run_cli("verify", "--dir", str(site), "--grace", "0", "--json")
    assert ver.code == 6 and ver.json["ok"] is False
    failures = ver.json["failures"]
    assert failures and all(f["key"] is None and f["receipt"] == str(site) for f in failures), failures
    assert any("'README'" in f["reason"] for f in failures)
    assert [f["reason"] for f in failures] == ver.json["dir"]["problems"]
    text = run_cli("verify", "--dir", str(site), "--grace", "0")
    assert text.code == 6 and f"{site}: 'README'" in text.out and "verification failed" in text.out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_symlink_in_place_of_the_current_generation_is_not_followed_by_verify(tmp_path: Path, layout: str) -> None:
    site = adopt(tmp_path, layout=layout)
    gen = site.resolve()
    copy = tmp_path / "copy"
    for d, _s, fs in os.walk(site, followlinks=True):  # the same bytes, elsewhere
        for f in fs:
            rel = os.path.relpath(os.path.join(d, f), site)
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            (copy / rel).write_bytes((site / rel).read_bytes())
    aside = gen.parent / "aside"
    os.rename(gen, aside)
    os.symlink(copy, gen)
    ver = run_cli("verify", "--dir", str(site), "--grace", "0", "--json")
    assert ver.code == 6 and "not a folder oncepatch built" in " ".join(ver.json["dir"]["problems"]), ver.out
    res = run_cli("apply", str(change(tmp_path, "add")[0]), "--dir", str(site), "--key", "k", "--json")
    assert res.code == 4 and res.json["error"]["reason"] == "generation_replaced", res.out + res.err


def test_a_patch_cannot_write_through_a_symlink_it_made(tmp_path: Path) -> None:
    site = adopt(tmp_path, NESTED, layout="shared")
    victim = tmp_path / "victim"
    write_tree(victim, {"keep.txt": "not oncepatch's\n"})
    before_victim = snapshot_tree(victim)
    scratch = tmp_path / "scratch-evil"
    scratch.mkdir()
    git(scratch, "init", "-q")
    write_tree(scratch, NESTED)
    git(scratch, "add", "-A")
    git(scratch, "commit", "-qm", "before")
    os.symlink(str(victim), scratch / "a/evil")  # a link of the content: kept as a link, never followed
    git(scratch, "add", "-A")
    pf = tmp_path / "evil.diff"
    pf.write_bytes(git(scratch, "diff", "--cached", "--full-index", "--binary").encode())
    apply(site, pf, "evil")
    assert os.readlink(site / "a/evil") == str(victim)
    through = tmp_path / "through.patch"
    through.write_text("*** Begin Patch\n*** Add File: a/evil/planted.txt\n+x\n*** End Patch\n")
    res = run_cli("apply", str(through), "--dir", str(site), "--key", "through", "--json")
    assert res.code == 4 and res.json["error"]["type"] == "unsafe_path", res.out + res.err
    up = tmp_path / "up.patch"
    up.write_text("*** Begin Patch\n*** Add File: a/../../escape.txt\n+x\n*** End Patch\n")
    res = run_cli("apply", str(up), "--dir", str(site), "--key", "up", "--json")
    assert res.code == 4 and res.json["error"]["type"] == "unsafe_path", res.out + res.err
    assert snapshot_tree(victim) == before_victim and not (tmp_path / "escape.txt").exists()
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


def test_recover_builds_again_a_shared_folder_removed_by_hand(tmp_path: Path) -> None:
    import shutil

    site = adopt(tmp_path, NESTED, layout="shared")
    first = tree_of(objects(site))
    y = trees(site) / subtree(objects(site), first, "x/y")
    os.chmod(y, 0o755)
    shutil.rmtree(y)  # the link x/y now names nothing
    assert not (site / "x/y/z.txt").exists()
    ver = run_cli("verify", "--dir", str(site), "--grace", "0", "--json")
    assert ver.code == 6 and "'x/y/'" in " ".join(ver.json["dir"]["problems"]), ver.out
    dry = run_cli("recover", "--dir", str(site), "--dry-run", "--json")
    assert dry.code == 0 and any("would build again" in n for n in dry.json["dir"]["done"]) and not y.exists()
    rec = run_cli("recover", "--dir", str(site), "--json")
    assert rec.code == 0 and any(f"built again tree folder {y.name[:12]}" in n for n in rec.json["dir"]["done"])
    assert view_of_folder(site) == expected_view(NESTED) and os.readlink(site) == f"site.oncepatch/trees/{first}"
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0
    again = run_cli("recover", "--dir", str(site), "--json")
    assert again.code == 0 and not [n for n in again.json["dir"]["done"] if "built again" in n]

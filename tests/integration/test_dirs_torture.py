"""Directory targets under fire: several writers at once, and kill -9 at random with readers reading throughout.

Readers open the folder through its symlink once per read and read every
file relative to that descriptor (docs/DIRECTORIES.md, "Reading"); every view
they record must be exactly one generation of the branch's history — never a
mix, never a half-built folder.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import git, run_cli
from dirs_helpers import patch_between, read_view, tree_of, tree_views, view_of_folder, write_tree
from test_dirs import LAYOUTS
from torture_driver import commits_with_trailer, seed_from_env

CALLS = 6


def _base(calls: int) -> dict[str, str | bytes]:
    files: dict[str, str | bytes] = {}
    for i in range(calls):
        files[f"g{i}/a.txt"] = "".join(f"{i} line {n}\n" for n in range(30))
        files[f"g{i}/b.txt"] = f"b of {i}\n"
    files["shared/README"] = "read me\n"
    return files


def _edit(i: int, files: dict[str, str | bytes]) -> None:
    kind = i % 5
    if kind in (0, 4):
        files[f"g{i}/a.txt"] = str(files[f"g{i}/a.txt"]).replace(f"{i} line 7\n", f"{i} line SEVEN\n")
    if kind in (1, 4):
        files[f"g{i}/new.txt"] = f"new in {i}\n"
    if kind in (2, 4):
        del files[f"g{i}/b.txt"]
    if kind == 3:
        files[f"g{i}/renamed.txt"] = files.pop(f"g{i}/b.txt")


def _setup(tmp_path: Path, calls: int, layout: str = "whole") -> tuple[Path, list[Path], dict[str, str | bytes]]:
    base = _base(calls)
    site = tmp_path / "site"
    site.mkdir()
    write_tree(site, base)
    res = run_cli("init", "--dir", str(site), *LAYOUTS[layout])
    assert res.code == 0, res.err
    final = dict(base)
    patches = []
    for i in range(calls):
        after = dict(base)
        _edit(i, after)
        _edit(i, final)
        pf = tmp_path / f"call{i}.diff"
        pf.write_bytes(patch_between(tmp_path / f"scratch{i}", base, after))
        patches.append(pf)
    return site, patches, final


def _apply_argv(site: Path, pf: Path, key: str) -> list[str]:
    return [sys.executable, "-m", "patcher.cli", "apply", str(pf), "--dir", str(site), "--key", key, "--json",
            "--no-server"]


def _sha_view(files: dict[str, str | bytes]) -> dict[str, str]:
    import hashlib

    return {k: hashlib.sha256(v.encode() if isinstance(v, str) else v).hexdigest() for k, v in files.items()}


class Readers:
    """Threads that read the folder through its symlink until stopped; each view kept once."""

    def __init__(self, site: Path, n: int = 2) -> None:
        self.site, self.views, self.reads, self.errors = site, set[frozenset[tuple[str, str]]](), 0, list[str]()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                fd = os.open(self.site, os.O_RDONLY | os.O_DIRECTORY)  # the symlink resolved once
            except OSError as exc:
                self.errors.append(f"open: {exc}")
                continue
            try:
                view = frozenset(read_view(fd).items())
            except OSError as exc:
                self.errors.append(f"read: {exc}")
                continue
            finally:
                os.close(fd)
            self.views.add(view)
            self.reads += 1

    def __enter__(self) -> Readers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_several_processes_apply_distinct_keys_each_lands_once(tmp_path: Path, layout: str) -> None:
    site, patches, final = _setup(tmp_path, CALLS, layout)
    with Readers(site) as readers:
        procs = [subprocess.Popen(_apply_argv(site, pf, f"k{i}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i, pf in enumerate(patches)]
        outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * CALLS, [o[1].decode()[-2000:] for o in outs]
    objects = Path(str(site) + ".oncepatch/objects.git")
    assert view_of_folder(site) == _sha_view(final)
    assert int(git(objects, "rev-list", "--count", "refs/heads/generations")) == 1 + CALLS
    log = run_cli("log", "--dir", str(site), "--json").json["generations"]
    assert sorted(g["key"] for g in log if g["key"]) == sorted(f"k{i}" for i in range(CALLS))
    views = {frozenset(v.items()) for v in tree_views(objects).values()}
    assert readers.reads > 0 and not readers.errors, readers.errors[:5]
    assert readers.views <= views
    assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kill9_torture_with_readers(tmp_path: Path, layout: str) -> None:
    seed = seed_from_env()
    rounds = int(os.environ.get("ONCEPATCH_DIR_TORTURE_ROUNDS", "2"))
    for rnd in range(rounds):
        rng = random.Random(f"{seed}/dirs/{rnd}")
        folder = tmp_path / f"round{rnd}"
        folder.mkdir()
        # The measured run time: one clean apply on a scratch target of the same shape.
        scratch = folder / "scratch"
        scratch.mkdir()
        s_site, s_patches, _ = _setup(scratch, 1, layout)
        t0 = time.monotonic()
        assert subprocess.run(_apply_argv(s_site, s_patches[0], "t"), capture_output=True).returncode == 0
        measured = time.monotonic() - t0

        site, patches, final = _setup(folder, CALLS, layout)
        objects = Path(str(site) + ".oncepatch/objects.git")
        with Readers(site) as readers:
            procs = []
            for i, pf in enumerate(patches):
                procs.append((subprocess.Popen(_apply_argv(site, pf, f"k{i}"), stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL), time.monotonic() + rng.uniform(0, measured)))
            for proc, at in procs:
                delay = at - time.monotonic()
                if delay > 0:
                    try:
                        proc.wait(timeout=delay)
                    except subprocess.TimeoutExpired:
                        pass
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                proc.wait()
            rec = run_cli("recover", "--dir", str(site), "--json", "--tmp-age", "0")
            assert rec.code == 0, f"seed {seed} round {rnd}: {rec.out} {rec.err}"
            results = [run_cli("apply", str(pf), "--dir", str(site), "--key", f"k{i}", "--json")
                       for i, pf in enumerate(patches)]
        assert [r.code for r in results] == [0] * CALLS, (seed, rnd, [r.out + r.err for r in results])
        assert view_of_folder(site) == _sha_view(final), (seed, rnd)
        for r in results:
            assert commits_with_trailer(objects, r.json["call_id"], "refs/heads/generations") == [r.json["commit"]]
        assert int(git(objects, "rev-list", "--count", "refs/heads/generations")) == 1 + CALLS
        folder_name = "trees" if layout == "shared" else "generations"
        assert os.readlink(site) == f"site.oncepatch/{folder_name}/{tree_of(objects)}"
        assert not [n for n in os.listdir(Path(str(site) + f".oncepatch/{folder_name}")) if n.startswith(".")]
        views = {frozenset(v.items()) for v in tree_views(objects).values()}
        assert readers.reads > 0 and not readers.errors, (seed, rnd, readers.errors[:5])
        assert readers.views <= views, (seed, rnd, "a reader saw a folder that is no generation")
        assert run_cli("verify", "--dir", str(site), "--grace", "0").code == 0, (seed, rnd)

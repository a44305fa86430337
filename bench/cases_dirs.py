"""Directory targets (docs/DIRECTORIES.md): ``apply`` to a folder of 1k and 100k files beside writing the files by hand.

For each size and each layout a folder of ``n`` small files (100 per
sub-folder) is adopted (``oncepatch init --dir``, timed once): *whole* (a
folder per generation, every file hard-linked) and *shared*
(``--share-folders``: a folder per git tree, unchanged sub-folders shared by
symlinks).  Then, per round, a change of 1 and of
100 files (each a new file, so every round is a new generation), through the
in-process API:

* **oncepatch, directory target** — ``patcher.apply`` on the target's object
  database: the receipt protocol, the commit, then the new generation built
  (unchanged files hard-linked) and the symlink switched; the build and switch
  are also timed alone (*of which: generation*), and so is the check for
  edits outside oncepatch that precedes the call (*of which: outside-edit
  check*: ``patcher.dirs.refuse_outside_edits``);
* **one by one with fsync** — the same files written into a plain folder of the
  same size, each opened, written, fsynced and closed, then the folder fsynced:
  what a program that writes a live folder in place does, with no atomicity.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

from bench.stats import median

__all__ = ["section_dirs"]


def _make_folder(path: str, n: int) -> None:
    for i in range(n):
        sub = os.path.join(path, f"d{i // 100:04d}")
        if i % 100 == 0:
            os.makedirs(sub)
        with open(os.path.join(sub, f"f{i % 100:02d}.txt"), "wb") as fh:
            fh.write(f"file {i}\n".encode() * 8)


def _patch(round_: int, files: int) -> bytes:
    out = ["*** Begin Patch"]
    for j in range(files):
        out += [f"*** Add File: new/r{round_:04d}/f{j:03d}.txt", f"+round {round_} file {j}"]
    out.append("*** End Patch")
    return ("\n".join(out) + "\n").encode()


def _by_hand(folder: str, round_: int, files: int) -> None:
    sub = os.path.join(folder, "new", f"r{round_:04d}")
    os.makedirs(sub)
    for j in range(files):
        fd = os.open(os.path.join(sub, f"f{j:03d}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, f"round {round_} file {j}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in (sub, os.path.dirname(sub)):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def section_dirs(env: Any, sizes: dict[str, int], rounds: int, log: Any) -> dict[str, Any]:
    import patcher
    import patcher.execute as execute

    timed: list[float] = []
    checked: list[float] = []
    real_sync, real_check = execute.sync, execute.refuse_outside_edits

    def sync(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_sync(*a, **kw)
        finally:
            timed.append(time.perf_counter() - t)

    def check(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_check(*a, **kw)
        finally:
            checked.append(time.perf_counter() - t)

    execute.sync = sync  # type: ignore[assignment]
    execute.refuse_outside_edits = check  # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    try:
        for label, n in sizes.items():
            for layout in ("whole", "shared"):
                rows += _rows(env, label, n, layout, rounds, log, patcher.apply, timed, checked)
    finally:
        execute.sync = real_sync  # type: ignore[assignment]
        execute.refuse_outside_edits = real_check  # type: ignore[assignment]
    return {"rows": rows}


def _rows(env: Any, label: str, n: int, layout: str, rounds: int, log: Any, apply: Any, timed: list[float],
          checked: list[float]) -> list[dict[str, Any]]:
    """The 1-file and 100-file rows of one size and one layout (``timed``/``checked``: filled by the seams)."""
    out: list[dict[str, Any]] = []
    root = os.path.join(env.tmp, f"dirs-{label}-{layout}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    site, plain = os.path.join(root, "site"), os.path.join(root, "plain")
    log(f"[dirs] making two folders of {label} files ({layout})")
    _make_folder(site, n)
    _make_folder(plain, n)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "patcher.cli", "init", "--dir", site, "--no-server",
                    *(["--share-folders"] if layout == "shared" else [])], check=True, capture_output=True)
    init_s = time.perf_counter() - t
    objects = site + ".oncepatch/objects.git"
    for files in (1, 100):
        log(f"[dirs] {label} files, {layout}: {rounds} rounds of {files}-file changes")
        ours, hand, gen, chk = [], [], [], []
        for r in range(rounds):
            rn = files * 1000 + r
            data = _patch(rn, files)
            timed.clear()
            checked.clear()
            t = time.perf_counter()
            apply(objects, data, key=f"bench-{files}-{r}")
            ours.append(time.perf_counter() - t)
            gen.append(sum(timed))
            chk.append(sum(checked))
            t = time.perf_counter()
            _by_hand(plain, rn, files)
            hand.append(time.perf_counter() - t)
        out.append({"size": label, "layout": layout, "files": n, "changed": files, "init_s": init_s,
                    "apply_s": median(ours), "generation_s": median(gen), "check_s": median(chk),
                    "by_hand_s": median(hand), "rounds": rounds})
    subprocess.run(["chmod", "-R", "u+w", root], check=False)  # read-only generations
    shutil.rmtree(root, ignore_errors=True)
    return out

"""Several "machines" (clones, each with its own store) on one git server: remote mode's tests and bench.

:func:`make_cluster` puts a seed repository on a :class:`git_server.GitServer`
and clones it once per machine.  :func:`key_patch` is key ``i``'s change:
line ``8i+5`` of ``shared.txt`` rewritten and a new file ``new/k<i>.txt`` —
the changes commute (their contexts never overlap), so whatever order they
land in, the tree is :func:`serial_tree`'s.

``python tests/remote_cluster.py drive CLONE KEY...`` applies the keys' patches
one after another through ``patcher.protocol.apply(..., remote="origin")`` and
prints one JSON line per call (its envelope, and the seconds it took).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["Cluster", "make_server_repo", "make_cluster", "key_patch", "serial_tree", "drive", "remote_git"]

SHARED_LINES = 8 * 400


def _git(cwd: Path | str, *args: str) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False)
    if res.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {res.stderr.decode()}")
    return res.stdout.decode()


def shared_text() -> str:
    return "".join(f"line {n}\n" for n in range(1, SHARED_LINES + 1))


def key_patch(i: int) -> str:
    """Key ``i``'s patch: line ``8i+5`` of ``shared.txt`` changed, ``new/k<i>.txt`` added."""
    t = 8 * i + 5
    ctx_before = "".join(f" line {n}\n" for n in range(t - 3, t))
    ctx_after = "".join(f" line {n}\n" for n in range(t + 1, t + 4))
    return (f"--- a/shared.txt\n+++ b/shared.txt\n@@ -{t - 3},7 +{t - 3},7 @@\n{ctx_before}-line {t}\n"
            f"+line {t} changed by key {i}\n{ctx_after}"
            f"--- /dev/null\n+++ b/new/k{i}.txt\n@@ -0,0 +1 @@\n+key {i}\n")


@dataclass
class Cluster:
    server_repo: Path  # the bare repository the daemon serves
    machines: list[Path]
    url: str


def make_server_repo(root: Path) -> Path:
    """The seed repository and its bare copy ``root/srv/server.git``; returns ``root/srv`` (what is served)."""
    seed = root / "seed"
    seed.mkdir(parents=True)
    _git(seed, "init", "-q", "-b", "main")
    (seed / "shared.txt").write_text(shared_text())
    (seed / "README").write_text("remote mode\n")
    _git(seed, "add", "-A")
    _git(seed, "commit", "-q", "-m", "initial")
    srv = root / "srv"
    srv.mkdir()
    _git(root, "clone", "-q", "--bare", str(seed), str(srv / "server.git"))
    return srv


def make_cluster(root: Path, url_of: str, machines: int) -> Cluster:
    """``machines`` clones of ``url_of`` (the served ``root/srv/server.git``, :func:`make_server_repo`)."""
    clones = []
    for m in range(machines):
        clone = root / f"machine{m}"
        _git(root, "clone", "-q", url_of, str(clone))
        clones.append(clone)
    return Cluster(root / "srv" / "server.git", clones, url_of)


def remote_git(cluster: Cluster, *args: str) -> str:
    return _git(cluster.server_repo, *args)


def serial_tree(root: Path, keys: list[int]) -> str:
    """The tree of the seed with every key's change applied one after another (plain git)."""
    ref = root / "serial"
    _git(root, "clone", "-q", str(root / "seed"), str(ref))
    lines = shared_text().splitlines(keepends=True)
    for i in keys:
        t = 8 * i + 5
        lines[t - 1] = f"line {t} changed by key {i}\n"
        (ref / "new").mkdir(exist_ok=True)
        (ref / "new" / f"k{i}.txt").write_text(f"key {i}\n")
    (ref / "shared.txt").write_text("".join(lines))
    _git(ref, "add", "-A")
    _git(ref, "commit", "-q", "-m", "serial")
    return _git(ref, "rev-parse", "HEAD^{tree}").strip()


def drive(clone: Path, keys: list[int], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A process applying ``keys`` in ``clone`` one after another (its stdout: one JSON line per call)."""
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, str(Path(__file__)), "drive", str(clone), *map(str, keys)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)


def _drive(clone: str, keys: list[int]) -> None:
    from cas.errors import OncepatchError
    from patcher.protocol import apply

    for i in keys:
        t0 = time.perf_counter()
        try:
            doc = apply(clone, key_patch(i), key=f"key-{i}", remote="origin").to_json()
        except OncepatchError as exc:
            doc = {"ok": False, "error": exc.envelope()}
        doc["seconds"] = time.perf_counter() - t0
        print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "drive":
        _drive(sys.argv[2], [int(k) for k in sys.argv[3:]])
    else:
        raise SystemExit("usage: remote_cluster.py drive CLONE KEY...")

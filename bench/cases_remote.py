"""Remote mode (docs/REMOTE.md): machines × keys through a real ``git daemon`` on 127.0.0.1.

Each machine is a clone with its own store, driven by one long-lived API
process (``tests/remote_cluster.py drive``) that applies its keys one after
another with ``remote="origin"``; all machines run at once on one branch.
Measured: wall time and calls/s, per-call latency, re-stages (a lost lease:
the branch moved under the push), and the checks (every key landed once,
the tree equal to applying them serially).  The row "1 machine, serial" is
the same number of keys from one machine: the cost of the push path
without contention.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.env import ROOT
from bench.stats import fmt_ms

# The git server and the cluster are the tests' (tests/git_server.py, tests/remote_cluster.py).
sys.path.insert(0, os.path.join(ROOT, "tests"))

from git_server import GitServer  # noqa: E402
from remote_cluster import drive, make_cluster, make_server_repo, remote_git, serial_tree  # noqa: E402

__all__ = ["section_remote", "render_remote"]


def _run(out: str, machines: int, per_machine: int, log: Any) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="remote-", dir=out))
    server = GitServer(make_server_repo(root)).start()
    try:
        cluster = make_cluster(root, server.url("server.git"), machines)
        before = remote_git(cluster, "rev-parse", "main").strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEPATCH_")}
        env["ONCEPATCH_SERVER"] = "never"
        t0 = time.perf_counter()
        procs = [drive(m, list(range(i * per_machine, (i + 1) * per_machine)), env)
                 for i, m in enumerate(cluster.machines)]
        docs: list[dict[str, Any]] = []
        per_machine_restages: list[list[int]] = []
        for p in procs:
            stdout, stderr = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(stderr.decode())
            mine = [json.loads(line) for line in stdout.decode().splitlines()]
            per_machine_restages.append([int(d["remote"]["restages"]) if d.get("ok") else -1 for d in mine])
            docs += mine
        wall = time.perf_counter() - t0
        total = machines * per_machine
        landed = int(remote_git(cluster, "rev-list", "--count", f"{before}..main").strip())
        ok = [d for d in docs if d.get("ok")]
        errors: dict[str, int] = {}
        for d in docs:
            if not d.get("ok"):
                errors[d["error"]["type"]] = errors.get(d["error"]["type"], 0) + 1
        restages = [int(d["remote"]["restages"]) for d in ok]
        tree_ok = remote_git(cluster, "rev-parse", "main^{tree}").strip() == serial_tree(root, list(range(total)))
        secs = sorted(float(d["seconds"]) for d in docs)
        log(f"remote: {machines} machine(s) x {per_machine} keys: {wall:.1f} s, {sum(restages)} re-stages")
        return {"machines": machines, "keys": total, "landed": landed, "wall_s": wall, "per_s": total / wall,
                "median_s": secs[len(secs) // 2], "p90_s": secs[min(len(secs) - 1, int(len(secs) * 0.9))],
                "restages": sum(restages), "restages_max": max(restages, default=0), "errors": errors,
                "tree_equals_serial": tree_ok, "restages_by_machine": per_machine_restages}
    finally:
        server.close()


def section_remote(env: Any, machines: int, per_machine: int, log: Any) -> dict[str, Any]:
    rows = [_run(env.out, machines, per_machine, log), _run(env.out, 1, machines * per_machine, log)]
    return {"rows": rows}


def render_remote(s: dict[str, Any]) -> str:
    from bench.report import _table

    parts = ["\n### Remote mode: machines × keys on one branch through `git daemon` (docs/REMOTE.md)\n\n"]
    rows = []
    for r in s["rows"]:
        rows.append([f"{r['machines']} machine(s)" + (", serial" if r["machines"] == 1 else ", at once"),
                     str(r["keys"]), str(r["landed"]), f"{r['wall_s']:.1f}", f"{r['per_s']:.1f}",
                     fmt_ms(r["median_s"]), fmt_ms(r["p90_s"]), str(r["restages"]), str(r["restages_max"]),
                     ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none",
                     "yes" if r["tree_equals_serial"] else "NO"])
    parts.append(_table(["machines", "keys", "commits landed", "wall s", "calls/s", "call median (ms)",
                         "call p90 (ms)", "re-stages", "max per call", "errors", "tree = serial"], rows))
    return "".join(parts)

"""Section ``server``: a cold CLI apply through ``oncepatch serve``, side by side (issue 27).

Contenders, one new change each per round, interleaved:

* ``CLI cold, through the server`` — ``oncepatch apply p.diff --json`` as a cold
  child process with ``ONCEPATCH_SERVER=require`` (a server started once for
  the section);
* ``CLI cold, in process`` — the same with ``ONCEPATCH_SERVER=never``;
* ``API`` — :func:`patcher.protocol.apply` in this process (kept stores);
* the same CLI call with the patch on standard input through the server and
  through a ``serve --broker`` of the same user (a broker reads the patch from
  there only): the difference is the broker's per-call overhead (issue 26);
* ``git pair`` — ``git apply --index && git commit`` (the baseline);
* ``codex apply_patch`` — OpenAI Codex's native binary run through a symlink
  named ``apply_patch`` (``npm install -g @openai/codex``), on a 200-line file
  of its own folder (it writes the file only: no commit, no receipt), when
  it is installed.

All on the checked-out ``main``.  Then replays: ``CLI replay, through the
server`` beside ``python -c pass``.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import orjson

from bench.cases_apply import Contenders, _row, python_floor
from bench.env import ONCEPATCH, PYTHON, Env, run, run_rusage
from bench.repos import BenchRepo
from bench.stats import fmt_ms, interleave

__all__ = ["section_server", "render_server", "codex_apply_patch"]

SERVED = "CLI cold, through the server"
STDIN_SERVED = "CLI cold, through the server, patch on stdin"
BROKERED = "CLI cold, through `serve --broker`, patch on stdin"


def codex_apply_patch(env: Env) -> str | None:
    """A path named ``apply_patch`` to codex's native binary, when codex is installed (else None)."""
    found = shutil.which("apply_patch")
    if found:
        return found
    roots = []
    try:
        roots.append(subprocess.run(["npm", "root", "-g"], capture_output=True, text=True, timeout=30,
                                    check=False).stdout.strip())
    except OSError:
        pass
    for root in filter(None, roots):
        pattern = os.path.join(root, "@openai", "codex", "**", "vendor", "*", "**", "codex")
        arch = {"aarch64": "aarch64", "arm64": "aarch64"}.get(os.uname().machine, os.uname().machine)
        for binary in sorted(glob.glob(pattern, recursive=True)):
            if os.path.isfile(binary) and os.access(binary, os.X_OK) and "linux" in binary and arch in binary:
                link = os.path.join(env.tmp, "codex-bin", "apply_patch")  # codex acts as apply_patch by its name
                os.makedirs(os.path.dirname(link), exist_ok=True)
                if not os.path.lexists(link):
                    os.symlink(binary, link)
                return link
    return None


def _codex(env: Env, binary: str) -> Callable[[int], Any]:
    folder = os.path.join(env.tmp, "codex-tree")
    os.makedirs(folder, exist_ok=True)
    lines = [f"line {i}\n" for i in range(1, 201)]
    with open(os.path.join(folder, "f.txt"), "w") as fh:
        fh.writelines(lines)

    def op(r: int) -> tuple[float, dict[str, Any] | None]:
        old, new = ("line 100", "line 100 b") if r % 2 == 0 else ("line 100 b", "line 100")
        if r < 0:  # the warm-up round's pair, then round 0 starts from the file as written
            old, new = "line 100", "line 100"
        envelope = (f"*** Begin Patch\n*** Update File: f.txt\n@@\n line 99\n-{old}\n+{new}\n line 101\n"
                    "*** End Patch\n")
        elapsed, rc, out, err, _rss = run_rusage([binary, envelope], cwd=folder)
        if rc != 0:
            raise RuntimeError(f"apply_patch failed ({rc}): {err.decode(errors='replace')[-500:]}")
        return elapsed, None
    return op


def _server_cli(c: Contenders, env_vars: dict[str, str]) -> Callable[[int], Any]:
    name = "cli-served"

    def op(_r: int) -> tuple[float, dict[str, Any] | None]:
        pf = c._patch_file(c._make("main", 1, name))
        cmd = [ONCEPATCH, "apply", pf, "--json", "--repo", c.repo.path]
        elapsed, rc, out, err, _rss = run_rusage(cmd, cwd=c.repo.path, env={**os.environ, **env_vars})
        if rc != 0 or orjson.loads(out).get("replayed"):
            raise RuntimeError(f"served CLI apply failed ({rc}): {out[-500:]!r} {err[-500:]!r}")
        c.applied.setdefault(name, []).append(pf.encode())
        return elapsed, None
    return op


def _stdin_cli(c: Contenders, env_vars: dict[str, str], name: str) -> Callable[[int], Any]:
    """``oncepatch apply - --json`` with the patch on standard input (a broker reads it from there only)."""
    def op(_r: int) -> tuple[float, dict[str, Any] | None]:
        with open(c._patch_file(c._make("main", 1, name)), "rb") as fh:
            data = fh.read()
        cmd = [ONCEPATCH, "apply", "-", "--json", "--repo", c.repo.path]
        elapsed, rc, out, err, _rss = run_rusage(cmd, cwd=c.repo.path, env={**os.environ, **env_vars}, stdin=data)
        if rc != 0 or orjson.loads(out).get("replayed"):
            raise RuntimeError(f"{name} apply failed ({rc}): {out[-500:]!r} {err[-500:]!r}")
        return elapsed, None
    return op


def _status_none(repo: BenchRepo, env_vars: dict[str, str]) -> Callable[[int], Any]:
    """``oncepatch status none --json``: a served call with no commit and no fsync (the per-call path alone)."""
    def op(_r: int) -> tuple[float, dict[str, Any] | None]:
        cmd = [ONCEPATCH, "status", "none", "--json", "--repo", repo.path]
        elapsed, rc, out, err, _rss = run_rusage(cmd, cwd=repo.path, env={**os.environ, **env_vars})
        if b"not_found" not in out:
            raise RuntimeError(f"status through the server failed ({rc}): {out[-500:]!r} {err[-500:]!r}")
        return elapsed, None
    return op


def _start(folder: str, *extra: str) -> int:
    started = run([PYTHON, "-m", "patcher.cli", "serve", "--background", "--socket-dir", folder, "--idle", "900",
                   *extra])
    words = started.stdout.decode().split()
    if started.returncode != 0 or "pid" not in words:
        raise RuntimeError(f"the server did not start: {started.stdout!r} {started.stderr!r}")
    return int(words[words.index("pid") + 1])


def _server_replay(c: Contenders, env_vars: dict[str, str]) -> Callable[[int], Any]:
    def op(r: int) -> tuple[float, dict[str, Any] | None]:
        files = c.applied["cli-served"]
        pf = files[r % len(files)].decode()
        cmd = [ONCEPATCH, "apply", pf, "--json", "--repo", c.repo.path]
        elapsed, rc, out, err, _rss = run_rusage(cmd, cwd=c.repo.path, env={**os.environ, **env_vars})
        if rc != 0 or not orjson.loads(out).get("replayed"):
            raise RuntimeError(f"served CLI replay did not replay ({rc}): {out[-500:]!r} {err[-500:]!r}")
        return elapsed, None
    return op


def _client_imports(repo: BenchRepo, env_vars: dict[str, str]) -> dict[str, Any]:
    """What the installed command loads on a served call: ``PYTHONPROFILEIMPORTTIME`` of ``status`` through the server."""
    timed = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    res = run([ONCEPATCH, "status", "none", "--json", "--repo", repo.path], cwd=repo.path,
              env={**timed, **env_vars}, check=False)
    floor = run([PYTHON, "-c", "pass"], cwd=repo.path, env=timed)

    def mods(text: bytes) -> dict[str, int]:
        found = {}
        for line in text.decode(errors="replace").splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s+(.*)$", line)
            if m:
                found[m.group(2).strip()] = int(m.group(1))
        return found

    ours, base = mods(res.stderr), mods(floor.stderr)
    extra = {k: v for k, v in ours.items() if k not in base}
    return {"modules": sorted(extra), "import_ms": round(sum(extra.values()) / 1000, 1),
            "pygit2": any(k.startswith("pygit2") for k in extra)}


def section_server(env: Env, repos: dict[str, BenchRepo], rounds: dict[str, int],
                   log: Callable[[str], None]) -> dict[str, Any]:
    folder = os.path.join(env.tmp, "server")
    pid = _start(folder)
    # A broker of this same user (no root needed): the broker's own path per call — the caller's
    # environment filtered, its own umask, the confinement checks — beside the plain server.
    broker_folder = os.path.join(env.tmp, "broker")
    broker_pid = _start(broker_folder, "--broker")
    served = {"ONCEPATCH_SERVER": "require", "ONCEPATCH_SERVER_DIR": folder}
    brokered = {"ONCEPATCH_SERVER": "require", "ONCEPATCH_SERVER_DIR": broker_folder}
    never = {"ONCEPATCH_SERVER": "never"}
    codex = codex_apply_patch(env)
    out: dict[str, Any] = {"rows": [], "replay": [], "codex": codex}
    try:
        for size, repo in repos.items():
            c = Contenders(env, repo, f"srv{size}")
            contenders: list[tuple[str, Callable[[int], Any]]] = [
                ("git pair", c.git_pair()),
                ("API, branch checked out", c.api("main")),
                (SERVED, _server_cli(c, served)),
                ("CLI cold, in process", _in_process(c, never)),
                (STDIN_SERVED, _stdin_cli(c, served, "cli-served-stdin")),
                (BROKERED, _stdin_cli(c, brokered, "cli-brokered")),
            ]
            if codex:
                contenders.append(("codex apply_patch (native binary)", _codex(env, codex)))
            log(f"[server] one-file patch, {size} files: {rounds[size]} rounds")
            res = interleave(contenders, rounds[size], warmup=1, progress=log)
            base = res["git pair"]
            out["rows"] += [_row(s, None if name == "git pair" else base, size=size) for name, s in res.items()]
            log(f"[server] replay, {size} files: {max(5, rounds[size])} rounds")
            rep = interleave([
                ("python -c pass", python_floor("pass")),
                ("CLI replay, through the server", _server_replay(c, served)),
            ], max(5, rounds[size]), warmup=1)
            floor = rep["python -c pass"]
            out["replay"] += [_row(s, None if s is floor else floor, size=size) for s in rep.values()]
        first = next(iter(repos.values()))
        log("[server] broker per-call overhead: a status call through each")
        per = interleave([("status, through the server", _status_none(first, served)),
                          ("status, through `serve --broker`", _status_none(first, brokered))],
                         max(20, max(rounds.values())), warmup=1)
        out["broker_status"] = [_row(st, None)
                                for st in per.values()]
        out["client_imports"] = _client_imports(next(iter(repos.values())), served)
    finally:
        for server in (pid, broker_pid):
            try:
                os.kill(server, 15)
            except ProcessLookupError:
                pass
    return out


def _in_process(c: Contenders, env_vars: dict[str, str]) -> Callable[[int], Any]:
    name = "cli-inproc"

    def op(_r: int) -> tuple[float, dict[str, Any] | None]:
        pf = c._patch_file(c._make("main", 1, name))
        cmd = [ONCEPATCH, "apply", pf, "--json", "--repo", c.repo.path]
        elapsed, rc, out, err, _rss = run_rusage(cmd, cwd=c.repo.path, env={**os.environ, **env_vars})
        if rc != 0:
            raise RuntimeError(f"CLI apply failed ({rc}): {out[-500:]!r} {err[-500:]!r}")
        return elapsed, None
    return op


def render_server(s: dict[str, Any]) -> str:
    from bench.report import _table, _tables_by_size

    parts = ["\n### Server: a cold CLI apply through `oncepatch serve` (ms; ratio = git pair median / this "
             "median, > 1 is faster)\n"]
    parts += _tables_by_size(s["rows"], "**{size} files**", "vs git pair")
    parts.append("\n**Replay through the server** (ratio = `python -c pass` median / this median)\n")
    parts += _tables_by_size(s["replay"], "{size} files", "vs python -c pass")
    checks = []
    for size in dict.fromkeys(r["size"] for r in s["rows"]):
        rows = {r["name"]: r for r in s["rows"] if r["size"] == size}
        ours, git = rows[SERVED]["median_s"], rows["git pair"]["median_s"]
        want = 10.0 if size.endswith("00k") else 1.0
        checks.append([f"{size}: through the server vs git pair ≥ {want:g}×", f"{git / ours:.2f}×",
                       "met" if git / ours >= want else "NOT met"])
        codex = rows.get("codex apply_patch (native binary)")
        if codex:
            checks.append([f"{size}: through the server ≤ 5× codex apply_patch", f"{ours / codex['median_s']:.1f}×",
                           "met" if ours <= 5 * codex["median_s"] else "NOT met"])
        if STDIN_SERVED in rows and BROKERED in rows:
            extra = rows[BROKERED]["median_s"] - rows[STDIN_SERVED]["median_s"]
            checks.append([f"{size}: broker per-call overhead (broker − server median, both stdin)",
                           f"{extra * 1000:+.1f} ms", "–"])
    for r in s["replay"]:
        if r["name"].startswith("CLI replay"):
            ratio = r["median_s"] / r["baseline_median_s"]
            checks.append([f"{r['size']}: replay ≤ 3× python -c pass ({fmt_ms(r['baseline_median_s'])} ms)",
                           f"{ratio:.2f}×", "met" if ratio <= 3 else "NOT met"])
    per = {r["name"]: r for r in s.get("broker_status", [])}
    if len(per) == 2:
        a, b = per["status, through the server"], per["status, through `serve --broker`"]
        checks.append(["broker per-call overhead: `status` (no commit) through `serve --broker` − through "
                       "the server", f"{(b['median_s'] - a['median_s']) * 1000:+.1f} ms "
                       f"({fmt_ms(b['median_s'])} vs {fmt_ms(a['median_s'])} ms, n {b['n']})", "–"])
    if not s.get("codex"):
        checks.append(["codex apply_patch", "not installed", "–"])
    parts.append("\n**Targets (issue 27)**\n\n")
    parts.append(_table(["target", "measured", ""], checks))
    imp = s.get("client_imports")
    if imp:
        parts.append(f"\nThe installed command's own imports on a served call (beyond `python -c pass`): "
                     f"{len(imp['modules'])} modules, {imp['import_ms']} ms, pygit2 loaded: {imp['pygit2']} "
                     f"({', '.join(f'`{m}`' for m in imp['modules'])}).\n")
    return "".join(parts)

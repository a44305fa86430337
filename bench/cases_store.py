"""Sections 4–5: ``recover`` and ``verify`` over large stores; the watcher's flag latency.

Synthetic stores.  Applying 100,000 patches through the API would take many
minutes, so a store of N receipts is synthesised from real parts:

* one bare repository holds a chain of N real commits (one ``git fast-import``
  stream), each changing one file of a 1,000-file tree;
* for each commit a ``committed`` receipt is built with the product's own
  record type (:class:`receipts.receipt.Receipt`: identity, call_id,
  args_sha256, outputs with the real blob oid and sha256) and written with the
  product's own writer, ``ReceiptStore.record``, which also builds the
  ``committed`` event for the hash-chained ledger (a ``prepared`` event is
  appended first, as a real apply does); the ledger lines are written by a
  fast stand-in for ``Ledger.append`` (same line format, one open file
  instead of a lock, a tail read and an fsync per event);
* the key refs ``refs/oncepatch/keys/<h>`` are written as one ``packed-refs``
  file (what ``git pack-refs`` would leave).

While synthesising, ``os.fsync`` is stubbed (a store of 100,000 receipts
would otherwise take ~3 fsyncs each); one ``os.sync()`` follows.  Afterwards
``verify`` must pass on the store: a synthesis that drifted from the product's
format fails loudly instead of measuring the wrong thing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from bench.env import ONCEPATCH, PYTHON, Env, run, run_rusage
from bench.repos import make_repo
from bench.stats import interleave, median, p90

__all__ = ["ReceiptsRepo", "make_receipts_repo", "synthesise_store", "section_recover_verify", "section_watcher"]


class ReceiptsRepo:
    def __init__(self, path: str, commits: list[tuple[str, str, str, str, bytes]]) -> None:
        self.path = path
        # (commit, parent, tree, path, content) per receipt
        self.commits = commits


def make_receipts_repo(path: str, n: int) -> tuple[ReceiptsRepo, float]:
    """A bare repository with a chain of ``n`` commits on ``main``, each changing one file."""
    t0 = time.perf_counter()
    if os.path.exists(path):
        shutil.rmtree(path)
    run(["git", "init", "-q", "--bare", "-b", "main", path])
    run(["git", "config", "gc.auto", "0"], cwd=path)
    marks = os.path.join(os.path.abspath(path), "bench-marks")
    proc = subprocess.Popen(["git", "fast-import", "--quiet", f"--export-marks={marks}"], cwd=path,
                            stdin=subprocess.PIPE)
    w = proc.stdin
    assert w is not None
    contents: list[tuple[str, bytes]] = []
    for i in range(n):
        fpath = f"src/d{(i % 1000) // 50:02d}/f{i % 1000:04d}.txt"
        data = f"receipt {i} wrote this line\n".encode()
        contents.append((fpath, data))
        msg = f"bench commit {i}\n".encode()
        w.write(b"commit refs/heads/main\nmark :%d\ncommitter Bench <bench@example.com> %d +0000\n"
                b"data %d\n%s" % (i + 1, 1700000000 + i, len(msg), msg))
        w.write(b"M 100644 inline %s\ndata %d\n%s\n" % (fpath.encode(), len(data), data))
    w.close()
    if proc.wait() != 0:
        raise RuntimeError("git fast-import failed")
    by_mark: dict[int, str] = {}
    with open(marks) as fh:
        for line in fh:
            m, oid = line.split()
            by_mark[int(m[1:])] = oid
    trees: dict[str, str] = {}
    out = run(["git", "log", "--format=%H %T", "main"], cwd=path).stdout.decode()
    for line in out.splitlines():
        c, t = line.split()
        trees[c] = t
    commits = []
    for i in range(n):
        c = by_mark[i + 1]
        parent = by_mark.get(i, "")
        commits.append((c, parent, trees[c], contents[i][0], contents[i][1]))
    return ReceiptsRepo(os.path.realpath(path), commits), time.perf_counter() - t0


@contextlib.contextmanager
def _no_fsync() -> Iterator[None]:
    real = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real  # type: ignore[assignment]
        os.sync()


@contextlib.contextmanager
def _fast_ledger(path: str) -> Iterator[None]:
    """``Ledger.append`` without the per-event lock, tail read and fsync: one open file, same lines.

    Each line is ``canonical_json(event + seq + prev)`` where ``prev`` is the
    sha256 of the previous line — exactly what ``Ledger.append`` writes (the
    event documents themselves still come from ``append_receipt_event``), so
    ``verify`` checks the chain it would check on a real store.
    """
    from receipts.canonical import canonical_json
    from receipts.ledger import GENESIS, Ledger

    real = Ledger.append
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fh = open(path, "ab")
    state = {"seq": 0, "prev": GENESIS}

    def append(self: Ledger, event: dict[str, Any], *, sync: bool = True,
               wait: float | None = None) -> dict[str, Any]:
        stored = dict(event)
        stored["seq"] = state["seq"] + 1
        stored["prev"] = state["prev"]
        line = canonical_json(stored)
        fh.write(line + b"\n")
        state["seq"] = stored["seq"]
        state["prev"] = hashlib.sha256(line).hexdigest()
        return stored

    Ledger.append = append  # type: ignore[method-assign]
    try:
        yield
    finally:
        Ledger.append = real  # type: ignore[method-assign]
        fh.close()


def synthesise_store(root: str, repo: ReceiptsRepo, n: int) -> float:
    """Write ``n`` committed receipts (and their ledger events, key refs) into a fresh store ``root``."""
    from cas.hashing import git_blob_oid
    from patcher.args import TOOL, TOOL_VERSION
    from receipts.identity import compute_args_sha256, compute_call_id, key_hash, make_identity
    from receipts.receipt import Receipt, now_iso
    from receipts.store import ReceiptStore

    t0 = time.perf_counter()
    if os.path.exists(root):
        shutil.rmtree(root)
    store = ReceiptStore(root)
    refs: list[tuple[str, str]] = []
    owner = {"host": "bench", "pid": 1, "start_time": None, "since": now_iso()}
    with _no_fsync(), _fast_ledger(store.ledger.path):
        for i in range(n):
            commit, parent, tree, fpath, data = repo.commits[i]
            args = {"repo": repo.path, "branch": "refs/heads/main",
                    "patch_sha256": hashlib.sha256(b"bench receipt %d" % i).hexdigest(),
                    "format": "unified", "check": None, "message": None}
            identity = make_identity(TOOL, TOOL_VERSION, args)
            call_id = compute_call_id(identity)
            now = now_iso()
            out = {"path": fpath, "op": "modify", "sha256": hashlib.sha256(data).hexdigest(),
                   "blob": git_blob_oid(data), "mode": 0o100644}
            prepared = Receipt(
                key=call_id, call_id=call_id, identity=identity,
                args_sha256=compute_args_sha256(TOOL, TOOL_VERSION, args), tool=TOOL, tool_version=TOOL_VERSION,
                status="prepared", fencing_token=1, owner=owner, created_at=now, updated_at=now,
                base={"ref": "refs/heads/main", "commit": parent or None}, candidate=commit,
                outputs=(out,), extra={"touched": [fpath]},
            )
            store.ledger.append_receipt_event("prepared", prepared)
            final = prepared.evolve(status="committed", commit=commit, tree=tree)
            store.record(final, "committed")
            refs.append((f"refs/oncepatch/keys/{key_hash(call_id)}", commit))
    _write_packed_refs(repo.path, refs)
    return time.perf_counter() - t0


def _write_packed_refs(git_dir: str, refs: list[tuple[str, str]]) -> None:
    path = os.path.join(git_dir, "packed-refs")
    existing: dict[str, str] = {}
    with contextlib.suppress(FileNotFoundError):
        with open(path) as fh:
            for line in fh:
                if line.startswith(("#", "^")):
                    continue
                oid, name = line.split()
                existing[name] = oid
    existing.update({name: oid for name, oid in refs})
    with open(path + ".tmp", "w") as fh:
        fh.write("# pack-refs with: peeled fully-peeled sorted \n")
        for name in sorted(existing):
            fh.write(f"{existing[name]} {name}\n")
    os.replace(path + ".tmp", path)


def _cli(cmd: str, store: str) -> Callable[[int], Any]:
    def op(_r: int) -> tuple[float, dict[str, Any] | None]:
        elapsed, rc, out, err, rss = run_rusage([ONCEPATCH, cmd, "--json", "--store", store], cwd=store, mem=True)
        doc = orjson.loads(out) if out.strip() else {}
        if rc != 0:
            raise RuntimeError(f"{cmd} failed ({rc}): {out[-1500:]!r} {err[-500:]!r}")
        if cmd == "recover" and doc.get("changed"):
            raise RuntimeError(f"recover found something to do: {str(doc)[:1500]}")
        return elapsed, {"maxrss_kib": rss}
    return op


_FLOOR = """
import os, sys, orjson
root = os.path.join(sys.argv[1], 'receipts'); n = 0
for shard in os.listdir(root):
    d = os.path.join(root, shard)
    for name in os.listdir(d):
        with open(os.path.join(d, name), 'rb') as fh:
            orjson.loads(fh.read()); n += 1
print(n)
"""


def _floor(store: str) -> Callable[[int], Any]:
    def op(_r: int) -> tuple[float, dict[str, Any] | None]:
        elapsed, rc, out, err, rss = run_rusage([PYTHON, "-c", _FLOOR, store], mem=True)
        if rc != 0:
            raise RuntimeError(err.decode(errors="replace"))
        return elapsed, {"maxrss_kib": rss}
    return op


def section_recover_verify(env: Env, sizes: dict[str, int], rounds: dict[str, int],
                           log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, str], ReceiptsRepo]:
    """Returns (tables, store path per size label, the receipts repo)."""
    top = max(sizes.values())
    log(f"[4] receipts repo: {top} commits")
    rrepo, gen_s = make_receipts_repo(os.path.join(env.out, "repo-receipts"), top)
    tables: dict[str, Any] = {"rows": [], "gen": {"repo_commits": top, "repo_s": gen_s}}
    stores: dict[str, str] = {}
    for label, n in sizes.items():
        root = os.path.join(env.out, f"store-{label}")
        log(f"[4] synthesising a store of {n} receipts")
        syn_s = synthesise_store(root, rrepo, n)
        tables["gen"][f"store_{label}_s"] = syn_s
        stores[label] = root
        log(f"[4] recover / verify over {n} receipts: {rounds[label]} rounds")
        res = interleave([
            ("read + parse every receipt (floor)", _floor(root)),
            ("oncepatch verify", _cli("verify", root)),
            ("oncepatch recover (nothing to do)", _cli("recover", root)),
        ], rounds[label], warmup=0)
        floor = res["read + parse every receipt (floor)"]
        for name, s in res.items():
            tables["rows"].append({
                **s.to_json(), "size": label, "receipts": n,
                "baseline": None if s is floor else floor.name, "baseline_median_s": floor.median,
                "per_s": n / s.median if s.median else None, "maxrss_kib": s.extra_max("maxrss_kib"),
            })
    return tables, stores, rrepo


# -- section 5 ------------------------------------------------------------------------------------


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _wait_idle(pid: int, timeout: float, quiet: float = 0.6) -> float:
    """Seconds until the process stops using CPU for ``quiet`` seconds (its start-up scan is done)."""
    t0 = time.perf_counter()
    last = _cpu_ticks(pid)
    still_since = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        time.sleep(0.1)
        now = _cpu_ticks(pid)
        if now != last:
            last, still_since = now, time.perf_counter()
        elif time.perf_counter() - still_since >= quiet and time.perf_counter() - t0 > 0.5:
            return still_since - t0
    raise RuntimeError("watcher did not settle")


def section_watcher(env: Env, runs: list[dict[str, Any]], grace: float,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Flag latency: a receipt left ``prepared`` by a killed apply → the watcher's JSON line.

    Each run: ``size``, ``root`` (store), ``receipts``, ``config`` (label),
    ``args`` (extra CLI args), ``orphans``.
    """
    orepo, _ = make_repo(os.path.join(env.out, "repo-orphans"), 500, checkout=False)
    rows = []
    for spec in runs:
        label, root, n = spec["size"], spec["root"], spec["receipts"]
        watch = ["watch", "--json", "--grace", str(grace), "--store", root, *spec.get("args", [])]
        cmd = [ONCEPATCH, *watch]
        log(f"[5] watcher ({spec['config']}) over {n} receipts: {spec['orphans']} orphans")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=_root())
        lines: list[tuple[float, dict[str, Any]]] = []
        cond = threading.Condition()

        def reader() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                t = time.time()
                with cond:
                    lines.append((t, orjson.loads(raw)))
                    cond.notify_all()

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            startup = _wait_idle(proc.pid, timeout=600)
            with cond:  # orphans left by earlier runs are flagged at start-up: not ours to time
                seen = {x[1].get("receipt") for x in lines if "flag" in x[1]}
            lat: list[float] = []
            for k in range(spec["orphans"]):
                data = orepo.patch("side", orepo.next_paths("side", 1), f"orphan-{label}")
                pf = os.path.join(env.tmp, f"orphan-{label}-{k}.diff")
                with open(pf, "wb") as fh:
                    fh.write(data)
                crash_env = dict(os.environ, ONCEPATCH_CRASH_AT="after-prepare")
                res = subprocess.run([ONCEPATCH, "apply", pf, "--json", "--repo", orepo.path, "--branch", "side",
                                      "--store", root], env=crash_env, capture_output=True)
                if res.returncode != 137:
                    raise RuntimeError(f"crash apply exited {res.returncode}: {res.stdout[-500:]!r}")
                deadline = time.time() + grace + 90
                with cond:
                    while True:
                        fresh = [x for x in lines if "flag" in x[1] and x[1].get("receipt") not in seen]
                        if fresh:
                            break
                        if not cond.wait(timeout=max(0.0, deadline - time.time())):
                            raise RuntimeError(f"no flag within {grace + 90}s")
                    t_flag, doc = fresh[0]
                    seen.add(doc.get("receipt"))
                created = os.stat(doc["receipt"]).st_mtime
                lat.append(t_flag - created)
            rss = _rss_kib(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        rows.append({"size": label, "receipts": n, "config": spec["config"], "grace_s": grace, "startup_scan_s": startup,
                     "median_s": median(lat), "p90_s": p90(lat), "samples_s": lat, "rss_kib": rss})
    return {"rows": rows}


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None

"""``python -m bench [--quick] [--only SECTIONS] [--out DIR] [--update-doc]`` (run by ``scripts/bench``).

Writes ``<out>/results.json`` and ``<out>/report.md``; with ``--update-doc``
also replaces the generated part of ``docs/BENCHMARKS.md`` (between the
``bench:begin`` / ``bench:end`` markers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from typing import Any

import orjson

SECTIONS = ("single", "large", "agents", "store", "watch", "fsync", "profile", "matching", "signing", "server",
            "dirs", "remote")

FULL: dict[str, Any] = {
    "sizes": {"1k": 1000, "10k": 10_000, "100k": 100_000},
    "rounds": {"1k": 40, "10k": 30, "100k": 20},
    "files500_on": "10k", "rounds_500": 4,
    "agents_on": "10k", "agents": (8, 25), "agents_rounds": 1,
    "big_size": 100 << 20, "rounds_big": 3,
    "receipts": {"1k": 1000, "10k": 10_000, "100k": 100_000},
    "receipt_rounds": {"1k": 5, "10k": 3, "100k": 2},
    "watch": [("100k", "as specified", [], 5), ("1k", "as specified", [], 5)],
    "fsync_sizes": ("1k", "100k"), "strace_runs": 3, "ab_rounds": 15,
    "profile_size": "100k", "profile_ops": {"side": 40, "main": 20}, "profile_store": "10k",
    "matching_rounds": 5, "signing_rounds": 30,
    "server_sizes": ("1k", "100k"),
    "dirs_sizes": {"1k": 1000, "100k": 100_000}, "dirs_rounds": 5,
    "remote": (3, 30),
}
QUICK: dict[str, Any] = {
    "sizes": {"1k": 1000, "10k": 10_000},
    "rounds": {"1k": 6, "10k": 4},
    "files500_on": "1k", "rounds_500": 1,
    "agents_on": "1k", "agents": (4, 5), "agents_rounds": 1,
    "big_size": 16 << 20, "rounds_big": 1,
    "receipts": {"1k": 1000, "5k": 5000},
    "receipt_rounds": {"1k": 2, "5k": 1},
    "watch": [("5k", "as specified", [], 2)],
    "fsync_sizes": ("1k",), "strace_runs": 1, "ab_rounds": 5,
    "profile_size": "10k", "profile_ops": {"side": 10, "main": 5}, "profile_store": "1k",
    "matching_rounds": 3, "signing_rounds": 8,
    "server_sizes": ("1k",),
    "dirs_sizes": {"1k": 1000}, "dirs_rounds": 3,
    "remote": (3, 10),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes and few rounds (under a minute)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--out", default=None, help="output folder (default: <repo>/bench-out)")
    ap.add_argument("--update-doc", action="store_true", help="rewrite the tables in docs/BENCHMARKS.md")
    ap.add_argument("--sizes", default=None, help="comma-separated subset of the repository sizes (e.g. 1k,100k)")
    ap.add_argument("--object-sync", choices=("batch", "each", "both"), default="batch",
                    help="a call's new objects synced in one batch (the product's way), one by one by "
                         "libgit2 (the way before), or both as rows side by side in section 1")
    args = ap.parse_args(argv)

    from bench.env import ROOT, setup_env

    cfg = dict(QUICK if args.quick else FULL)
    if args.sizes:
        wanted = [x.strip() for x in args.sizes.split(",") if x.strip()]
        if set(wanted) - set(cfg["sizes"]):
            ap.error(f"unknown sizes: {', '.join(sorted(set(wanted) - set(cfg['sizes'])))}")
        cfg["sizes"] = {k: v for k, v in cfg["sizes"].items() if k in wanted}
        if cfg["sizes"] and cfg["profile_size"] not in cfg["sizes"]:  # profile the largest repository asked for
            cfg["profile_size"] = list(cfg["sizes"])[-1]
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    env = setup_env(args.out or os.path.join(ROOT, "bench-out"))

    # Imported after setup_env: the product (and libgit2) must see the bench HOME.
    from bench import report
    from bench.env import fsync_floor, machine_info, metadata_floor

    if args.object_sync == "each":
        import cas.loose_objects

        cas.loose_objects.BATCH = False

    t_start = time.perf_counter()
    loads: list[float] = []

    def log(msg: str) -> None:
        loads.append(os.getloadavg()[0])
        sys.stderr.write(f"{time.perf_counter() - t_start:7.1f}s  {msg}\n")
        sys.stderr.flush()

    res: dict[str, Any] = {
        "command": "scripts/bench" + (" --quick" if args.quick else "") +
                   (f" --only {args.only}" if args.only != ",".join(SECTIONS) else "") +
                   (f" --sizes {args.sizes}" if args.sizes else "") +
                   (f" --object-sync {args.object_sync}" if args.object_sync != "batch" else ""),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": machine_info(env.out), "gen": {},
    }
    floor_start = fsync_floor(env.tmp)
    meta_start = metadata_floor(env.tmp)
    repos = _repos(env, cfg, only, res, log)
    if "single" in only:
        from bench.cases_apply import cli_apply_importtime, section_single

        res["single"] = section_single(env, repos, cfg["rounds"], log, both_syncs=args.object_sync == "both")
        res["metadata_floor"] = {"bench folder": meta_start} | {  # the calls' own folders, once they ran there
            f"{size} repo's .git": metadata_floor(os.path.join(repo.path, ".git")) for size, repo in repos.items()}
        res["cold_imports"] = cli_apply_importtime(next(iter(repos.values())), env)
    if "large" in only:
        from bench.cases_apply import section_large

        key = cfg["files500_on"]
        res["large"] = section_large(env, repos[key], key, cfg["big_size"], cfg["rounds_500"], cfg["rounds_big"], log)
    if "agents" in only:
        from bench.cases_apply import section_concurrency

        key = cfg["agents_on"]
        procs, per = cfg["agents"]
        res["agents"] = section_concurrency(env, repos[key], key, procs, per, cfg["agents_rounds"], log)
    stores: dict[str, str] = {}
    if "store" in only or "watch" in only or "profile" in only:
        from bench.cases_store import section_recover_verify

        wanted = cfg["receipts"] if "store" in only else {
            k: v for k, v in cfg["receipts"].items()
            if k in {w[0] for w in cfg["watch"]} | {cfg["profile_store"]}}
        rounds = cfg["receipt_rounds"] if "store" in only else {k: 0 for k in wanted}
        tables, stores, _rrepo = section_recover_verify(env, wanted, rounds, log)
        if "store" in only:
            res["store"] = tables
    if "fsync" in only:
        from bench.fsyncs import section_fsync

        res["fsync"] = section_fsync(env, {k: repos[k] for k in cfg["fsync_sizes"] if k in repos},
                                     cfg["strace_runs"], cfg["ab_rounds"], log)
    if "profile" in only:
        res["profile"] = _profile(env, cfg, repos, stores, log)
    if "matching" in only:
        from bench.cases_matching import section_matching

        res["matching"] = section_matching(env, cfg["matching_rounds"], log)
    if "signing" in only:
        from bench.cases_signing import section_signing

        res["signing"] = section_signing(env, cfg["signing_rounds"], log)
    if "server" in only:
        from bench.cases_server import section_server

        res["server"] = section_server(env, {k: repos[k] for k in cfg["server_sizes"] if k in repos},
                                       cfg["rounds"], log)
    if "dirs" in only:
        from bench.cases_dirs import section_dirs

        sizes = {k: v for k, v in cfg["dirs_sizes"].items() if not args.sizes or k in args.sizes.split(",")}
        res["dirs"] = section_dirs(env, sizes, cfg["dirs_rounds"], log)
    if "remote" in only:
        from bench.cases_remote import section_remote

        res["remote"] = section_remote(env, *cfg["remote"], log)
    if "watch" in only:  # last: it leaves orphaned receipts in the stores
        from bench.cases_store import section_watcher

        runs = [{"size": size, "root": stores[size], "receipts": cfg["receipts"][size], "config": conf,
                 "args": extra, "orphans": k} for size, conf, extra, k in cfg["watch"]]
        res["watch"] = section_watcher(env, runs, 1.0, log)
    floor_end = fsync_floor(env.tmp)
    res["fsync_floor"] = " / ".join(
        f"fsync {f['fsync_ms']:.2f} ms, durable atomic write {f['atomic_write_ms']:.2f} ms"
        for f in (floor_start, floor_end))
    res["wall_s"] = time.perf_counter() - t_start
    res["load"] = f"min {min(loads):.2f}, max {max(loads):.2f}" if loads else "–"
    text = report.render(res)
    with open(os.path.join(env.out, "results.json"), "wb") as fh:
        fh.write(orjson.dumps(res, option=orjson.OPT_INDENT_2, default=str))
    with open(os.path.join(env.out, "report.md"), "w") as fh:
        fh.write(text)
    if args.update_doc:
        _update_doc(os.path.join(ROOT, "docs", "BENCHMARKS.md"), text)
    sys.stdout.write(text)
    log(f"done: {env.out}/report.md")
    return 0


def _repos(env: Any, cfg: dict[str, Any], only: list[str], res: dict[str, Any], log: Any) -> dict[str, Any]:
    from bench.repos import make_repo

    need: set[str] = set()
    if "single" in only:
        need |= set(cfg["sizes"])
    if "large" in only:
        need.add(cfg["files500_on"])
    if "agents" in only:
        need.add(cfg["agents_on"])
    if "fsync" in only:
        need |= set(cfg["fsync_sizes"])
    if "profile" in only:
        need.add(cfg["profile_size"])
    if "server" in only:
        need |= set(cfg["server_sizes"])
    repos = {}
    for label, n in cfg["sizes"].items():
        if label in need:
            log(f"generating the {label}-file repository")
            repos[label], res["gen"][f"repo {label}"] = make_repo(os.path.join(env.out, f"repo-{label}"), n)
    return repos


def _profile(env: Any, cfg: dict[str, Any], repos: dict[str, Any], stores: dict[str, str], log: Any) -> dict[str, Any]:
    from bench.cases_apply import Contenders
    from bench.profiling import profile_cli, profile_op

    out: dict[str, Any] = {}
    size = cfg["profile_size"]
    c = Contenders(env, repos[size], f"prof{size}")
    for branch, where in (("side", "not checked out"), ("main", "checked out")):
        n = cfg["profile_ops"][branch]
        log(f"[profile] API apply, branch {where}, {size} files: {n} calls")
        out[f"API apply, one file, branch {where}, {size} files"] = profile_op(c.api(branch), n)
    log("[profile] API replay")
    out[f"API replay, {size} files"] = profile_op(c.api_replay("api-side"), 20)
    s = cfg["profile_store"]
    if s in stores:
        for cmd in ("verify", "recover"):
            log(f"[profile] {cmd} over the {s} store (in process)")
            out[f"{cmd}, {s} receipts (in-process CLI main)"] = profile_cli([cmd, "--json", "--store", stores[s]])
    return out


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _update_doc(path: str, text: str) -> None:
    with open(path) as fh:
        doc = fh.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: markers {BEGIN} / {END} not found")
    head, rest = doc.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    with open(path + ".tmp", "w") as fh:
        fh.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())

"""Markdown tables and the target check, from the results dict of one run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from bench.stats import fmt_ms, fmt_ratio

__all__ = ["render", "targets"]


def _mib(kib: int | None) -> str:
    return "–" if not kib else f"{kib / 1024:.0f}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _tables_by_size(rows: list[dict[str, Any]], title: str, ratio: str) -> list[str]:
    """One timing table per size, in the order the sizes ran; ``title`` formats ``{size}``."""
    parts = []
    for size in dict.fromkeys(r["size"] for r in rows):
        parts.append(f"\n{title.format(size=size)}\n\n")
        parts.append(_table(["contender", "median", "p90", "n", ratio],
                            _timing_rows([r for r in rows if r["size"] == size])))
    return parts


def _timing_rows(rows: list[dict[str, Any]], *, rss: bool = False) -> list[list[str]]:
    out = []
    for r in rows:
        base = r.get("baseline_median_s")
        floor = r["name"].startswith("python")
        line = [r["name"], fmt_ms(r["median_s"]), fmt_ms(r["p90_s"]), str(r["n"]),
                "(floor)" if floor else fmt_ratio(base, r["median_s"]) if r.get("baseline") else "baseline"]
        if rss:
            line.append(_mib(r.get("maxrss_kib")))
        out.append(line)
    return out


def _find(rows: list[dict[str, Any]], size: str, name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("size") == size and r["name"] == name), None)


def _ab_median(res: dict[str, Any], size: str | None, name: str) -> float | None:
    """Section 6's in-process median (ms) of ``name`` at ``size``."""
    row = next((r for r in res.get("fsync", {}).get("ab", []) if r.get("size") == size and r["name"] == name), None)
    return None if row is None else row["median_s"] * 1000


def _flush_points(res: dict[str, Any], size: str | None, where: str) -> int | None:
    p = next((x for x in res.get("fsync", {}).get("points", []) if x["size"] == size and x["where"] == where), None)
    return None if p is None else int(p["rounds"] + p["single"] + p["libgit2_moves"])


def _work_and_fsync(res: dict[str, Any], size: str | None, checked_out: bool, limit: float) -> str:
    """Why an in-process apply is over ``limit`` ms: its work without fsync, and what its flushes add (section 6)."""
    where = "checked out" if checked_out else "not checked out"
    durable = _ab_median(res, size, f"API durable, {where}")
    stubbed = _ab_median(res, size, f"API fsync stubbed, {where}")
    points = _flush_points(res, size, where)
    if durable is None or stubbed is None:
        return "section 6 was not measured at this size"
    flushes = f"{points} flush points" if points is not None else "its flush points"
    if stubbed > limit:
        lead = (f"with every fsync stubbed the call still takes {stubbed:.1f} ms (section 6), over the limit by "
                f"itself: the Python and libgit2 work of one call on this machine")
    else:
        lead = f"the work takes {stubbed:.1f} ms with every fsync stubbed (section 6)"
    return f"{lead}; {flushes} add {durable - stubbed:.1f} ms{_machine(res, size)}"


def _floor_ms(res: dict[str, Any], size: str | None, name: str) -> float | None:
    row = _find(res.get("single", {}).get("replay", []), size, name) if size else None
    return None if row is None else row["median_s"] * 1000


def _machine(res: dict[str, Any], size: str | None) -> str:
    """How fast this machine started Python in the same minutes (section 2's floor row)."""
    floor = _floor_ms(res, size, "python -c pass")
    return f" (`python -c pass`: {floor:.1f} ms in the same run)" if floor is not None else ""


def targets(res: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(target, measured, verdict, why) for each target of issue 7; ``why`` from this run's own figures."""
    out: list[tuple[str, str, str, str]] = []
    single = res.get("single", {}).get("single", [])
    sizes = [r["size"] for r in single if r["name"] == "git pair"]
    lo = "1k" if "1k" in sizes else (sizes[0] if sizes else None)
    hi = "100k" if "100k" in sizes else None

    def ms(r: dict[str, Any] | None) -> float | None:
        return None if r is None else r["median_s"] * 1000

    def check(name: str, value: float | None, limit: float, unit: str = "ms", *, le: bool = True,
              shown: str | None = None, why: Callable[[], str] | None = None) -> None:
        if value is None:
            out.append((name, "not measured in this run", "n/a", ""))
            return
        ok = value <= limit if le else value >= limit
        s = shown or f"{value:.1f} {unit}".strip()
        if ok:
            verdict = "**met**"
        elif le:
            verdict = f"**missed** by {value - limit:.1f} {unit} ({value / limit:.1f}× the limit)".replace("  ", " ")
        else:
            verdict = f"**missed**: {value:.2f}{unit} vs ≥ {limit:g}{unit}"
        out.append((name, s, verdict, "" if ok or why is None else why()))

    api_side = "API, branch not checked out"
    api_main = "API, branch checked out"
    def pair_ms(size: str | None) -> Callable[[], str]:
        g = _find(single, size, "git pair") if size else None
        return lambda: (f"the git pair took {ms(g):.1f} ms in the same rounds{_machine(res, size)}" if g
                        else "no git pair at this size")

    for size, label in ((lo, "1k"), (hi, "100k")):
        r = _find(single, size, api_side) if size else None
        check(f"API not checked out ≤ 5 ms median at {size or label}", ms(r), 5.0,
              why=functools.partial(_work_and_fsync, res, size, False, 5.0))
    for size, label, want in ((lo, "1k", 1.5), (hi, "100k", 25.0)):
        r = _find(single, size, api_side) if size else None
        g = _find(single, size, "git pair") if size else None
        ratio = g["median_s"] / r["median_s"] if r and g else None
        check(f"API not checked out ≥ {want:g}× faster than git pair at {size or label}", ratio, want, "×",
              le=False, shown=f"{ratio:.2f}×" if ratio else None, why=pair_ms(size))
    a, b = (_find(single, lo, api_side) if lo else None), (_find(single, hi, api_side) if hi else None)
    flat = b["median_s"] / a["median_s"] if a and b else None
    check("API not checked out flat: 100k median ≤ 1.3 × 1k median", flat, 1.3, "×",
          shown=f"{flat:.2f}×" if flat else None,
          why=lambda: f"{ms(a):.1f} ms at 1k, {ms(b):.1f} ms at 100k")
    r = _find(single, hi, api_main) if hi else None
    check("API checked out ≤ 45 ms at 100k", ms(r), 45.0, why=lambda: _work_and_fsync(res, hi, True, 45.0) + (
        "; section 1 runs it between git pairs, whose unsynced index (about 10 MB at 100k files) the disk "
        "writes out meanwhile"))
    g = _find(single, hi, "git pair") if hi else None
    ratio = g["median_s"] / r["median_s"] if r and g else None
    check("API checked out ≥ 3.5× faster than git pair at 100k", ratio, 3.5, "×", le=False,
          shown=f"{ratio:.2f}×" if ratio else None, why=pair_ms(hi))
    r = _find(single, lo, api_main) if lo else None
    check(f"API checked out ≤ 5 ms at {lo or '1k'}", ms(r), 5.0,
          why=lambda: _work_and_fsync(res, lo, True, 5.0))
    def import_pygit2() -> str:
        took = _floor_ms(res, hi, "python -c 'import pygit2'")
        return f"`python -c 'import pygit2'` alone took {took:.0f} ms" if took is not None else ""

    for name in ("CLI cold, branch checked out", "CLI cold, branch not checked out"):
        r = _find(single, hi, name) if hi else None
        gm = ms(g)
        val = ms(r)
        check(f"{name} at 100k ≤ git pair ({fmt_ms(g['median_s']) if g else '?'} ms)",
              val, gm if gm is not None else 0.0,
              why=import_pygit2)
    reps = [r for r in res.get("single", {}).get("replay", []) if r["name"] == "CLI replay"]
    worst = max(reps, key=lambda r: r["median_s"]) if reps else None
    imp = res.get("single", {}).get("importtime", {})

    def replay_why() -> str:
        size = worst["size"] if worst else None
        floor = _floor_ms(res, size, "python -c pass")
        rp = imp.get("replay", {})
        said = [f"`python -c pass` took {floor:.1f} ms at that size" if floor is not None else ""]
        if rp:
            said.append(f"a replay imports {rp['modules']} modules, {rp['import_ms']:.1f} ms of their own "
                        f"(`-X importtime`, which slows each)")
        return "; ".join(x for x in said if x)

    check(f"CLI replay ≤ 40 ms median (worst size: {worst['size'] if worst else '?'})", ms(worst), 40.0,
          why=replay_why)
    if imp:
        bad = imp.get("replay", {}).get("pygit2_imported") or imp.get("replay_sys_modules_has_pygit2")
        out.append(("CLI replay does not import pygit2", "imported" if bad else "not imported",
                    "**missed**" if bad else "**met**", ""))
    store = res.get("store", {}).get("rows", [])
    floor_100k = next((r for r in store if r["size"] == "100k" and r["name"].startswith("read + parse")), None)

    def store_why() -> str:
        if floor_100k is None:
            return ""
        return (f"reading and parsing the 100k receipt files alone took {floor_100k['median_s']:.1f} s "
                f"(the floor row){_machine(res, hi)}")

    v = next((r for r in store if r["size"] == "100k" and r["name"] == "oncepatch verify"), None)
    check("verify of 100k receipts ≤ 10 s", v["median_s"] if v else None, 10.0, "s", why=store_why)
    check("verify of 100k receipts peak memory ≤ 300 MiB", (v["maxrss_kib"] / 1024) if v else None, 300.0, "MiB")
    rc = next((r for r in store if r["size"] == "100k" and r["name"].startswith("oncepatch recover")), None)
    check("recover (nothing to do) over 100k receipts ≤ 5 s", rc["median_s"] if rc else None, 5.0, "s",
          why=store_why)
    w = next((r for r in res.get("watch", {}).get("rows", [])
              if r["size"] == "100k" and r.get("config") == "as specified"), None)
    if w is not None:
        check(f"watcher flag latency ≤ grace + 1 s = {w['grace_s'] + 1:g} s at 100k", w["median_s"],
              w["grace_s"] + 1, "s", why=lambda: f"its start-up scan took {w['startup_scan_s']:.1f} s")
    else:
        check("watcher flag latency ≤ grace + 1 s at 100k", None, 0)
    big = res.get("large", {}).get("bigfile", [])
    size = res.get("large", {}).get("big_size")
    for r in big:
        if r["name"].startswith("API (fresh process), branch checked out") and size:
            floor = next((x for x in big if x["name"].startswith("python:")), None)
            extra = (r["maxrss_kib"] - (floor["maxrss_kib"] if floor else 0)) * 1024 / size
            check(f"{size >> 20} MiB file: API peak memory above the import floor ≤ 3 × file size", extra, 3.0, "×",
                  shown=f"{extra:.1f}× ({_mib(r['maxrss_kib'])} MiB peak)",
                  why=functools.partial("the import floor is {} MiB".format,
                                        _mib(floor["maxrss_kib"] if floor else None)))
    return out


def render(res: dict[str, Any]) -> str:
    parts: list[str] = []
    m = res["machine"]
    parts.append("### Machine and run\n")
    parts.append(_table(["", ""], [
        ["command", f"`{res['command']}`"],
        ["date (UTC)", res["date"]],
        ["CPU", f"{m['cpu']}, {m['nproc']} cores"], ["RAM", f"{m['ram_gib']} GiB"],
        ["filesystem", m["filesystem"]], ["kernel", m["kernel"]],
        ["python / pygit2 / libgit2", f"{m['python']} / {m['pygit2']} / {m['libgit2']}"],
        ["git", m["git"]], ["strace", m["strace"]],
        ["product measured", m.get("product", "–")],
        ["fsync floor here (start / end of run)", res.get("fsync_floor", "–")],
        ["filesystem journal", m.get("journal", "–")],
        ["new file / rename over an empty file / over a file holding data, fsync aside (median; the bench "
         "folder at the start, each repo's .git after section 1)",
         "; ".join(f"{where}: {f['create_us']:.0f} / {f['rename_us']:.0f} / "
                   + (f"{f['rename_data_us']:.0f}" if "rename_data_us" in f else "–") + " µs"
                   for where, f in res.get("metadata_floor", {}).items()) or "–"],
        ["load average (1 min) during the run", res.get("load", "–")],
        ["total wall time", f"{res.get('wall_s', 0):.0f} s"],
        ["repo generation", ", ".join(f"{k}: {v:.1f} s" for k, v in res.get("gen", {}).items())],
    ]))
    s = res.get("single")
    if s:
        parts.append("\n### 1. One-file patch (ms; ratio = git pair median / this median, > 1 is faster)\n")
        for size in dict.fromkeys(r["size"] for r in s["single"]):
            clean = s["clean"].get(size)
            parts += _tables_by_size([r for r in s["single"] if r["size"] == size],
                                     f"**{{size}} files** (worktree clean afterwards: {clean})", "vs git pair")
        parts.append("\n### 2. Replay of a committed call (ms)\n")
        parts += _tables_by_size(s["replay"], "**{size} files**", "vs git pair")
        imp = s.get("importtime", {})
        if imp:
            rp = imp["replay"]
            parts.append(
                f"\nCLI replay imports: pygit2 imported = **{rp['pygit2_imported']}** (`-X importtime`), "
                f"`'pygit2' in sys.modules` after `main()` = **{imp['replay_sys_modules_has_pygit2']}**; "
                f"{rp['modules']} modules, {rp['import_ms']} ms of imports (self times summed); "
                "largest: " + ", ".join(f"`{m}` {t} ms" for m, t in rp["top"]) + ".\n")
        cold = res.get("cold_imports")
        if cold:
            parts.append(f"\nCLI cold *apply* imports: {cold['modules']} modules, {cold['import_ms']} ms; largest: "
                         + ", ".join(f"`{m}` {t} ms" for m, t in cold["top"]) + ".\n")
    if res.get("server"):
        from bench.cases_server import render_server

        parts.append(render_server(res["server"]))
    if res.get("remote"):
        from bench.cases_remote import render_remote

        parts.append(render_remote(res["remote"]))
    lg = res.get("large")
    if lg:
        parts.append(f"\n### 3. Large changes\n\n**500-file patch, {lg['files500'][0]['size']} files** (ms; worktree "
                     f"clean afterwards: {lg['files500_clean']})\n\n")
        parts.append(_table(["contender", "median", "p90", "n", "vs git pair"], _timing_rows(lg["files500"])))
        parts.append(f"\n**One line changed in a {lg['big_size'] >> 20} MiB file** (ms; peak RSS of the process "
                     f"in MiB, max over rounds; worktree clean afterwards: {lg['bigfile_clean']})\n\n")
        parts.append(_table(["contender", "median", "p90", "n", "vs git pair", "peak RSS MiB"],
                            _timing_rows(lg["bigfile"], rss=True)))
    ag = res.get("agents")
    if ag:
        r0 = ag["rows"][0]
        parts.append(f"\n### Many agents at once (issue 4): one-file patches on distinct files of one branch, "
                     f"{r0['size']} files\n\nEach process is a long-lived API caller (`bench.worker batch`); wall "
                     f"time includes process start-up (each process imports pygit2), the apply-loop span does not. Worktree clean afterwards: {ag['clean']}.\n\n")
        rows = []
        for r in ag["rows"]:
            serial = next((x for x in ag["rows"] if x["branch"] == r["branch"] and x["mode"] == "serial"), None)
            rows.append([f"branch {r['branch']}", r["mode"], str(r["procs"]), str(r["calls"]), str(r["landed"]),
                         str(r["commits_added"]), str(r.get("restaged", "–")),
                         ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none",
                         f"{r['wall_s']:.2f}", f"{r['per_s']:.1f}",
                         f"{r['per_s'] / serial['per_s']:.2f}×" if serial else "–",
                         f"{r['span_per_s']:.1f}",
                         f"{r['span_per_s'] / serial['span_per_s']:.2f}×" if serial else "–"])
        parts.append(_table(["target", "mode", "processes", "calls", "landed", "commits added",
                             "re-staged (branch moved)", "errors", "wall s",
                             "calls/s (wall)", "vs serial", "calls/s (apply loops only)", "vs serial"], rows))
    st = res.get("store")
    if st:
        parts.append("\n### 4. `recover` and `verify` over stores of committed receipts (cold CLI processes)\n\n")
        rows = []
        for r in st["rows"]:
            rows.append([r["size"], r["name"], fmt_ms(r["median_s"]), fmt_ms(r["p90_s"]), str(r["n"]),
                         f"{r['per_s']:,.0f}" if r.get("per_s") else "–", _mib(r.get("maxrss_kib")),
                         fmt_ratio(r["baseline_median_s"], r["median_s"]) if r.get("baseline") else "floor"])
        parts.append(_table(["receipts", "command", "median (ms)", "p90", "n", "receipts/s", "peak RSS MiB",
                             "vs floor"], rows))
        parts.append("\nStore synthesis: " + ", ".join(f"{k} {v:.1f}" + ("" if k == "repo_commits" else " s")
                                                      for k, v in st["gen"].items()) + ".\n")
    w = res.get("watch")
    if w:
        parts.append("\n### 5. Watcher: orphan created → flag printed by `oncepatch watch --json --grace 1`\n\n")
        rows = [[r["config"], f"{r['receipts']:,}", f"{r['startup_scan_s']:.1f} s", f"{r['median_s']:.2f} s",
                 f"{r['p90_s']:.2f} s", str(len(r["samples_s"])), f"{r['grace_s'] + 1:g} s", _mib(r.get("rss_kib"))]
                for r in w["rows"]]
        parts.append(_table(["watcher", "receipts", "start-up scan", "latency median", "p90", "n", "target",
                             "peak RSS MiB"], rows))
    mt = res.get("matching")
    if mt:
        parts.append("\n### Matching cost against input size (in-process matcher; `git apply --check` on the "
                     f"same input, a process each; median of {mt['rounds']})\n\n"
                     "Doubling the input should at most about double the time: ratios near 2, never near 4.\n\n")
        rows = []
        for r in mt["rows"]:
            prev = next((x for x in mt["rows"] if x["case"] == r["case"] and x["scale"] * 2 == r["scale"]), None)
            rows.append([r["case"], f"{r['scale']}x", f"{r['file_lines']:,}", f"{r['patch_bytes']:,}", r["outcome"],
                         fmt_ms(r["median_s"]), f"{r['median_s'] / prev['median_s']:.2f}" if prev else "–",
                         fmt_ms(r["git_median_s"]),
                         f"{r['git_median_s'] / prev['git_median_s']:.2f}" if prev else "–",
                         "applies" if r["git_rc"] == 0 else "refuses"])
        parts.append(_table(["case", "size", "file lines", "patch bytes", "oncepatch outcome", "oncepatch median",
                             "vs half size", "git apply --check", "vs half size", "git outcome"], rows))
    sg = res.get("signing")
    if sg:
        parts.append("\n### Signing cost (docs/SECURITY.md, signed mode; in process unless said; medians)\n\n")
        rows = [["receipt: sign + verify (Ed25519, `cryptography`)",
                 fmt_ms(sg["receipt_sign_s"] + sg["receipt_check_s"]),
                 f"{fmt_ms(sg['receipt_sign_s'])} + {fmt_ms(sg['receipt_check_s'])}"],
                ["ledger event: sign + verify (canonical JSON included)",
                 fmt_ms(sg["event_sign_s"] + sg["event_check_s"]),
                 f"{fmt_ms(sg['event_sign_s'])} + {fmt_ms(sg['event_check_s'])}"]]
        if "ssh_sign_s" in sg:
            rows.append(["`ssh-keygen -Y sign` + `-Y verify` (a process each)",
                         fmt_ms(sg["ssh_sign_s"] + sg["ssh_check_s"]),
                         f"{fmt_ms(sg['ssh_sign_s'])} + {fmt_ms(sg['ssh_check_s'])}"])
        rows += [["a call's signing work: the list read, the key loaded, 4 signatures", fmt_ms(sg["call_work_s"]), ""],
                 ["importing the Ed25519 module (once per process, signed stores only)", fmt_ms(sg["import_s"]), ""],
                 [f"apply, unsigned store (median of {sg['rounds']})", fmt_ms(sg["call_unsigned_s"]), ""],
                 [f"apply, signed store (median of {sg['rounds']}; 4 signatures, 1 check)",
                  fmt_ms(sg["call_signed_s"]),
                  f"{fmt_ms(sg['call_signed_s'] - sg['call_unsigned_s'])} more"]]
        parts.append(_table(["what", "ms", "of which (ms)"], rows))
    dr = res.get("dirs")
    if dr:
        parts.append("\n### Directory targets (docs/DIRECTORIES.md; in-process API, median of "
                     f"{dr['rows'][0]['rounds'] if dr['rows'] else 0} rounds)\n\n"
                     "*layout*: *whole* (a folder per generation, every unchanged file hard-linked) or *shared* "
                     "(`init --dir --share-folders`: a folder per git tree, unchanged sub-folders shared by "
                     "symlinks); *generation*: building the new generation and switching "
                     "the symlink, part of *apply*; *outside-edit check*: the lstat of the current generation's "
                     "files (whole: every file; shared: the folders the change runs through) against the "
                     "manifests before the call, part of *apply*; *by hand*: the same new files written one by "
                     "one into a plain folder, each fsynced (not atomic).\n\n")
        rows = [[f"{r['files']:,}", r.get("layout", "whole"), str(r["changed"]), fmt_ms(r["apply_s"]),
                 fmt_ms(r["generation_s"]),
                 fmt_ms(r.get("check_s", 0.0)), fmt_ms(r["apply_s"] - r["generation_s"] - r.get("check_s", 0.0)),
                 fmt_ms(r["by_hand_s"]), f"{r['init_s']:.1f} s"] for r in dr["rows"]]
        parts.append(_table(["files in folder", "layout", "files changed", "oncepatch apply", "of which: generation",
                             "of which: outside-edit check", "the rest (receipts, commit)", "by hand, fsync each",
                             "init --dir (once)"], rows))
    fs = res.get("fsync")
    if fs:
        parts.append("\n### 6. fsync per transaction\n\n**strace** (`strace -f -T -y`, one cold process each; "
                     "median of the runs; *ms in fsync* sums the time inside every call, so calls made at once "
                     "count each)\n\n")
        rows = [[r["size"], r["name"], f"{r['count']:g}", str(r["dirs"]), f"{r['fsync_ms']:.1f}",
                 f"{r['wall_ms']:.0f}", ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items(),
                                                                               key=lambda kv: -kv[1]))]
                for r in fs["strace"]]
        parts.append(_table(["files", "process", "fsyncs", "of which folders", "ms in fsync", "wall ms (traced)",
                             "what was synced"], rows))
        if fs.get("points"):
            parts.append("\n**Flush points per apply** (in process, counted at the seams; median of 5 calls): a "
                         "*round* is one `fsync_all` — its files synced at once, on threads (one file: "
                         "on the calling thread) — and counts once, whichever module calls it; "
                         "*single* are `os.fsync` calls made alone; libgit2's own are its ref and reflog syncs for "
                         "the branch, one after another (from the strace kinds above). The protocol's floor is two flush points (before and "
                         "after the branch moves).\n\n")
            prow = []
            for p in fs["points"]:
                st = next((r for r in fs["strace"] if r["size"] == p["size"]
                           and r["name"] == f"oncepatch apply, branch {p['where']}"), None)
                lg = sum(1 for q in (st["paths"] if st else [])
                         if q.startswith((".git/refs/heads", ".git/logs")) and "oncepatch" not in q
                         ) if p.get("libgit2_moves", 1) else 0
                prow.append([p["size"], p["where"], f"{p['rounds']:g} ({p['batched']:g} files)", f"{p['single']:g}",
                             f"{lg:g}", f"{p['rounds'] + p['single'] + lg:g}"])
            parts.append(_table(["files", "branch", "batched rounds (files)", "single fsyncs", "libgit2 (branch)",
                                 "sequential flush points"], prow))
        first = next((r for r in fs["strace"] if r["name"] == "oncepatch apply, branch checked out"), None)
        if first and first.get("paths"):
            runs: list[list[Any]] = []
            for p in first["paths"]:
                if runs and runs[-1][0] == p:
                    runs[-1][1] += 1
                else:
                    runs.append([p, 1])
            parts.append(f"\nWhat one `oncepatch apply` (branch checked out, {first['size']} files) syncs, in order "
                         "(`<h>` a hash, `<xx>` a fan-out folder):\n\n```\n"
                         + "\n".join(f"{p}" + (f"  ×{n}" if n > 1 else "") for p, n in runs) + "\n```\n")
        parts.append("\n**In process, durable vs fsync stubbed** (`os.fsync` no-op and libgit2 "
                     "`enable_fsync_gitdir(False)`; interleaved)\n\n")
        rows = []
        for size in dict.fromkeys(r["size"] for r in fs["ab"]):
            for where in ("not checked out", "checked out"):
                d = next(r for r in fs["ab"] if r["size"] == size and r["name"] == f"API durable, {where}")
                n = next(r for r in fs["ab"] if r["size"] == size and r["name"] == f"API fsync stubbed, {where}")
                share = (d["median_s"] - n["median_s"]) / d["median_s"] if d["median_s"] else 0
                rows.append([size, f"API, branch {where}", fmt_ms(d["median_s"]), fmt_ms(n["median_s"]),
                             fmt_ms(d["median_s"] - n["median_s"]), f"{share:.0%}"])
        parts.append(_table(["files", "call", "durable median (ms)", "no-fsync median", "fsync cost", "share"],
                            rows))
    parts.append("\n### Target check (issue 7)\n\n")
    parts.append("Where a target is missed, *why* gives the figures of this run that account for it "
                 "(docs/BENCHMARKS.md, Reading, says more).\n\n")
    parts.append(_table(["target", "measured", "verdict", "why (this run's figures)"],
                        [list(t) for t in targets(res)]))
    pr = res.get("profile")
    if pr:
        parts.append("\n### Profile tables (cProfile; per call)\n")
        for name, p in pr.items():
            parts.append(f"\n**{name}** — {p['total_ms']:.1f} ms per call under the profiler, {p['ops']} calls\n\n")
            rows = [[str(i + 1), f"`{r['func']}`", f"{r['cum_ms']:.2f}", f"{r['self_ms']:.2f}", f"{r['calls']:g}"]
                    for i, r in enumerate(p["by_cum"][:12])]
            parts.append(_table(["#", "function", "cum ms/call", "self ms/call", "calls/call"], rows))
            parts.append("\nLargest self time: " + ", ".join(
                f"`{r['func']}` {r['self_ms']:.2f} ms" for r in p["by_self"][:6]) + ".\n")
    return "".join(parts)

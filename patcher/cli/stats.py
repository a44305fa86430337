"""CLI command ``stats``: counts over the event ledger (:mod:`receipts.stats`; docs/LIFECYCLE.md, "stats")."""

from __future__ import annotations

import argparse
import os
from datetime import datetime, timedelta, timezone
from typing import Any

from cas.durable import write_durable
from cas.errors import EXIT_OK, DurableWriteError, UsageError
from receipts.stats import COUNTERS, Stats, parse_duration, read_stats, to_prometheus
from receipts.store import ReceiptStore
from patcher.cli.common import add_common, path_given, store_root

__all__ = ["register", "HANDLERS"]


#: The longest ``--since`` window: 1000 years (a ledger older than that is older than git).
MAX_SINCE = 1000 * 366 * 86400.0


def _duration(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value <= MAX_SINCE:  # (inf and NaN too): the window's start would be before year 1
        raise argparse.ArgumentTypeError(f"{text!r} is longer than 1000 years (the whole ledger: leave out --since)")
    return value


def register(sub: Any) -> None:
    p = sub.add_parser("stats", help="counts over the event ledger: duplicates, replays, unknowns, recoveries, latency")
    add_common(p)
    p.add_argument("--since", type=_duration, default=None, metavar="DURATION",
                   help="only events of the last DURATION (90s, 15m, 24h, 7d)")
    p.add_argument("--prometheus", type=path_given, default=None, metavar="FILE",
                   help="also write FILE in Prometheus' text format, atomically (for node-exporter's "
                        "textfile collector: name it *.prom)")


def _text(stats: Stats) -> str:
    window = f" since {stats.since}" if stats.since else ""
    lines = [f"ledger: {stats.events} event(s), {stats.counted_events} counted{window}"]
    if stats.compacted is not None:
        c = stats.compacted
        lines.append(f"compacted by gc: events {c['first_seq']}..{c['last_seq']} ({c['events']} event(s), in the "
                     "archive), not counted: the counts are of the events since")
    for name, (labels, _help) in COUNTERS.items():
        rows = stats.counters[name]
        lines.append(f"{name.replace('_', ' ')}: {sum(rows.values())}")
        for key, n in sorted(rows.items()):
            if len(labels) > 1 or len(rows) > 1:  # one tool's total is the line above
                lines.append("  " + " ".join(f"{lab}={val}" for lab, val in zip(labels, key)) + f"  {n}")
    lines.append("keys now:")
    for (tool, state), n in sorted(stats.states.items()):
        lines.append(f"  tool={tool} state={state}  {n}")
    for tool, row in stats.latency().items():
        lines.append(f"latency {tool}: p50 {row['p50']:.3f}s p95 {row['p95']:.3f}s over {row['count']} execution(s)")
    lines.append("not counted: idempotency conflicts (refused before anything is written)")
    return "\n".join(lines) + "\n"


def _cmd_stats(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    if args.since is not None and args.prometheus is not None:
        raise UsageError("--prometheus exports counters over the whole ledger: leave out --since "
                         "(a window's counts are no counters)")
    since = datetime.now(timezone.utc) - timedelta(seconds=args.since) if args.since is not None else None
    stats = read_stats(ReceiptStore(store_root(args)), since=since)
    doc: dict[str, Any] = {"ok": True, **stats.to_json()}
    text = _text(stats)
    if args.prometheus is not None:
        target = os.path.abspath(args.prometheus)
        # write_durable: a tmp file beside the target (same folder, a name the collector's *.prom
        # glob skips), renamed over it; a scrape sees the old file or the new one, never half of one.
        try:
            write_durable(target, to_prometheus(stats).encode(), mode=0o644)
        except DurableWriteError as exc:  # a folder missing, a folder named so, no right to write: the caller's to fix
            raise UsageError(f"{exc.message} (--prometheus; nothing was written)") from exc
        doc["prometheus"] = target
        text += f"wrote {target}\n"
    return EXIT_OK, doc, text


HANDLERS = {"stats": _cmd_stats}

"""CLI command ``oncepatch doctor``: what a crash left, and the one command to run next (no changes)."""

from __future__ import annotations

import argparse
from typing import Any

from cas.errors import EXIT_IN_PROGRESS, EXIT_OK, EXIT_VERIFY
from cas.gitdir import discover
from patcher.cli.common import add_common, store_root
from patcher.cli.progress import shown
from patcher.doctor import diagnose

__all__ = ["register", "HANDLERS"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", help="after a crash: what is pending or corrupt, whose lock is left, the one command to run next",
        description="Look at the receipt store and the repository and say what to do next; changes nothing. "
                    "Exit 0: nothing pending; 5: a call pending or a crashed call's lock left "
                    "(run 'oncepatch recover'); 6: a receipt is corrupt. With --dir PATH (a directory target) also the "
                    "folder: a switch left undone (5), paths changed outside oncepatch (6).")
    add_common(p)


def _lock_line(lk: dict[str, Any]) -> str:
    if not lk["oncepatch"]:
        what = "empty, " if lk.get("empty") else ""
        return (f"  {lk['path']}: not oncepatch's ({what}git's or another tool's): if no git runs "
                f"(fuser '{lk['path']}'), remove it")
    if lk.get("crashed"):
        return (f"  {lk['path']}: oncepatch's, left by a crashed call (pid {lk['pid']} gone): do not delete "
                f"it, 'oncepatch recover' settles the call and removes it")
    if lk.get("crashed") is None:
        return f"  {lk['path']}: oncepatch's, of a call on host '{lk.get('host')}' (cannot tell from here)"
    return f"  {lk['path']}: oncepatch's, held by a running call (pid {lk['pid']})"


def _folder_lines(folder: dict[str, Any]) -> list[str]:
    """A directory target's part (docs/DIRECTORIES.md)."""
    shows = folder["shows"]
    lines = [f"dir {folder['path']}: " + (f"shows generation {shows[:12]}" if shows else
                                         "no symlink to one of its generations")]
    if folder["pending_switch"]:
        lines.append(f"  switch pending: the branch's tip is generation {folder['tip'][:12]}, the folder shows "
                     f"{shows[:12]}")
    if folder["generation_missing"]:
        lines.append(f"  generation {shows[:12]}'s folder is gone")
    edited = folder["edited_outside"]
    if edited:
        lines.append(f"  changed outside oncepatch: {len(edited)} path(s)")
        lines += [f"    {p}" for p in edited[:20]] + ([f"    ... and {len(edited) - 20} more"] if len(edited) > 20
                                                     else [])
    lines += [f"  left by a crashed build: {p}" for p in folder["leftovers"]]
    return lines


def _cmd_doctor(args: argparse.Namespace) -> tuple[int, dict[str, Any], str]:
    from patcher.cli.recovery import _hooks_dir

    hooks, _configured = _hooks_dir(discover(args.repo))
    with shown("looking: receipts read"):
        d = diagnose(args.repo, store_root(args), hooks, dir=getattr(args, "dir", None))
    lines = [f"store {d['store']}: {d['receipts']} receipt(s)"]
    lines.append(f"pending: {len(d['pending'])}")
    for p in d["pending"]:
        age = f"{p['age_s']:.0f}s ago" if p["age_s"] is not None else "age unknown"
        who = {True: "its call is running", False: "its call is gone (crashed)", None: "cannot tell"}[p["call_alive"]]
        lines.append(f"  {p['key']}: {p['status']} {age}, {who}")
    lines.append(f"corrupt: {len(d['corrupt'])}")
    lines += [f"  {c['receipt']}{' (key ' + repr(c['key']) + ')' if c['key'] else ''}: {c['reason']}"
              for c in d["corrupt"]]
    lines.append(f"locks: {len(d['locks'])}")
    lines += [_lock_line(lk) for lk in d["locks"]]
    h = d["hook"]
    if h["installed"]:
        lines.append(f"hook: installed ({h['by']}: {h['path']})")
    else:
        lines.append(f"hook: not installed{' (' + h['note'] + ')' if h.get('note') else ''}")
    folder = d.get("dir")
    if folder is not None:
        lines += _folder_lines(folder)
    lines.append(f"next: {d['next']}  ({d['why']})")
    code = (EXIT_VERIFY if d["corrupt"] or (folder is not None and folder["edited_outside"]) else
            EXIT_IN_PROGRESS if d["pending"] or any(lk["oncepatch"] and lk.get("crashed") for lk in d["locks"])
            or (folder is not None and (folder["pending_switch"] or folder["generation_missing"]
                                        or folder["not_linked"] or folder["leftovers"]))
            else EXIT_OK)
    return code, d, "\n".join(lines) + "\n"


HANDLERS = {"doctor": _cmd_doctor}

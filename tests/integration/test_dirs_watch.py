"""``watch --dir``: a committed call whose folder was not switched is flagged (docs/DIRECTORIES.md).

The switch runs after the branch moved; when it fails (here: ``switch.lock``
held by this test past the call's ``--lock-timeout``) the call still commits,
with a warning in its receipt, and the folder stays behind the branch's tip
until ``recover --dir``.  The watcher sees the committed receipt through its
watchdog observer (the periodic rescan is an hour away) and asks the git
adapter what is left undone; the generic watcher never looks at the folder.
"""

from __future__ import annotations

import fcntl
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from conftest import run_cli
from dirs_helpers import patch_between, tree_of, write_tree

from receipts.store import ReceiptStore
from receipts.watcher import Watcher

BASE: dict[str, str | bytes] = {"index.html": "<h1>old</h1>\n", "css/site.css": "body {}\n"}
AFTER: dict[str, str | bytes] = {"index.html": "<h1>new</h1>\n", "css/site.css": "body {}\n"}


class _Seen(Watcher):
    """A watcher that says when its first scan is done (its observer runs from then on) and what it was told."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.scanned = threading.Event()
        self.notified: list[str] = []

    def rescan(self) -> None:
        super().rescan()
        self.scanned.set()

    def notify(self, path: str) -> None:
        self.notified.append(path)
        super().notify(path)


def test_watch_flags_a_committed_call_whose_folder_was_not_switched(tmp_path: Path) -> None:
    from patcher.git_adapter import adapters

    site = tmp_path / "site"
    site.mkdir()
    write_tree(site, BASE)
    assert run_cli("init", "--dir", str(site)).code == 0
    objects = Path(str(site) + ".oncepatch/objects.git")
    shown = os.readlink(site)
    pf = tmp_path / "change.diff"
    pf.write_bytes(patch_between(tmp_path / "scratch", BASE, AFTER))

    rstore = ReceiptStore(str(objects / "oncepatch"))
    flags: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    unfinished = threading.Event()

    def on_flag(obj: dict[str, Any]) -> None:
        flags.put(obj)
        if obj.get("flag") == "unfinished":
            unfinished.set()

    watcher = _Seen(rstore, adapters(rstore, {}, read_only=True), grace=3600.0, rescan_interval=3600.0,
                    on_flag=on_flag)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    lock_fd = os.open(Path(str(site) + ".oncepatch") / "switch.lock", os.O_RDWR | os.O_CREAT, 0o644)
    thread.start()
    try:
        assert watcher.scanned.wait(60), "the watcher never made its first scan"
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # the switch cannot take it: the call commits, the folder stays
        t = time.monotonic()
        res = run_cli("apply", str(pf), "--dir", str(site), "--key", "deploy/1", "--lock-timeout", "0.2",
                      "--json")
        took = time.monotonic() - t
        assert res.code == 0, res.out + res.err
        assert any("not switched" in w for w in res.json["warnings"]), res.json
        assert os.readlink(site) == shown  # behind the tip
        assert unfinished.wait(max(10.0, 20 * took)), f"no flag; seen {watcher.notified}"
        got: list[dict[str, Any]] = []
        while not flags.empty():
            got.append(flags.get_nowait())
        [flag] = [f for f in got if f.get("flag") == "unfinished"]
        assert flag["key"] == "deploy/1" and flag["next_action"] == "recover"
        assert flag["receipt"] in watcher.notified  # from the observer's event, not a rescan
        assert f"oncepatch recover --dir {site}" in flag["left"][0]
        assert tree_of(objects)[:12] in flag["left"][0]
    finally:
        stop.set()
        thread.join(30)
        os.close(lock_fd)  # (the flock goes with it)
    assert not thread.is_alive()

    # The CLI: --once flags it (exit 6), --recover switches the folder, then nothing is left.
    once = run_cli("watch", "--dir", str(site), "--once", "--grace", "0")
    assert once.code == 6 and "unfinished: deploy/1" in once.out and "recover --dir" in once.out, once.out + once.err
    fixed = run_cli("watch", "--dir", str(site), "--once", "--grace", "0", "--recover", "--json")
    assert fixed.code == 6, fixed.out + fixed.err
    assert os.readlink(site) == f"site.oncepatch/generations/{tree_of(objects)}"
    assert (site / "index.html").read_text() == "<h1>new</h1>\n"
    clean = run_cli("watch", "--dir", str(site), "--once", "--grace", "0")
    assert clean.code == 0, clean.out + clean.err


def test_a_committed_receipt_with_its_folder_switched_is_not_flagged(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    write_tree(site, BASE)
    assert run_cli("init", "--dir", str(site)).code == 0
    pf = tmp_path / "change.diff"
    pf.write_bytes(patch_between(tmp_path / "scratch", BASE, AFTER))
    lock_fd = os.open(Path(str(site) + ".oncepatch") / "switch.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        res = run_cli("apply", str(pf), "--dir", str(site), "--key", "deploy/1", "--lock-timeout", "0.2", "--json")
        assert res.code == 0 and res.json["warnings"], res.out + res.err
    finally:
        os.close(lock_fd)
    assert run_cli("recover", "--dir", str(site)).code == 0  # switched since: the warning stays, nothing is left
    once = run_cli("watch", "--dir", str(site), "--once", "--grace", "0")
    assert once.code == 0, once.out + once.err

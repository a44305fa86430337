"""receipts.ledger: the append-only, hash-chained event ledger."""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from receipts.canonical import canonical_json
from receipts.errors import CorruptLedger, InProgress
from receipts.ledger import GENESIS, Ledger


def make_ledger(tmp_path: Path, n: int = 0) -> Ledger:
    led = Ledger(str(tmp_path / "events.jsonl"), str(tmp_path / "locks" / "ledger.lock"), lock_timeout=5)
    for i in range(n):
        led.append({"event": "e", "i": i})
    return led


def lines_of(led: Ledger) -> list[bytes]:
    return Path(led.path).read_bytes().splitlines(keepends=True)


def write_lines(led: Ledger, lines: list[bytes]) -> None:
    Path(led.path).write_bytes(b"".join(lines))


def test_append_fills_seq_and_prev_and_chain_verifies(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    first = led.append({"event": "a"})
    second = led.append({"event": "b", "x": [1, 2]})
    assert first == {"event": "a", "seq": 1, "prev": GENESIS}
    raw = lines_of(led)
    assert raw[0] == canonical_json(first) + b"\n"  # each line is canonical JSON
    assert second["seq"] == 2 and second["prev"] == hashlib.sha256(raw[0][:-1]).hexdigest()
    assert list(led.events()) == [first, second]
    assert led.verify_chain() == []


def test_empty_or_missing_ledger(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    assert list(led.events()) == [] and led.verify_chain() == []


def test_append_does_not_mutate_the_callers_event(tmp_path: Path) -> None:
    ev = {"event": "x"}
    make_ledger(tmp_path).append(ev)
    assert ev == {"event": "x"}


def test_chain_of_many_verifies_and_continues_after_reopen(tmp_path: Path) -> None:
    make_ledger(tmp_path, 30)
    led = make_ledger(tmp_path)  # a new instance reads the tail from disk
    assert led.append({"event": "more"})["seq"] == 31
    assert [e["seq"] for e in led.events()] == list(range(1, 32))
    assert led.verify_chain() == []


def test_tail_is_found_in_a_ledger_larger_than_the_read_window(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    big = "x" * 70_000  # one line longer than the 64 KiB tail window
    led.append({"event": "big", "pad": big})
    led.append({"event": "big", "pad": big})
    third = led.append({"event": "small"})
    assert third["seq"] == 3
    assert third["prev"] == hashlib.sha256(lines_of(led)[1][:-1]).hexdigest()
    assert led.verify_chain() == []


def test_deleting_a_line_is_reported_at_that_line(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 5)
    lines = lines_of(led)
    del lines[2]  # line 3
    write_lines(led, lines)
    problems = led.verify_chain()
    assert problems and problems[0].line == 3
    assert "hash chain broken" in problems[0].reason


def test_deleting_the_first_line_is_reported(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 3)
    write_lines(led, lines_of(led)[1:])
    assert led.verify_chain()[0].line == 1


def test_editing_a_line_breaks_the_link_to_the_next(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 5)
    lines = lines_of(led)
    obj = orjson.loads(lines[1])
    obj["i"] = 999  # valid JSON, right seq and prev: only its hash changed
    lines[1] = canonical_json(obj) + b"\n"
    write_lines(led, lines)
    problems = led.verify_chain()
    assert [p.line for p in problems] == [3]  # the link from line 3 back to the edited line 2
    assert "prev does not match" in problems[0].reason


def test_editing_a_seq_is_reported_at_that_line(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 4)
    lines = lines_of(led)
    obj = orjson.loads(lines[1])
    obj["seq"] = 7
    lines[1] = canonical_json(obj) + b"\n"
    write_lines(led, lines)
    problems = led.verify_chain()
    assert problems[0].line == 2 and "seq is 7, expected 2" in problems[0].reason


def test_reordering_two_lines_is_reported(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 5)
    lines = lines_of(led)
    lines[1], lines[2] = lines[2], lines[1]
    write_lines(led, lines)
    problems = led.verify_chain()
    assert problems[0].line == 2
    assert {p.line for p in problems} >= {2, 3}


def test_garbage_line_is_reported_and_events_raise(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 3)
    lines = lines_of(led)
    lines[1] = b"not json\n"
    write_lines(led, lines)
    problems = led.verify_chain()
    assert problems[0].line == 2 and problems[0].reason == "not JSON"
    with pytest.raises(CorruptLedger) as ei:
        list(led.events())
    assert "line 2" in ei.value.message


def test_non_object_line(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 2)
    write_lines(led, [lines_of(led)[0], b"[1,2]\n"])
    assert led.verify_chain()[0].line == 2
    with pytest.raises(CorruptLedger):
        list(led.events())


# -- torn tail: a crash during an append -------------------------------------------


def test_torn_last_line_is_skipped_then_truncated_by_next_append(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 3)
    intact = Path(led.path).read_bytes()
    with open(led.path, "ab") as fh:
        fh.write(b'{"at":"2026-01-01T00:00:00Z","event":"half","i')  # the crash: no newline
    assert [e["seq"] for e in led.events()] == [1, 2, 3]
    problems = led.verify_chain()
    assert [p.line for p in problems] == [4] and "torn" in problems[0].reason

    fourth = led.append({"event": "after"})
    assert fourth["seq"] == 4
    data = Path(led.path).read_bytes()
    assert data.startswith(intact) and b"half" not in data
    assert data == intact + canonical_json(fourth) + b"\n"
    assert led.verify_chain() == []
    assert [e["seq"] for e in led.events()] == [1, 2, 3, 4]


def test_torn_only_line_is_truncated(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    Path(led.path).write_bytes(b'{"at":"2026-01-01')
    assert list(led.events()) == []
    assert led.append({"event": "first"}) == {"event": "first", "seq": 1, "prev": GENESIS}
    assert led.verify_chain() == []


def test_unreadable_last_full_line_refuses_to_append(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 2)
    with open(led.path, "ab") as fh:
        fh.write(b"garbage\n")
    before = Path(led.path).read_bytes()
    with pytest.raises(CorruptLedger):
        led.append({"event": "x"})
    assert Path(led.path).read_bytes() == before  # never chains onto, or cuts, a corrupt line


# -- locking ------------------------------------------------------------------------


def test_lock_timeout_raises_in_progress(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 1)
    led.lock_timeout = 0.1
    fd = os.open(led.lock_path, os.O_RDWR)  # another holder: a separate open file, so flock contends
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(InProgress):
            led.append({"event": "blocked"})
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert [e["seq"] for e in led.events()] == [1]
    assert led.append({"event": "free"})["seq"] == 2


# -- contention: real processes ---------------------------------------------------------

WORKERS = 8
PER_WORKER = 50


def _append_worker(path: str, lock_path: str, worker: int, barrier: Any) -> None:
    led = Ledger(path, lock_path, lock_timeout=60)
    barrier.wait(timeout=60)
    for i in range(PER_WORKER):
        led.append({"event": "stress", "worker": worker, "i": i})


def test_concurrent_appends_from_real_processes(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    os.makedirs(os.path.dirname(led.lock_path), exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WORKERS)
    procs = [ctx.Process(target=_append_worker, args=(led.path, led.lock_path, w, barrier)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:  # always reap
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * WORKERS

    raw = Path(led.path).read_bytes()
    assert raw.count(b"\n") == WORKERS * PER_WORKER and raw.endswith(b"\n")
    events = list(led.events())
    assert [e["seq"] for e in events] == list(range(1, WORKERS * PER_WORKER + 1))
    assert led.verify_chain() == []
    for w in range(WORKERS):  # each worker's events appear once, in its own order
        assert [e["i"] for e in events if e["worker"] == w] == list(range(PER_WORKER))


def test_a_whole_last_event_without_its_newline_is_completed_not_cut(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 3)
    intact = Path(led.path).read_bytes()
    Path(led.path).write_bytes(intact[:-1])
    torn = led.torn_tail()
    assert torn is not None and torn.complete and torn.own
    assert [e["seq"] for e in led.events()] == [1, 2]
    fourth = led.append({"event": "after"})
    assert fourth["seq"] == 4  # the third event kept, chained onto
    assert Path(led.path).read_bytes() == intact + canonical_json(fourth) + b"\n"
    assert led.verify_chain() == []


@pytest.mark.parametrize(("tail", "own"), [
    (b'{"at":"2026-01-01T00:00:00Z","event":"repl', True),
    (b'{"at', True),
    (b'{"event":"half","se', False),  # not how an event starts
    (b'{"at":"x","event":"y","prev":"' + b"1" * 10, False),  # another chain's prev
    (b'{"at":"x","event":"y","prev":"' + b"0" * 64 + b'","seq":7', False),  # seq 7, not the next
])
def test_torn_tail_tells_an_append_of_ours_from_anything_else(tmp_path: Path, tail: bytes, own: bool) -> None:
    led = make_ledger(tmp_path, 2)
    with open(led.path, "ab") as fh:
        fh.write(tail)
    torn = led.torn_tail()
    assert torn is not None and torn.own is own and not torn.complete and torn.data == tail


@pytest.mark.parametrize("tail", [
    b'{"event":"half","se',  # not how an event starts
    b'{"seq":1',
    b'{"at":"x","event":"y","prev":"' + b"1" * 10,  # another chain's prev
])
def test_a_torn_tail_that_is_no_append_of_ours_is_never_cut_or_chained_onto(tmp_path: Path, tail: bytes) -> None:
    led = make_ledger(tmp_path, 2)
    with open(led.path, "ab") as fh:
        fh.write(tail)
    before = Path(led.path).read_bytes()
    with pytest.raises(CorruptLedger) as exc:
        led.refuse_foreign_tail(effect_status="not_started")
    assert exc.value.effect_status == "not_started" and exc.value.next_action == "recover"
    assert "oncepatch recover" in exc.value.message
    with pytest.raises(CorruptLedger):
        led.append({"event": "after"})
    assert Path(led.path).read_bytes() == before  # the evidence kept, byte for byte


@pytest.mark.parametrize("cut", [0, 1, 7, 40, None])
def test_a_tail_torn_from_an_append_of_ours_is_allowed_and_repaired(tmp_path: Path, cut: int | None) -> None:
    """Every prefix of the event an append was writing (a process killed mid-write) is its own."""
    led = make_ledger(tmp_path, 2)
    intact = Path(led.path).read_bytes()
    third = led.append({"at": "2026-01-01T00:00:00Z", "event": "third"})
    line = canonical_json(third)
    Path(led.path).write_bytes(intact + line[:cut])  # None: the whole event, without its newline
    led.refuse_foreign_tail()  # raises nothing
    fourth = led.append({"at": "2026-01-01T00:00:01Z", "event": "fourth"})
    expected_seq = 4 if cut is None else 3  # a whole event that lost its newline is kept
    assert fourth["seq"] == expected_seq and led.verify_chain() == []


def test_a_line_naming_a_member_twice_is_a_problem_of_the_chain(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, 3)
    lines = lines_of(led)
    assert led.verify_chain() == []
    lines[1] = lines[1].replace(b'"event":"e"', b'"event":"x","event":"e"', 1)
    write_lines(led, lines)
    problems = led.verify_chain()
    assert [(p.line, "member 'event' is given twice" in p.reason) for p in problems][:1] == [(2, True)], problems

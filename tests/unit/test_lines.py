"""A file's lines and the linear search over them (pure): every path finds what a naive scan finds."""

from __future__ import annotations

import random

from patcher.budget import WorkBudget
from patcher.lines import Lines, chomp, find_all, split_lines


def _naive(keys: list[bytes], pattern: list[bytes], lo: int) -> list[int]:
    return [i for i in range(lo, len(keys) - len(pattern) + 1) if keys[i:i + len(pattern)] == pattern]


def test_the_keys_without_terminators_are_chomp_s() -> None:
    rnd = random.Random(3)
    for _ in range(5000):
        data = bytes(rnd.choice(b"ab\r\n") for _ in range(rnd.randint(0, 14)))
        lines = Lines(data, WorkBudget(), "f")
        assert lines.keys("exact", True) == [chomp(x) for x in split_lines(data)], data


def test_walking_indexed_and_kmp_searches_agree_with_a_naive_scan() -> None:
    rnd = random.Random(5)
    for _ in range(300):
        data = b"".join(rnd.choice([b"a\n", b"b\n", b"a \n"]) for _ in range(rnd.randint(1, 60)))
        lines = Lines(data, WorkBudget(), "f")
        for _round in range(6):  # later rounds search through the index (made after two walks)
            pattern = [rnd.choice([b"a", b"b"]) for _ in range(rnd.randint(1, 5))]
            lo = rnd.randint(0, 10)
            keys = lines.keys("rstrip", False)
            assert lines.scan("rstrip", False, pattern, lo) == _naive(keys, pattern, lo)
            first = lines.first("rstrip", False, pattern[0], lo)
            assert first == next((i for i in range(lo, len(keys)) if keys[i] == pattern[0]), None)
        assert find_all(keys, pattern, lo) == _naive(keys, pattern, lo)


def test_a_pattern_found_at_every_start_switches_to_one_pass() -> None:
    budget = WorkBudget()
    lines = Lines(b"a\n" * 5000, budget, "f")
    assert lines.scan("exact", False, [b"a\n"] * 2000, 0) == list(range(3001))
    assert budget.spent < 100 * 7000  # a comparison at each start would be 6 million

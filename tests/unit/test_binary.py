"""Git binary patches: base-85 hunks and the delta format (pure; git's own output is tested in integration)."""

from __future__ import annotations

import base64
import random
import zlib

import pytest

from cas.hashing import git_blob_oid
from patcher.formats.binary import apply_delta, b85decode, read_binary_hunks
from patcher.errors import ContextNotFound, ParseError


def encode_hunk(method: str, data: bytes, *, per_line: int = 52) -> list[bytes]:
    """A hunk laid out as git's diff.c writes it (``per_line`` bytes of deflated data a line)."""
    deflated = zlib.compress(data, 9)
    out = [f"{method} {len(data)}\n".encode()]
    for at in range(0, len(deflated), per_line):
        chunk = deflated[at:at + per_line]
        n = len(chunk)
        head = chr(ord("A") + n - 1) if n <= 26 else chr(ord("a") + n - 27)
        padded = chunk + b"\0" * (-n % 4)
        out.append(head.encode() + base64.b85encode(padded) + b"\n")
    out.append(b"\n")
    return out


@pytest.mark.parametrize("size", [0, 1, 3, 4, 51, 52, 53, 1000, 70_000])
def test_hunks_round_trip(size: int) -> None:
    data = random.Random(size).randbytes(size)
    lines = encode_hunk("literal", data) + encode_hunk("literal", b"reverse") + [b"diff --git a/x b/x\n"]
    forward, reverse, end = read_binary_hunks(lines, 0, "x")
    assert forward == ("literal", data)
    assert reverse == ("literal", b"")  # checked as a stream, not kept
    assert lines[end] == b"diff --git a/x b/x\n"


def test_lines_with_filler_before_the_last_are_cut_line_by_line() -> None:
    data = random.Random(7).randbytes(500)
    lines = encode_hunk("literal", data, per_line=10)  # 10 bytes a line: each line has 2 bytes of filler
    assert read_binary_hunks(lines, 0, "x")[0] == ("literal", data)


def test_reverse_hunk_is_optional_and_crlf_lines_are_read() -> None:
    lines = [line.replace(b"\n", b"\r\n") for line in encode_hunk("delta", b"abc")]
    forward, reverse, end = read_binary_hunks(lines, 0, "x")
    assert forward == ("delta", b"abc") and reverse is None and end == len(lines)


def test_a_hunk_that_inflates_to_more_than_its_size_is_refused() -> None:
    lines = encode_hunk("literal", b"0123456789")
    lines[0] = b"literal 9\n"
    with pytest.raises(ParseError, match="does not inflate to 9 bytes"):
        read_binary_hunks(lines, 0, "x")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _copy(offset: int, size: int) -> bytes:
    cmd, args = 0x80, bytearray()
    for i in range(4):
        if (offset >> (8 * i)) & 0xFF:
            cmd |= 1 << i
            args.append((offset >> (8 * i)) & 0xFF)
    size_field = 0 if size == 0x10000 else size
    for i in range(3):
        if (size_field >> (8 * i)) & 0xFF:
            cmd |= 0x10 << i
            args.append((size_field >> (8 * i)) & 0xFF)
    return bytes([cmd]) + bytes(args)


def _insert(data: bytes) -> bytes:
    assert 0 < len(data) < 0x80
    return bytes([len(data)]) + data


def test_delta_copies_and_inserts() -> None:
    src = bytes(range(256)) * 300  # 76,800 bytes
    ops = _copy(0, 10) + _insert(b"NEW") + _copy(70_000, 6_800) + _copy(256, 0x10000)  # to the very end; size 0
    dst = src[:10] + b"NEW" + src[70_000:] + src[256:256 + 0x10000]
    delta = _varint(len(src)) + _varint(len(dst)) + ops
    assert apply_delta(src, delta, "f") == dst


@pytest.mark.parametrize("delta, why", [
    (_varint(5) + _varint(3) + _copy(0, 3), "expects 5 bytes, the file has 4"),
    (_varint(4) + _varint(3) + _copy(2, 3), "a copy reaches past the data"),
    (_varint(4) + _varint(2) + _copy(0, 3), "a copy reaches past the data"),
    (_varint(4) + _varint(3) + b"\x05ab", "an insert reaches past the data"),
    (_varint(4) + _varint(3) + b"\x00", "opcode 0"),
    (_varint(4) + _varint(5) + _copy(0, 4), "the result has 4 bytes, the delta says 5"),
    (_varint(4) + _varint(3) + b"\x91", "truncated copy"),
    (b"\x84", "truncated size header"),
])
def test_bad_deltas_are_refused(delta: bytes, why: str) -> None:
    with pytest.raises(ContextNotFound, match="binary delta for 'f' does not apply") as info:
        apply_delta(b"abcd", delta, "f")
    assert why in info.value.message


def test_the_blob_ids_binary_edits_are_checked_with_are_gits() -> None:
    assert git_blob_oid(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert git_blob_oid(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


@pytest.mark.parametrize("size", [0, 4, 8, 52, 4 * 16384 - 4, 4 * 16384, 4 * 16384 + 8, 300_000])
def test_b85decode_is_base64s(size: int) -> None:
    data = random.Random(size).randbytes(size)
    text = base64.b85encode(data)
    assert b85decode(text) == base64.b85decode(text) == data
    assert b85decode(b"|NsC0" * 3) == b"\xff" * 12, "the largest group"


@pytest.mark.parametrize("text", [b"|NsC1", b"~~~~~", b"0000 ", b"0000\"", b"00000" * 20000 + b"|NsC1"])
def test_b85decode_refuses_what_base64_refuses(text: bytes) -> None:
    with pytest.raises(ValueError):
        base64.b85decode(text)
    with pytest.raises(ValueError):
        b85decode(text)


def test_results_over_the_limit_are_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    import patcher.formats.binary as binary
    from patcher.errors import TooLarge

    monkeypatch.setattr(binary, "MAX_BINARY_BYTES", 1000)
    with pytest.raises(TooLarge) as info:
        apply_delta(b"abcd", _varint(4) + _varint(1001) + _copy(0, 4), "f")
    assert info.value.details == {"path": "f", "size": 1001, "limit": 1000}
    with pytest.raises(TooLarge):
        read_binary_hunks(encode_hunk("literal", bytes(1001)), 0, "x")
    assert read_binary_hunks(encode_hunk("literal", bytes(1000)), 0, "x")[0] == ("literal", bytes(1000))


def test_reverse_hunks_are_checked_as_a_stream() -> None:
    """A reverse hunk is inflated a chunk at a time and must still inflate to its stated size."""
    import tracemalloc

    big = bytes(32 << 20)  # 32 MiB of zeros: 32 KiB deflated
    lines = encode_hunk("literal", b"new") + encode_hunk("literal", big)
    tracemalloc.start()
    try:
        forward, reverse, _end = read_binary_hunks(lines, 0, "x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert forward == ("literal", b"new") and reverse == ("literal", b"")
    assert peak < 8 << 20, peak  # never held whole
    short = encode_hunk("literal", b"new") + encode_hunk("literal", big)
    short[len(encode_hunk("literal", b"new"))] = f"literal {len(big) - 1}\n".encode()
    with pytest.raises(ParseError, match="does not inflate"):
        read_binary_hunks(short, 0, "x")
    long = encode_hunk("literal", b"new") + encode_hunk("literal", big)
    long[len(encode_hunk("literal", b"new"))] = f"literal {len(big) + 1}\n".encode()
    with pytest.raises(ParseError, match="inflates to|does not inflate"):
        read_binary_hunks(long, 0, "x")


def test_one_inflate_budget_bounds_a_whole_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hunk under the per-file limit, together over it: refused before inflating the next."""
    import patcher.formats.binary as binary
    from patcher.errors import TooLarge
    from patcher.formats.binary import InflateBudget

    monkeypatch.setattr(binary, "MAX_BINARY_BYTES", 1000)
    budget = InflateBudget()
    hunk = encode_hunk("literal", bytes(600))
    assert read_binary_hunks(hunk, 0, "a", budget)[0] == ("literal", bytes(600))
    with pytest.raises(TooLarge) as info:
        read_binary_hunks(hunk, 0, "b", budget)
    assert info.value.details["total"] == 1200 and info.value.details["limit"] == 1000
    # Reverse hunks have an allowance of their own (checked, never held), bounded the same way.
    budget = InflateBudget()
    read_binary_hunks(encode_hunk("literal", b"x") + hunk, 0, "a", budget)
    with pytest.raises(TooLarge):
        read_binary_hunks(encode_hunk("literal", b"y") + hunk, 0, "b", budget)

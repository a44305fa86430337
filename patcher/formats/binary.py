"""Git's binary patches (``GIT binary patch``: ``literal``/``delta`` hunks), pure.

Each data line is a length byte (``A``-``Z`` = 1-26, ``a``-``z`` = 27-52) and
base-85 groups; the hunk's bytes are zlib data that inflate to exactly the
stated size; a ``delta`` is git's delta format against the old content.
These are git's rules (``apply.c``: ``parse_binary_hunk``; ``patch-delta.c``),
with one leniency: the blank line that ends a hunk may be missing at the end
of the patch (agents and mailers drop trailing blank lines).
"""

from __future__ import annotations

import zlib

from receipts.environ import env_int
from patcher.errors import ContextNotFound, ParseError, TooLarge
from patcher.matching import chomp

__all__ = ["BinaryHunk", "InflateBudget", "MAX_BINARY_BYTES", "read_binary_hunks", "apply_delta", "delta_result_size",
           "b85decode"]

#: The largest file a binary hunk may inflate to, or a delta may make (bytes).  The
#: patch's own limit does not bound them: deflated data and deltas are far smaller.
MAX_BINARY_BYTES = env_int("ONCEPATCH_MAX_BINARY_BYTES", 512 << 20)

#: (method, inflated bytes): method is ``"literal"`` or ``"delta"``.
BinaryHunk = tuple[str, bytes]

_STREAM_CHUNK = 1 << 20  # bytes a reverse hunk is inflated by at a time (checked, then dropped)


class InflateBudget:
    """The bytes one patch's binary hunks may inflate to, all files together.

    Forward hunks are held (they are the new content): at most
    :data:`MAX_BINARY_BYTES` in all.  Reverse hunks are only checked, inflated as
    a stream and dropped: at most as many again.  Without it, four zlib bombs
    of 512 MiB each (a few KiB of patch apiece) held 3 GiB.
    """

    __slots__ = ("held", "streamed", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = MAX_BINARY_BYTES if limit is None else limit
        self.held = 0
        self.streamed = 0

    def take(self, size: int, path: str, line: int | None, *, held: bool) -> None:
        """Reserve ``size`` inflated bytes before inflating them (``line``: the hunk's, if known).

        Raises:
            TooLarge: the patch's binary hunks would inflate past the limit.
        """
        total = (self.held if held else self.streamed) + size
        if total > self.limit:
            where = "" if line is None else f" (line {line})"
            raise TooLarge(f"binary data for '{path}'{where} would bring the patch's {'new' if held else 'reverse'} "
                           f"binary data to {total} bytes, over the limit of {self.limit} (ONCEPATCH_MAX_BINARY_BYTES)",
                           details=_with_line({"path": path, "size": size, "total": total, "limit": self.limit}, line))
        if held:
            self.held = total
        else:
            self.streamed = total


_B85 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"
_B85_DIGIT = bytes(_B85.index(c) if c in _B85 else 0xFF for c in range(256))
_B85_CHUNK = 5 * 16384  # characters decoded at a time (big integers that stay in cache)


def b85decode(text: bytes) -> bytes:
    """Base 85 (git's and RFC 1924's alphabet) to bytes: five characters to four bytes, big-endian.

    ``len(text)`` must be a multiple of 5.  The same result as
    :func:`base64.b85decode` on such input, about six times faster: each
    chunk's groups are evaluated at once, as 8-byte fields of one big integer
    (``((d0 * 85 + d1) * 85 + ...)``, fields never carry into each other).

    Raises:
        ValueError: a character outside the alphabet, or a group above 2**32 - 1.
    """
    out: list[bytes] = []
    for start in range(0, len(text), _B85_CHUNK):
        part = text[start:start + _B85_CHUNK]
        groups = len(part) // 5
        digits = part.translate(_B85_DIGIT)
        if b"\xff" in digits:
            raise ValueError("bad base-85 character")
        field = bytearray(8 * groups)
        total = 0
        for k in range(5):
            field[0::8] = digits[k::5]
            total = total * 85 + int.from_bytes(field, "little")
        raw = total.to_bytes(8 * groups, "little")
        if raw[4::8].count(0) != groups:  # 85**5 < 2**33: only a field's fifth byte can be set
            raise ValueError("base-85 group above 2**32 - 1")
        words = bytearray(4 * groups)
        for k in range(4):
            words[k::4] = raw[3 - k::8]  # each field's low four bytes, big-endian
        out.append(bytes(words))
    return b"".join(out)


def _length_byte(c: int) -> int:
    if 0x41 <= c <= 0x5A:  # A-Z
        return c - 0x41 + 1
    if 0x61 <= c <= 0x7A:  # a-z
        return c - 0x61 + 27
    return -1


def _read_hunk(lines: list[bytes], i: int, path: str, budget: InflateBudget,
               keep: bool = True) -> tuple[BinaryHunk | None, int]:
    """One ``literal``/``delta`` hunk at ``lines[i]``; ``(None, i)`` when ``lines[i]`` starts none.

    ``keep=False`` (a reverse hunk): the data is checked as a stream, never held
    whole; the hunk's bytes are returned empty.
    """
    if i >= len(lines):
        return None, i
    head = chomp(lines[i])
    method, _, size_text = head.partition(b" ")
    if method not in (b"literal", b"delta") or not size_text.isdigit():
        return None, i
    size = int(size_text) if len(size_text) <= 20 else MAX_BINARY_BYTES + 1
    start = i + 1
    if size > MAX_BINARY_BYTES:
        raise _too_large(path, size, i + 1)
    budget.take(size, path, i + 1, held=keep)

    def corrupt(at: int, why: str) -> ParseError:
        return ParseError(f"corrupt binary patch for '{path}' at line {at}: {why}",
                          details={"line": at, "path": path})

    bodies: list[bytes] = []
    lengths: list[int] = []
    j = start
    while j < len(lines):
        line = chomp(lines[j])
        if not line:
            j += 1  # the blank line that ends the hunk
            break
        n = _length_byte(line[0])
        groups, rest = divmod(len(line) - 1, 5)
        if n < 0 or rest or groups == 0:
            raise corrupt(j + 1, "not a base-85 data line")
        if not groups * 4 - 4 < n <= groups * 4:
            raise corrupt(j + 1, "the line's length byte does not fit its data")
        bodies.append(line[1:])
        lengths.append(n)
        j += 1
    # (The end of the patch ends the hunk as well as a blank line does.)
    try:
        decoded = b85decode(b"".join(bodies))
    except ValueError as exc:
        raise corrupt(start, f"bad base-85 data ({exc})") from None
    if any(n != len(body) // 5 * 4 for body, n in zip(bodies[:-1], lengths[:-1])):
        # Filler before the last line (git fills only the last): cut each line's own.
        parts: list[bytes] = []
        at = 0
        for body, n in zip(bodies, lengths):
            parts.append(decoded[at:at + n])
            at += len(body) // 5 * 4
        deflated = b"".join(parts)
    else:
        deflated = decoded[: sum(lengths)]
    try:
        data, got = _inflate(deflated, size, keep)
    except zlib.error as exc:
        raise corrupt(start, f"the data does not inflate to {size} bytes ({exc})") from None
    if got != size:
        raise corrupt(start, f"the data inflates to {got} bytes, not {size}")
    return (method.decode("ascii"), data), j


def _inflate(deflated: bytes, size: int, keep: bool) -> tuple[bytes, int]:
    """``deflated`` inflated (``b""`` unless ``keep``) and its inflated length, never past ``size + 1`` bytes.

    Raises:
        zlib.error: not zlib data, or more data than ``size``.
    """
    z = zlib.decompressobj()
    if keep:
        data = z.decompress(deflated, size + 1)
        got = len(data)
    else:
        data, got = b"", 0
        pending = deflated
        while True:  # one chunk at a time: a reverse hunk is checked, never held
            got += len(z.decompress(pending, _STREAM_CHUNK))
            pending = z.unconsumed_tail
            if got > size or z.eof or not pending:
                break
    if got > size or not z.eof or z.unconsumed_tail:
        raise zlib.error("more data than stated" if got > size else "incomplete or trailing data")
    return data, got


def _with_line(details: dict[str, object], line: int | None) -> dict[str, object]:
    return details if line is None else {**details, "line": line}


def _too_large(path: str, size: int, line: int | None = None) -> TooLarge:
    details = _with_line({"path": path, "size": size, "limit": MAX_BINARY_BYTES}, line)
    return TooLarge(f"binary data for '{path}' is {size} bytes, over the limit of {MAX_BINARY_BYTES} "
                    "(ONCEPATCH_MAX_BINARY_BYTES)", details=details)


def read_binary_hunks(lines: list[bytes], i: int, path: str,
                      budget: InflateBudget | None = None) -> tuple[BinaryHunk, BinaryHunk | None, int]:
    """The forward and (optional) reverse hunks after a ``GIT binary patch`` line.

    ``lines[i]`` is the line after ``GIT binary patch``.  Returns both hunks and
    the index of the first line after them.  The reverse hunk is checked (it
    inflates to its stated size) but not kept: its bytes are returned empty.
    ``budget`` is the patch's (a fresh one if ``None``).

    Raises:
        ParseError: no forward hunk, or a hunk that is not what git writes.
        TooLarge: a hunk states more than :data:`MAX_BINARY_BYTES`, or the
            patch's hunks together more than ``budget`` allows.
    """
    if budget is None:
        budget = InflateBudget()
    forward, j = _read_hunk(lines, i, path, budget)
    if forward is None:
        raise ParseError(f"binary patch for '{path}' at line {i} has no 'literal' or 'delta' hunk",
                         details={"line": i, "path": path})
    reverse, j = _read_hunk(lines, j, path, budget, keep=False)
    return forward, reverse, j


def _varint(delta: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(delta):
            raise ValueError("truncated size header")
        c = delta[at]
        at += 1
        value |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return value, at


def delta_result_size(delta: bytes) -> int:
    """The size a git delta says its result has (0 if its header is cut: :func:`apply_delta` says why)."""
    try:
        return _varint(delta, _varint(delta, 0)[1])[0]
    except ValueError:
        return 0


def apply_delta(src: bytes, delta: bytes, path: str) -> bytes:
    """Apply a git delta (``patch-delta.c``) to ``src``.

    Raises:
        ContextNotFound: the delta was made against other bytes (sizes differ,
            a copy reaches past the source, the result has the wrong size).
        TooLarge: the result would be over :data:`MAX_BINARY_BYTES`.
    """
    def bad(why: str) -> ContextNotFound:
        return ContextNotFound(f"binary delta for '{path}' does not apply to its current content: {why}",
                               details={"path": path})

    try:
        src_size, at = _varint(delta, 0)
        dst_size, at = _varint(delta, at)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if src_size != len(src):
        raise bad(f"it expects {src_size} bytes, the file has {len(src)}")
    if dst_size > MAX_BINARY_BYTES:
        raise _too_large(path, dst_size)
    out = bytearray(dst_size)
    n = 0  # bytes of out written
    view = memoryview(src)
    top = len(delta)
    while at < top:
        cmd = delta[at]
        at += 1
        if cmd & 0x80:
            fields = [0, 0]  # offset (four bytes), size (three)
            for k, bit in enumerate((0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40)):
                if cmd & bit:
                    if at >= top:
                        raise bad("truncated copy")
                    fields[k // 4] |= delta[at] << (8 * (k % 4))
                    at += 1
            offset, size = fields[0], fields[1] or 0x10000
            if offset + size > src_size or n + size > dst_size:
                raise bad("a copy reaches past the data")
            out[n:n + size] = view[offset:offset + size]
            n += size
        elif cmd:
            if n + cmd > dst_size or at + cmd > top:
                raise bad("an insert reaches past the data")
            out[n:n + cmd] = delta[at:at + cmd]
            n += cmd
            at += cmd
        else:
            raise bad("opcode 0")
    if n != dst_size:
        raise bad(f"the result has {n} bytes, the delta says {dst_size}")
    return bytes(out)

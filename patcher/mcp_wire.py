"""The MCP server's stdio wire: one JSON-RPC message a line in, each one answered.

The SDK's stdio transport reads stdin as UTF-8 with ``errors="replace"`` and
drops, without a word, every line it cannot read as a JSON-RPC message.  An
agent's client then waits for an answer that never comes, and a patch sent
with a byte that is not UTF-8 is committed with U+FFFD in its place: another
change than the one sent.  So the server owns its standard streams and puts
this wire between them and the SDK (docs/AGENTS.md, "The wire"):

* every line is checked before the SDK sees it; one that is not a message
  is answered here with JSON-RPC's error (``-32700`` not UTF-8 or not JSON,
  ``-32600`` anything else: a batch, an id that is neither a string nor an
  integer, a request before ``initialize`` (unless it carries the
  2026-07-28 protocol's per-request version, which has no handshake), a line over :func:`max_line`
  bytes) and the server reads on;
* a ``tools/call`` naming an argument its tool does not take is answered
  with a tool error (``check_call``): a misspelt ``branch`` would otherwise
  commit to the default branch;
* when stdin ends, the SDK is told only once every request it was given is
  answered (or cancelled): a client that writes its requests and closes
  stdin still reads every outcome, and a call never ends unanswered
  because its input ended before its effect did;
* only whole lines that are JSON-RPC messages reach stdout, under one lock, so
  the answers written here never tear the SDK's; anything else written to
  ``sys.stdout`` goes to stderr.

Standard streams: fd 0 and fd 1 are moved to private descriptors, fd 0 then
reads ``/dev/null`` and fd 1 writes to stderr while the server runs (a child
process can neither read the wire nor write to it), and ``sys.stdin`` /
``sys.stdout`` are this wire's, which the SDK then uses as it finds them.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from cas.errors import UsageError, clip
from receipts import jsonio

__all__ = ["PARSE_ERROR", "INVALID_REQUEST", "Wire", "claim_stdio", "max_line"]

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
_CHUNK = 1 << 20
_UNGATED = frozenset({"initialize", "ping"})
#: A request of the 2026-07-28 protocol carries its version here (``mcp_types.PROTOCOL_VERSION_META_KEY``).
_MODERN_META_KEY = "io.modelcontextprotocol/protocolVersion"

log = logging.getLogger("oncepatch.mcp")

#: ``check_call(tool name, arguments)``: the ``tools/call`` result to answer instead, or None to let it run.
CheckCall = Callable[[str, dict[str, Any]], "dict[str, Any] | None"]


def max_line() -> int:
    """The longest line read: any patch the apply takes fits, however JSON escapes it (``\\u00XX``: 6 bytes a byte)."""
    from patcher.args import MAX_PATCH_BYTES

    return 6 * MAX_PATCH_BYTES + (64 << 10)


def _valid_id(doc: Any) -> str | int | None:
    """The id of a parsed message, if it is one an answer can carry (MCP: a string or an integer)."""
    if isinstance(doc, dict):
        rid = doc.get("id")
        if isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool)):
            return rid
    return None


def _id_key(rid: Any) -> tuple[str, Any]:
    return (type(rid).__name__, rid)


class Wire:
    """The checks between the client's lines and the SDK; :attr:`reader` and :attr:`writer` are its two ends."""

    def __init__(self, in_fd: int, out_fd: int, *, validate: Callable[[bytes], Any],
                 check_call: CheckCall | None = None, limit: int | None = None) -> None:
        self.in_fd = in_fd
        self.out_fd = out_fd
        self.validate = validate
        self.check_call = check_call
        self.limit = max_line() if limit is None else limit
        self._initialized = False
        self._pending: Counter[tuple[str, Any]] = Counter()
        self._cond = threading.Condition()
        self._out_lock = threading.Lock()
        self._out_partial = bytearray()
        self._out_broken = False
        self._in_buf = bytearray()
        self._in_eof = False
        self.reader = _Reader(self)
        self.writer = _Writer(self)

    # -- in ------------------------------------------------------------------

    def next_line(self) -> bytes:
        """The next line for the SDK (with its newline), or ``b""`` at the end once nothing is pending."""
        while True:
            line = self._read_line()
            if line is None:
                with self._cond:
                    while self._pending and not self._out_broken:
                        self._cond.wait()
                return b""
            admitted = self.admit(line)
            if admitted is not None:
                return admitted + b"\n"

    def _read_line(self) -> bytes | None:
        """One line from stdin without its newline; one over the limit is read through and answered as too long."""
        skipped = 0
        scanned = 0  # bytes of the buffer known to hold no newline: each byte is looked at once
        while True:
            nl = self._in_buf.find(b"\n", scanned)
            if nl >= 0:
                line = bytes(self._in_buf[:nl])
                del self._in_buf[:nl + 1]
                if skipped:
                    self._too_long(skipped + len(line))
                    skipped = scanned = 0
                    continue
                return line
            scanned = len(self._in_buf)
            if scanned > self.limit:  # read on to its newline, keeping nothing
                skipped += scanned
                self._in_buf.clear()
                scanned = 0
            if self._in_eof:
                rest = bytes(self._in_buf)
                self._in_buf.clear()
                if skipped:
                    self._too_long(skipped + len(rest))
                    return None
                return rest if rest.strip() else None
            chunk = os.read(self.in_fd, _CHUNK)
            if not chunk:
                self._in_eof = True
            self._in_buf += chunk

    def _too_long(self, size: int) -> None:
        self.answer_error(None, INVALID_REQUEST, f"message is {size} bytes, over the limit of {self.limit}")

    def admit(self, line: bytes) -> bytes | None:
        """``line`` if the SDK may have it; None when it was answered here (or is blank)."""
        if not line.strip():
            return None
        try:
            validated = self.validate(line)  # pydantic's JSON reader refuses bytes that are not UTF-8 too
        except Exception:  # noqa: BLE001 - the SDK's validator raises pydantic's errors: classified below
            self._refuse_unreadable(line)
            return None
        msg = getattr(validated, "root", validated)  # SDK 1.x: a RootModel
        method = getattr(msg, "method", None)
        if method is not None:
            # The SDK's reader (as orjson) keeps the last of a member given twice: a call naming
            # "branch" twice would run on whichever came last.  Refused instead (docs/DECISIONS.md).
            try:
                jsonio.loads_unique(line)
            except jsonio.DuplicateMember as exc:
                self._refuse_duplicate(msg, method, exc)
                return None
            except jsonio.JsonError:
                pass  # read by the SDK's validator: what it holds is the SDK's to judge
        has_id = hasattr(msg, "id") and method is not None
        if method is not None and not has_id:  # a notification, or a request whose id the SDK ignored
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError:
                doc = {}
            if isinstance(doc, dict) and "id" in doc:
                self.answer_error(None, INVALID_REQUEST, "the id must be a string or an integer, "
                                  f"not {type(doc['id']).__name__ if doc['id'] is not None else 'null'}")
                return None
            if method == "notifications/cancelled":
                params = getattr(msg, "params", None) or {}
                self._settle(params.get("requestId"))
            return line
        if not has_id:
            return line  # a client's answer to a request of the server's
        rid = msg.id
        params = getattr(msg, "params", None) or {}
        meta = params.get("_meta")
        if isinstance(meta, dict) and _MODERN_META_KEY in meta:
            self._initialized = True  # the 2026-07-28 protocol: no handshake, every request says its version
        if method not in _UNGATED and not self._initialized:
            self.answer_error(rid, INVALID_REQUEST, f"the server is not initialized: send 'initialize' before '{clip(method)}'")
            return None
        if method == "initialize":
            self._initialized = True
        if method == "tools/call" and self.check_call is not None and isinstance(params.get("arguments"), dict):
            refused = self.check_call(str(params.get("name")), params["arguments"])
            if refused is not None:
                self._emit({"jsonrpc": "2.0", "id": rid, "result": refused})
                return None
        with self._cond:
            self._pending[_id_key(rid)] += 1
        return line

    def _refuse_duplicate(self, msg: Any, method: str, exc: jsonio.DuplicateMember) -> None:
        rid = getattr(msg, "id", None)
        if method != "tools/call" or rid is None:
            self.answer_error(rid, INVALID_REQUEST, f"{exc}: send each member once")
            return
        arguments = (getattr(msg, "params", None) or {}).get("arguments")
        key = arguments.get("idempotency_key") if isinstance(arguments, dict) else None
        err = UsageError(f"{exc}: which one was meant is not the server's to guess; send each member once",
                         key=key if isinstance(key, str) else None,
                         details={"reason": "duplicate_member", "member": clip(exc.name)})
        doc = {"ok": False, "error": err.envelope()}
        self._emit({"jsonrpc": "2.0", "id": rid, "result": {
            "content": [{"type": "text", "text": orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()}],
            "structuredContent": doc, "isError": True}})

    def _refuse_unreadable(self, line: bytes) -> None:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.answer_error(self._lenient_id(line), PARSE_ERROR,
                              f"message is not valid UTF-8 (byte {exc.start}): JSON-RPC messages are UTF-8")
            return
        try:
            doc = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            self.answer_error(None, PARSE_ERROR, f"message is not JSON: {exc}")
            return
        if isinstance(doc, list):
            self.answer_error(None, INVALID_REQUEST, "batches are not supported: send one message a line")
        elif not isinstance(doc, dict) or doc.get("jsonrpc") != "2.0":
            self.answer_error(_valid_id(doc), INVALID_REQUEST, "not a JSON-RPC 2.0 message: an object with "
                              "'jsonrpc': '2.0' and a 'method' (or a 'result' or 'error' with its 'id')")
        else:
            self.answer_error(_valid_id(doc), INVALID_REQUEST, "not a JSON-RPC 2.0 message the server reads "
                              "(method, id and params of the types JSON-RPC gives them)")

    @staticmethod
    def _lenient_id(line: bytes) -> str | int | None:
        try:
            return _valid_id(orjson.loads(line.decode("utf-8", "replace")))
        except orjson.JSONDecodeError:
            return None

    def _settle(self, rid: Any) -> None:
        with self._cond:
            k = _id_key(rid)
            if self._pending[k] > 0:
                self._pending[k] -= 1
                if self._pending[k] == 0:
                    del self._pending[k]
            self._cond.notify_all()

    # -- out -----------------------------------------------------------------

    def answer_error(self, rid: str | int | None, code: int, message: str) -> None:
        log.info("refused a message: %s", message)
        self._emit({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}})

    def _emit(self, doc: dict[str, Any]) -> None:
        with self._out_lock:
            self._send(orjson.dumps(doc) + b"\n")

    def write(self, data: bytes) -> None:
        """Bytes the SDK wrote: each whole line goes out at once (a message) or to the log (anything else)."""
        with self._out_lock:
            self._out_partial += data
            end = self._out_partial.rfind(b"\n")
            if end < 0:
                return
            lines = bytes(self._out_partial[:end + 1])
            del self._out_partial[:end + 1]
            for line in lines.splitlines(keepends=True):
                try:
                    # The SDK's reader, not orjson: an id past 64 bits must compare equal to the request's
                    # (orjson reads it as a float, and stdin's end would wait for it for ever).
                    validated = self.validate(line)
                except Exception:  # noqa: BLE001 - pydantic's errors: the line is no message
                    if line.strip():
                        log.warning("kept off the wire (not a message): %r", line[:200])
                    continue
                msg = getattr(validated, "root", validated)
                self._send(line)
                if getattr(msg, "method", None) is None and hasattr(msg, "id"):  # a response or an error
                    self._settle(msg.id)

    def _send(self, data: bytes) -> None:
        """Write ``data`` whole (the caller holds the output lock); a client gone from stdout ends the waiting."""
        if self._out_broken:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.out_fd, view):]
        except OSError as exc:
            log.warning("stdout is gone (%s): answers are dropped from now on", exc)
            with self._cond:
                self._out_broken = True
                self._cond.notify_all()


class _Reader(io.RawIOBase):
    def __init__(self, wire: Wire) -> None:
        super().__init__()
        self.wire = wire
        self._line = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if not self._line:
            self._line = memoryview(self.wire.next_line())
        n = min(len(b), len(self._line))
        b[:n] = self._line[:n]
        self._line = self._line[n:]  # a view: a long line is copied out once, not once per chunk
        return n


class _Writer(io.RawIOBase):
    def __init__(self, wire: Wire) -> None:
        super().__init__()
        self.wire = wire

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.wire.write(data)
        return len(data)


@contextlib.contextmanager
def claim_stdio(*, validate: Callable[[bytes], Any], check_call: CheckCall | None = None) -> Iterator[Wire]:
    """While it lasts: the wire on private copies of fd 0 and 1, fd 0 on ``/dev/null``, fd 1 on stderr,
    ``sys.stdin`` and ``sys.stdout`` the wire's; everything put back after."""
    in_fd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    out_fd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    saved = sys.stdin, sys.stdout
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            os.dup2(null, 0)
        finally:
            os.close(null)
        os.dup2(2, 1)
        wire = Wire(in_fd, out_fd, validate=validate, check_call=check_call)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(wire.reader, _CHUNK), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(wire.writer, _CHUNK), encoding="utf-8")
        yield wire
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stdin, sys.stdout = saved
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        os.close(in_fd)
        os.close(out_fd)

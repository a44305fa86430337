"""The API client's and the MCP server's calls sent to a running ``oncepatch serve`` (or broker).

A call (``apply``, ``status``, ``recover``, ``verify``) goes over the CLI's
own wire (:mod:`patcher.connect`) as the CLI's command line — ``apply - --json --key K --repo R …`` with the patch on its
standard input — so the server runs the very code the CLI runs, judges the
caller by ``SO_PEERCRED`` and, as a broker, writes and signs with its own
user and key.  Its standard input, output and error are anonymous in-memory
files (``memfd``); the answer is the JSON envelope the call printed, which
:mod:`patcher.api` turns back into the in-process result or error.

Choosing is the CLI's: ``never`` runs in process, ``auto`` uses a running
server of this version and else runs in process, ``start`` also starts one
for the next call, ``require`` fails (``io_error``, ``not_started``) without
one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from cas.errors import OncepatchError, UsageError
from receipts import jsonio
from patcher import connect

__all__ = ["choose", "run"]


def choose(server: str | None) -> str:
    """The mode of a client: ``server`` if given, else ``$ONCEPATCH_SERVER``, else ``auto``.

    Raises:
        UsageError: not one of auto, never, require, start.
    """
    how = server if server is not None else (os.environ.get("ONCEPATCH_SERVER") or "auto")
    if how not in connect.MODES:
        raise UsageError(f"ONCEPATCH_SERVER (or server=) must be one of {', '.join(connect.MODES)}, not '{how}'")
    return how


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def run(argv: Sequence[str], how: str, *, stdin: bytes = b"", cwd: str = ".") -> dict[str, Any] | None:
    """Send ``argv`` (a command that prints one JSON envelope) to the server: the envelope, or None.

    None: run the call in process instead (``never``; no server under
    ``auto``/``start``; refused before it ran; or a read whose server went
    away, which is safe to run again).  ``cwd``: the folder the call runs in.

    Raises:
        OncepatchError: ``require`` without a server (``io_error``, ``not_started``); an ``apply``
            whose server or process ended without answering (``unknown``, ``next_action: recover``).
    """
    if how == "never" or os.environ.get("ONCEPATCH_PAUSE_AT"):
        return None
    fds = (_memfd("oncepatch-in", stdin), _memfd("oncepatch-out"), _memfd("oncepatch-err"),
           os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    try:
        try:
            started, last = connect.exchange(list(argv), how, fds)
        except connect.NoServer as exc:
            if how == "require":
                raise OncepatchError(f"{exc} (ONCEPATCH_SERVER=require)", retryable=True,
                                     effect_status="not_started", next_action="retry", error_type="io_error") from None
            return None
        out, err = _read_all(fds[1]), _read_all(fds[2])
    finally:
        for fd in fds:
            os.close(fd)
    is_apply = bool(argv) and argv[0] == "apply"
    if last is not None and last[0] == "X":
        try:
            doc = jsonio.loads(out.strip().splitlines()[-1])
        except (jsonio.JsonError, IndexError):
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("ok"), bool):
            return doc
        raise OncepatchError(f"the oncepatch server's call answered no envelope (exit {last[1:]}): "
                             f"{err.decode('utf-8', 'replace').strip()[-500:]}",
                             effect_status="unknown" if is_apply else "not_started",
                             next_action="recover" if is_apply else "retry", retryable=not is_apply)
    if last is not None and last[0] == "D":
        raise OncepatchError(f"the oncepatch server's call process ended with status {last[1:]} before answering",
                             retryable=False, effect_status="unknown" if is_apply else "not_started",
                             next_action="recover" if is_apply else "retry", error_type="unknown")
    if not started:
        if how == "require":
            reason = last[1:] if last is not None else "it closed the connection"
            raise OncepatchError(f"the oncepatch server refused the call: {reason}", retryable=True,
                                 effect_status="not_started", next_action="retry", error_type="io_error")
        return None
    if not is_apply:
        return None
    raise OncepatchError("the oncepatch server ended during the call: whether it committed is not known here",
                         retryable=False, effect_status="unknown", next_action="recover", error_type="unknown")

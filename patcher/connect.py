"""The CLI's thin client: one command sent to a running ``oncepatch serve`` (docs/AGENTS.md).

Loaded first by every ``oncepatch`` process, so it imports only ``os``,
``sys``, ``stat`` and ``_socket`` (the C half of ``socket``: the Python half
loads ``enum``, ``selectors`` and ``io`` helpers, 3-10 ms a call).  ``apply``, ``status``, ``verify``,
``recover`` and ``log`` go to the server of this very version when one
listens; every other command, and every call that finds no such server, runs
in process (:mod:`patcher.cli.run`), exactly as the server would run it.

The wire (``oncepatch-serve/1``): the client sends one frame — a 4-byte
length, then NUL-separated fields: the protocol name, the version token,
the umask, the argument count, the arguments, then ``NAME=value`` of its
environment — with its standard input, output and error and its working
folder passed as file descriptors (``SCM_RIGHTS``).  The server answers with
lines: ``A`` (the call runs now), ``X<code>`` (it ended with this exit
status), ``D<status>`` (the process running it died with this status, no
answer given), ``R<reason>`` (refused before anything ran).

Choosing: ``--no-server`` or ``ONCEPATCH_SERVER=never`` runs in process;
``auto`` (the default) uses a running server and else runs in process;
``start`` is ``auto`` that also starts a server in the background for the
next call; ``require`` fails (exit 5, ``io_error``) when no server answers.
A call with a pause point armed (``ONCEPATCH_PAUSE_AT``, a test facility)
always runs in process: the point stops the process its caller started.
"""

from __future__ import annotations

import _socket
import os
import stat
import sys

TYPE_CHECKING = False  # (typing's would load typing: mypy takes any TYPE_CHECKING as true)
if TYPE_CHECKING:
    from typing import NoReturn

__all__ = ["COMMANDS", "PROTOCOL", "NoServer", "call", "exchange", "leave", "mode", "socket_dir", "socket_path",
           "version_token"]

#: The commands a server answers (the others always run in process).
COMMANDS = frozenset({"apply", "status", "verify", "recover", "log"})
MODES = ("auto", "never", "require", "start")
PROTOCOL = b"oncepatch-serve/1"
_PACKAGES = ("cas", "receipts", "patcher")
_TOKEN_MODULUS = (1 << 64) - 59  # the largest prime below 2**64


class NoServer(Exception):
    """No usable server: nothing was sent that ran."""


def version_token() -> str:
    """What a server must share with this client to be used: interpreter, install and every source file.

    Edited source, another interpreter or another install is another token,
    so another socket: a server of another version is never asked.  The
    limits read from the environment at import time (``ONCEPATCH_MAX_*``)
    are part of it too.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding cas/, receipts/, patcher/
    parts = [sys.version, sys.prefix, root]
    # Each folder's files, then its subfolders, in name order (as os.walk would, top
    # down): os.scandir's entries carry their type, so only the .py files are stat'ed.
    folders = [os.path.join(root, pkg) for pkg in reversed(_PACKAGES)]
    while folders:
        folder = folders.pop()
        with os.scandir(folder) as found:
            entries = sorted(found, key=lambda e: e.name)
        rel = folder[len(root):]
        subfolders = []
        for entry in entries:
            if entry.name.endswith(".py") and not entry.is_dir():
                st = entry.stat()
                parts.append(f"{rel}/{entry.name}:{st.st_mtime_ns}:{st.st_size}")
            elif entry.name != "__pycache__" and entry.is_dir():
                subfolders.append(entry.path)
        folders += reversed(subfolders)
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("ONCEPATCH_MAX_"))
    data = "\0".join(parts).encode("utf-8", "surrogateescape")
    # 64 bits of the bytes without a hash module (zlib's import cost 0.4-1 ms of every
    # served call): them as one number (after a 1, so that no leading byte is lost),
    # modulo the prime 2**64 - 59.
    digest = int.from_bytes(b"\1" + data, "big") % _TOKEN_MODULUS
    return f"{digest:016x}"


def socket_dir() -> tuple[str, bool]:
    """The server's folder, and whether it was named explicitly (``ONCEPATCH_SERVER_DIR``)."""
    given = os.environ.get("ONCEPATCH_SERVER_DIR")
    if given:
        return os.path.abspath(given), True
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "oncepatch"), False
    return f"/tmp/oncepatch-{os.getuid()}", False


def socket_path(folder: str, token: str) -> str:
    return os.path.join(folder, f"oncepatch-{token}.sock")


def trusted(folder: str, explicit: bool) -> bool:
    """Whether a server's folder may be used: ours and private (0700), or, named explicitly, not writable by others."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if explicit:  # a broker's folder: its owner's, and nobody else may put a socket there
        return st.st_mode & 0o022 == 0
    return st.st_uid == os.getuid() and st.st_mode & 0o077 == 0


def mode(argv: list[str]) -> str:
    if "--no-server" in argv:
        return "never"
    value = os.environ.get("ONCEPATCH_SERVER") or "auto"
    return value if value in MODES else "invalid"


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _request(token: str, argv: list[str]) -> bytes:
    fields = [PROTOCOL, token.encode(), str(_umask()).encode(), str(len(argv)).encode()]
    fields += [os.fsencode(a) for a in argv]
    fields += [k + b"=" + v for k, v in os.environb.items()]
    payload = b"\0".join(fields)
    return len(payload).to_bytes(4, "big") + payload


def _connect(path: str) -> _socket.socket:
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        # Non-blocking: a full backlog (or a stopped server) answers EAGAIN at once
        # instead of keeping the caller waiting; the call then runs in process.
        s.setblocking(False)
        s.connect(path)
        s.setblocking(True)
    except OSError as exc:
        s.close()
        raise NoServer(str(exc)) from exc
    return s


def _send(s: _socket.socket, data: bytes, fds: tuple[int, int, int, int] | None) -> None:
    cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if fds is None else -1
    try:
        passed = fds if fds is not None else (0, 1, 2, cwd)
        rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in passed)  # (socket.send_fds)
        sent = s.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
        if sent < len(data):
            s.sendall(data[sent:])
    except OSError as exc:  # a closed standard stream, a server gone between connect and send
        raise NoServer(str(exc)) from exc
    finally:
        if cwd >= 0:
            os.close(cwd)


def _answers(s: _socket.socket) -> tuple[bool, str | None]:
    """Read the server's lines: (whether the call started, the last line) — None at end of stream."""
    started = False
    buf = b""
    while True:
        try:
            chunk = s.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            return started, None
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode("utf-8", "replace")
            if text == "A":
                started = True
            elif text[:1] in ("X", "D", "R"):
                return started, text


def _start_background() -> None:
    """Start a server for the next call (``ONCEPATCH_SERVER=start``); this call runs in process."""
    import subprocess

    try:
        subprocess.Popen([sys.executable, "-m", "patcher.cli", "serve"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         close_fds=True)
    except OSError:
        pass


def _fail(argv: list[str], kind: str, message: str, *, effect_status: str, next_action: str, code: int,
          retryable: bool) -> int:
    """An error the client answers itself, in the CLI's envelope."""
    if "--json" in argv:
        import json

        err = {"type": kind, "message": message, "retryable": retryable, "effect_status": effect_status,
               "key": None, "next_action": next_action}
        try:
            sys.stdout.write(json.dumps({"ok": False, "error": err}, separators=(",", ":")) + "\n")
            sys.stdout.flush()
        except (OSError, ValueError) as exc:
            # Standard output that takes no bytes (a full disk, EIO, a reader gone): the exit
            # status is still this error's, as patcher.cli.run's _emit keeps a call's.
            try:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)  # what is left in the buffer is flushed there at exit
                os.close(null)
                sys.stderr.write(f"oncepatch: cannot write to standard output: {exc}\n")
            except (OSError, ValueError):
                pass
    else:
        try:
            sys.stderr.write(f"oncepatch: {kind}: {message}\n")
        except (OSError, ValueError):
            pass
    return code


def exchange(argv: list[str], how: str, fds: tuple[int, int, int, int] | None = None) -> tuple[bool, str | None]:
    """Send one call to the server of this version: (whether it started, its last answer line; None: none).

    ``fds``: the call's standard input, output, error and working folder
    (default: this process's own 0, 1, 2 and ``.``) — how the API client and
    the MCP server hand a call over (:mod:`patcher.remote`).

    Raises:
        NoServer: no usable server answered (``start``: one is started for the next call); nothing ran.
    """
    token = version_token()
    folder, explicit = socket_dir()
    path = socket_path(folder, token)
    try:
        if not trusted(folder, explicit):
            raise NoServer(f"no private server folder '{folder}'")
        s = _connect(path)
    except NoServer as exc:
        if how == "start":
            _start_background()
        raise NoServer(f"no oncepatch server of this version at '{path}': {exc}") from exc
    try:
        try:
            _send(s, _request(token, argv), fds)
        except NoServer:  # refused at once (its reason may be waiting), or gone: nothing ran
            pass
        return _answers(s)
    finally:
        s.close()


def _standard_fds_open() -> bool:
    """Whether descriptors 0, 1 and 2 are open (a caller may start this process with one closed)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return False
    return True


def call(argv: list[str]) -> int | None:
    """Run ``argv`` through a server: its exit status, or None to run it in process instead."""
    how = mode(argv)
    if how == "invalid":
        return _fail(argv, "usage", f"ONCEPATCH_SERVER must be one of {', '.join(MODES)}, not "
                     f"'{os.environ.get('ONCEPATCH_SERVER')}'", effect_status="not_started",
                     next_action="fix_input", code=2, retryable=False)
    if how == "never" or not argv or argv[0] not in COMMANDS:
        return None
    if os.environ.get("ONCEPATCH_PAUSE_AT"):
        return None  # a pause point stops the process running the call: its caller watches this one
    if not _standard_fds_open():
        return None  # the socket would take the closed number and be passed as the call's own stream
    try:
        started, last = exchange(argv, how)
    except NoServer as exc:
        if how == "require":
            return _fail(argv, "io_error", f"{exc} (ONCEPATCH_SERVER=require)", effect_status="not_started",
                         next_action="retry", code=5, retryable=True)
        return None
    if last is not None and last[0] == "X":
        return int(last[1:])
    if last is not None and last[0] == "D":
        sys.stderr.write(f"oncepatch: the server's call process ended with status {last[1:]} before answering; "
                         "run 'oncepatch recover' before anything else\n")
        return int(last[1:])
    if not started:  # refused, or the server went away before the call ran: nothing ran
        if how == "require":
            reason = last[1:] if last is not None else "it closed the connection"
            return _fail(argv, "io_error", f"the oncepatch server refused the call: {reason}",
                         effect_status="not_started", next_action="retry", code=5, retryable=True)
        return None
    if argv[0] != "apply":  # reads and recover are safe to run again: run it here
        return None
    return _fail(argv, "unknown", "the oncepatch server ended during the call: whether it committed is not "
                 "known here", effect_status="unknown", next_action="recover", code=5, retryable=False)


def leave(code: int) -> NoReturn:
    """End this client process with the server's exit status, without the interpreter's finalization.

    Nothing of this process needs finalizing: the call ran in the server, which
    wrote its answer to this process's own descriptors, and the client starts no
    thread and registers no ``atexit`` handler.  Tearing down the interpreter's
    modules and objects would cost 2-3 ms of a 30 ms call (docs/BENCHMARKS.md,
    issue 27).  Its own buffered text is flushed first; a flush that fails (a
    closed pipe) exits 120, as the interpreter's own shutdown would.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            code = 120
    os._exit(code)

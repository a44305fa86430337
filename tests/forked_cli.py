"""``python -m patcher.cli`` without paying the interpreter's start-up on every call.

Most integration tests run the CLI as a real process and read its exit code
and output (:func:`conftest.run_cli`).  Starting Python and importing
oncepatch (pygit2, libgit2, the formats, the MCP server) costs about 0.4 s of
CPU per call, which was most of the suite's time.  Here a **fork server**
imports ``patcher.cli`` once; each call is a child forked from it, which then
runs ``patcher.cli``'s ``__main__`` exactly as ``python -m patcher.cli`` would:

* it is a process of its own (own pid, own locks, killed by ``os._exit``
  crash points without taking the tests with it), reaped by a middle process
  that reports its exit status (negative for a signal, as ``subprocess`` says);
* its stdin, stdout and stderr are pipes, like ``subprocess.run``'s; its
  working directory, environment, umask and ``sys.argv``/``sys.path[0]`` are
  the caller's, as for a fresh ``python -m``; libgit2's configuration search
  paths (read from ``HOME`` at import) are guessed again from the new
  environment — taken the way ``oncepatch serve``'s workers take a caller's
  (:mod:`patcher.cli.server`), with the same code; at exit it joins its threads, runs atexit and flushes, like
  the interpreter's own shutdown;
* what the server cannot reproduce it does not fake: a call whose environment
  changes a variable that the imports read (``ONCEPATCH_MAX_*`` limits, found
  by recording the reads) or one that Python reads at start-up (``PYTHON*``,
  the locale) runs as a real ``python -m patcher.cli`` process instead.

The one difference left is the string hash seed, shared by the calls of one
server (a fresh interpreter draws its own).  ``ONCEPATCH_TEST_FORK=0`` turns
the server off: every call is then a real process (``scripts/test`` runs
that way with ``--no-fork-cli``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV_SWITCH = "ONCEPATCH_TEST_FORK"
_STARTUP_PREFIXES = ("PYTHON", "LC_")
_STARTUP_NAMES = {"LANG", "LANGUAGE"}
_ROOT = Path(__file__).resolve().parent.parent


# Read once, at import: the tests' hermetic fixture takes every ONCEPATCH_* variable away.
_ENABLED = os.environ.get(ENV_SWITCH, "1") != "0"


def enabled() -> bool:
    return _ENABLED


# -- the server (runs in its own process: ``python forked_cli.py``) ------------------------------------


def _serve() -> None:
    import runpy
    import traceback

    # Record the variables the imports read: a call that changes one of them cannot share them.
    environ_type = type(os.environ)
    real_getitem = environ_type.__getitem__
    read: set[str] = set()

    def recording(self: Any, key: str) -> Any:
        read.add(key)
        return real_getitem(self, key)

    environ_type.__getitem__ = recording  # type: ignore[method-assign]
    try:
        import patcher.cli.run  # noqa: F401  (the in-process CLI; patcher.cli's __main__ is run by runpy in each child)
    finally:
        environ_type.__getitem__ = real_getitem  # type: ignore[method-assign]
    from patcher.cli import server

    base_env = dict(os.environ)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + sys.argv[1])
    sock.listen(64)
    hello = {"read": sorted(k for k in read if not k.startswith(_STARTUP_PREFIXES)), "env": base_env}
    sys.stdout.write(json.dumps(hello) + "\n")
    sys.stdout.flush()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the middles are reaped by the kernel

    def run_child(req: dict[str, Any], fds: list[int]) -> None:
        """In the forked child: become ``python -m patcher.cli <argv>`` and exit as it would."""
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        os.chdir(req["cwd"])
        os.umask(req["umask"])
        # As the server's workers take a caller's: the environment, the time zone, libgit2's
        # configuration search paths guessed again from this HOME, and the standard streams.
        server._take_environment({os.fsencode(k): os.fsencode(v) for k, v in req["env"].items()}, broker=False)
        server._standard_streams()
        sys.path[0] = req["cwd"]
        sys.argv = ["-m", *req["argv"]]
        code: int = 0
        try:
            runpy.run_module("patcher.cli", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code & 0xFF
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        # The interpreter's shutdown: join the threads, atexit, flush.
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BrokenPipeError:
                code = 120
        os._exit(code)

    stdin_fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([sock, stdin_fd], [], [])
        if stdin_fd in ready and not os.read(stdin_fd, 1):
            return  # the tests' process is gone
        if sock not in ready:
            continue
        conn, _ = sock.accept()
        msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        size = struct.unpack("!I", msg[:4])[0]
        body = msg[4:]
        while len(body) < size:
            body += conn.recv(size - len(body))
        req = json.loads(body)
        if os.fork() == 0:  # the middle: forks the call, reports its pid and its exit status
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (ignored, waitpid would find no child)
            sock.close()
            pid = os.fork()
            if pid == 0:
                conn.close()
                run_child(req, list(fds))
            for fd in fds:
                os.close(fd)
            conn.sendall(b"%d\n" % pid)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            conn.sendall(b"%d\n" % code)
            os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()


# -- the client (in the tests' process) ----------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        self.name = f"oncepatch-tests-{os.getpid()}-{os.urandom(6).hex()}"
        env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), self.name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=_ROOT, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the CLI fork server did not start")
        hello = json.loads(line)
        self.read: list[str] = hello["read"]
        self.env: dict[str, str] = hello["env"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_server: _Server | None = None
_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    with _lock:
        if _server is None or not _server.alive():
            _server = _Server()
        return _server


def shutdown() -> None:
    global _server
    with _lock:
        if _server is not None:
            _server.close()
            _server = None


def _startup_sensitive(name: str) -> bool:
    return name.startswith(_STARTUP_PREFIXES) or name in _STARTUP_NAMES


def can_fork(env: dict[str, str]) -> bool:
    """Whether a forked call with ``env`` is the same as a fresh ``python -m patcher.cli``."""
    if not enabled():
        return False
    server = _get_server()
    base = server.env
    for name in set(env) | set(base):
        if (_startup_sensitive(name) or name in server.read) and env.get(name) != base.get(name):
            return False
    return True


def _umask() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise RuntimeError("no Umask in /proc/self/status")


def run(args: list[str], *, cwd: str | None, input: bytes | None, env: dict[str, str],
        timeout: float) -> tuple[int, bytes, bytes]:
    """One forked call: (exit code, stdout, stderr), with ``subprocess.run``'s timeout behaviour."""
    server = _get_server()
    req = json.dumps({"argv": args, "cwd": os.path.abspath(cwd) if cwd is not None else os.getcwd(),
                      "env": env, "umask": _umask()}).encode()
    if input is None:  # the caller's own stdin, as subprocess.run leaves it
        in_r, in_w = os.dup(0), -1
    else:
        in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + server.name)
        socket.send_fds(conn, [struct.pack("!I", len(req)) + req], [in_r, out_w, err_w])
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    pending = input or b""
    writing = in_w
    if writing >= 0 and not pending:
        os.close(writing)
        writing = -1
    status = b""
    pid = 0
    deadline = time.monotonic() + timeout
    reading = [out_r, err_r, conn.fileno()]
    try:
        while reading:
            left = deadline - time.monotonic()
            if left <= 0:
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                raise subprocess.TimeoutExpired([sys.executable, "-m", "patcher.cli", *args], timeout)
            r, w, _ = select.select(reading, [writing] if writing >= 0 else [], [], left)
            if w:
                try:
                    n = os.write(writing, pending[:65536])
                    pending = pending[n:]
                except BrokenPipeError:
                    pending = b""
                if not pending:
                    os.close(writing)
                    writing = -1
            for fd in r:
                data = os.read(fd, 65536)
                if fd == conn.fileno():
                    status += data
                    if status.count(b"\n") >= 1 and not pid:
                        pid = int(status.split(b"\n", 1)[0])
                else:
                    chunks[fd].append(data)
                if not data:
                    reading.remove(fd)
    finally:
        if writing >= 0:
            os.close(writing)
        os.close(out_r)
        os.close(err_r)
        conn.close()
    lines = status.split(b"\n")
    if len(lines) < 3:
        raise RuntimeError(f"the CLI fork server lost the call {args!r}: {status!r}")
    return int(lines[1]), b"".join(chunks[out_r]), b"".join(chunks[err_r])


if __name__ == "__main__":
    _serve()

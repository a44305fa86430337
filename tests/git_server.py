"""A real git server for remote mode's tests and bench: ``git daemon`` on 127.0.0.1 (docs/REMOTE.md).

:class:`GitServer` starts ``git daemon --export-all --enable=receive-pack``
in its own process group, waits for its "Ready to rumble" line and a connect
that succeeds (no sleeps), drains its log in a thread, and kills the whole
group on :meth:`stop` (the daemon forks one ``receive-pack`` per push: a push
under way dies with it).

A server can be stopped and started again on the same port (a test of a
server that goes down and comes back): from its creation to :meth:`close`
it holds the port with a bound, non-listening ``SO_REUSEADDR`` socket of its
own.  A client's connect is refused while the daemon is down, as with
nothing there; no other process can bind the port or get it as an
ephemeral port meanwhile; and the daemon (``--reuseaddr``) binds beside it.
:meth:`stop` returns once every process of the daemon's group has exited
(each waited on through a pidfd), so the old daemon's listening socket is
closed before a restart binds; a bind that still finds the port in use is
tried again within a bound derived from the daemon's measured start-up time.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

__all__ = ["GitServer", "free_port", "wait_group_gone"]

# A start that finds the port in use is tried again for this many times the
# daemon's measured start-up (each try is a whole daemon start, so it paces itself).
BUSY_RETRY_FACTOR = 50


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _reserve(host: str, port: int) -> socket.socket:
    """A bound, non-listening ``SO_REUSEADDR`` socket on ``host:port`` (0: a free port the kernel picks)."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except BaseException:
        s.close()
        raise
    return s


def _group_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited (zombies have: their files are closed)."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(name))
    return members


def wait_group_gone(pgid: int) -> None:
    """Return once no process of group ``pgid`` is left running, each waited on by its pidfd (no polling loop).

    Meant after ``killpg(pgid, SIGKILL)``: no process joins the group any more,
    so the scan ends when a pass finds none.
    """
    while members := _group_members(pgid):
        for pid in members:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                poller.poll()  # readable once the process has exited
            finally:
                os.close(fd)


class _PortBusy(RuntimeError):
    """The daemon could not bind its port: another socket listens on it."""


class GitServer:
    """``git daemon`` serving the bare repositories under ``base`` on ``host:port``."""

    def __init__(self, base: Path, host: str = "127.0.0.1", port: int | None = None,
                 prefix: list[str] | None = None) -> None:
        self.base, self.host = base, host
        self.prefix = prefix or []  # e.g. ["ip", "netns", "exec", NAME]
        self._chosen = port is None  # a port picked here may be picked again if the first one is lost
        self._reservation: socket.socket | None = None
        if self.prefix:  # the daemon binds in another network namespace: nothing to hold here
            self.port = port if port is not None else free_port(host)
        else:
            self._reservation = _reserve(host, port or 0)
            self.port = int(self._reservation.getsockname()[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: list[str] = []
        self.startup: float | None = None  # seconds from spawn to accepting, measured on the first start

    def url(self, name: str) -> str:
        return f"git://{self.host}:{self.port}/{name}"

    def start(self) -> GitServer:
        """Start the daemon (again, after :meth:`stop`) and return once a connect to it succeeds.

        Raises:
            RuntimeError: the daemon exited first (its log says why), or its port
                stayed in use past the bound.
        """
        if self.proc is not None:
            raise RuntimeError("git daemon already running")
        deadline: float | None = None
        picks = 3 if self._chosen and self._reservation is None else 0
        while True:
            began = time.monotonic()
            try:
                self._start()
            except _PortBusy:
                if picks > 0:  # an unreserved port picked here was taken: pick another
                    picks -= 1
                    self.port = free_port(self.host)
                    continue
                spent = time.monotonic() - began
                if deadline is None:
                    deadline = began + BUSY_RETRY_FACTOR * max(self.startup or 0.0, spent)
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"git daemon: port {self.port} still in use: {self.log[-3:]}") from None
                continue
            if self.startup is None:
                self.startup = time.monotonic() - began
            return self

    def _start(self) -> None:
        if self._reservation is None and not self.prefix:
            self._reservation = _reserve(self.host, self.port)
        self.proc = subprocess.Popen(
            [*self.prefix, "git", "daemon", "--verbose", "--reuseaddr", "--export-all", "--enable=receive-pack",
             f"--base-path={self.base}", f"--listen={self.host}", f"--port={self.port}", str(self.base)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        assert self.proc.stderr is not None
        mark = len(self.log)
        for raw in self.proc.stderr:  # blocks until the daemon says something
            line = raw.decode("utf-8", "replace").rstrip()
            self.log.append(line)
            if "Ready to rumble" in line:
                break
        else:
            proc, self.proc = self.proc, None
            proc.wait()
            said = self.log[mark:]
            if any("in use" in line for line in said):
                raise _PortBusy(f"git daemon could not bind port {self.port}: {said}")
            raise RuntimeError(f"git daemon did not start: {said}")
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
        if not self.prefix:  # reachable from here: a connect is the proof it accepts
            with socket.create_connection((self.host, self.port)):
                pass

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            self.log.append(raw.decode("utf-8", "replace").rstrip())

    def stop(self) -> None:
        """Kill the daemon and every process it forked (SIGKILL to its group); return once all have exited.

        The port stays held (see the module's docstring) until :meth:`close`.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        wait_group_gone(proc.pid)

    def close(self) -> None:
        """:meth:`stop`, then let the port go."""
        self.stop()
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

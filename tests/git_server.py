"""A real git server for remote mode's tests and bench: ``git daemon`` on 127.0.0.1 (docs/REMOTE.md).

:class:`GitServer` starts ``git daemon --export-all --enable=receive-pack``
in its own process group, waits for its "Ready to rumble" line (no sleeps),
drains its log in a thread, and kills the whole group on :meth:`stop` (the
daemon forks one ``receive-pack`` per push: a push under way dies with it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

__all__ = ["GitServer", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class GitServer:
    """``git daemon`` serving the bare repositories under ``base`` on ``host:port``."""

    def __init__(self, base: Path, host: str = "127.0.0.1", port: int | None = None,
                 prefix: list[str] | None = None) -> None:
        self.base, self.host = base, host
        self._chosen = port is None  # a port picked here may be taken before the daemon binds it: picked again
        self.port = port if port is not None else free_port(host)
        self.prefix = prefix or []  # e.g. ["ip", "netns", "exec", NAME]
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: list[str] = []

    def url(self, name: str) -> str:
        return f"git://{self.host}:{self.port}/{name}"

    def start(self) -> GitServer:
        """Start the daemon and return once it accepts connections (its "Ready to rumble" line).

        Raises:
            RuntimeError: the daemon exited first (its log says why, e.g. the port was taken).
        """
        for _attempt in range(3 if self._chosen else 1):
            try:
                return self._start()
            except RuntimeError:
                if not self._chosen:
                    raise
                self.port = free_port(self.host)
        return self._start()

    def _start(self) -> GitServer:
        self.proc = subprocess.Popen(
            [*self.prefix, "git", "daemon", "--verbose", "--reuseaddr", "--export-all", "--enable=receive-pack",
             f"--base-path={self.base}", f"--listen={self.host}", f"--port={self.port}", str(self.base)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:  # blocks until the daemon says something
            line = raw.decode("utf-8", "replace").rstrip()
            self.log.append(line)
            if "Ready to rumble" in line:
                break
        else:
            self.proc.wait()
            raise RuntimeError(f"git daemon did not start: {self.log}")
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stderr is not None
        for raw in proc.stderr:
            self.log.append(raw.decode("utf-8", "replace").rstrip())

    def stop(self) -> None:
        """Kill the daemon and every process it forked (SIGKILL to its group), and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

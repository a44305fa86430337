"""``oncepatch serve``: a long-lived local server the CLI's calls go through (docs/AGENTS.md, docs/SECURITY.md).

One process per user (or, with ``--broker``, per store owner) listens on a
Unix socket in a private folder and keeps the interpreter and every module
of oncepatch loaded.  Each call runs in a process forked from it ahead of
time (a *spare*), which takes the caller's standard streams, working folder,
umask and environment and runs :func:`patcher.cli.run.main` — the very code
the CLI runs in process — so the answer, the exit status, the receipts and
the crash points are the same, and nothing of one call reaches another.

The listening process checks every peer with ``SO_PEERCRED`` (the same uid;
with ``--broker`` the users and groups it allows), hands the connection to
the spare, forks the next spare, and, when a call's process dies before it
answered (a crash point, ``kill -9``), tells the client its exit status.
It exits after ``--idle`` seconds without a call.

The wire is described in :mod:`patcher.connect`.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import grp
import importlib
import io
import os
import pkgutil
import pwd
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cas.errors import EXIT_OK, UsageError
from receipts.policy import Caller
from patcher import connect
from patcher.cli.common import path_given, seconds

__all__ = ["register", "serve", "BROKER_ENV"]

#: What a broker takes of its caller's environment: who wrote the change, and when (the
#: committer is the broker's own identity: it makes the commit).
BROKER_ENV = frozenset({"GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_AUTHOR_DATE", "TZ"})
_SO_PEERGROUPS = 59  # Linux's getsockopt for the peer's supplementary groups (4.13 and later)
_MAX_FRAME = 16 << 20
Call = Callable[..., int]


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the CLI's calls from one long-lived process (faster; the broker)")
    p.add_argument("--idle", type=seconds, default=900.0,
                   help="exit after this many seconds without a call (default 900; 0 = never)")
    p.add_argument("--socket-dir", type=path_given, default=None,
                   help="folder of the socket (default: $ONCEPATCH_SERVER_DIR, else $XDG_RUNTIME_DIR/oncepatch, "
                        "else /tmp/oncepatch-<uid>)")
    p.add_argument("--background", action="store_true",
                   help="start the server detached and return once it listens (or one already does)")
    p.add_argument("--broker", action="store_true",
                   help="serve other users (--allow-user, --allow-group; default: this user's group) as the "
                        "owner of their stores")
    p.add_argument("--allow-user", action="append", default=[], metavar="USER",
                   help="with --broker: a user whose calls are served (repeatable)")
    p.add_argument("--allow-group", action="append", default=[], metavar="GROUP",
                   help="with --broker: a group whose members' calls are served (repeatable)")
    p.add_argument("--backlog", type=int, default=socket.SOMAXCONN, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


@dataclass
class _Config:
    broker: bool
    uids: frozenset[int]
    gids: frozenset[int]

    def allows(self, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
        if uid == os.getuid():
            return True
        return self.broker and (uid in self.uids or bool(self.gids & ({gid} | set(groups))))


def _config(args: argparse.Namespace) -> _Config:
    uids: set[int] = set()
    gids: set[int] = set()
    for name in args.allow_user:
        try:
            uids.add(int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid)
        except KeyError:
            raise UsageError(f"no such user '{name}'") from None
    for name in args.allow_group:
        try:
            gids.add(int(name) if name.isdigit() else grp.getgrnam(name).gr_gid)
        except KeyError:
            raise UsageError(f"no such group '{name}'") from None
    if (uids or gids) and not args.broker:
        raise UsageError("--allow-user and --allow-group need --broker")
    if args.broker and not uids and not gids:
        gids.add(os.getgid())
    return _Config(args.broker, frozenset(uids), frozenset(gids))


def _folder(args: argparse.Namespace) -> str:
    folder = os.path.abspath(args.socket_dir) if args.socket_dir else connect.socket_dir()[0]
    mode = 0o755 if args.broker else 0o700
    try:
        os.makedirs(folder, mode=mode, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        raise UsageError(f"cannot make the server's folder '{folder}': {exc.strerror or exc}") from exc
    if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.getuid():
        raise UsageError(f"the server's folder '{folder}' is not a folder of this user")
    if st.st_mode & 0o777 != mode:
        os.chmod(folder, mode)
    return folder


def _preload() -> None:
    """Import every module a call may need, once, before the first spare is forked."""
    for pkg in ("cas", "receipts", "patcher"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
            if info.name.endswith("__main__") or info.name == "patcher.mcp_server":
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional extra that is not installed
                pass


def _background(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "patcher.cli", "serve", "--idle", repr(args.idle), "--backlog", str(args.backlog)]
    if args.socket_dir:
        argv += ["--socket-dir", os.path.abspath(args.socket_dir)]
    if args.broker:
        argv.append("--broker")
    for name in args.allow_user:
        argv += ["--allow-user", name]
    for name in args.allow_group:
        argv += ["--allow-group", name]
    log = os.path.join(_folder(args), "serve.log")  # the detached server's stderr
    r, w = os.pipe()
    try:
        with open(log, "ab") as err:
            proc = subprocess.Popen([*argv, "--ready-fd", str(w)], pass_fds=(w,), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as fh:
        said = fh.readline().decode("utf-8", "replace").strip()
    if not said:
        proc.wait()
        raise UsageError(f"the server did not start (exit {proc.returncode}): see '{log}'")
    sys.stdout.write(said + "\n")
    sys.stdout.flush()
    return EXIT_OK


def serve(args: argparse.Namespace, call: Call) -> int:
    """``oncepatch serve``: listen until idle; ``call(argv, caller=, confined=)`` runs one command."""
    if args.background:
        return _background(args)
    config = _config(args)
    folder = _folder(args)
    path = connect.socket_path(folder, connect.version_token())
    ready = args.ready_fd

    def say(text: str) -> None:
        nonlocal ready
        if ready is not None:
            os.write(ready, text.encode() + b"\n")
            os.close(ready)
            ready = None
        sys.stderr.write(f"oncepatch serve: {text}\n")
        sys.stderr.flush()

    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another server of this version holds the socket (or is starting)
        os.close(lock)
        say(f"running {path}")  # (its pid: the one holding the lock)
        return EXIT_OK
    _preload()
    gc.freeze()  # what is loaded now is never collected: a call's process does not copy it by scanning it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)  # stale: its server is gone (we hold the lock)
    except FileNotFoundError:
        pass
    old = os.umask(0o111 if config.broker else 0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o666 if config.broker else 0o600)
    listener.listen(max(1, args.backlog))
    inode = os.stat(path).st_ino
    try:
        _Loop(listener, path, inode, config, call, args.idle).run(lambda: say(f"ready {path} pid {os.getpid()}"))
    finally:
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass
        listener.close()
        os.close(lock)
    return EXIT_OK


@dataclass
class _Spare:
    pid: int
    chan: socket.socket


@dataclass
class _Loop:
    listener: socket.socket
    path: str
    inode: int
    config: _Config
    call: Call
    idle: float
    busy: dict[int, socket.socket] = field(default_factory=dict)
    spare: _Spare | None = None
    stop: bool = False

    def run(self, ready: Callable[[], None]) -> None:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake = (wake_r, wake_w)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        ready()  # (first: a spare must not inherit the descriptor that says so)
        self.spare = self._fork_spare()
        last = time.monotonic()
        try:
            while not self.stop:
                left = last + self.idle - time.monotonic() if self.idle else 1.0
                if left <= 0 and not self.busy:
                    break
                wait = min(max(left, 0.01), 1.0)
                readable, _, _ = select.select([self.listener.fileno(), wake_r], [], [], wait)
                if wake_r in readable:
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    if self._reap():
                        last = time.monotonic()
                if self.listener.fileno() in readable:
                    self._accept()
                    last = time.monotonic()
                if not self._still_ours():
                    break
        finally:
            signal.set_wakeup_fd(-1)
            if self.spare is not None:
                self.spare.chan.close()  # the spare reads the end of its channel and exits
            os.close(wake_r)
            os.close(wake_w)

    def _stop(self, *_: Any) -> None:
        self.stop = True

    def _still_ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        groups = _peer_groups(conn, uid, gid)
        if not self.config.allows(uid, gid, groups):
            _send_quietly(conn, f"Rcaller uid {uid} is not allowed by this server\n".encode())
            conn.close()
            return
        spare = self.spare
        if spare is None:
            spare = self._fork_spare()
        creds = struct.pack(f"!4i{len(groups)}i", pid, uid, gid, len(groups), *groups)
        try:
            socket.send_fds(spare.chan, [creds], [conn.fileno()])
        except OSError:  # the spare died: the client reads the end and runs the call itself
            conn.close()
            self.spare = self._fork_spare()
            return
        spare.chan.close()
        self.busy[spare.pid] = conn
        self.spare = self._fork_spare()

    def _reap(self) -> bool:
        reaped = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reaped = True
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            conn = self.busy.pop(pid, None)
            if conn is not None:
                _send_quietly(conn, b"D%d\n" % code)  # read only when the call's process never answered
                conn.close()
            elif self.spare is not None and pid == self.spare.pid:
                self.spare.chan.close()
                self.spare = self._fork_spare()
        return reaped

    def _fork_spare(self) -> _Spare:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        pid = os.fork()
        if pid:
            child_end.close()
            return _Spare(pid, parent_end)
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            parent_end.close()
            self.listener.close()
            for conn in self.busy.values():
                conn.close()
            if self.spare is not None:
                self.spare.chan.close()
            os.close(self.wake[0])
            os.close(self.wake[1])
            code = _serve_one(child_end, self.call, self.config)
        except BaseException:  # noqa: BLE001 - a spare's last line: never back into the server's loop
            traceback.print_exc()
        finally:
            os._exit(code)


def _peer_groups(conn: socket.socket, uid: int, gid: int) -> tuple[int, ...]:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        return tuple(sorted(set(struct.unpack(f"{len(raw) // 4}I", raw))))
    except OSError:
        try:
            return tuple(sorted(set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))))
        except KeyError:
            return (gid,)


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:  # the client went away: its call still ran (or was never started)
        pass


def _read_frame(conn: socket.socket) -> tuple[bytes, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 65536, 4)
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        if len(data) >= 4 and int.from_bytes(data[:4], "big") > _MAX_FRAME:
            raise ValueError("request too large")
        more = conn.recv(65536)
        if not more:
            raise ValueError("the request ended early")
        data += more
    return data[4:4 + int.from_bytes(data[:4], "big")], fds


def _serve_one(chan: socket.socket, call: Call, config: _Config) -> int:
    """A spare: wait for one connection from the server, run its call, answer, end."""
    try:
        msg, fds, _, _ = socket.recv_fds(chan, 4096, 1)
    except OSError:
        return 0
    if not fds:  # the server is shutting down
        return 0
    chan.close()
    conn = socket.socket(fileno=fds[0])
    pid, uid, gid, n = struct.unpack("!4i", msg[:16])
    groups = struct.unpack(f"!{n}i", msg[16:16 + 4 * n])
    received: list[int] = []
    try:
        payload, received = _read_frame(conn)
        fields = payload.split(b"\0")
        if fields[0] != connect.PROTOCOL or len(received) != 4:
            raise ValueError("not an oncepatch-serve/1 request")
        if fields[1].decode() != connect.version_token():
            raise ValueError("another version")
        umask, argc = int(fields[2]), int(fields[3])
        argv = [os.fsdecode(a) for a in fields[4:4 + argc]]
        if not argv or argv[0] not in connect.COMMANDS:
            raise ValueError(f"'{argv[0] if argv else ''}' runs in the caller's process")
        env = dict(item.split(b"=", 1) for item in fields[4 + argc:] if b"=" in item)
        for target, fd in enumerate(received[:3]):
            os.dup2(fd, target)
        os.fchdir(received[3])
    except (ValueError, OSError) as exc:
        _send_quietly(conn, f"R{exc}\n".encode())
        return 0
    finally:
        for fd in received:
            os.close(fd)
    _take_environment(env, config.broker)
    if not config.broker:
        os.umask(umask)  # a broker writes with its own: its store stays readable, never writable, by callers
    _standard_streams()
    sys.argv = ["oncepatch", *argv]
    _send_quietly(conn, b"A\n")
    caller = Caller.of(uid, gid, frozenset(groups), pid=pid, peer=True)
    try:
        code = call(argv, caller=caller, confined=config.broker)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # the client closed its end: the call ran all the same
                pass
    _send_quietly(conn, b"X%d\n" % code)
    return 0


def _take_environment(env: dict[bytes, bytes], broker: bool) -> None:
    """The caller's environment, as the CLI would have had it (a broker: only the author and the time zone)."""
    if broker:
        for name in BROKER_ENV:
            os.environb.pop(name.encode(), None)
        os.environb.update({k: v for k, v in env.items() if k.decode("ascii", "replace") in BROKER_ENV})
    else:
        os.environb.clear()
        os.environb.update(env)
    time.tzset()
    pygit2 = sys.modules.get("pygit2")
    if pygit2 is not None:  # libgit2 found the global config from $HOME when it started: again, from the caller's
        from pygit2.enums import ConfigLevel

        for level in (ConfigLevel.SYSTEM, ConfigLevel.XDG, ConfigLevel.GLOBAL):
            pygit2.settings.search_path[level] = None


def _standard_streams() -> None:
    """Python's standard streams over the caller's descriptors 0, 1 and 2 (nothing buffered of the server's)."""
    def text(fd: int, mode: str, like: Any) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: Any = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding=getattr(like, "encoding", None) or "utf-8",
                                errors=getattr(like, "errors", None) or "strict", line_buffering=fd == 2)

    sys.stdin = text(0, "r", sys.stdin)
    sys.stdout = text(1, "w", sys.stdout)
    sys.stderr = text(2, "w", sys.stderr)

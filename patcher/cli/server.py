"""``oncepatch serve``: a long-lived local server the CLI's calls go through (docs/AGENTS.md, docs/SECURITY.md).

One process per user (or, with ``--broker``, per store owner) listens on a
Unix socket in a private folder and keeps the interpreter and every module
of oncepatch loaded.  Calls run in **workers**: processes forked from it
that each run calls one after another.  A worker takes the caller's
standard streams, working folder, umask and environment for the call, runs
:func:`patcher.cli.run.main` — the very code the CLI runs in process — and
then gives all of it back (streams on ``/dev/null``, folder ``/``), so the
answer, the exit status, the receipts and the crash points are the same,
and nothing of one call reaches the next but warm caches and the
repositories it keeps open (per configuration environment; libgit2 reads
refs, packs and the index from disk again at each use, so another process's
commit, ``repack`` or ``gc`` between two calls is seen by the next).  A
call is given to the worker that finished last (the warmest); one more is
forked ahead when none is idle, and a worker that dies mid-call (a crash
point, ``kill -9``) is replaced.  Why workers and not a process per call,
nor calls in the listening process: docs/AGENTS.md, "The CLI through a
server".

The listening process checks every peer with ``SO_PEERCRED`` (the same uid;
with ``--broker`` the users and groups it allows), hands the connection to
a worker, and, when a worker dies before it answered, tells the client its
exit status.  A watcher process runs :class:`receipts.watcher.Watcher` over
every store the server served and appends its flags to ``watch.jsonl`` in
the server's folder.  It exits after ``--idle`` seconds without a call.

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

from cas.errors import EXIT_INTERNAL, EXIT_OK, UsageError, clip
from cas.loose_objects import remove_own_tmp_objdirs
from receipts.environ import env_int
from receipts.policy import Caller
from patcher import connect
from patcher.cli.common import path_given, seconds

__all__ = ["register", "serve", "BROKER_ENV", "WATCH_LOG", "MAX_CALLS_PER_PEER"]

#: The watcher's flags, in the server's folder: one JSON object a line, as ``oncepatch watch --json`` prints them.
WATCH_LOG = "watch.jsonl"

#: What a broker takes of its caller's environment: who wrote the change, and when (the
#: committer is the broker's own identity: it makes the commit).
BROKER_ENV = frozenset({"GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_AUTHOR_DATE", "TZ"})
_SO_PEERGROUPS = 59  # Linux's getsockopt for the peer's supplementary groups (4.13 and later)
_MAX_FRAME = 16 << 20
#: Seconds a connection has to send its whole request: the thin client sends it right after it
#: connects.  A peer that sends nothing (or a byte now and then) held a worker, a whole process,
#: for ever: a few hundred such connections from an allowed user took the broker's memory.
_FRAME_DEADLINE = 10.0
#: Calls one peer (a uid, as ``SO_PEERCRED`` names it) may have running at once: each holds a
#: worker, a whole process, until it ends (up to its lock timeouts, or a check's 600 s).  Beyond
#: it a connection is refused (``R``): the client runs the call in process, or under
#: ``ONCEPATCH_SERVER=require`` answers exit 5, ``not_started``.  Without it, one user of a broker
#: opening connections in a loop forked a process for each until the machine's memory ran out.
MAX_CALLS_PER_PEER = max(1, env_int("ONCEPATCH_MAX_CALLS_PER_PEER", 32))
_IDLE_WORKERS = 2  # idle workers kept (more finish at once under load: the others exit)
_WATCHED_STORES = 256  # stores the server's watcher is told of, at most
_WATCH_NICE = 10  # the watcher's scheduling priority, below the calls'
_WATCHING = 8  # stores watched at once (each an inotify instance, of the user's 128): the oldest stops for a new one
_KEPT_REPOSITORIES = 32  # open repositories a worker keeps per configuration environment
_KEPT_CONFIGS = 8  # configuration environments whose repositories a worker keeps open
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
    p.add_argument("--no-watch", action="store_true",
                   help="do not watch the stores it serves for orphaned prepared receipts")
    p.add_argument("--watch-grace", type=seconds, default=30.0,
                   help="the watcher flags a prepared receipt this many seconds old whose owner is gone (default 30)")
    p.add_argument("--watch-rescan", type=seconds, default=30.0,
                   help="the watcher rescans each store this often, in seconds (default 30)")
    p.add_argument("--backlog", type=int, default=socket.SOMAXCONN, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


@dataclass(frozen=True)
class _WatchSettings:
    grace: float
    rescan: float
    log: str  # the flags, one JSON object a line (as 'oncepatch watch --json' prints them)


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
    if args.no_watch:
        argv.append("--no-watch")
    argv += ["--watch-grace", repr(args.watch_grace), "--watch-rescan", repr(args.watch_rescan)]
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
    """``oncepatch serve``: listen until idle; ``call(argv, caller=, confined=, stores=)`` runs one command.

    ``stores``: the worker's open repositories for the call's configuration
    environment, to reuse (:func:`patcher.cli.run.main`).
    """
    if args.background:
        return _background(args)
    config = _config(args)
    if config.broker:  # what it writes is never its callers' to write, whatever umask it was started with
        os.umask(os.umask(0o022) | 0o022)
    folder = _folder(args)
    token = connect.version_token()  # of the code loaded now: what every call of this server runs
    path = connect.socket_path(folder, token)
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
        watch = None if args.no_watch else _WatchSettings(args.watch_grace, args.watch_rescan,
                                                          os.path.join(folder, WATCH_LOG))
        _Loop(listener, path, inode, config, call, args.idle, watch, lock=lock, token=token).run(lambda: say(f"ready {path} pid {os.getpid()}"))
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
class _Worker:
    """A process that runs calls one after another: idle, or running ``conn``'s call."""

    pid: int
    chan: socket.socket
    conn: socket.socket | None = None
    said: bytes = b""
    peer: int = -1  # the uid whose call it runs (``conn``'s)


@dataclass
class _Loop:
    listener: socket.socket
    path: str
    inode: int
    config: _Config
    call: Call
    idle: float
    watch: _WatchSettings | None = None
    workers: dict[int, _Worker] = field(default_factory=dict)
    ready_workers: list[_Worker] = field(default_factory=list)  # idle, the last one to finish on top
    roots: set[str] = field(default_factory=set)
    watcher: tuple[int, int] | None = None  # (pid, the pipe it reads store roots from)
    lock: int = -1  # the flock that says a server of this version runs: the listener's alone
    token: str = ""  # the version token in the socket's name (connect.version_token at start)
    stop: bool = False

    def run(self, ready: Callable[[], None]) -> None:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake = (wake_r, wake_w)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        ready()  # (first: a worker must not inherit the descriptor that says so)
        if self.watch is not None:
            self._start_watcher()
        self.ready_workers.append(self._fork_worker())
        last = time.monotonic()
        try:
            while not self.stop:
                left = last + self.idle - time.monotonic() if self.idle else 1.0
                busy = any(w.conn is not None for w in self.workers.values())
                if left <= 0 and not busy:
                    break
                wait = min(max(left, 0.01), 1.0)
                chans = {w.chan.fileno(): w for w in self.workers.values() if w.chan.fileno() >= 0}
                readable, _, _ = select.select([self.listener.fileno(), wake_r, *chans], [], [], wait)
                if wake_r in readable:
                    try:
                        while os.read(wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    if self._reap():
                        last = time.monotonic()
                for fd in readable:
                    if fd in chans:
                        self._heard(chans[fd])
                        last = time.monotonic()
                if self.listener.fileno() in readable:
                    self._accept()
                    last = time.monotonic()
                if not self._still_ours():
                    break
        finally:
            signal.set_wakeup_fd(-1)
            for worker in self.workers.values():
                worker.chan.close()  # an idle worker reads the end of its channel and exits; a busy one after its call
            if self.watcher is not None:
                os.close(self.watcher[1])  # the watcher reads the end of its pipe and exits
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
        running = sum(1 for w in self.workers.values() if w.conn is not None and w.peer == uid)
        if running >= MAX_CALLS_PER_PEER:
            _send_quietly(conn, f"Rcaller uid {uid} has {running} calls running in this server, its limit "
                                f"(ONCEPATCH_MAX_CALLS_PER_PEER={MAX_CALLS_PER_PEER})\n".encode())
            conn.close()
            return
        # The worker that finished last: its caches (modules' first-use state, open repositories) are the warmest.
        worker = self.ready_workers.pop() if self.ready_workers else self._fork_worker()
        creds = struct.pack(f"!4i{len(groups)}i", pid, uid, gid, len(groups), *groups)
        try:
            socket.send_fds(worker.chan, [creds], [conn.fileno()])
        except OSError:  # the worker died: the client reads the end and runs the call itself
            conn.close()
        else:
            worker.conn, worker.peer = conn, uid
        if not self.ready_workers:
            self.ready_workers.append(self._fork_worker())  # the next call's, forked while this one runs

    def _heard(self, worker: _Worker) -> None:
        """A worker's lines: ``S<root>`` (a store it served), ``I`` (its call is over: idle again)."""
        try:
            data = worker.chan.recv(65536)
        except OSError:
            data = b""
        if not data:  # it is ending: reaped (and its caller told) on SIGCHLD
            self._forget(worker)
            return
        worker.said += data
        while b"\n" in worker.said:
            line, worker.said = worker.said.split(b"\n", 1)
            if line[:1] == b"S":
                self._watch_root(os.fsdecode(line[1:]))
            elif line == b"I" and worker.conn is not None:
                worker.conn.close()
                worker.conn = None
                if len(self.ready_workers) < _IDLE_WORKERS:
                    self.ready_workers.append(worker)
                else:
                    self._forget(worker)  # enough idle ones: it reads the end of its channel and exits

    def _forget(self, worker: _Worker) -> None:
        if worker in self.ready_workers:
            self.ready_workers.remove(worker)
        if worker.conn is None:  # (a busy one's caller is told by _reap when it ends)
            worker.chan.close()

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
            if self.watcher is not None and pid == self.watcher[0]:
                os.close(self.watcher[1])
                self.watcher = None
                if not self.stop:
                    self._start_watcher()
                continue
            worker = self.workers.pop(pid, None)
            if worker is None:
                continue
            if worker.conn is not None:
                _send_quietly(worker.conn, b"D%d\n" % code)  # read only when the call's process never answered
                worker.conn.close()
                worker.conn = None
            if worker in self.ready_workers:
                self.ready_workers.remove(worker)
            worker.chan.close()
        if reaped and not self.ready_workers and not self.stop:
            self.ready_workers.append(self._fork_worker())
        return reaped

    def _watch_root(self, root: str) -> None:
        if root in self.roots or len(self.roots) >= _WATCHED_STORES:
            return
        self.roots.add(root)
        if self.watcher is not None:
            try:
                os.write(self.watcher[1], os.fsencode(root) + b"\n")
            except OSError:  # it died: restarted, with every root, when reaped
                pass

    def _start_watcher(self) -> None:
        assert self.watch is not None
        r, w = os.pipe2(os.O_CLOEXEC)
        settings, roots = self.watch, sorted(self.roots)

        def body() -> int:
            os.close(w)  # (the server's end)
            return _watch_stores(r, settings, roots)

        pid = self._fork(body, keep=(r,))
        os.close(r)
        self.watcher = (pid, w)

    def _fork_worker(self) -> _Worker:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        def body() -> int:
            parent_end.close()  # (the server's end)
            try:
                return _work(child_end, self.call, self.config, self.token)
            finally:
                # It ends by os._exit, which runs no exit handler: the temporary object folders it
                # kept for its calls' batches (cas.loose_objects) would stay in every repository.
                remove_own_tmp_objdirs()

        pid = self._fork(body, keep=(child_end.fileno(),))
        child_end.close()
        worker = self.workers[pid] = _Worker(pid, parent_end)
        return worker

    def _fork(self, body: Callable[[], int], keep: tuple[int, ...]) -> int:
        """A child of this server that runs ``body`` with none of the server's descriptors but ``keep``."""
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.listener.close()
            if self.lock >= 0:
                os.close(self.lock)  # a worker finishing its call must not keep the next server from starting
            for worker in self.workers.values():
                if worker.chan.fileno() not in keep:
                    worker.chan.close()
                if worker.conn is not None:
                    worker.conn.close()
            if self.watcher is not None:
                os.close(self.watcher[1])
            os.close(self.wake[0])
            os.close(self.wake[1])
            code = body()
        except BaseException:  # noqa: BLE001 - a child's last line: never back into the server's loop
            traceback.print_exc()
        finally:
            os._exit(code)


def _peer_groups(conn: socket.socket, uid: int, gid: int) -> tuple[int, ...]:
    try:
        # 1024 bytes (256 groups) is the most Python's getsockopt takes: a larger buffer is refused
        # (EINVAL), and the group database, below, would answer instead of the kernel.
        raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
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
    """The request's frame and the descriptors passed with it, whole within :data:`_FRAME_DEADLINE` seconds.

    Raises:
        ValueError: too large, ended early, or not whole by the deadline; the descriptors
            received are closed (a peer that passes some and stops would leak them into the worker).
    """
    deadline = time.monotonic() + _FRAME_DEADLINE
    fds: list[int] = []
    try:
        conn.settimeout(_FRAME_DEADLINE)
        data, fds, _, _ = socket.recv_fds(conn, 65536, 4)
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
            if len(data) >= 4 and int.from_bytes(data[:4], "big") > _MAX_FRAME:
                raise ValueError("request too large")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            conn.settimeout(remaining)  # one deadline for the whole frame, not one per byte sent
            more = conn.recv(65536)
            if not more:
                raise ValueError("the request ended early")
            data += more
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, TimeoutError):
            raise ValueError(f"no whole request within {_FRAME_DEADLINE:g} s") from None
        raise
    finally:
        conn.settimeout(None)  # the answers are written blocking, as before
    return data[4:4 + int.from_bytes(data[:4], "big")], fds


def _work(chan: socket.socket, call: Call, config: _Config, token: str) -> int:
    """A worker: run the calls the server hands over, one after another, until it closes the channel.

    Between calls the worker is as it was forked: standard streams on
    ``/dev/null``, working folder ``/``, the server's umask and environment.
    What it keeps are the modules' warm state and the open repositories
    (:func:`_kept_stores`).
    """
    base_env = dict(os.environb)
    base_umask = os.umask(0o022)
    os.umask(base_umask)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    _settle_streams(null, base_env, base_umask)
    announced: set[str] = set()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(chan, 1 << 20, 1)
        except OSError:
            return 0
        if not fds:  # the server is shutting down (or gone)
            return 0
        conn = socket.socket(fileno=fds[0])
        try:
            root = _serve_call(conn, msg, call, config, announced, chan, token)
        finally:
            _settle_streams(null, base_env, base_umask)
            conn.close()
        try:
            if root is not None and root not in announced:
                announced.add(root)
                chan.sendall(b"S" + os.fsencode(root) + b"\n")
            chan.sendall(b"I\n")
        except OSError:  # the server is gone: this worker's last call is done
            return 0


def _settle_streams(null: int, env: dict[bytes, bytes], umask: int) -> None:
    """Back to the worker's own state: nothing of the last caller's (streams, folder, umask, environment)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the client closed its end: the call ran all the same
            pass
    for target in (0, 1, 2):
        os.dup2(null, target)  # the caller's pipes are not held open by an idle worker
    os.chdir("/")
    os.umask(umask)
    if os.environb != env:
        _take_environment(env, broker=False)
    _standard_streams()


def _serve_call(conn: socket.socket, msg: bytes, call: Call, config: _Config, announced: set[str],
                chan: socket.socket, token: str) -> str | None:
    """One call: take the caller's streams, folder, umask and environment, run it, answer; its store's root."""
    pid, uid, gid, n = struct.unpack("!4i", msg[:16])
    groups = struct.unpack(f"!{n}i", msg[16:16 + 4 * n])
    received: list[int] = []
    try:
        payload, received = _read_frame(conn)
        fields = payload.split(b"\0")
        if fields[0] != connect.PROTOCOL or len(received) != 4 or len(fields) < 4:
            raise ValueError("not an oncepatch-serve/1 request")  # (a short one killed the worker: IndexError)
        if fields[1].decode() != token:  # (not walked again per call: the loaded code is the start's)
            raise ValueError("another version")
        umask, argc = int(fields[2]), int(fields[3])
        argv = [os.fsdecode(a) for a in fields[4:4 + argc]]
        if not argv or argv[0] not in connect.COMMANDS:
            raise ValueError(f"'{clip(argv[0]) if argv else ''}' runs in the caller's process")
        env = dict(item.split(b"=", 1) for item in fields[4 + argc:] if b"=" in item)
        for target, fd in enumerate(received[:3]):
            os.dup2(fd, target)
        os.fchdir(received[3])
    except (ValueError, OSError) as exc:
        _send_quietly(conn, f"R{exc}\n".encode())
        return None
    finally:
        for fd in received:
            os.close(fd)
    _take_environment(env, config.broker)
    if not config.broker:
        os.umask(umask)  # a broker writes with its own: its store stays readable, never writable, by callers
    _standard_streams()
    sys.argv = ["oncepatch", *argv]
    _send_quietly(conn, b"A\n")
    root = _served_root(argv)
    if root is not None and root not in announced:  # before the call: a call that dies still has its store watched
        announced.add(root)
        try:
            chan.sendall(b"S" + os.fsencode(root) + b"\n")
        except OSError:
            pass
    caller = Caller.of(uid, gid, frozenset(groups), pid=pid, peer=True)
    try:
        code = call(argv, caller=caller, confined=config.broker, stores=_kept_stores(env))
    except Exception:  # noqa: BLE001 - (the CLI answers its own errors) what escaped it: a broken pipe while printing
        traceback.print_exc()
        code = EXIT_INTERNAL
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the client closed its end: the call ran all the same
            pass
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for target in (0, 1, 2):
            os.dup2(null, target)  # before the answer: the caller's pipes end when the caller does
    finally:
        os.close(null)
    _send_quietly(conn, b"X%d\n" % code)
    return root


#: The repositories kept open by a worker, per configuration environment (a repository opened
#: under one HOME reads that HOME's git config): {(HOME, XDG_CONFIG_HOME, GIT_* but the identity): {path: GitStore}}.
_STORES: dict[tuple[bytes, ...], dict[str, Any]] = {}
_IDENTITY = (b"GIT_AUTHOR_", b"GIT_COMMITTER_")


def _kept_stores(env: dict[bytes, bytes]) -> dict[str, Any]:
    key = tuple(sorted(k + b"=" + v for k, v in env.items()
                       if (k.startswith(b"GIT_") and not k.startswith(_IDENTITY)) or k in (b"HOME", b"XDG_CONFIG_HOME")))
    found = _STORES.get(key)
    if found is None:
        while len(_STORES) >= _KEPT_CONFIGS:
            _STORES.pop(next(iter(_STORES)))  # the oldest: its repositories close when collected
        found = _STORES[key] = {}
    while len(found) >= _KEPT_REPOSITORIES:
        found.pop(next(iter(found)))  # the first opened: it closes when collected
    return found


_ROOTS: dict[tuple[str, str, str | None, str | None], str | None] = {}


def _served_root(argv: list[str]) -> str | None:
    """The receipt store a call names (``--repo``, ``--store``, ``$ONCEPATCH_STORE``); None: no repository there."""
    def option(name: str) -> str | None:
        found = None
        for i, arg in enumerate(argv):
            if arg == name and i + 1 < len(argv):
                found = argv[i + 1]
            elif arg.startswith(name + "="):
                found = arg[len(name) + 1:]
        return found

    where = (os.getcwd(), option("--repo") or ".", option("--store"), os.environ.get("ONCEPATCH_STORE"))
    root = _ROOTS.get(where)
    if root is None:
        try:
            if where[2] or where[3]:
                root = os.path.abspath(where[2] or where[3] or "")
            else:
                from cas.gitdir import discover
                from patcher.protocol import store_root_for

                root = store_root_for(discover(where[1]).common_dir)
        except Exception:  # noqa: BLE001 - no repository there: the call says so itself
            return None
        if len(_ROOTS) < 1024:
            _ROOTS[where] = root
    return root


def _watch_stores(pipe: int, settings: _WatchSettings, roots: list[str]) -> int:
    """The server's watcher: :class:`receipts.watcher.Watcher` over each store root read from ``pipe``.

    A root is watched once its ``receipts`` folder exists (the watcher never
    makes a store: a call refused before it wrote anything leaves none); at
    most ``_WATCHING`` at once, the oldest stopped for a new one (``recover``
    and ``verify`` find all it would flag without it).  Ends when the server
    closes the pipe.
    """
    import json
    import threading

    from receipts.store import ReceiptStore
    from receipts.watcher import Watcher
    from patcher.git_adapter import adapters

    os.chdir("/")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # Behind the calls: the events of a call's receipts reach it while that call (and the
    # next caller's start) want both cores of a small machine, and a flag waits its grace anyway.
    os.nice(_WATCH_NICE)
    waiting = list(roots)
    threads: list[tuple[threading.Thread, threading.Event]] = []
    lock = threading.Lock()

    def flag(obj: dict[str, Any]) -> None:
        line = json.dumps({**obj, "store": obj.get("store") or ""}, separators=(",", ":")) + "\n"
        with lock:
            fd = os.open(settings.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        sys.stderr.write(f"oncepatch serve: watcher: {line}")
        sys.stderr.flush()

    def watch(root: str, stop: threading.Event) -> None:
        rstore = ReceiptStore(root)
        try:
            Watcher(rstore, adapters(rstore, {}, read_only=True), grace=settings.grace,
                    rescan_interval=settings.rescan, on_flag=lambda obj: flag({**obj, "store": root}),
                    on_error=lambda msg: print(f"oncepatch serve: watcher: {msg}", file=sys.stderr)).run(stop)
        except Exception as exc:  # noqa: BLE001 - a store gone (or unreadable) ends its watcher only
            sys.stderr.write(f"oncepatch serve: watcher of '{root}' ended: {exc}\n")

    buf = b""
    try:
        while True:
            for root in list(waiting):
                if os.path.isdir(os.path.join(root, "receipts")):
                    waiting.remove(root)
                    threads = [(t, stop) for t, stop in threads if t.is_alive()]
                    if len(threads) >= _WATCHING:
                        oldest, stop = threads.pop(0)
                        stop.set()
                        oldest.join(timeout=5)
                    stop = threading.Event()
                    t = threading.Thread(target=watch, args=(root, stop), name=f"watch {root}", daemon=True)
                    t.start()
                    threads.append((t, stop))
            ready, _, _ = select.select([pipe], [], [], 0.5 if waiting else None)
            if not ready:
                continue
            data = os.read(pipe, 65536)
            if not data:
                return 0
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                waiting.append(os.fsdecode(line))
    finally:
        for _, stop in threads:
            stop.set()
        for t, _ in threads:
            t.join(timeout=5)


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

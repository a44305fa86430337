"""Hermetic environment, tool paths, child-process helpers and the machine description."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ROOT", "PYTHON", "ONCEPATCH", "GNU_TIME", "Env", "setup_env", "run", "run_rusage", "fsync_floor", "metadata_floor",
           "product_revision", "machine_info"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
_bin = os.path.dirname(PYTHON)
ONCEPATCH = os.path.join(_bin, "oncepatch") if os.path.exists(os.path.join(_bin, "oncepatch")) else ""


@dataclass(frozen=True)
class Env:
    out: str  # the run's output folder (bench-out/ by default)
    home: str
    tmp: str


def setup_env(out: str) -> Env:
    """Point HOME at a private folder with a minimal git config; clear GIT_* and ONCEPATCH_*.

    Set before pygit2 is first imported (libgit2 reads the global config path
    from HOME on first use), so the in-process API and every child see the
    same configuration — no developer's config leaks into the numbers.
    """
    out = os.path.abspath(out)
    home = os.path.join(out, "home")
    tmp = os.path.join(out, "tmp")
    os.makedirs(home, exist_ok=True)
    os.makedirs(tmp, exist_ok=True)
    for name in list(os.environ):
        if name.startswith(("GIT_", "ONCEPATCH_")):
            del os.environ[name]
    # Measure the product as installed: its modules compiled once (pip does this on
    # install), not recompiled by every cold process when the shell forbids
    # writing bytecode (PYTHONDONTWRITEBYTECODE).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    import compileall

    for pkg in ("cas", "receipts", "patcher"):
        compileall.compile_dir(os.path.join(ROOT, pkg), quiet=1)
    os.environ.update({
        "HOME": home,
        "XDG_CONFIG_HOME": os.path.join(home, ".config"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "Bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
        "GIT_COMMITTER_NAME": "Bench", "GIT_COMMITTER_EMAIL": "bench@example.com",
        "LC_ALL": "C",
        # The CLI rows run in process; the server section asks for its server explicitly.
        "ONCEPATCH_SERVER": "never",
    })
    with open(os.path.join(home, ".gitconfig"), "w") as fh:
        fh.write("[user]\n\tname = Bench\n\temail = bench@example.com\n"
                 "[init]\n\tdefaultBranch = main\n[gc]\n\tauto = 0\n[core]\n\tautocrlf = false\n")
    return Env(out, home, tmp)


def run(cmd: list[str] | str, *, cwd: str | None = None, input: bytes | None = None,
        env: dict[str, str] | None = None, check: bool = True, shell: bool = False) -> subprocess.CompletedProcess[bytes]:
    res = subprocess.run(cmd, cwd=cwd, input=input, capture_output=True, env=env, shell=shell, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"command failed ({res.returncode}): {cmd}\n{res.stderr.decode(errors='replace')[-2000:]}"
                           f"\n{res.stdout.decode(errors='replace')[-1000:]}")
    return res


def _gnu_time() -> str | None:
    path = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    if path is None:
        return None
    res = subprocess.run([path, "-f", "%M", "true"], capture_output=True)
    return path if res.returncode == 0 and res.stderr.strip().isdigit() else None


GNU_TIME = _gnu_time()


def run_rusage(cmd: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
               stdin: bytes | None = None, mem: bool = False) -> tuple[float, int, bytes, bytes, int | None]:
    """Run ``cmd``; return (wall seconds, exit status, stdout, stderr, peak RSS in KiB or ``None``).

    With ``mem``, the command runs under GNU ``time -f %M``, which reports the
    peak RSS of its child (and the descendants it reaped).  Why not ``wait4``
    here: a child forked from this (large) harness starts with the harness's
    RSS as its high-water mark, and Linux carries that mark through ``exec``
    into ``ru_maxrss`` — every child would report at least the harness's size.
    A child forked from the small ``time`` process does not.
    """
    out_file = None
    if mem:
        if GNU_TIME is None:
            raise RuntimeError("GNU time is needed for memory peaks: apt-get install time")
        fd, out_file = tempfile.mkstemp(prefix="bench-rss-")
        os.close(fd)
        cmd = [GNU_TIME, "-f", "%M", "-o", out_file, *cmd]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = _drain(p, stdin)
    rc = p.wait()
    elapsed = time.perf_counter() - t0
    rss = None
    if out_file is not None:
        with open(out_file) as fh:
            lines = [ln.strip() for ln in fh if ln.strip()]
        os.unlink(out_file)
        rss = int(lines[-1]) if lines and lines[-1].isdigit() else None
    return elapsed, rc, out, err, rss


def _drain(p: subprocess.Popen[bytes], data: bytes | None) -> tuple[bytes, bytes]:
    """Feed stdin and read stdout and stderr to the end (threads: no pipe can fill up)."""
    import threading

    box: dict[str, bytes] = {}

    def read_err() -> None:
        box["err"] = p.stderr.read()  # type: ignore[union-attr]
        p.stderr.close()  # type: ignore[union-attr]

    t = threading.Thread(target=read_err)
    t.start()
    if data is not None:
        def feed() -> None:
            try:
                p.stdin.write(data)  # type: ignore[union-attr]
                p.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass

        t2 = threading.Thread(target=feed)
        t2.start()
    out = p.stdout.read()  # type: ignore[union-attr]
    p.stdout.close()  # type: ignore[union-attr]
    t.join()
    if data is not None:
        t2.join()
    return out, box.get("err", b"")


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def product_revision() -> str:
    """The commit the product code comes from, and whether its folders have uncommitted changes."""
    rev = os.environ.get("BENCH_PRODUCT_REV")
    if rev:
        return rev
    head = run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False).stdout.decode().strip()
    if not head:
        return "unknown (not a git checkout)"
    dirty = run(["git", "status", "--porcelain", "--", "cas", "receipts", "patcher"], cwd=ROOT,
                check=False).stdout.decode().splitlines()
    return f"{head}" + (f" + uncommitted changes in {len(dirty)} file(s) of cas/receipts/patcher" if dirty else "")


def fsync_floor(folder: str, n: int = 40) -> dict[str, float]:
    """Median ms of: one fsync of a small rewritten file; one durable atomic write (tmp, fsync, rename, dir fsync)."""
    import statistics

    path = os.path.join(folder, "fsync-probe")
    one, atomic = [], []
    for i in range(n):
        with open(path, "wb") as fh:
            fh.write(b"x" * (100 + i))
            fh.flush()
            t0 = time.perf_counter()
            os.fsync(fh.fileno())
            one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path + ".tmp", "wb") as fh:
            fh.write(b"y" * (100 + i))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        atomic.append(time.perf_counter() - t0)
    os.unlink(path)
    return {"fsync_ms": statistics.median(one) * 1000, "atomic_write_ms": statistics.median(atomic) * 1000}


def metadata_floor(folder: str, n: int = 200) -> dict[str, float]:
    """Median µs of creating a new file (``O_CREAT|O_EXCL``) and of renaming it over an existing one, in ``folder``.

    What every tmp file and every atomic replace costs there, fsync aside.  On
    this machine a create costs a few µs in one folder and 0.1–0.6 ms in
    another of the same filesystem (which folders varies between runs): it is
    measured in the folders the calls ran in, after they ran.  The rename is
    timed twice: over an empty file, and over one that holds data (a ref, a
    receipt, the index: every replace the protocol makes), whose freed block
    costs what the filesystem's ``discard`` option makes it cost.
    """
    import statistics

    target = os.path.join(folder, ".metadata-probe")
    create, rename, rename_data = [], [], []
    for i in range(n):
        tmp = f"{target}.{os.getpid()}-{i}.tmp"
        t0 = time.perf_counter()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        create.append(time.perf_counter() - t0)
        os.close(fd)
        t0 = time.perf_counter()
        os.replace(tmp, target)
        rename.append(time.perf_counter() - t0)
    for i in range(n + 1):  # the first one replaces the empty file: not counted
        tmp = f"{target}.{os.getpid()}-{i}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"0" * 64)
        os.fsync(fd)  # (as the protocol's are: no delayed allocation left to the rename)
        os.close(fd)
        t0 = time.perf_counter()
        os.replace(tmp, target)
        if i:
            rename_data.append(time.perf_counter() - t0)
    os.unlink(target)
    return {"create_us": statistics.median(create) * 1e6, "rename_us": statistics.median(rename) * 1e6,
            "rename_data_us": statistics.median(rename_data) * 1e6}


def _journal(source: str) -> str:
    """``yes`` / ``no`` for an ext3/4 block device (``/proc/fs/jbd2`` lists journaled ones), else ``–``."""
    dev = os.path.basename(source.split("[", 1)[0])
    if not source.startswith("/dev/") or not os.path.isdir("/proc/fs/jbd2"):
        return "–"
    return "yes" if any(name.startswith(dev + "-") for name in os.listdir("/proc/fs/jbd2")) else "no"


def machine_info(path: str) -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor())
    mem_kib = next((int(ln.split()[1]) for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), 0)
    fs = run(["findmnt", "-n", "-T", path, "-o", "FSTYPE,SOURCE,OPTIONS"], check=False).stdout.decode().strip()
    git = run(["git", "--version"], check=False).stdout.decode().strip()
    import pygit2

    strace = shutil.which("strace")
    sv = run([strace, "-V"], check=False).stdout.decode().splitlines()[0] if strace else "not installed"
    return {
        "product": product_revision(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kib / (1 << 20), 1),
        "filesystem": fs,
        "journal": _journal(fs.split()[1]) if len(fs.split()) > 1 and fs.split()[0].startswith("ext") else "–",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pygit2": pygit2.__version__,
        "libgit2": pygit2.LIBGIT2_VERSION,
        "git": git,
        "strace": sv,
        "maxrss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }

"""``--check CMD``: run a command against the candidate tree before the branch may move (docs/CONCURRENCY.md section 7).

The candidate commit is checked out into a temporary git worktree under
``<store>/tmp/worktrees/<h>-<pid>`` (git shares the object database: only the
files are written); CMD runs there, and a non-zero exit or a timeout is
``rejected`` (``check_failed``).  The user's worktree and branch are not
touched until the check passed; the temporary worktree is removed
afterwards, and after a crash by ``recover``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable

from cas.crash import crash_point
from cas.progress import phase
from cas.durable import write_durable
from cas.objects import GitStore
from receipts.errors import CorruptReceipt
from receipts.identity import key_hash
from receipts.store import ReceiptStore
from patcher.errors import CheckFailed

__all__ = ["run_check", "check_worktree_root", "remove_check_worktree", "verified_path", "OUTPUT_CAP"]

#: At most this much of a check's output is kept (the digest covers all of it).
OUTPUT_CAP = 1 << 20


def check_worktree_root(rstore: ReceiptStore) -> str:
    return os.path.join(rstore.tmp_dir, "worktrees")


def _git(cwd: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=timeout, env=env, check=False)


def verified_path(fd: int, shown: str) -> str:
    """The path of the folder open as ``fd``, checked to lead to that very folder now (device and inode).

    For the tools that take a path (git, a process's working folder): the path
    is the folder's own (``/proc/self/fd``: no store folder swapped for a symlink
    since it was opened lies on it), else ``shown``.  What remains: a folder on
    the way swapped between this check and the tool's own open of the path.

    Raises:
        CorruptReceipt: the path leads elsewhere (or nowhere) now.
    """
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = shown
    st = os.fstat(fd)
    try:
        now = os.stat(real)
    except OSError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise CorruptReceipt(shown, "a store folder was swapped while in use (a symlink?): not used through its path")
    return real


def remove_check_worktree(repo_dir: str, folder_fd: int, name: str) -> None:
    """Remove the temporary worktree ``name`` of the folder open as ``folder_fd``, then git's entry for it
    (safe to repeat).

    Removed through the descriptor (``shutil.rmtree(dir_fd=)`` follows no
    symlink), never by a path git resolves; ``git worktree prune`` then drops
    the entry whose folder is gone.
    """
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(name, dir_fd=folder_fd)
    _git(repo_dir, "worktree", "prune")


def run_check(
    rstore: ReceiptStore,
    gstore: GitStore,
    candidate: str,
    cmd: str,
    *,
    key: str,
    timeout: float,
    on_fail: Callable[[CheckFailed], None],
) -> None:
    """Run ``cmd`` in a temporary worktree of ``candidate``; return if it passed.

    The worktree's folder is made through descriptors reached from the store's
    root without following a symlink (:meth:`ReceiptStore.folder_fd`); git and
    the command get its path only once checked to lead there
    (:func:`verified_path`).

    Raises:
        CheckFailed: non-zero exit or timeout (``on_fail`` has recorded the rejection).
        CorruptReceipt: ``tmp/`` or ``tmp/worktrees`` is a symlink (or was swapped for one): nothing was made.
    """
    h = key_hash(key)
    name = f"{h}-{os.getpid()}"
    shown = os.path.join(check_worktree_root(rstore), name)
    repo_dir = gstore.repo.workdir or gstore.common_dir
    with contextlib.ExitStack() as stack:
        root_fd = stack.enter_context(rstore.folder_fd(check_worktree_root(rstore), create=True))
        with contextlib.suppress(FileNotFoundError):
            os.lstat(name, dir_fd=root_fd)
            remove_check_worktree(repo_dir, root_fd, name)  # a crashed call of an earlier process of this pid
        os.mkdir(name, 0o755, dir_fd=root_fd)
        stack.callback(remove_check_worktree, repo_dir, root_fd, name)  # also when anything below fails
        entry_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        stack.callback(os.close, entry_fd)
        with phase("creating the check's worktree"):  # seconds in a large repository: say so
            res = _git(repo_dir, "worktree", "add", "--detach", "--force", verified_path(entry_fd, shown), candidate)
        if res.returncode != 0:
            raise CheckFailed(
                f"cannot create a worktree for the check: {res.stderr.decode(errors='replace').strip()}",
                details={"check": cmd}, error_type="check_failed",
            )
        crash_point("check-running")
        with phase(f"running the check '{cmd}'"):
            status, output, digest, size, timed_out = _run(cmd, verified_path(entry_fd, shown), timeout)
        with phase("removing the check's worktree"):
            stack.close()
    if status == 0 and not timed_out:
        return
    out_path = rstore.path_for_hash(h)[:-5] + ".check.txt"
    with rstore.folder_fd(os.path.dirname(out_path), create=True) as shard_fd:
        write_durable(os.path.basename(out_path), output, dir_fd=shard_fd)
    reason = f"timed out after {timeout:g}s" if timed_out else f"exited with status {status}"
    err = CheckFailed(
        f"check '{cmd}' {reason}",
        details={"check": cmd, "exit_status": status, "timed_out": timed_out, "output_sha256": digest,
                 "output_bytes": size, "output_path": out_path},
    )
    on_fail(err)
    raise err


def _run(cmd: str, cwd: str, timeout: float) -> tuple[int, bytes, str, int, bool]:
    """Run ``cmd``: ``(exit status, first OUTPUT_CAP bytes of its output, sha256 of all of it, size, timed out)``.

    The output goes to an unnamed file, not a pipe: a background process the
    check leaves behind (``server &``) keeps a pipe open, and reading it to its
    end waited for that process, not for the check (a passing check was then
    "timed out", or waited on forever when the process left the group).  The
    check's exit is what counts; what is left of its process group is killed.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and k != "ONCEPATCH_CRASH_AT"}
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, shell=True, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        timed_out = False
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            status = -9
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the check's leftovers (or the check, timed out)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        out.seek(0)
        head = out.read(OUTPUT_CAP)
        digest = hashlib.sha256(head)
        size = len(head)
        for chunk in iter(lambda: out.read(1 << 20), b""):  # hashed whole, kept capped (memory stays small)
            digest.update(chunk)
            size += len(chunk)
    return status, head, digest.hexdigest(), size, timed_out

"""The ``command`` effect: run a program once per key; **not queryable**.

Nobody can tell from outside whether an arbitrary command did its work, so
:meth:`CommandAdapter.query` always answers ``unknown``: a crash while the
command runs, or a timeout, leaves the receipt ``unknown`` until a person
looks and runs ``oncepatch resolve KEY --as committed|rejected --note ...``.
This is the path every non-queryable tool takes (docs/DESIGN.md section 1).

Args (the identity): ``argv``, ``cwd`` (absolute, real), ``env`` (only the
variables the caller sets, sorted; ``None``: inherit), ``stdin_sha256``.  The
timeout is not part of the intent.  A command that runs to its end is
``committed`` whatever its exit status (it ran, once): the result holds
``returncode`` and the digests and tails of stdout and stderr.  A program
that cannot be started is ``rejected`` (nothing ran).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from receipts.adapter import QueryResult
from receipts.effects import EffectCall, EffectResult, InvalidEffectArgs, perform
from receipts.receipt import Receipt
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore

__all__ = ["TOOL", "TOOL_VERSION", "CommandAdapter", "command_args", "run_command", "TAIL_BYTES"]

TOOL = "command"
TOOL_VERSION = "1"
#: How much of stdout and stderr the result keeps (the end: where errors are).
TAIL_BYTES = 8192


def command_args(argv: Sequence[str], *, cwd: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, stdin: bytes | None = None) -> dict[str, Any]:
    """The normalised args of running ``argv``.

    Raises:
        InvalidEffectArgs: empty argv or a non-string item.
    """
    if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidEffectArgs("argv must be a non-empty list of strings")
    return {
        "argv": list(argv),
        "cwd": os.path.realpath(os.fspath(cwd) if cwd is not None else os.getcwd()),
        "env": dict(sorted(env.items())) if env is not None else None,
        "stdin_sha256": hashlib.sha256(stdin).hexdigest() if stdin is not None else None,
    }


def _tail(data: bytes) -> str:
    return data[-TAIL_BYTES:].decode("utf-8", "replace")


class CommandAdapter:
    tool = TOOL
    tool_version = TOOL_VERSION

    def prepare(self, args: dict[str, Any]) -> dict[str, Any]:
        if not os.path.isdir(str(args["cwd"])):
            raise InvalidEffectArgs(f"cannot run in '{args['cwd']}': no such folder")
        return {}

    def query(self, receipt: Receipt) -> QueryResult:
        return QueryResult("unknown", "a command's effect cannot be queried")

    def settle(self, receipt: Receipt) -> list[str]:
        return []

    def confirm(self, receipt: Receipt) -> list[str]:
        return []

    def verify_committed(self, receipt: Receipt) -> list[str]:
        return []


def run_command(
    argv: Sequence[str],
    *,
    key: str | None = None,
    store: ReceiptStore | str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    stdin: bytes | None = None,
    timeout: float | None = None,
    attempt: int = 1,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> EffectResult:
    """Run ``argv`` once per key (``env`` is added to the inherited environment).

    Raises: as :func:`receipts.effects.effect`; a timeout is
    :class:`~receipts.effects.EffectUnknown` (the command may have acted), and
    the process is killed.
    """
    args = command_args(argv, cwd=cwd, env=env, stdin=stdin)

    def run(call: EffectCall) -> dict[str, Any]:
        with call.before_send():  # exec failures happen before the program runs
            proc = subprocess.Popen(
                args["argv"], cwd=args["cwd"], env={**os.environ, **env} if env is not None else None,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a timeout stops the whole tree
            )
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except BaseException:
            # Kill the group, not only the child: a grandchild holding the pipes open
            # would keep communicate() waiting past the timeout.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return {
            "returncode": proc.returncode,
            "stdout_sha256": hashlib.sha256(out).hexdigest(),
            "stderr_sha256": hashlib.sha256(err).hexdigest(),
            "stdout_tail": _tail(out),
            "stderr_tail": _tail(err),
        }

    return perform(TOOL, args, run, key=key, adapter=CommandAdapter(), store=store,
                   tool_version=TOOL_VERSION, attempt=attempt, lock_timeout=lock_timeout)

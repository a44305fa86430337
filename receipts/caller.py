"""Who is calling: the uid, gid and groups a call runs for (stdlib only).

In process the caller is this process.  Through ``oncepatch serve`` it is the
peer of the server's socket, as the kernel reports it (``SO_PEERCRED``): the
process cannot claim another identity.  The CLI hands it to every command as
``args.caller`` (:func:`patcher.cli.run.main`), the hook an authorize step
reads before the idempotency step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Caller"]


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    groups: tuple[int, ...]
    pid: int
    #: True when the kernel vouched for it (a server's peer), False for this process's own view
    peer: bool = False

    @classmethod
    def of_process(cls) -> Caller:
        return cls(os.getuid(), os.getgid(), tuple(sorted(set(os.getgroups()) | {os.getgid()})), os.getpid())

"""An ``index.lock`` is never held past the call that took it, whatever transient fault the call met.

A long-lived caller (``patcher.api.Client``, the MCP server) outlives its
calls: a lock left behind by one of them is its own process's, which is
alive, so no later call takes it for a dead call's lock, and every later
call of the caller (and every ``git commit``) met ``index.lock`` until the
process exited.  The faults are injected in-process at the seam (``os.unlink``
of the lock, ``os.replace`` onto the index), transient: the call fails or
succeeds, and then the lock is gone, the index is whole, and the same
client applies again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import patcher
from cas.errors import OncepatchError
from conftest import Repo, snapshot


def add_file(name: str) -> str:
    return f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1 @@\n+{name}\n"


EDIT = """\
--- a/src/app.py
+++ b/src/app.py
@@ -1,3 +1,3 @@
 line 1
-line 2
+line two
 line 3
"""


def failing(real: Callable[..., Any], names: Callable[[str], bool], at: set[int],
            argument: int = 0) -> Callable[..., Any]:
    """``real``, raising EIO on the calls (1-based, counted among those whose path ``names``) listed in ``at``."""
    seen = [0]

    def call(*args: Any, **kw: Any) -> Any:
        path = os.fspath(args[argument])
        if names(path):
            seen[0] += 1
            if seen[0] in at:
                raise OSError(5, "Input/output error (injected)", path)
        return real(*args, **kw)

    call.seen = seen  # type: ignore[attr-defined]
    return call


def named(target: Path) -> Callable[[str], bool]:
    return lambda path: path == os.fspath(target)


def applies_again(repo: Repo, client: patcher.Client, name: str) -> None:
    res = client.apply(add_file(name), key=f"after/{name}")
    assert res.status == "committed" and not res.replayed
    assert repo.head() == res.commit and (repo.path / name).read_text() == f"{name}\n"
    assert repo.git("status", "--porcelain") == ""


@pytest.mark.parametrize("which", [1, 2], ids=["pre_check_lock", "lock_held_over_the_move"])
def test_a_transient_fault_removing_index_lock_does_not_leave_it(repo: Repo, monkeypatch: pytest.MonkeyPatch,
                                                                 which: int) -> None:
    """The call takes the lock twice (the pre-check, then over the branch's move); either removal may fail once."""
    lock = repo.path / ".git" / "index.lock"
    with patcher.Client(repo.path, lock_timeout=1) as client:
        unlink = failing(os.unlink, named(lock), {which})
        monkeypatch.setattr(os, "unlink", unlink)
        res = client.apply(EDIT, key="k")
        monkeypatch.undo()
        assert unlink.seen[0] > which  # the fault was met, and the removal tried again
        assert not lock.exists()
        assert res.status == "committed" and repo.head() == res.commit
        assert repo.git("status", "--porcelain") == ""
        applies_again(repo, client, "next.txt")


def test_a_transient_fault_writing_the_index_and_putting_it_back_releases_the_lock(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged index's write fails (nothing moves), then dropping the index kept for it fails once: the lock stayed.

    (Settling a worktree's index that cannot be put back leaves its lock held on purpose:
    released, git would commit the staged entries.  A transient fault must not get there.)
    """
    from cas.index_lock import KEPT_PREFIX

    index = repo.path / ".git" / "index"
    lock = repo.path / ".git" / "index.lock"
    before = snapshot(repo)
    with patcher.Client(repo.path, lock_timeout=1) as client:
        replace = failing(os.replace, named(index), {1}, argument=1)
        unlink = failing(os.unlink, lambda path: os.path.basename(path).startswith(KEPT_PREFIX), {1})
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "unlink", unlink)
        with pytest.raises(OncepatchError) as info:
            client.apply(EDIT, key="k")
        monkeypatch.undo()
        assert replace.seen[0] == 1 and unlink.seen[0] == 2  # the write failed; the kept index, dropped again
        assert info.value.effect_status in ("not_applied", "not_started"), info.value.envelope()
        assert not lock.exists()
        assert not [n for n in os.listdir(repo.path / ".git") if n.startswith(KEPT_PREFIX)]
        after = snapshot(repo)
        assert {k: v for k, v in after.items() if k != "store"} == {k: v for k, v in before.items() if k != "store"}
        # The same client, the same key: applied now (the rejection was retryable).
        res = client.apply(EDIT, key="k")
        assert res.status == "committed" and repo.head() == res.commit
        applies_again(repo, client, "next.txt")


def test_a_removal_that_keeps_failing_is_reported_and_the_lock_stays_ours(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not transient: the error comes back (never a silent lock left), and a later release removes it."""
    from cas.index_lock import RELEASE_ATTEMPTS, hold_index_lock

    lock_path = repo.path / ".git" / "index.lock"
    lock = hold_index_lock(str(repo.path), timeout=0.0)
    monkeypatch.setattr(os, "unlink", failing(os.unlink, named(lock_path), set(range(1, RELEASE_ATTEMPTS + 1))))
    with pytest.raises(OSError):
        lock.release()
    monkeypatch.undo()
    assert lock_path.exists()
    lock.release()
    assert not lock_path.exists()

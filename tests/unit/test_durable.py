"""cas.durable: the one durable-write helper (tmp beside target, fsync, replace, fsync folder).

Fault tests inject the failure at the seam (``os.write``, ``os.fsync``,
``os.replace``) and assert no residue: target unchanged, no tmp file left.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cas import durable
from cas.durable import TMP_MARK, append_durable, fsync_dir, is_own_tmp, open_dir_nofollow, write_durable
from cas.errors import DurableWriteError, UnsafeWorktreePath

OLD = b"old content\n"
NEW = b"new content, longer than the old one\n" * 100


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _residue(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if TMP_MARK in n)


@pytest.fixture
def target(tmp_path: Path) -> Path:
    p = tmp_path / "data.json"
    p.write_bytes(OLD)
    p.chmod(0o600)
    return p


@pytest.fixture
def umask077() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


# -- the happy path ---------------------------------------------------------------


def test_new_file_has_exact_content_and_default_mode(tmp_path: Path, umask077: None) -> None:
    p = tmp_path / "fresh.bin"
    data = bytes(range(256)) * 10
    write_durable(str(p), data)
    assert p.read_bytes() == data
    assert stat.S_IMODE(p.stat().st_mode) == 0o644  # umask 077 did not narrow it
    assert _residue(tmp_path) == []


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755, 0o700])
def test_mode_is_applied_exactly_despite_umask(target: Path, mode: int, umask077: None) -> None:
    write_durable(str(target), NEW, mode=mode)
    assert target.read_bytes() == NEW
    assert stat.S_IMODE(target.stat().st_mode) == mode


def test_replaces_existing_file_with_new_inode(target: Path) -> None:
    before = target.stat().st_ino
    write_durable(str(target), NEW)
    assert target.read_bytes() == NEW
    assert target.stat().st_ino != before  # replaced by rename, not rewritten in place
    assert _residue(target.parent) == []


def test_empty_data_and_memoryview(tmp_path: Path) -> None:
    p = tmp_path / "empty"
    write_durable(str(p), b"")
    assert p.read_bytes() == b""
    write_durable(str(p), memoryview(b"abcdef")[2:])
    assert p.read_bytes() == b"cdef"


def test_short_writes_are_looped(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    calls: list[int] = []

    def short_write(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        return real_write(fd, bytes(data[:7]))  # never more than 7 bytes at a time

    monkeypatch.setattr(os, "write", short_write)
    write_durable(str(target), NEW)
    monkeypatch.undo()
    assert target.read_bytes() == NEW
    assert len(calls) == -(-len(NEW) // 7)


def _record_syncs_and_renames(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def rec_fsync(fd: int) -> None:
        events.append(("fsync", _fd_path(fd)))
        real_fsync(fd)

    def rec_replace(src: str, dst: str, **kw: object) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", rec_fsync)
    monkeypatch.setattr(os, "replace", rec_replace)
    return events


def test_fsyncs_tmp_before_replace_and_folder_after(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _record_syncs_and_renames(monkeypatch)
    write_durable(str(target), NEW)
    monkeypatch.undo()
    kinds = [k for k, _ in events]
    assert kinds == ["fsync", "replace", "fsync"]
    tmp_name = os.path.basename(events[0][1])  # the tmp file's data was synced
    assert is_own_tmp(tmp_name) and tmp_name.startswith(".data.json" + TMP_MARK)
    assert events[1][1] == str(target)  # then renamed over the target
    assert events[2][1] == str(target.parent)  # then the folder holding the rename


def test_tmp_file_is_beside_target_and_named_as_ours(target: Path) -> None:
    seen: list[str] = []

    def hook() -> None:
        seen.extend(n for n in os.listdir(target.parent) if n != target.name)

    write_durable(str(target), NEW, before_replace=hook)
    assert len(seen) == 1
    name = seen[0]
    assert is_own_tmp(name)
    assert name.startswith(f".data.json{TMP_MARK}{os.getpid()}-")


def test_before_replace_runs_after_fsync_and_before_rename(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_fsync = os.fsync

    def rec_fsync(fd: int) -> None:
        order.append("fsync")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", rec_fsync)
    inside: dict[str, object] = {}

    def hook() -> None:
        order.append("hook")
        inside["target"] = target.read_bytes()
        tmps = [target.parent / n for n in _residue(target.parent)]
        inside["tmp"] = [p.read_bytes() for p in tmps]
        inside["tmp_mode"] = [stat.S_IMODE(p.stat().st_mode) for p in tmps]

    write_durable(str(target), NEW, mode=0o640, before_replace=hook)
    monkeypatch.undo()
    assert order[:2] == ["fsync", "hook"]
    assert inside["target"] == OLD  # not yet renamed
    assert inside["tmp"] == [NEW]  # complete and synced
    assert inside["tmp_mode"] == [0o640]
    assert target.read_bytes() == NEW
    assert _residue(target.parent) == []


# -- failures leave no residue --------------------------------------------------


def _enospc(*_a: object, **_k: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_write_enospc_leaves_target_and_no_tmp(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    n = [0]

    def failing_write(fd: int, data: bytes | memoryview) -> int:
        n[0] += 1
        if n[0] == 1:
            return real_write(fd, bytes(data[:100]))  # a partial tmp file exists, then the disk fills
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(DurableWriteError) as ei:
        write_durable(str(target), NEW)
    monkeypatch.undo()
    assert ei.value.cause.errno == errno.ENOSPC
    assert ei.value.path == str(target)
    assert "No space left" in ei.value.message
    assert target.read_bytes() == OLD
    assert _residue(target.parent) == []


def test_fsync_eio_leaves_target_and_no_tmp(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(DurableWriteError) as ei:
        write_durable(str(target), NEW)
    monkeypatch.undo()
    assert ei.value.cause.errno == errno.EIO
    assert ei.value.retryable is True
    assert target.read_bytes() == OLD
    assert _residue(target.parent) == []


def test_fsync_enospc_on_new_target_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(DurableWriteError):
        write_durable(str(tmp_path / "new"), NEW)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_replace_failure_leaves_target_and_no_tmp(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "replace", _enospc)
    with pytest.raises(DurableWriteError) as ei:
        write_durable(str(target), NEW)
    monkeypatch.undo()
    assert ei.value.cause.errno == errno.ENOSPC
    assert target.read_bytes() == OLD
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _residue(target.parent) == []


def test_hook_exception_propagates_unwrapped_and_cleans_up(target: Path) -> None:
    class Boom(Exception):
        pass

    def hook() -> None:
        raise Boom()

    with pytest.raises(Boom):
        write_durable(str(target), NEW, before_replace=hook)
    assert target.read_bytes() == OLD
    assert _residue(target.parent) == []


def test_keyboard_interrupt_in_hook_cleans_up(target: Path) -> None:
    def hook() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_durable(str(target), NEW, before_replace=hook)
    assert target.read_bytes() == OLD
    assert _residue(target.parent) == []


def test_folder_fsync_failure_after_rename_is_unknown(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync
    n = [0]

    def second_fails(fd: int) -> None:
        n[0] += 1
        if n[0] == 2:  # the folder's fsync, after the rename
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", second_fails)
    with pytest.raises(DurableWriteError) as ei:
        write_durable(str(target), NEW)
    monkeypatch.undo()
    assert ei.value.effect_status == "unknown"  # the rename landed; its durability is in doubt
    assert target.read_bytes() == NEW
    assert _residue(target.parent) == []


def test_missing_folder_is_a_durable_write_error(tmp_path: Path) -> None:
    with pytest.raises(DurableWriteError) as ei:
        write_durable(str(tmp_path / "nope" / "x"), b"x")
    assert isinstance(ei.value.cause, FileNotFoundError)


def test_symlink_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    link = tmp_path / "link"
    link.symlink_to(victim)
    write_durable(str(link), NEW)
    assert not link.is_symlink() and link.read_bytes() == NEW
    assert victim.read_bytes() == b"precious\n"


def test_folder_at_target_fails_without_residue(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inside").write_bytes(b"x")
    with pytest.raises(DurableWriteError):
        write_durable(str(tmp_path / "dir"), NEW)
    assert (tmp_path / "dir" / "inside").read_bytes() == b"x"
    assert _residue(tmp_path) == []


# -- O_EXCL | O_NOFOLLOW: never reuse or follow someone else's file --------------


def test_planted_symlink_at_tmp_name_is_never_followed(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    victim.write_bytes(b"precious\n")
    monkeypatch.setattr(durable, "_token", lambda: "deadbeef")
    planted = target.parent / f".{target.name}{TMP_MARK}{os.getpid()}-deadbeef"
    planted.symlink_to(victim)

    with pytest.raises(DurableWriteError) as ei:
        write_durable(str(target), NEW)
    assert ei.value.cause.errno == errno.EEXIST
    assert victim.read_bytes() == b"precious\n"
    assert planted.is_symlink() and os.readlink(planted) == str(victim)  # not ours: not removed
    assert target.read_bytes() == OLD


def test_planted_dangling_symlink_is_not_created_through(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ghost = tmp_path / "ghost"
    monkeypatch.setattr(durable, "_token", lambda: "0badf00d")
    planted = target.parent / f".{target.name}{TMP_MARK}{os.getpid()}-0badf00d"
    planted.symlink_to(ghost)
    with pytest.raises(DurableWriteError):
        write_durable(str(target), NEW)
    assert not ghost.exists()  # O_CREAT through a dangling link would have made it
    assert target.read_bytes() == OLD


def test_planted_regular_file_at_tmp_name_is_not_reused(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durable, "_token", lambda: "cafebabe")
    planted = target.parent / f".{target.name}{TMP_MARK}{os.getpid()}-cafebabe"
    planted.write_bytes(b"someone else's\n")
    with pytest.raises(DurableWriteError):
        write_durable(str(target), NEW)
    assert planted.read_bytes() == b"someone else's\n"
    assert target.read_bytes() == OLD


# -- dir_fd --------------------------------------------------------------------


def test_dir_fd_variant_writes_relative_to_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "inner"
    folder.mkdir()
    (folder / "f").write_bytes(OLD)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_durable("f", NEW, mode=0o751, dir_fd=fd)
    finally:
        os.close(fd)
    assert (folder / "f").read_bytes() == NEW
    assert stat.S_IMODE((folder / "f").stat().st_mode) == 0o751
    assert os.listdir(elsewhere) == []
    assert _residue(folder) == []


def test_dir_fd_variant_failure_cleans_up_in_that_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "inner"
    folder.mkdir()
    (folder / "f").write_bytes(OLD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "replace", _enospc)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(DurableWriteError):
            write_durable("f", NEW, dir_fd=fd)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert (folder / "f").read_bytes() == OLD
    assert _residue(folder) == []
    assert _residue(tmp_path) == []


def test_fsync_dir_by_path_and_by_fd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def rec(fd: int) -> None:
        synced.append(_fd_path(fd))
        real(fd)

    monkeypatch.setattr(os, "fsync", rec)
    fsync_dir(str(tmp_path))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync_dir(dir_fd=fd)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert synced == [str(tmp_path), str(tmp_path)]


# -- open_dir_nofollow ----------------------------------------------------------


def test_open_dir_nofollow_refuses_symlinked_folder(tmp_path: Path) -> None:
    root = tmp_path / "wt"
    (root / "real").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    (root / "real" / "inner_link").symlink_to(outside)
    for rel in ("link", "link/sub", "real/inner_link"):
        with pytest.raises(UnsafeWorktreePath) as ei:
            with open_dir_nofollow(str(root), rel, create=True):
                pass
        assert ei.value.details["path"] == rel
    assert os.listdir(outside) == []  # create=True made nothing through the link


def test_open_dir_nofollow_refuses_a_file_component(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UnsafeWorktreePath):
        with open_dir_nofollow(str(tmp_path), "f/x", create=True):
            pass


def test_open_dir_nofollow_opens_existing_and_creates_missing(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    with open_dir_nofollow(str(tmp_path), "a") as fd:
        assert _fd_path(fd) == str(tmp_path / "a")
    with pytest.raises(FileNotFoundError):
        with open_dir_nofollow(str(tmp_path), "a/b/c"):
            pass
    assert not (tmp_path / "a" / "b").exists()
    with open_dir_nofollow(str(tmp_path), "a/b/c", create=True) as fd:
        assert _fd_path(fd) == str(tmp_path / "a" / "b" / "c")
        write_durable("file", b"inside", dir_fd=fd)
    assert (tmp_path / "a" / "b" / "c" / "file").read_bytes() == b"inside"
    with open_dir_nofollow(str(tmp_path), "") as fd:
        assert _fd_path(fd) == str(tmp_path)


def test_open_dir_nofollow_closes_its_fds(tmp_path: Path) -> None:
    (tmp_path / "l").symlink_to(tmp_path)
    # What an earlier test of this worker left for the collector (a pipe of an unreaped object, say)
    # is closed now, not between the two counts.
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with open_dir_nofollow(str(tmp_path), "x/y/z", create=True):
            pass
        with pytest.raises(UnsafeWorktreePath):
            with open_dir_nofollow(str(tmp_path), "l/q"):
                pass
        with pytest.raises(FileNotFoundError):
            with open_dir_nofollow(str(tmp_path), "x/y/missing"):
                pass
    assert len(os.listdir("/proc/self/fd")) == before


# -- append_durable ---------------------------------------------------------------


def test_append_durable_appends_and_fsyncs_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "sub" / "events.jsonl"
    log.parent.mkdir()
    synced: list[str] = []
    real = os.fsync

    def rec(fd: int) -> None:
        synced.append(_fd_path(fd))
        real(fd)

    monkeypatch.setattr(os, "fsync", rec)
    append_durable(str(log), b"one\n")
    append_durable(str(log), b"two\n")
    monkeypatch.undo()
    assert log.read_bytes() == b"one\ntwo\n"
    # file synced on every append; its folder once, when the file was created
    assert synced == [str(log), str(log.parent), str(log)]


def test_append_durable_fsync_failure_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"one\n")
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(DurableWriteError) as ei:
        append_durable(str(log), b"two\n")
    assert ei.value.cause.errno == errno.ENOSPC


# -- is_own_tmp -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        (f".x.json{TMP_MARK}12-abcd0123", True),
        (f".README{TMP_MARK}1-00", True),
        (f"x.json{TMP_MARK}12-abcd", False),  # no leading dot: not a name we create
        (".x.json", False),
        ("x.json", False),
        (".x.json.tmp", False),
        ("", False),
    ],
)
def test_is_own_tmp(name: str, ours: bool) -> None:
    assert is_own_tmp(name) is ours


# -- DurableBatch: several files, two rounds of concurrent fsyncs -------------------------------


def test_batch_syncs_every_tmp_before_any_rename_and_every_folder_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "old").mkdir()
    targets = [tmp_path / "old" / "a", tmp_path / "new" / "deeper" / "b", tmp_path / "c"]
    events = _record_syncs_and_renames(monkeypatch)
    batch = durable.DurableBatch()
    for i, t in enumerate(targets):
        batch.add(str(t), b"payload %d" % i)
    seen: list[str] = []
    batch.commit(after_renames=lambda: seen.append("after") or [str(tmp_path / "c")])
    monkeypatch.undo()
    assert [t.read_bytes() for t in targets] == [b"payload 0", b"payload 1", b"payload 2"]
    assert seen == ["after"]
    kinds = [k for k, _ in events]
    first_rename, last_rename = kinds.index("replace"), len(kinds) - 1 - kinds[::-1].index("replace")
    round1 = {p for k, p in events[:first_rename] if k == "fsync"}
    round2 = {p for k, p in events[last_rename + 1:] if k == "fsync"}
    assert all(k == "replace" for k in kinds[first_rename:last_rename + 1])
    assert [p for k, p in events if k == "replace"] == [str(t) for t in targets]  # in the order added
    assert len(round1) == 3 and all(TMP_MARK in os.path.basename(p) for p in round1)
    # every folder a file landed in, the parents of the folders made, and the extra path
    assert round2 == {str(tmp_path / "old"), str(tmp_path / "new" / "deeper"), str(tmp_path / "new"),
                      str(tmp_path), str(tmp_path / "c")}
    assert _residue(tmp_path) == [] and _residue(tmp_path / "old") == []


def test_batch_failure_before_renames_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(OLD)
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if os.path.basename(_fd_path(fd)).startswith(".b"):
            raise OSError(errno.EIO, "injected")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    batch = durable.DurableBatch()
    batch.add(str(a), NEW)
    batch.add(str(b), NEW)
    with pytest.raises(DurableWriteError) as info:
        batch.commit()
    monkeypatch.undo()
    assert info.value.cause.errno == errno.EIO
    assert a.read_bytes() == OLD and not b.exists()
    assert _residue(tmp_path) == []


def test_batch_failed_rename_leaves_no_tmp_of_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_replace = os.replace

    def failing_replace(src: str, dst: str, **kw: object) -> None:
        if os.path.basename(dst) == "second":
            raise OSError(errno.EIO, "injected")
        real_replace(src, dst, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", failing_replace)
    batch = durable.DurableBatch()
    for name in ("first", "second", "third"):
        batch.add(str(tmp_path / name), name.encode())
    with pytest.raises(DurableWriteError):
        batch.commit()
    monkeypatch.undo()
    assert (tmp_path / "first").read_bytes() == b"first"  # renamed before the failure
    assert not (tmp_path / "second").exists() and not (tmp_path / "third").exists()
    assert _residue(tmp_path) == []


def test_batch_last_round_failure_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync

    def failing_dir_fsync(fd: int) -> None:
        if os.path.isdir(_fd_path(fd)):
            raise OSError(errno.EIO, "injected")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_dir_fsync)
    batch = durable.DurableBatch()
    batch.add(str(tmp_path / "x"), NEW)
    with pytest.raises(DurableWriteError) as info:
        batch.commit()
    monkeypatch.undo()
    assert (tmp_path / "x").read_bytes() == NEW  # renamed: only its durability is in doubt
    assert info.value.envelope()["effect_status"] == "unknown"


def test_batch_refuses_a_path_queued_twice(tmp_path: Path) -> None:
    batch = durable.DurableBatch()
    batch.add(str(tmp_path / "new"), b"n")
    with pytest.raises(ValueError):
        batch.add(str(tmp_path / "new"), b"other")  # a second entry for one path is a bug


def test_fsync_pool_is_remade_in_a_forked_child(tmp_path: Path) -> None:
    durable.fsync_all([str(tmp_path), str(tmp_path)])  # one path: inline
    files = [str(tmp_path / f"f{i}") for i in range(4)]
    for f in files:
        Path(f).write_bytes(b"x")
    durable.fsync_all(files)  # more than two: starts the pool in this process
    assert durable._POOL is not None and durable._POOL_PID == os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        signal.alarm(10)  # the parent's pool threads do not exist here: reusing them would hang
        try:
            durable.fsync_all(files)
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("n", [2, 5])  # on the threads (one path alone is synced inline)
def test_fsync_all_reports_a_failure_after_trying_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             n: int) -> None:
    files = [tmp_path / f"f{i}" for i in range(n)]
    for f in files:
        f.write_bytes(b"x")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync_failing_on_f1(fd: int) -> None:
        path = _fd_path(fd)
        synced.append(path)
        if path.endswith("/f1"):
            raise OSError(errno.EIO, "injected")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_failing_on_f1)
    with pytest.raises(DurableWriteError) as info:
        durable.fsync_all(str(f) for f in files)
    monkeypatch.undo()
    assert info.value.path == str(files[1]) and info.value.cause.errno == errno.EIO
    assert sorted(synced) == sorted(str(f) for f in files)


def test_batch_in_open_folders_writes_files_and_symlinks_and_syncs_by_fd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "old").write_bytes(OLD)
    events = _record_syncs_and_renames(monkeypatch)
    with open_dir_nofollow(str(tmp_path), "a") as dfd:
        batch = durable.DurableBatch()
        batch.add_in_dir(dfd, "old", NEW, mode=0o755)
        batch.add_in_dir(dfd, "link", symlink="old")
        batch.add_in_dir(dfd, "third", b"3")
        batch.commit()
    monkeypatch.undo()
    assert (tmp_path / "a" / "old").read_bytes() == NEW
    assert stat.S_IMODE((tmp_path / "a" / "old").stat().st_mode) == 0o755
    assert os.readlink(tmp_path / "a" / "link") == "old"
    assert (tmp_path / "a" / "third").read_bytes() == b"3"
    kinds = [k for k, _ in events]
    assert kinds.count("replace") == 3 and kinds.index("replace") >= 2  # both files' tmps synced first
    assert events[-1] == ("fsync", str(tmp_path / "a"))  # then the folder, through its fd
    assert _residue(tmp_path / "a") == []


def test_batch_in_open_folder_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "keep").write_bytes(OLD)

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with open_dir_nofollow(str(tmp_path), "a") as dfd:
        batch = durable.DurableBatch()
        batch.add_in_dir(dfd, "keep", NEW)
        batch.add_in_dir(dfd, "link", symlink="keep")
        with pytest.raises(DurableWriteError):
            batch.commit()
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "a")) == ["keep"] and (tmp_path / "a" / "keep").read_bytes() == OLD


def test_exchange_swaps_two_names_or_changes_nothing(tmp_path: Path) -> None:
    """``renameat2(RENAME_EXCHANGE)``: both names stay, their files swap; a missing name changes nothing."""
    from cas.durable import exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"new")
    b.write_bytes(b"old")
    ino_a = a.stat().st_ino
    if not exchange(str(a), str(b)):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this system or filesystem")
    assert (a.read_bytes(), b.read_bytes()) == (b"old", b"new") and b.stat().st_ino == ino_a
    with pytest.raises(FileNotFoundError):
        exchange(str(tmp_path / "missing"), str(b))
    assert b.read_bytes() == b"new" and not (tmp_path / "missing").exists()


def test_batch_step_alongside_runs_while_the_first_round_syncs(tmp_path: Path, target: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    tmp_synced = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if TMP_MARK in _fd_path(fd):
            tmp_synced.set()

    monkeypatch.setattr(os, "fsync", fsync)
    seen: list[bytes] = []

    def step() -> None:
        # The tmp file's sync runs on another thread meanwhile: waited for here, not after.
        assert tmp_synced.wait(10), "the first round did not start before the step"
        seen.append(target.read_bytes())

    batch = durable.DurableBatch()
    batch.add(str(target), NEW)
    batch.alongside_first(step)
    batch.commit()
    assert seen == [OLD]  # nothing renamed before the step returned
    assert target.read_bytes() == NEW and _residue(tmp_path) == []


def test_batch_step_alongside_that_fails_renames_nothing(tmp_path: Path, target: Path) -> None:
    def step() -> None:
        raise RuntimeError("the ref could not be created")

    batch = durable.DurableBatch()
    batch.add(str(target), NEW)
    batch.alongside_first(step)
    with pytest.raises(RuntimeError, match="could not be created"):
        batch.commit()
    assert target.read_bytes() == OLD and _residue(tmp_path) == []

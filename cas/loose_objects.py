"""A call's new loose objects, written by libgit2 and made durable in two concurrent rounds.

This is the one place oncepatch turns libgit2's object syncs off, to make a
call's objects durable together instead of one after another (a speed rule
of the project: an unusual speed-up lives in one module and says why).

Why: with ``enable_fsync_gitdir`` libgit2 syncs every loose object it writes
and the folder it renames it into, serially: a one-file patch (a blob, the
trees on its path, a commit) paid seven to ten syncs in a row, about half of
an in-process apply at 1k files (docs/BENCHMARKS.md, "Issue 23").  git's own
answer is ``core.fsyncMethod=batch``; this is that answer, step for step.

:func:`write_new` — the calling sequence, in order:

1. each object the repository already has (loose, packed, an alternate's) is
   freshened through libgit2's ``Odb.write`` as before: nothing is written,
   nothing needs a sync;
2. the others are written by libgit2 (``Odb.write``, never by hand) into the
   process's temporary object folder in ``objects/``,
   ``objects/tmp_objdir-oncepatch-<pid>-<random>/xx/…`` (git's name for
   one; kept for the next batches, :class:`_TmpObjdir`), with libgit2's
   fsync switched off for those writes only (:func:`_unsynced_objects`);
3. every written file is synced, at once (:func:`cas.durable.fsync_all`: one
   thread each; the disk flushes them together);
4. each file is renamed to ``objects/xx/…`` (its fan-out folder made when
   missing);
5. the fan-out folders renamed into, and ``objects/`` when one was made, are
   synced, at once;
6. a failed batch's files left in the temporary folder are removed.

:func:`stage_new` stops after step 2 and hands steps 3 to 6 to a
:class:`cas.durable.DurableBatch` that makes other files durable with the
objects (:class:`NewObjects`): the ``prepared`` receipt's tmp file is synced
in step 3's round, renamed after step 4, and its folder and the ledger are
synced in step 5's.  Two rounds of syncs for both instead of four.

Crash safety (docs/DESIGN.md, section 4): no object has its final name before
its bytes are synced (a power cut cannot leave a torn object that a later
write would take as present), and :func:`write_new` returns only when every
object is durable under its final name — before the ``prepared`` receipt is
written and before any ref moves.  The temporary folder is removed as the
process exits; a killed process leaves it, and ``git prune`` removes it past
its expiry (a ``tmp_`` name in ``objects/``), ``recover`` past
``--tmp-age`` (:func:`stale_tmp_objdirs`).

libgit2's switch is process-wide.  What it leaves unsynced while it is off:
objects written into a folder of libgit2's (its loose backend reads the
switch at each write), and the ref store of a repository first used in that
time (libgit2's ref backend reads it once, when it is created).  So: the
switch is off only while this module's lock is held, around the writes of
step 2; :func:`open_repository` opens a repository and creates its ref
backend under that lock, so that its refs and reflogs are always synced.
Other libgit2 writes of oncepatch sync themselves (the index is synced by
:mod:`cas.index`).  A program that writes objects through pygit2 on
another thread while a call runs may see those objects unsynced: libgit2
offers no switch per repository.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator, Mapping

import pygit2

from cas.durable import free_on_threads, fsync_all
from cas.errors import DurableWriteError, GitStoreError

__all__ = ["BATCH", "LIBGIT2_OBJECT_TMP_PREFIX", "NewObjects", "TMP_OBJDIR_PREFIX", "TmpObjdirGone", "enable_fsync",
           "open_repository", "remove_own_tmp_objdirs", "stage_new", "stale_tmp_objdirs", "write_new", "write_object"]

#: Off: every object is written and synced by libgit2 on its own, one after another (the
#: measured baseline: ``scripts/bench --object-sync both``).
BATCH = True

#: git's name for a temporary object folder (``tmp-objdir.c``); ``git prune`` removes ``tmp_*`` past its expiry.
TMP_OBJDIR_PREFIX = "tmp_objdir-oncepatch-"

_OBJECT_TYPES = {b"commit": 1, b"tree": 2, b"blob": 3}

#: How many times one object's write or move is tried while git's maintenance removes its fan-out folder.
_ATTEMPTS = 16

# Held while libgit2's fsync switch is off, and while a repository's ref backend is created.
_SWITCH = threading.Lock()
_fsync_on: bool | None = None  # None: never set here (libgit2's default, off)


def _forget_lock_in_child() -> None:
    # A forked child has only the forking thread: a lock another thread held stays held for
    # ever, and the switch that thread turned off stays off.  Its temporary object folders
    # are its own (their names carry its pid).
    global _SWITCH, _TMP_OBJDIRS, _TMP_OBJDIRS_GUARD
    _SWITCH = threading.Lock()
    _TMP_OBJDIRS, _TMP_OBJDIRS_GUARD = {}, threading.Lock()
    if _fsync_on:
        pygit2.settings.enable_fsync_gitdir(True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_lock_in_child)


def enable_fsync(on: bool | None = None) -> None:
    """Switch libgit2's syncs of what it writes in a git dir on or off (a benchmark's floor).

    ``None``: on, unless it was set before (as each store opens).
    """
    global _fsync_on
    if on is None and _fsync_on is not None:
        return
    with _SWITCH:
        _fsync_on = True if on is None else on
        pygit2.settings.enable_fsync_gitdir(_fsync_on)


@contextlib.contextmanager
def _unsynced_objects() -> Iterator[None]:
    """libgit2's fsync switch off for the writes inside (under the lock; see the module docstring)."""
    with _SWITCH:
        if not _fsync_on:
            yield
            return
        pygit2.settings.enable_fsync_gitdir(False)
        try:
            yield
        finally:
            pygit2.settings.enable_fsync_gitdir(True)


def open_repository(path: str) -> pygit2.Repository:
    """Open ``path`` with libgit2, its ref backend created while the fsync switch is on (module docstring).

    Raises:
        pygit2.GitError, KeyError: as ``pygit2.Repository`` does.
    """
    with _SWITCH:
        repo = pygit2.Repository(path)
        # Race guarded: libgit2 creates a repository's ref backend on the first ref
        # access and takes the switch's value then, for good; created while another
        # thread's objects are written, its refs and reflogs would never be synced.
        with contextlib.suppress(pygit2.GitError, ValueError):
            repo.references.get("HEAD")
    return repo


def write_object(odb: pygit2.Odb, oid: str, header: bytes, data: bytes | memoryview) -> None:
    """Write one object through ``odb`` (loose, or freshened if there); it must get the id hashed by the caller.

    Raises:
        GitStoreError: libgit2 failed, or named the object otherwise.
    """
    kind = _OBJECT_TYPES[header[:header.index(b" ")]]
    raw = bytes(data) if isinstance(data, memoryview) else data
    for attempt in range(_ATTEMPTS):
        try:
            written = odb.write(kind, raw)
            break
        except OSError as exc:
            # (libgit2's OS errors arrive as a bare OSError, errno unset, strerror in the text.)
            if not _is_enoent(exc) or attempt == _ATTEMPTS - 1:
                raise GitStoreError(f"cannot write object '{oid}': {exc}") from exc
            # Race guarded: git's prune-packed and 'maintenance run --task=loose-objects'
            # remove an emptied fan-out folder (objects/xx/) between libgit2 making it and
            # renaming the object into it; git's own writer makes the folder again and
            # retries (object-file.c, create_tmpfile), libgit2 does not: so here.
        except pygit2.GitError as exc:
            raise GitStoreError(f"cannot write object '{oid}': {exc}") from exc
    if str(written) != oid:
        raise GitStoreError(f"object '{oid}' was written as '{written}'")


def _is_enoent(exc: OSError) -> bool:
    return exc.errno == errno.ENOENT or "No such file or directory" in str(exc)


def write_new(odb: pygit2.Odb, objects: str, todo: Mapping[str, tuple[bytes, bytes | memoryview]]) -> None:
    """Write ``todo`` ({hex id: (header, bytes)}) into ``objects`` durably, new ones in one batch (module docstring).

    ``odb`` is the repository's object database over ``objects``.  Returns
    when every object exists, the new ones synced under their final names.

    Raises:
        GitStoreError: libgit2 could not write an object, or a file or folder could not be synced or moved.
    """
    if not BATCH:
        made = any(not os.path.isdir(os.path.join(objects, oid[:2])) for oid in todo)
        for oid, (header, data) in todo.items():
            write_object(odb, oid, header, data)  # each synced by libgit2, with its folder
        if made:
            _sync([objects])  # a fan-out folder libgit2 made is an entry of objects/
        return
    new = _freshen_present(odb, todo)
    for attempt in range(_ATTEMPTS):
        try:
            _write_batch(objects, new)
            return
        except _TmpObjdirGone:
            # Race guarded: 'git prune --expire=now' (unsafe beside writers, git says) removes
            # any tmp_ folder in objects/, ours too, mid-batch: write the batch again.
            if attempt == _ATTEMPTS - 1:
                raise GitStoreError(f"cannot write objects: '{objects}' lost its temporary folder "
                                    f"{_ATTEMPTS} times in a row (a 'git prune --expire=now' loop?)") from None


def _freshen_present(odb: pygit2.Odb, todo: Mapping[str, tuple[bytes, bytes | memoryview]]
                     ) -> dict[str, tuple[bytes, bytes | memoryview]]:
    """Freshen the objects of ``todo`` the repository has (step 1); return the others."""
    present = _present(odb, list(todo))
    new = {}
    for oid, obj in todo.items():
        if oid in present:
            write_object(odb, oid, *obj)  # freshened (its mtime: gc's grace period), not written
        else:
            new[oid] = obj
    return new


def _present(odb: pygit2.Odb, oids: list[str]) -> set[str]:
    """Which of ``oids`` the repository has (loose, packed, an alternate's): ``git_odb_exists``, batched.

    ``oid in odb`` rescans the pack folder (and the multi-pack-index) on every
    miss, as git re-reads its packs before it calls an object missing; a
    call's objects are new, so that was one rescan per object.  Here every id
    is looked up in each backend first, and the misses once more after one
    rescan for all of them: the same answer, one rescan a call.

    Raises:
        GitStoreError: libgit2 failed to look an object up.
    """
    try:
        backends = list(odb.backends)
        ids = {oid: pygit2.Oid(hex=oid) for oid in oids}
        missing = [oid for oid, one in ids.items() if not any(b.exists(one) for b in backends)]
        if missing:
            for backend in backends:
                backend.refresh()  # (nothing to rescan in the loose one)
            missing = [oid for oid in missing if not any(b.exists(ids[oid]) for b in backends)]
    except pygit2.GitError as exc:
        raise GitStoreError(f"cannot look objects up: {exc}") from exc
    return set(oids).difference(missing)


class _TmpObjdirGone(Exception):
    """The temporary object folder was removed while the batch used it."""


class _TmpObjdir:
    """This process's temporary object folder in one ``objects/``, kept for its next batches.

    Made once and kept, with the fan-out folders libgit2 makes in it: making
    and removing folders on every call cost more than the syncs the batch
    saves, on a busy disk (each new folder is a block allocated, each removed
    one a block freed and discarded).  Removed as the process exits; a killed
    process's is removed by ``recover`` or ``git prune`` past their expiry
    (its mtime is renewed by each batch: age is the proof it is not in use).
    """

    def __init__(self, objects: str) -> None:
        self.objects = objects
        self.path = ""
        self.odb: pygit2.Odb | None = None
        self.pid = 0
        self.lock = threading.Lock()  # one batch at a time: two would share file names

    def open(self) -> tuple[str, pygit2.Odb]:
        """The folder and libgit2's object database over it, made if missing; its mtime renewed.

        Raises:
            GitStoreError: it could not be made or opened.
        """
        if self.odb is not None and self.pid == os.getpid():
            try:
                os.utime(self.path)
                return self.path, self.odb
            except OSError:
                pass  # removed (a 'git prune --expire=now', a 'recover --tmp-age 0'): made again
        self.odb = None
        path = os.path.join(self.objects, f"{TMP_OBJDIR_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.mkdir(path, 0o700)
            odb = pygit2.Odb(path)
        except (OSError, pygit2.GitError) as exc:
            raise GitStoreError(f"cannot create the temporary object folder '{path}': {exc}") from exc
        self.path, self.odb, self.pid = path, odb, os.getpid()
        return path, odb

    def forget(self) -> None:
        self.odb = None


_TMP_OBJDIRS: dict[str, _TmpObjdir] = {}
_TMP_OBJDIRS_GUARD = threading.Lock()


def _tmp_objdir(objects: str) -> _TmpObjdir:
    with _TMP_OBJDIRS_GUARD:
        found = _TMP_OBJDIRS.get(objects)
        if found is None:
            found = _TMP_OBJDIRS[objects] = _TmpObjdir(objects)
        return found


@atexit.register
def remove_own_tmp_objdirs() -> None:
    """Remove this process's temporary object folders: run at exit, and by a process that ends by
    ``os._exit`` (a forked server worker, which runs no exit handler) as it ends."""
    for tmp in list(_TMP_OBJDIRS.values()):
        if tmp.odb is not None and tmp.pid == os.getpid():  # (a forked child's are its parent's)
            _remove_tree(tmp.path)
            tmp.forget()


#: A temporary object folder with this many fan-out folders has them removed on threads
#: (:func:`cas.durable.free_on_threads`): a large patch's objects fill up to 256 of them, and a
#: one-shot CLI process removes them as it exits.
_RMDIR_AT_ONCE_FROM = 16


def _remove_tree(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)``, its sub-folders on threads when there are many."""
    try:
        subs = [entry.path for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        subs = []
    if len(subs) >= _RMDIR_AT_ONCE_FROM:
        free_on_threads(functools.partial(shutil.rmtree, ignore_errors=True), subs)
    shutil.rmtree(path, ignore_errors=True)


def _write_batch(objects: str, new: Mapping[str, tuple[bytes, bytes | memoryview]]) -> None:
    if not new:
        return
    holder = _tmp_objdir(objects)
    with holder.lock:
        tmp, staged = holder.open()
        files = [os.path.join(tmp, oid[:2], oid[2:]) for oid in new]
        moved = 0
        try:
            with _unsynced_objects():
                for oid, (header, data) in new.items():
                    try:
                        write_object(staged, oid, header, data)
                    except GitStoreError:
                        if not os.path.isdir(tmp):
                            raise _TmpObjdirGone() from None
                        raise
            _sync(files, tmp)
            folders = {os.path.join(objects, oid[:2]): None for oid in new}
            made = False
            for oid, src in zip(new, files):
                made |= _move(src, os.path.join(objects, oid[:2]), oid[2:], tmp)
                moved += 1
            _sync([*folders, *([objects] if made else [])])
        except _TmpObjdirGone:
            holder.forget()
            raise
        finally:
            for src in files[moved:]:  # a failed batch's files: none is taken for a later write's
                with contextlib.suppress(OSError):
                    os.unlink(src)


def stage_new(odb: pygit2.Odb, objects: str,
              todo: Mapping[str, tuple[bytes, bytes | memoryview]]) -> NewObjects | None:
    """:func:`write_new`'s steps 1 and 2, the rest left to a :class:`cas.durable.DurableBatch` (:class:`NewObjects`).

    For a batch that makes its own files durable with the objects (the
    ``prepared`` receipt that names them): one round of syncs for both, the
    objects renamed before the batch's files, their folders synced in the
    batch's last round.  ``None``: nothing new to write (the objects the
    repository has are freshened here).  The caller closes what it gets.

    Raises:
        TmpObjdirGone: the temporary folder was removed while libgit2 wrote
            into it (a ``git prune --expire=now``): :func:`write_new` retries.
        GitStoreError: libgit2 could not write an object.
    """
    if not BATCH:
        return None
    new = _freshen_present(odb, todo)
    return NewObjects(objects, new) if new else None


class TmpObjdirGone(GitStoreError):
    """The temporary object folder was removed while a batch used it (nothing of the batch was placed)."""


class NewObjects:
    """New objects written by libgit2 into the temporary folder, made durable by a batch (:func:`stage_new`).

    Holds the temporary folder (one batch at a time) until :meth:`close`.
    The steps are :func:`write_new`'s: the files synced in the batch's first
    round (:meth:`to_sync`), renamed into ``objects/`` before the batch's own
    files (:meth:`place`), their fan-out folders synced in its last round.
    """

    def __init__(self, objects: str, new: Mapping[str, tuple[bytes, bytes | memoryview]]) -> None:
        self.objects = objects
        self._new = new
        self._holder = _tmp_objdir(objects)
        self._holder.lock.acquire()
        self._held = True
        self._moved = 0
        self._fds: list[int] = []
        self.placed = False
        self.files: list[str] = []
        self.tmp = ""
        try:
            self.tmp, staged = self._holder.open()
            self.files = [os.path.join(self.tmp, oid[:2], oid[2:]) for oid in new]
            with _unsynced_objects():
                for oid, (header, data) in new.items():
                    try:
                        write_object(staged, oid, header, data)
                    except GitStoreError:
                        if not os.path.isdir(self.tmp):
                            raise TmpObjdirGone(f"'{self.tmp}' was removed while objects were written") from None
                        raise
        except BaseException:
            if self.tmp and not os.path.isdir(self.tmp):
                self._holder.forget()
            self.discard()
            self.close()
            raise

    def to_sync(self) -> list[str]:
        return list(self.files)

    def place(self) -> list[int]:
        """Rename every object into ``objects/``; return its fan-out folders (and ``objects/`` if one was made), open.

        Raises:
            TmpObjdirGone: an object is gone with the temporary folder.
            GitStoreError: a rename failed otherwise, or a folder could not be opened.
        """
        made = False
        try:
            for oid, src in zip(self._new, self.files):
                made |= _move(src, os.path.join(self.objects, oid[:2]), oid[2:], self.tmp)
                self._moved += 1
        except _TmpObjdirGone:
            self._holder.forget()
            raise TmpObjdirGone(f"'{self.tmp}' was removed while its objects were moved") from None
        self.placed = True
        folders = [*dict.fromkeys(os.path.join(self.objects, oid[:2]) for oid in self._new),
                   *([self.objects] if made else [])]
        for folder in folders:
            try:
                self._fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            except FileNotFoundError:
                # Race guarded: git's 'maintenance run --task=loose-objects' packed the objects
                # just moved and prune-packed removed their emptied folder (as _sync allows).
                continue
            except OSError as exc:
                raise GitStoreError(f"cannot sync '{folder}': {exc}") from exc
        return list(self._fds)

    def gone(self) -> bool:
        """Whether the batch failed because the temporary folder was removed before the objects were placed."""
        return not self.placed and not os.path.isdir(self.tmp)

    def discard(self) -> None:
        for src in self.files[self._moved:]:  # a failed batch's files: none is taken for a later write's
            with contextlib.suppress(OSError):
                os.unlink(src)

    def close(self) -> None:
        """Close the folders :meth:`place` opened and let the next batch use the temporary folder."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        if self._held:
            self._held = False
            self._holder.lock.release()


def _move(src: str, folder: str, name: str, tmp: str) -> bool:
    """Rename ``src`` to ``folder/name``, making ``folder`` when missing; whether it was made here.

    Raises:
        _TmpObjdirGone: ``src`` is gone with its folder.
        GitStoreError: the rename failed otherwise.
    """
    made = False
    for attempt in range(_ATTEMPTS):
        try:
            os.rename(src, os.path.join(folder, name))
            return made
        except FileNotFoundError as exc:
            if not os.path.exists(src):
                if not os.path.isdir(tmp):
                    raise _TmpObjdirGone() from None
                raise GitStoreError(f"cannot move object file '{src}': {exc}") from exc
            if attempt == _ATTEMPTS - 1:
                raise GitStoreError(f"cannot move object file '{src}': {exc}") from exc
            # Race guarded: the fan-out folder is missing, or an emptied one was removed by
            # git's prune-packed since it was made (as write_object's): make it, try again.
            try:
                os.mkdir(folder, 0o777)  # as libgit2 and git make it, less the umask
                made = True
            except FileExistsError:
                pass
            except OSError as err:
                raise GitStoreError(f"cannot create the object folder '{folder}': {err}") from err
        except OSError as exc:
            raise GitStoreError(f"cannot move object file '{src}': {exc}") from exc
    return made  # (not reached)


def _sync(paths: list[str], tmp: str | None = None) -> None:
    """One concurrent round of syncs (``tmp``: of the files in that temporary folder; else of folders in ``objects/``).

    Raises:
        _TmpObjdirGone: a file of ``tmp`` is gone with its folder.
        GitStoreError: a sync failed.
    """
    try:
        fsync_all(paths)
    except DurableWriteError as exc:
        if tmp is not None:
            if isinstance(exc.cause, FileNotFoundError) and not os.path.isdir(tmp):
                raise _TmpObjdirGone() from None
        elif all(isinstance(p, str) and not os.path.lexists(p) for p in exc.failed):
            # Race guarded: git's 'maintenance run --task=loose-objects' packed the objects
            # just moved and prune-packed removed their emptied fan-out folder: what it held
            # is in a pack git synced.  (Removed otherwise: ensure_objects finds it under
            # the ref's lock.)
            return
        raise GitStoreError(f"cannot sync '{exc.path}': {exc.cause}") from exc


#: libgit2 writes a loose object to ``objects/tmp_object_git2_XXXXXX`` before renaming it into place.
LIBGIT2_OBJECT_TMP_PREFIX = "tmp_object_git2_"


def stale_tmp_objdirs(objects: str, tmp_age: float, *, remove: bool = True) -> list[str]:
    """What killed writers left in ``objects``, older than ``tmp_age`` seconds, removed.

    Our temporary object folders and libgit2's ``tmp_object_git2_*`` files.
    Like ``git prune`` (which removes ``tmp_`` entries past its expiry), age is
    the proof no writer still fills one; ``remove=False`` (a dry run): only
    list them.  Never follows a symlink.
    """
    found: list[str] = []
    try:
        entries = os.listdir(objects)
    except (FileNotFoundError, NotADirectoryError):
        return found
    now = time.time()
    for entry in sorted(entries):
        if entry.startswith(TMP_OBJDIR_PREFIX):
            is_kind = stat.S_ISDIR
        elif entry.startswith(LIBGIT2_OBJECT_TMP_PREFIX):
            is_kind = stat.S_ISREG
        else:
            continue
        path = os.path.join(objects, entry)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not is_kind(st.st_mode) or now - st.st_mtime < tmp_age:
            continue
        if remove:
            if is_kind is stat.S_ISDIR:
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:  # another cleaner's
                    continue
            if os.path.lexists(path):
                continue
        found.append(path)
    return found

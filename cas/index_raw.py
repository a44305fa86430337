"""git's index as bytes: the entries a patch modifies are found and rewritten in place.

A patch that modifies files already in the index changes 62 bytes per file
(stat data, mode, object id) and the cached trees on their folders; everything
else is passed through as the bytes that were read (why: :mod:`cas.index`).
Anything this module does not prove raises :class:`Unsupported`, and the
caller parses the index with libgit2 instead:

* **Versions 2 and 3**, SHA-1 (version 4 compresses paths against the previous
  entry: an entry cannot be found by its path; :meth:`RawIndex.walk` reads it
  in order, for a file libgit2 has just written).
* **An entry is found** by searching for ``<path>\\0`` and proving that the
  bytes around it are an entry for exactly that path: the flags hold the path's
  length, the entry starts a multiple of 8 bytes after the header, its mode is
  one git writes, its padding is NULs up to the next 8-byte boundary.  Entries
  are sorted by path, so the search runs only between the nearest paths
  already found.  Merge stages, ``assume-valid`` and version 3's extended flags
  (``skip-worktree``, ``intent-to-add``) are left to libgit2, and so is a path
  whose bytes appear but prove no entry; a path whose bytes appear nowhere is
  not in the index.  The caller compares the entry's id with the base's.
* **The extensions** are found through ``EOIE`` or, without it, by the ``TREE``
  extension from which a chain of extensions reaches the checksum exactly.
  Only ``TREE``, ``REUC``, ``IEOT``, ``EOIE`` and ``sdir`` are handled; a split
  index is refused, as libgit2 refuses it.  The changed files' folders'
  cached trees are invalidated, as ``git add`` does; ``EOIE``'s hash is
  recomputed; entry offsets do not move, so ``IEOT`` stays valid.
* **Racily clean entries** whose files changed are smudged, as git's writer
  does (:meth:`RawIndex._racy_entries`); a file found unchanged once its
  timestamps had settled is not read again while its stat data stays the
  same (:data:`_VERIFIED`).
* **The checksum** of the file read is verified in a thread while the caller
  looks its paths up; the new file's starts from a state over the unchanged
  bytes before the first entry found (hashed while the call prepares).
* **The file written is kept** (``written=``): mapped from the descriptor that
  wrote it, not verified again, its found paths and stamp offsets carried over.
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Iterable

from cas.git_filters import cleaned_oid
from cas.hashing import git_blob_oid
from cas.objects import TreeEntry

__all__ = ["Unsupported", "RawIndex", "MAX_PATHS", "MAX_RACY"]

#: Lookups beyond this many paths parse the index instead (each costs a scan).
MAX_PATHS = 8
#: More racily clean entries than this leave the update to libgit2.
MAX_RACY = 1024
#: Paths found in one file carried to the next it is written as (their offsets hold).
_CARRIED_PATHS = 4096

_ENTRY_MODES = frozenset({0o100644, 0o100755, 0o120000})
# Gitlinks and sparse-index folders: proven entries, but libgit2's to update.
_MODES = _ENTRY_MODES | {0o160000, 0o040000}
# "sdir" marks a sparse index: it holds no data, and a file entry in the cone is updated as in any index.
_HANDLED_EXT = frozenset({b"TREE", b"REUC", b"IEOT", b"EOIE", b"sdir"})
#: Racily clean entries whose files were read and found to hold the entry:
#: ``{(workdir, path): (object id, mode, the file's stat signature)}``.  Race guarded: a
#: change made after the file was read gets an mtime (and ctime) of that moment or
#: later, so it changes the signature: unless the file was changed in the very
#: tick it was read, which is why only a file whose timestamps are older than
#: the read by :data:`_SETTLED_NS` (and below a second: a filesystem of whole
#: seconds stamps a later change alike) is remembered.  What git's rule still
#: asks of every write (each racily clean entry looked at again) then costs an
#: ``lstat``, not a read and a hash, in a long-lived caller that writes the
#: index several times a second (the server's workers).
_VERIFIED: dict[tuple[str, bytes], tuple[str, int, tuple[int, ...]]] = {}
_VERIFIED_MAX = 4096
#: How much older than the read a file's mtime and ctime must be for :data:`_VERIFIED`
#: (far above a filesystem clock's tick: 1 to 10 ms).
_SETTLED_NS = 50_000_000
_NODE = re.compile(rb"([^\0]*)\0(-?[0-9]+) ([0-9]+)\n")
_HEAD = struct.Struct(">10I20sH")  # an entry up to its flags: 62 bytes
_THREADED_HASH = 1 << 18  # below this the checksum is verified inline


def _settled(st: os.stat_result, now: int) -> bool:
    """Whether a change after ``now`` would show in ``st``'s timestamps (see :data:`_VERIFIED`)."""
    return all(0 < ns % 1_000_000_000 and ns < now - _SETTLED_NS for ns in (st.st_mtime_ns, st.st_ctime_ns))


class Unsupported(Exception):
    """This index, or this change to it, needs the full parser."""


#: The index's bytes: mapped from the file.
_Bytes = bytes | mmap.mmap
_Chain = list[tuple[bytes, int, int]]  # each extension as (signature, offset, size of its data)


def _be32(data: _Bytes, off: int) -> int:
    return int.from_bytes(data[off:off + 4], "big")


def _find_all(data: _Bytes, needle: bytes, lo: int, hi: int) -> list[int]:
    found, q = [], data.find(needle, lo, hi)
    while q != -1:
        found.append(q)
        q = data.find(needle, q + 1, hi)
    return found


def _eoie_hash(headers: Iterable[tuple[bytes, int]]) -> bytes:
    """EOIE's hash over the extensions' headers, given as (signature, size)."""
    h = hashlib.sha1()
    for sig, size in headers:
        h.update(sig + size.to_bytes(4, "big"))
    return h.digest()


def _handled(chain: _Chain) -> _Chain:
    if any(sig not in _HANDLED_EXT for sig, _off, _size in chain):
        raise Unsupported("an extension left to libgit2")
    return chain


def _varint(data: _Bytes, pos: int, end: int) -> tuple[int, int]:
    """git's offset varint (``decode_varint``) at ``pos``: its value and the offset after it."""
    if pos >= end:
        raise Unsupported("a version 4 path")
    c = data[pos]
    pos += 1
    value = c & 127
    while c & 128:
        if pos >= end or value >= 1 << 56:
            raise Unsupported("a version 4 path")
        c = data[pos]
        pos += 1
        value = ((value + 1) << 7) | (c & 127)
    return value, pos


class RawIndex:
    """One read of an index file; see the module docstring."""

    def __init__(self, path: str, *, written: tuple[int, RawIndex, list[tuple[int, int]]] | None = None,
                 stamp_ns: int | None = None) -> None:
        """Map the index at ``path`` and start verifying its checksum.

        ``stamp_ns``: the mtime the racy-clean rule is judged against, when not
        the file's own (a file libgit2 has just written: :mod:`cas.index`);
        versions 2 to 4 are read then, through :meth:`walk`.  ``written``:
        ``(fd, previous, edits)`` for the file this process has just written
        from ``previous`` with these ``(offset, size)`` edits and installed
        (``fd`` open on it, ``index.lock`` held): not verified again, and what
        ``previous`` had found carries over.
        """
        if written is None and stamp_ns is None:
            if any(name.startswith("sharedindex.") for name in os.listdir(os.path.dirname(path))):
                raise Unsupported("split index")
        # Mapped, not read: nothing is copied, and the checksum thread starts at
        # once.  git and libgit2 replace an index by renaming a new file over
        # it, never by rewriting it in place, so the mapping stays whole.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if written is None else written[0]
        try:
            st = os.fstat(fd)
            if st.st_size < 32:
                raise Unsupported("not an index this module reads")
            data = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            if written is None:
                os.close(fd)
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.mode = st.st_mode & 0o7777  # the new file keeps it (core.sharedRepository)
        if len(data) != st.st_size or data[:4] != b"DIRC":
            raise Unsupported("not an index this module reads")
        self.version = _be32(data, 4)
        if self.version not in ((2, 3) if stamp_ns is None else (2, 3, 4)):
            raise Unsupported(f"index version {self.version}")
        self.data = data
        self._verified: bool | None = None
        self._hashed = threading.Event()
        # (offset, [SHA-1 state over the bytes before it], the thread computing it, or None once carried over)
        self._prefix: tuple[int, list[hashlib._Hash], threading.Thread | None] | None = None
        # Folders whose TREE node this file is known to hold invalidated (or not at all): written so here.
        self._invalid: frozenset[bytes] = frozenset()
        self._ext: tuple[int, _Chain] | None = None
        self._found: dict[str, int | None] = {}
        self._sorted: list[tuple[bytes, int]] = []  # (path, offset) of the entries found, by path
        # git's racy-clean rule: an entry whose mtime is not older than the index
        # file may hide a change made in the same instant (see _racy_entries).
        self._index_sec = ((st.st_mtime_ns if stamp_ns is None else stamp_ns) // 1_000_000_000) & 0xFFFFFFFF
        # Every entry's offset by path, and its path by offset, once read in order (walk).
        self._walked: dict[bytes, int] | None = None
        self._paths_at: dict[int, bytes] = {}
        self._stamped: list[int] = []  # offsets of the index's own mtime second
        self._scanned = False
        self.edits: list[tuple[int, int]] = []  # (offset, size) of what :meth:`updated` replaced
        self.invalidated: frozenset[bytes] = frozenset()  # the folders :meth:`updated` invalidated
        # (n, SHA-1 state over the new file's first n bytes, its own), set by whoever hashed it
        self.written_prefix: tuple[int, hashlib._Hash] | None = None
        if written is not None:
            self._carry_over(*written[1:])
        elif len(data) < _THREADED_HASH:
            self._verify()
        else:
            threading.Thread(target=self._verify, name="oncepatch-index-checksum", daemon=True).start()

    def _carry_over(self, previous: RawIndex, edits: list[tuple[int, int]]) -> None:
        """Take what ``previous`` knew that still holds for this file, written from it with ``edits``."""
        self._verified = True
        self._hashed.set()
        # The new file's TREE is the previous one's with these folders invalidated;
        # its bytes before the first edit are the previous file's.
        self._invalid = previous._invalid | previous.invalidated
        if previous.written_prefix is not None:
            upto, state = previous.written_prefix
            self._prefix = (upto, [state], None)
        if len(previous._found) <= _CARRIED_PATHS:
            self._found = dict(previous._found)  # the entries did not move
            self._sorted = list(previous._sorted)
        if not (previous._scanned and previous._index_sec == self._index_sec):
            return  # scanned again if needed: the file's second is a new one
        # Same second: the stamps among the entries are where they were, but
        # where 4 bytes overlap what was replaced (looked for again).
        stamp, limit = self._index_sec.to_bytes(4, "big"), previous.extensions()[0]
        near = [(max(0, off - 3), off + size) for off, size in edits]
        stamped = [q for q in previous._stamped if q < limit and not any(lo <= q < hi for lo, hi in near)]
        for lo, hi in near:
            stamped += _find_all(self.data, stamp, lo, hi + 3)
        self._stamped = sorted(set(stamped))
        self._scanned = True

    # -- reading -------------------------------------------------------------

    def _verify(self) -> None:
        # One update: the GIL is released for the whole hash.
        data = self.data
        self._verified = hashlib.sha1(memoryview(data)[:len(data) - 20]).digest() == data[-20:]
        self._hashed.set()

    def scan_stamps(self) -> None:
        """Find where the index's mtime second occurs (for :meth:`_racy_entries`); once.

        ``bytes.find`` holds the GIL, so the caller runs this while it would
        wait anyway: for the checksum thread, which hashes meanwhile.
        """
        if not self._scanned:
            self._scanned = True
            self._stamped += _find_all(self.data, self._index_sec.to_bytes(4, "big"), 0, len(self.data) - 20)

    def start_prefix(self) -> None:
        """Start hashing the bytes before the first entry found, for the new file's checksum (:meth:`updated`).

        Runs while the call prepares.  A state carried over from the write that
        made this file is extended when short of that entry, replaced when past it.
        """
        found = [e for e in self._found.values() if e is not None]
        if not found or len(self.data) < _THREADED_HASH:
            return
        upto = min(found)
        base: tuple[int, hashlib._Hash] | None = None
        if self._prefix is not None:
            have, got, running = self._prefix
            if running is not None or have == upto:
                return
            if have < upto and got:
                base = (have, got[0])
        box: list[hashlib._Hash] = []

        def run() -> None:
            if base is None:
                box.append(hashlib.sha1(memoryview(self.data)[:upto]))
                return
            state = base[1].copy()
            state.update(memoryview(self.data)[base[0]:upto])
            box.append(state)

        thread = threading.Thread(target=run, daemon=True)
        self._prefix = (upto, box, thread)
        thread.start()

    def verified(self) -> None:
        """Wait for the checksum check; a mismatch is left to libgit2 to report."""
        self._hashed.wait()
        if not self._verified:
            raise Unsupported("index checksum does not match")

    def _proven(self, e: int, limit: int) -> bool:
        """Whether the bytes at ``e`` are an entry git writes, ending by ``limit`` (module docstring).

        Raises:
            Unsupported: a path too long for its flags to give its length.
        """
        data = self.data
        if e < 12 or (e - 12) % 8 or e + 62 > limit:
            return False
        flags = int.from_bytes(data[e + 60:e + 62], "big")
        extended, length = flags & 0x4000, flags & 0xFFF
        if (extended and self.version < 3) or _be32(data, e + 24) not in _MODES:
            return False
        if length == 0xFFF:
            raise Unsupported("a long path beside a racy timestamp")
        p = e + (64 if extended else 62)
        stop = e + ((p - e + length + 8) & ~7)
        return (bool(length) and stop <= limit and b"\0" not in data[p:p + length]
                and not data[p + length:stop].strip(b"\0"))

    def _updatable(self, e: int) -> int:
        """``e``, the offset of an entry this module may rewrite."""
        if int.from_bytes(self.data[e + 60:e + 62], "big") & 0xF000 or _be32(self.data, e + 24) not in _ENTRY_MODES:
            raise Unsupported("a staged conflict, flags or mode left to libgit2")
        return e

    def walk(self) -> None:
        """Read every entry in order (version 4's compressed paths): only a file libgit2 has just written.

        Raises:
            Unsupported: the entries do not parse.
        """
        if self._walked is not None:
            return
        data = self.data
        end = len(data) - 20
        walked: dict[bytes, int] = {}
        pos, prev = 12, b""
        for _ in range(_be32(data, 8)):
            if pos + 62 > end:
                raise Unsupported("entries run past the file")
            flags = int.from_bytes(data[pos + 60:pos + 62], "big")
            if flags & 0x4000 and self.version < 3:
                raise Unsupported("extended flags before version 3")
            p = pos + (64 if flags & 0x4000 else 62)
            if self.version == 4:
                strip, p = _varint(data, p, end)
                nul = data.find(b"\0", p, end)
                if nul == -1 or strip > len(prev):
                    raise Unsupported("a version 4 path")
                path = prev[:len(prev) - strip] + data[p:nul]
                nxt = nul + 1
            else:
                nul = data.find(b"\0", p, end)
                if nul == -1:
                    raise Unsupported("an entry's path")
                path = data[p:nul]
                nxt = pos + ((p - pos + len(path) + 8) & ~7)
            walked[path] = pos  # a conflict's last stage wins: locate leaves it to libgit2
            self._paths_at[pos] = path
            pos, prev = nxt, path
        self._walked = walked
        chain = self._chain(pos, end)
        if chain is None:
            raise Unsupported("no extensions after the entries")
        self._ext = (pos, _handled(chain))

    def locate(self, path: str) -> int | None:
        """Offset of ``path``'s entry, ``None`` when the path is not in the index.

        Raises:
            Unsupported: the entry is one this module leaves to libgit2, or the
                path's bytes occur but prove no entry.
        """
        if path in self._found:
            return self._found[path]
        found = self._found[path] = self._locate(path)
        if found is not None:
            bisect.insort(self._sorted, (os.fsencode(path), found))
        return found

    def _locate(self, path: str) -> int | None:
        raw = os.fsencode(path)
        if self._walked is not None:
            e = self._walked.get(raw)
            return None if e is None else self._updatable(e)
        if len(raw) >= 0xFFF or b"\0" in raw:
            raise Unsupported("path length")
        needle = raw + b"\0"
        data = self.data
        # Entries are sorted by path (git refuses an index that is not): the
        # entry, if any, lies between those of the nearest paths found before.
        lo, hi = 12, len(data)
        i = bisect.bisect_left(self._sorted, (raw,))
        if i:
            lo = self._sorted[i - 1][1] + 62
        if i < len(self._sorted):
            hi = self._sorted[i][1]
        pos = data.find(needle, lo, hi)
        seen = pos != -1
        while pos != -1:
            for e, extended in ((pos - 62, 0), (pos - 64, 0x4000)):
                if e < 12:
                    continue
                flags = int.from_bytes(data[e + 60:e + 62], "big")
                if flags & 0x4000 == extended and flags & 0xFFF == len(raw) and self._proven(e, len(data) - 20):
                    if self._updatable(e) + 62 + len(needle) > self.extensions()[0]:
                        raise Unsupported("found past the entries")
                    return e
            pos = data.find(needle, pos + 1, hi)
        if seen:
            raise Unsupported("path bytes occur outside a provable entry")
        return None

    def entry(self, path: str) -> TreeEntry | None:
        """``path``'s stage-0 entry as (object id, mode), ``None`` when it is not in the index.

        The checksum may still be being verified: call :meth:`verified` before acting on the answer.
        """
        e = self.locate(path)
        if e is None:
            return None
        return TreeEntry(self.data[e + 40:e + 60].hex(), _be32(self.data, e + 24))

    def _racy_entries(self) -> list[int]:
        """Offsets of the entries git would call racily clean against this file (mtime second = the file's).

        git's writer smudges such an entry (size 0: git compares contents) when
        its file changed: a new index with a later mtime would otherwise make a
        change from the index's own instant look clean.  Each holds the file's
        second at its offset 8 (mtimes later than the index's are not looked for).

        Raises:
            Unsupported: more than :data:`MAX_RACY` of them, or a path too long to prove.
        """
        start = self.extensions()[0]
        if self._walked is not None:
            stamp = self._index_sec.to_bytes(4, "big")
            found = [e for e in self._walked.values() if self.data[e + 8:e + 12] == stamp]
        else:
            self.scan_stamps()
            found = [q - 8 for q in self._stamped if self._proven(q - 8, start)]
        if len(found) > MAX_RACY:
            raise Unsupported("many racily clean entries")
        return found

    def _changed_file(self, workdir: str, e: int) -> bool:
        """Whether the racily clean entry at ``e`` hides a change to its file: git's ``ce_smudge_racily_clean_entry``.

        A changed size or mtime shows by itself; else the bytes are hashed and,
        when they differ from the entry's id, hashed as git would store them
        (git compares through the clean filter too: a CRLF file checked out by
        an eol filter is not changed, and smudged ``git diff-files`` would say so).
        """
        data = self.data
        if not _be32(data, e + 36):
            return False  # smudged already (or an empty file): smudging would change nothing
        path = self._path_at(e)
        mode, oid = _be32(data, e + 24), data[e + 40:e + 60].hex()
        if mode == 0o160000:
            return False  # gitlinks: git always looks at their contents
        full = os.path.join(workdir, os.fsdecode(path))
        now = time.time_ns()  # (before the lstat: see _VERIFIED)
        try:
            st = os.lstat(full)
        except OSError:
            return False  # gone: git sees that
        if ((st.st_size & 0xFFFFFFFF) != _be32(data, e + 36) or (int(st.st_mtime) & 0xFFFFFFFF) != _be32(data, e + 8)
                or st.st_mtime_ns % 1_000_000_000 != _be32(data, e + 12)):
            return False
        key = (workdir, bytes(path))
        signature = (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if _VERIFIED.get(key) == (oid, mode, signature):
            return False
        try:
            if mode == 0o120000:
                content = os.fsencode(os.readlink(full))
            else:
                with open(full, "rb") as fh:
                    content = fh.read()
        except OSError:
            return True
        if git_blob_oid(content) == oid:
            if _settled(st, now):
                if len(_VERIFIED) >= _VERIFIED_MAX:
                    _VERIFIED.clear()
                _VERIFIED[key] = (oid, mode, signature)
            return False
        return mode == 0o120000 or cleaned_oid(workdir, os.fsdecode(path), content) != oid

    def sparse(self) -> bool:
        """Whether this is a sparse index (its ``sdir`` extension): folders outside the cone are single entries.

        Raises:
            Unsupported: the extensions cannot be found.
        """
        return any(sig == b"sdir" for sig, _off, _size in self.extensions()[1])

    def _path_at(self, e: int) -> bytes:
        """The path of the entry at ``e``."""
        if e in self._paths_at:
            return self._paths_at[e]
        flags = int.from_bytes(self.data[e + 60:e + 62], "big")
        p = e + 62 + (2 if flags & 0x4000 else 0)
        return bytes(self.data[p:p + (flags & 0xFFF)])

    def extensions(self) -> tuple[int, _Chain]:
        """Where the entries end, and each extension as (signature, offset, size of its data)."""
        if self._ext is not None:
            return self._ext
        data = self.data
        end = len(data) - 20
        if end - 32 >= 12 and data[end - 32:end - 28] == b"EOIE" and _be32(data, end - 28) == 24:
            start = _be32(data, end - 24)
            chain = self._chain(start, end) if 12 <= start <= end - 32 else None
            if chain is None or chain[-1][0] != b"EOIE" or (
                    _eoie_hash((sig, size) for sig, _off, size in chain[:-1]) != data[end - 20:end]):
                raise Unsupported("EOIE does not describe the extensions")
        else:
            # Without EOIE: the last "TREE" at an entry boundary from which a
            # chain of extensions reaches the checksum exactly.
            chain = None
            pos = data.rfind(b"TREE", 12, end)
            while pos != -1:
                if (pos - 12) % 8 == 0 and data[pos - 1] == 0:
                    chain = self._chain(pos, end)
                    if chain is not None:
                        start = pos
                        break
                pos = data.rfind(b"TREE", 12, pos)
            if chain is None:
                raise Unsupported("no TREE extension found")
        self._ext = (start, _handled(chain))
        return self._ext

    def _chain(self, start: int, end: int) -> _Chain | None:
        data, chain, pos = self.data, [], start
        while pos + 8 <= end:
            size = _be32(data, pos + 4)
            chain.append((data[pos:pos + 4], pos, size))
            pos += 8 + size
        return chain if pos == end else None

    def _tree_invalidated(self, off: int, size: int, folders: set[bytes]) -> bytes:
        """The TREE extension's data with the nodes of ``folders`` (``b""`` is the root) invalidated.

        Nodes come in pre-order, each with its number of subtrees; a node's
        folder is known from the names of the nodes still open above it.  The
        walk stops once every folder's node has been seen: the rest is copied.
        """
        data = self.data
        end = off + 8 + size
        pos = off + 8
        match = _NODE.match
        # The names wanted at each depth: the full path is built only for those.
        wanted: list[set[bytes]] = []
        for folder in folders:
            parts = folder.split(b"/") if folder else []
            while len(wanted) <= len(parts):
                wanted.append(set())
            wanted[len(parts)].add(parts[-1] if parts else b"")
        out: list[bytes] = []
        last = pos
        names: list[bytes] = []  # names of the open nodes, root first
        left: list[int] = []  # subtrees still to come under each open node
        todo = len(folders)
        while pos < end and todo:
            m = match(data, pos, end)
            if m is None or (not left and pos != off + 8):
                raise Unsupported("TREE extension")
            name, count, subs = m.groups()
            depth = len(left)
            if depth:
                left[-1] -= 1
            elif name:
                raise Unsupported("TREE extension")
            after = m.end() + (0 if count[:1] == b"-" else 20)
            if depth < len(wanted) and name in wanted[depth]:
                folder = b"/".join([*names[1:], name]) if depth else b""
                if folder in folders:
                    todo -= 1
                    if count[:1] != b"-":
                        out.append(data[last:pos])
                        out.append(name + b"\0-1 " + subs + b"\n")
                        last = after
            pos = after
            nsubs = int(subs)
            if nsubs:
                left.append(nsubs)
                names.append(name)
            else:
                while left and left[-1] == 0:
                    left.pop()
                    names.pop()
        if pos > end or (todo and (left or pos != end)):
            raise Unsupported("TREE extension")
        out.append(data[last:end])
        return b"".join(out)

    # -- writing -------------------------------------------------------------

    def updated(self, workdir: str, changes: list[tuple[int, TreeEntry, os.stat_result]],
                ) -> tuple[list[bytes | memoryview], hashlib._Hash, int]:
        """The new index: each (entry offset, new entry, file's stat) set; see the module docstring.

        The entries keep their paths and flags; their folders' cached trees are
        invalidated; racily clean entries of ``workdir`` whose files changed
        are smudged (:meth:`_racy_entries`).  Returns the file as parts (without
        its checksum), and the checksum's state over the parts' first ``n``
        bytes, which are the old file's: ``(parts, state, n)``.
        """
        self.verified()
        start, chain = self.extensions()
        data = self.data
        view = memoryview(data)
        parts: list[bytes | memoryview] = []
        last = 0
        folders: set[bytes] = set()
        changes = sorted(changes, key=lambda c: c[0])
        ours = {e for e, _te, _st in changes}
        edits: list[tuple[int, int, bytes]] = []  # (offset, bytes replaced, new bytes)
        for e, te, st in changes:
            if te.mode not in _ENTRY_MODES or len(te.oid) != 40:
                raise Unsupported("mode or object format")
            flags = int.from_bytes(data[e + 60:e + 62], "big")
            path = self._path_at(e)
            edits.append((e, 62, _HEAD.pack(
                int(st.st_ctime) & 0xFFFFFFFF, st.st_ctime_ns % 1_000_000_000,
                int(st.st_mtime) & 0xFFFFFFFF, st.st_mtime_ns % 1_000_000_000,
                st.st_dev & 0xFFFFFFFF, st.st_ino & 0xFFFFFFFF, te.mode,
                st.st_uid & 0xFFFFFFFF, st.st_gid & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF,
                bytes.fromhex(te.oid), flags)))
            above = path.split(b"/")[:-1]
            folders.update(b"/".join(above[:i]) for i in range(len(above) + 1))  # b"": the root
        edits.extend((e + 36, 4, b"\0\0\0\0") for e in self._racy_entries()
                     if e not in ours and self._changed_file(workdir, e))
        edits.sort()
        self.edits = [(off, size) for off, size, _new in edits]
        self.invalidated = frozenset(folders)
        self.written_prefix = None
        first = edits[0][0] if edits else start
        state, hashed = hashlib.sha1(), 0
        if self._prefix is not None:
            upto, box, thread = self._prefix
            if thread is not None:
                thread.join()
            if upto <= first and box:
                state, hashed = box[0].copy(), upto
        for off, size, new in edits:
            parts += [view[last:off], new]
            last = off + size
        parts.append(view[last:start])
        headers: list[tuple[bytes, int]] = []
        for sig, off, size in chain:
            if sig == b"TREE":
                # Folders this file already holds invalidated: the walk would change nothing.
                body = view[off + 8:off + 8 + size] if folders <= self._invalid \
                    else self._tree_invalidated(off, size, folders)
                parts += [sig + len(body).to_bytes(4, "big"), body]
                headers.append((sig, len(body)))
            elif sig == b"EOIE":
                parts.append(b"EOIE" + (24).to_bytes(4, "big") + start.to_bytes(4, "big") + _eoie_hash(headers))
            else:
                parts.append(view[off:off + 8 + size])
                headers.append((sig, size))
        return parts, state, hashed

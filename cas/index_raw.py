"""git's index as bytes: the entries a patch modifies are found and rewritten in place.

git's index is one file rewritten whole, and at 100k entries libgit2 takes
tens of milliseconds to parse it and as long again to write it back.  A patch
that modifies files already in the index changes 62 bytes per file (stat data,
mode, object id) and the cached trees on their folders; everything else is
passed through as the bytes that were read.

What this module handles, and how it proves it (anything else raises
:class:`Unsupported`, and the caller parses the index with libgit2 instead):

* **Versions 2 and 3**, SHA-1.  Version 4 compresses paths against the previous
  entry, so an entry cannot be found by its path.
* **An entry is found** by searching for ``<path>\\0`` and checking that the
  bytes around it are an entry for exactly that path: the flags hold the path's
  length and no extended bit where there is none, the entry starts a multiple
  of 8 bytes after the header (every entry's length is), its mode is one git
  writes, and its padding is NULs up to the next 8-byte boundary.  The caller
  also compares the entry's object id with the base commit's.  Entries with a
  merge stage, ``assume-valid``, or version 3's extended flags
  (``skip-worktree``, ``intent-to-add``) are left to libgit2.  A path whose
  bytes appear but not as a provable entry is left to libgit2 too; a path whose
  bytes appear nowhere is not in the index.
* **The extensions** are found through ``EOIE`` (which records where the
  entries end) or, without it, by the ``TREE`` extension from which a chain of
  extensions reaches the checksum exactly.  Only ``TREE``, ``REUC``, ``IEOT``
  and ``EOIE`` are handled: ``UNTR``, ``FSMN``, ``sdir``, ``link`` and any
  other go to libgit2.  A split index (``sharedindex.*`` beside the index) is
  refused, as libgit2 refuses it.
* **Cached trees** (``TREE``) of the changed files' folders are invalidated,
  as ``git add`` does (``cache_tree_invalidate_path``): their entry count
  becomes ``-1`` and their object id goes.  ``EOIE``'s hash over the
  extension headers is recomputed.  Entry offsets do not move, so ``IEOT``
  stays valid.
* **The checksum** of the file read is verified (in a thread, while the
  caller looks its paths up), and the new file's is computed while it is
  written.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading

from cas.objects import TreeEntry

__all__ = ["Unsupported", "RawIndex", "MAX_PATHS"]

#: Lookups beyond this many paths parse the index instead (each costs a scan).
MAX_PATHS = 8

_ENTRY_MODES = frozenset({0o100644, 0o100755, 0o120000})
_OTHER_MODES = frozenset({0o160000, 0o040000})  # gitlinks, sparse-index folders: libgit2's
_HANDLED_EXT = frozenset({b"TREE", b"REUC", b"IEOT", b"EOIE"})
_NODE = re.compile(rb"([^\0]*)\0(-?[0-9]+) ([0-9]+)\n")
_HEAD = struct.Struct(">10I20sH")  # an entry up to its flags: 62 bytes
_THREADED_HASH = 1 << 18  # below this the checksum is verified inline
_STATE_STEP = 1 << 16


class Unsupported(Exception):
    """This index, or this change to it, needs the full parser."""


def _be32(data: bytes, off: int) -> int:
    return int.from_bytes(data[off:off + 4], "big")


class RawIndex:
    """One read of an index file; see the module docstring."""

    def __init__(self, path: str) -> None:
        folder = os.path.dirname(path)
        if any(name.startswith("sharedindex.") for name in os.listdir(folder)):
            raise Unsupported("split index")
        with open(path, "rb", buffering=0) as fh:
            st = os.fstat(fh.fileno())
            data = fh.readall()
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if len(data) != st.st_size or len(data) < 32 or data[:4] != b"DIRC":
            raise Unsupported("not an index this module reads")
        self.version = _be32(data, 4)
        if self.version not in (2, 3):
            raise Unsupported(f"index version {self.version}")
        self.count = _be32(data, 8)
        self.data = data
        self._verified: bool | None = None
        self._states: list[hashlib._Hash] = []
        self._verifier: threading.Thread | None = None
        self._ext: tuple[int, list[tuple[bytes, int, int]]] | None = None
        self._found: dict[str, int | None] = {}
        if len(data) < _THREADED_HASH:
            self._verify()
        else:
            self._verifier = threading.Thread(target=self._verify, daemon=True)
            self._verifier.start()

    # -- reading -------------------------------------------------------------

    def _verify(self) -> None:
        # The state is kept every _STATE_STEP bytes: the new file's checksum
        # starts from the last one before its first changed byte.
        view = memoryview(self.data)
        end = len(self.data) - 20
        h = hashlib.sha1()
        states = []
        for off in range(0, end, _STATE_STEP):
            states.append(h.copy())
            h.update(view[off:min(off + _STATE_STEP, end)])
        self._states = states
        self._verified = h.digest() == self.data[-20:]

    def verified(self) -> None:
        """Wait for the checksum check; a mismatch is left to libgit2 to report."""
        if self._verifier is not None:
            self._verifier.join()
            self._verifier = None
        if not self._verified:
            raise Unsupported("index checksum does not match")

    def _entry_at(self, p: int, length: int) -> int | None:
        """The offset of the entry whose path (``length`` bytes) starts at ``p``, if the bytes prove one."""
        data = self.data
        for extended in (False, True):
            e = p - (64 if extended else 62)
            if e < 12 or (e - 12) % 8:
                continue
            flags = int.from_bytes(data[e + 60:e + 62], "big")
            if bool(flags & 0x4000) != extended or (flags & 0xFFF) != length:
                continue
            if extended and self.version < 3:
                continue
            mode = _be32(data, e + 24)
            if mode not in _ENTRY_MODES and mode not in _OTHER_MODES:
                continue
            end = e + ((62 + (2 if extended else 0) + length + 8) & ~7)
            if end > len(data) - 20 or data[p + length:end].strip(b"\0"):
                continue
            return e
        return None

    def locate(self, path: str) -> int | None:
        """Offset of ``path``'s entry, ``None`` when the path is not in the index.

        Raises:
            Unsupported: the entry is one this module leaves to libgit2 (see the
                module docstring), or the path's bytes occur but prove no entry.
        """
        if path in self._found:
            return self._found[path]
        found = self._found[path] = self._locate(path)
        return found

    def _locate(self, path: str) -> int | None:
        raw = os.fsencode(path)
        if len(raw) >= 0xFFF or b"\0" in raw:
            raise Unsupported("path length")
        needle = raw + b"\0"
        data = self.data
        pos = data.find(needle, 12)
        seen = False
        while pos != -1:
            seen = True
            e = self._entry_at(pos, len(raw))
            if e is not None:
                flags = int.from_bytes(data[e + 60:e + 62], "big")
                if flags & 0xF000 or _be32(data, e + 24) not in _ENTRY_MODES:
                    raise Unsupported("a staged conflict, flags or mode left to libgit2")
                if e + 62 + len(needle) > self.extensions()[0]:
                    raise Unsupported("found past the entries")
                return e
            pos = data.find(needle, pos + 1)
        if seen:
            raise Unsupported("path bytes occur outside a provable entry")
        return None

    def entry(self, path: str) -> TreeEntry | None:
        """``path``'s stage-0 entry as (object id, mode), ``None`` when it is not in the index.

        The checksum may still be being verified: call :meth:`verified` before
        acting on the answer.
        """
        e = self.locate(path)
        if e is None:
            return None
        return TreeEntry(self.data[e + 40:e + 60].hex(), _be32(self.data, e + 24))

    def extensions(self) -> tuple[int, list[tuple[bytes, int, int]]]:
        """Where the entries end, and each extension as (signature, offset, size of its data)."""
        if self._ext is not None:
            return self._ext
        data = self.data
        end = len(data) - 20
        if end - 32 >= 12 and data[end - 32:end - 28] == b"EOIE" and _be32(data, end - 28) == 24:
            start = _be32(data, end - 24)
            chain = self._chain(start, end) if 12 <= start <= end - 32 else None
            if chain is None or chain[-1][0] != b"EOIE" or self._eoie(chain[:-1]) != data[end - 20:end]:
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
        if any(sig not in _HANDLED_EXT for sig, _off, _size in chain):
            raise Unsupported("an extension left to libgit2")
        self._ext = (start, chain)
        return self._ext

    def _chain(self, start: int, end: int) -> list[tuple[bytes, int, int]] | None:
        data = self.data
        chain = []
        pos = start
        while pos < end:
            if pos + 8 > end:
                return None
            sig = data[pos:pos + 4]
            size = _be32(data, pos + 4)
            chain.append((sig, pos, size))
            pos += 8 + size
        return chain if pos == end else None

    def _eoie(self, chain: list[tuple[bytes, int, int]]) -> bytes:
        h = hashlib.sha1()
        for sig, _off, size in chain:
            h.update(sig + size.to_bytes(4, "big"))
        return h.digest()

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

    def updated(self, changes: list[tuple[int, TreeEntry, os.stat_result]]) -> tuple[list[bytes | memoryview], hashlib._Hash, int]:
        """The new index: each (entry offset, new entry, file's stat) set; see the module docstring.

        The entries keep their paths and flags; their folders' cached trees are
        invalidated.  Returns the file as parts (without its checksum), and the
        checksum's state over the parts' first ``n`` bytes, which are the old
        file's: ``(parts, state, n)``.
        """
        self.verified()
        start, chain = self.extensions()
        data = self.data
        view = memoryview(data)
        parts: list[bytes | memoryview] = []
        last = 0
        folders: set[bytes] = set()
        changes = sorted(changes, key=lambda c: c[0])
        first = changes[0][0] if changes else start
        state = self._states[first // _STATE_STEP].copy()
        for e, te, st in changes:
            if te.mode not in _ENTRY_MODES or len(te.oid) != 40:
                raise Unsupported("mode or object format")
            flags = int.from_bytes(data[e + 60:e + 62], "big")
            path = data[e + 62:e + 62 + (flags & 0xFFF)]
            parts.append(view[last:e])
            parts.append(_HEAD.pack(
                int(st.st_ctime) & 0xFFFFFFFF, st.st_ctime_ns % 1_000_000_000,
                int(st.st_mtime) & 0xFFFFFFFF, st.st_mtime_ns % 1_000_000_000,
                st.st_dev & 0xFFFFFFFF, st.st_ino & 0xFFFFFFFF, te.mode,
                st.st_uid & 0xFFFFFFFF, st.st_gid & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF,
                bytes.fromhex(te.oid), flags))
            last = e + 62
            folders.add(b"")
            cut = path.rfind(b"/")
            while cut > 0:
                folders.add(path[:cut])
                cut = path.rfind(b"/", 0, cut)
        parts.append(view[last:start])
        headers: list[tuple[bytes, int]] = []
        for sig, off, size in chain:
            if sig == b"TREE":
                body = self._tree_invalidated(off, size, folders)
                parts.append(sig + len(body).to_bytes(4, "big"))
                parts.append(body)
                headers.append((sig, len(body)))
            elif sig == b"EOIE":
                h = hashlib.sha1()
                for s, n in headers:
                    h.update(s + n.to_bytes(4, "big"))
                parts.append(b"EOIE" + (24).to_bytes(4, "big") + start.to_bytes(4, "big") + h.digest())
            else:
                parts.append(view[off:off + 8 + size])
                headers.append((sig, size))
        return parts, state, first // _STATE_STEP * _STATE_STEP

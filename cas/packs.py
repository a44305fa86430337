"""One pack per transaction: a call's objects in one ``.pack`` and its ``.idx`` (stdlib only).

A call writes five to eight small objects (a blob, the trees on its path, a
commit).  As loose objects that is one file per object, each created, synced
and renamed, and up to one folder sync per object (``objects/xx/``): the
biggest share of the prepare round.  Written as one pack it is two files in one
folder, whatever the number of objects.

The formats are git's (``Documentation/gitformat-pack.txt``): pack version 2,
whole objects only (no deltas), zlib at git's loose-object level; index
version 2.  The pack is named by its checksum, as git names the packs it writes.

Packs must not pile up: git's ``gc --auto`` repacks the whole repository once it
holds more than ``gc.autoPackLimit`` (50) packs, and every reader looks an
object up pack by pack.  So a call folds *small* packs (at most
:data:`SMALL_MAX` objects and :data:`MERGE_BYTES_MAX` bytes, no ``.keep``,
``.promisor``, ``.mtimes``, ``.bitmap`` or ``.rev`` beside them) into the pack
it writes anyway — geometrically, as ``git repack --geometric=2`` does: the
smallest packs in turn, while each is smaller than twice what is merged so
far, so that every object is copied O(log n) times — once that choice makes
:data:`MERGE_TRIGGER` packs one, its own among them.  Their entries are
copied byte for byte, once the pack's checksum, each entry's CRC and each
object's id (inflated and hashed) check out; a pack with a delta or anything
else is left as it is.  The packs merged are noted once the new pack is
durable, and removed by a later call once :data:`RETIRE_GRACE` has passed
(:func:`retire`, :func:`sweep`; the note is ``objects/info/oncepatch-retired``).
A reader that had listed a removed pack finds its objects in the new one when
it rescans, as when git repacks.  Nothing is merged in a repository with a
``multi-pack-index``: it may name the small packs, and only git's own repack
rewrites it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from collections.abc import Collection, Iterable
from typing import Any

from cas.durable import TMP_MARK, append_durable
from cas.errors import DurableWriteError

__all__ = ["PackBuilder", "SmallPack", "small_packs", "choose_merge", "retire", "sweep", "deflate", "MERGE_TRIGGER",
           "SMALL_MAX"]

#: A call merges packs once the geometric rule would make this many one, its own among them.
MERGE_TRIGGER = 8
#: A pack of at most this many objects is small (a merge never makes a pack bigger than this).
SMALL_MAX = 4096
#: Objects bigger than this stay loose: they are streamed to disk, never held twice in memory.
OBJECT_MAX = 1 << 20
#: A call whose objects add up to more than this writes them loose (a pack is built in memory).
PACK_BYTES_MAX = 256 << 20
#: A pack file bigger than this is never read for a merge (nor is a merge made bigger).
MERGE_BYTES_MAX = 8 << 20
#: zlib level: git's default ``core.looseCompression`` (best speed); any level reads the same.
LEVEL = 1
#: Inputs up to this size are deflated with a window fitted to them (:func:`deflate`).
DEFLATE_SMALL = 1 << 14
_IDX_MAGIC = b"\377tOc"
_TYPES = {b"commit": 1, b"tree": 2, b"blob": 3, b"tag": 4}
_NAMES = {code: name for name, code in _TYPES.items()}
_COMPANIONS = (".keep", ".promisor", ".mtimes", ".bitmap", ".rev")


def deflate(data: bytes | memoryview, level: int = LEVEL) -> bytes:
    """``data`` as one zlib stream, as ``zlib.compress(data, level)`` but cheaper for small inputs.

    ``zlib.compress`` sets up its full 32 KiB window and hash tables (≈ 270 KB
    allocated and cleared) whatever the input: ≈ 90 µs for a 300-byte commit
    on this project's machines, against ≈ 10 µs with a window just big enough
    for the input and a smaller hash (memLevel 6).  The stream names its window
    in its header; every inflater (git's, libgit2's, anyone's default
    ``inflateInit``) reads any window up to 32 KiB, and the object id is over
    the inflated bytes, so nothing outside can tell.
    """
    n = len(data)
    if n > DEFLATE_SMALL:
        return zlib.compress(data, level)
    z = zlib.compressobj(level, zlib.DEFLATED, max(9, min(15, (n + 262).bit_length())), 6)
    return z.compress(data) + z.flush()


def _entry_header(kind: int, size: int) -> bytes:
    """A pack entry's header: type and size, 4 bits then 7 per byte, little-endian groups."""
    out = bytearray()
    byte = (kind << 4) | (size & 0x0F)
    size >>= 4
    while size:
        out.append(byte | 0x80)
        byte = size & 0x7F
        size >>= 7
    out.append(byte)
    return bytes(out)


class PackBuilder:
    """Objects gathered into one pack (built in memory: they are small)."""

    def __init__(self) -> None:
        # {raw oid: (entry bytes, crc32)}, in the order added
        self._entries: dict[bytes, tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add_object(self, oid_hex: str, header: bytes, body: bytes | memoryview) -> None:
        """Add a whole object; ``header`` is its loose header (``b"blob 12\\0"``)."""
        oid = bytes.fromhex(oid_hex)
        if oid in self._entries:
            return
        kind = _TYPES[header[:header.index(b" ")]]
        entry = _entry_header(kind, len(body)) + deflate(body)
        self._entries[oid] = (entry, zlib.crc32(entry))

    def add_entry(self, oid: bytes, entry: bytes, crc: int) -> None:
        """Add an entry copied from another pack (checked by the caller)."""
        self._entries.setdefault(oid, (entry, crc))

    def entries(self) -> list[tuple[bytes, bytes, int]]:
        """``(oid, entry bytes, crc32)`` of every object, as :func:`read_entries` reads them from the pack built."""
        return [(oid, entry, crc) for oid, (entry, crc) in self._entries.items()]

    def build(self) -> tuple[str, bytes, bytes]:
        """``(checksum hex, pack bytes, idx bytes)``."""
        parts = [b"PACK", struct.pack(">II", 2, len(self._entries))]
        offsets: dict[bytes, int] = {}
        at = 12
        for oid, (entry, _crc) in self._entries.items():
            offsets[oid] = at
            parts.append(entry)
            at += len(entry)
        if at >= 1 << 31:
            raise ValueError("pack too big for 31-bit offsets")
        body = b"".join(parts)
        checksum = hashlib.sha1(body).digest()
        pack = body + checksum
        oids = sorted(self._entries)
        fanout = [0] * 256
        for oid in oids:
            fanout[oid[0]] += 1
        total = 0
        for i in range(256):
            total += fanout[i]
            fanout[i] = total
        idx = b"".join([
            _IDX_MAGIC, struct.pack(">I", 2), struct.pack(">256I", *fanout), *oids,
            struct.pack(f">{len(oids)}I", *(self._entries[o][1] for o in oids)),
            struct.pack(f">{len(oids)}I", *(offsets[o] for o in oids)),
            checksum,
        ])
        idx += hashlib.sha1(idx).digest()
        return checksum.hex(), pack, idx


class SmallPack:
    """A pack in ``objects/pack`` that a merge may take: its name stem and object count."""

    __slots__ = ("stem", "count", "size")

    def __init__(self, stem: str, count: int, size: int = 0) -> None:
        self.stem = stem  # full path without the extension
        self.count = count
        self.size = size  # of the .pack file

    def __repr__(self) -> str:
        return f"SmallPack({os.path.basename(self.stem)!r}, {self.count})"


def small_packs(pack_dir: str, names: Collection[str] | None = None,
                cache: dict[str, tuple[int, int] | None] | None = None) -> list[SmallPack]:
    """The small packs of ``pack_dir``, smallest first (a count read from the idx's size).

    ``names``: the folder's listing when the caller has just made it.
    ``cache``: ``{idx name: (objects, pack bytes) or None}`` kept by the caller
    between calls; a pack never changes under its name, so only new names are
    looked at.
    """
    if names is None:
        try:
            names = set(os.listdir(pack_dir))
        except (FileNotFoundError, NotADirectoryError):
            return []
    if "multi-pack-index" in names:
        return []
    if cache is None:
        cache = {}
    else:
        for gone in [n for n in cache if n not in names]:
            del cache[gone]
    out: list[SmallPack] = []
    accompanied = {n.rpartition(".")[0] for n in names if n.endswith(_COMPANIONS)}
    for name in names:
        if not (name.startswith("pack-") and name.endswith(".idx")):
            continue
        base = name[:-4]
        if base + ".pack" not in names or base in accompanied:
            continue
        if name not in cache:
            cache[name] = _measure(os.path.join(pack_dir, base))
        found = cache[name]
        if found is not None:
            out.append(SmallPack(os.path.join(pack_dir, base), *found))
    out.sort(key=lambda p: (p.count, p.stem))
    return out


def _measure(stem: str) -> tuple[int, int] | None:
    """``(objects, pack bytes)`` of a small pack, ``None`` for any other."""
    try:
        size = os.stat(stem + ".idx").st_size
        pack_size = os.stat(stem + ".pack").st_size
    except OSError:
        return None
    # idx v2: 8 + 1024, 28 per object, 40 (no large offsets in a small pack)
    count, rest = divmod(size - 1072, 28)
    if rest or not 0 < count <= SMALL_MAX or pack_size > MERGE_BYTES_MAX:
        return None
    return count, pack_size


def choose_merge(new_count: int, packs: list[SmallPack]) -> list[SmallPack]:
    """Which of ``packs`` (smallest first) to fold into a new pack of ``new_count`` objects.

    The geometric rule's choice, once it makes :data:`MERGE_TRIGGER` packs one
    with the new pack; none before (a merge every call would copy the same
    small packs again and again).
    """
    chosen: list[SmallPack] = []
    merged, size = new_count, 0
    for pack in packs:
        if pack.count >= 2 * merged or merged + pack.count > SMALL_MAX or size + pack.size > MERGE_BYTES_MAX:
            break
        chosen.append(pack)
        merged += pack.count
        size += pack.size
    return chosen if len(chosen) + 1 >= MERGE_TRIGGER else []


def read_entries(stem: str) -> list[tuple[bytes, bytes, int]] | None:
    """``(oid, entry bytes, crc32)`` of every object of a small pack, or ``None`` if it cannot be taken whole.

    ``None``: gone (another process merged it), empty, not the format written
    here, a delta entry, or a checksum, CRC or object id that does not match.
    """
    try:
        with open(stem + ".idx", "rb") as fh:
            idx = fh.read()
        with open(stem + ".pack", "rb") as fh:
            pack = fh.read()
    except OSError:
        return None
    if len(idx) < 1072 or idx[:8] != _IDX_MAGIC + struct.pack(">I", 2) or len(pack) < 32:
        return None
    if hashlib.sha1(idx[:-20]).digest() != idx[-20:] or hashlib.sha1(pack[:-20]).digest() != pack[-20:]:
        return None
    if idx[-40:-20] != pack[-20:] or pack[:4] != b"PACK":
        return None
    n = struct.unpack(">I", idx[8 + 1020:8 + 1024])[0]
    version, count = struct.unpack(">II", pack[4:12])
    if version != 2 or count != n or not n or len(idx) != 1072 + 28 * n:
        return None
    base = 1032
    oids = [idx[base + 20 * i:base + 20 * i + 20] for i in range(n)]
    crcs = struct.unpack(f">{n}I", idx[base + 20 * n:base + 24 * n])
    offsets = struct.unpack(f">{n}I", idx[base + 24 * n:base + 28 * n])
    if any(off & 0x80000000 for off in offsets):
        return None
    order = sorted(range(n), key=lambda i: offsets[i])
    if offsets[order[0]] != 12:
        return None  # bytes before the first entry: not a pack written as git writes them
    ends = [offsets[order[k + 1]] for k in range(n - 1)] + [len(pack) - 20]
    out: list[tuple[bytes, bytes, int]] = []
    for k, i in enumerate(order):
        entry = pack[offsets[i]:ends[k]]
        if not entry or zlib.crc32(entry) != crcs[i] or _object_id(entry) != oids[i]:
            return None  # a delta, or not the object the idx says
        out.append((oids[i], entry, crcs[i]))
    return out


def _object_id(entry: bytes) -> bytes | None:
    """The id of the whole object a pack entry holds, if its zlib stream fills the entry exactly."""
    kind = (entry[0] >> 4) & 7
    if kind not in _NAMES:
        return None  # 6, 7: deltas
    size, shift, at = entry[0] & 0x0F, 4, 1
    byte = entry[0]
    while byte & 0x80:
        if at >= len(entry):
            return None
        byte = entry[at]
        size |= (byte & 0x7F) << shift
        shift += 7
        at += 1
    z = zlib.decompressobj()
    try:
        body = z.decompress(entry[at:], size + 1)
    except zlib.error:
        return None
    if len(body) != size or not z.eof or z.unused_data or z.unconsumed_tail:
        return None
    return hashlib.sha1(b"%s %d\0" % (_NAMES[kind], size) + body).digest()


#: Merged packs stay this many seconds before they are removed (see :func:`retire`) ...
RETIRE_GRACE = 1.0
#: ... unless more than this many wait: the oldest go first (calls many times a second).
RETIRE_MAX = 16


def retire(list_path: str, packs: Iterable[SmallPack], now: float) -> None:
    """Note that ``packs`` are merged into a durable pack: :func:`sweep` removes them after :data:`RETIRE_GRACE`
    (sooner when more than :data:`RETIRE_MAX` wait).

    Not at once: a reader (git, libgit2) lists the pack folder and opens the
    packs it listed a moment later.  A pack removed in between, whose objects
    went to a pack created after the listing, is a miss the reader's one
    rescan could not repair.  The list is advisory and not synced: a pack
    it forgets is an ordinary small pack again, merged once more (its objects
    copied twice, which git tolerates).
    """
    lines = "".join(f"{now:.3f} {os.path.basename(p.stem)}\n" for p in packs)
    if not lines:
        return
    try:
        os.makedirs(os.path.dirname(list_path), exist_ok=True)
        append_durable(list_path, lines.encode(), sync=False)
    except (OSError, DurableWriteError):
        pass  # not noted: merged again later


def sweep(pack_dir: str, list_path: str, now: float, seen: dict[str, Any] | None = None,
          removed: set[str] | None = None) -> set[str]:
    """Remove the noted packs whose grace has passed (idx first); return the stems still waiting.

    Two sweeps at once remove the same files (a missing one is fine) and may
    drop a note made meanwhile from the list: that pack is merged again later.
    ``seen``: kept by the caller between calls; while the list's file is the
    one last read (inode, size, mtime) and none of its notes is due, it is
    not read again.  (Were a change missed, a pack is removed a call later,
    or merged twice: both harmless, as above.)
    ``removed``: the stems removed now are added to it (a listing made
    before the sweep still names them).
    """
    try:
        st = os.stat(list_path)
    except OSError:
        return set()
    sig = (st.st_ino, st.st_size, st.st_mtime_ns)
    if seen is not None and seen.get("sig") == sig and now < seen["due"]:
        return set(seen["waiting"])
    try:
        with open(list_path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return set()
    waiting: list[tuple[str, str]] = []
    due: list[str] = []
    for line in raw.decode("utf-8", "replace").splitlines():
        stamp, _, name = line.partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            continue
        if not (name.startswith("pack-") and "/" not in name and name.isascii()):
            continue
        if when <= now - RETIRE_GRACE:
            due.append(name)
        else:
            waiting.append((stamp, name))
    if len(waiting) > RETIRE_MAX:  # in the order noted: the oldest first
        due += [name for _stamp, name in waiting[:len(waiting) - RETIRE_MAX]]
        waiting = waiting[len(waiting) - RETIRE_MAX:]
    if due:
        for name in due:
            if removed is not None:
                removed.add(os.path.join(pack_dir, name))
            for ext in (".idx", ".pack"):
                try:
                    os.unlink(os.path.join(pack_dir, name + ext))
                except OSError:
                    pass  # gone already (another sweep), or not ours to remove: duplicates are harmless
        tmp = f"{list_path}{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}"  # per thread
        try:
            with open(tmp, "w", encoding="ascii") as fh:
                fh.write("".join(f"{stamp} {name}\n" for stamp, name in waiting))
            os.replace(tmp, list_path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    still = {os.path.join(pack_dir, name) for _stamp, name in waiting}
    if seen is not None:
        if due:  # rewritten: read once more next time
            seen.clear()
        else:
            seen.update(sig=sig, waiting=still,
                        due=min((float(stamp) for stamp, _name in waiting), default=float("inf")) + RETIRE_GRACE)
    return still

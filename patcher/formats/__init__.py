"""Patch formats: detection and parsing into :class:`patcher.model.Patch` (pure).

Each format registers a cheap ``looks(data)`` test and a ``parse(data)``.
``auto`` picks the one format whose test accepts the input; detection never
guesses between two formats that both accept it: each ``looks`` is specific
(``docs/FORMATS.md``, "Detection"), and two that accept → :class:`ParseError`.

Built in: ``unified`` (:mod:`patcher.formats.unified`), ``apply_patch``
(:mod:`patcher.formats.envelope`), ``search_replace`` and ``str_replace``
(:mod:`patcher.formats.editblocks`), ``whole_file`` (:mod:`patcher.formats.wholefile`).

A format may also say how its edits apply (read by :mod:`patcher.stage`):
``apply_file(original, hunks, path=...)`` replaces
:func:`patcher.matching.apply_hunks` for its ``modify``/``rename`` hunks
(edit blocks apply one after another); ``writes_create`` makes a
``modify`` with whole ``content`` of a missing path an ``add`` (whole-file writes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from patcher.formats.detection import DETECTORS
from patcher.errors import ParseError
from patcher.model import AppliedFile, Patch
from patcher.paths import check_path, check_paths

__all__ = ["Format", "FileApplier", "FORMATS", "register", "detect", "parse_patch", "format_names", "get_format"]

FileApplier = Callable[..., AppliedFile]  # (original: bytes, hunks: Sequence[Hunk], *, path: str)


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    looks: Callable[[bytes], bool]
    parse: Callable[[bytes], Patch]
    apply_file: FileApplier | None = None
    writes_create: bool = False


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> None:
    FORMATS[fmt.name] = fmt


#: The formats :func:`_load_builtin` registers, known without importing their parsers (a replay
#: checks a name without them; a test keeps the two in step).
BUILTIN_NAMES = ("apply_patch", "search_replace", "str_replace", "unified", "whole_file")


def known_format(name: str) -> bool:
    """Whether ``name`` is a format ``--format`` takes (``auto`` included)."""
    return name == "auto" or name in BUILTIN_NAMES or name in FORMATS


def _load_builtin() -> None:
    # Deferred: these modules import Format from here (a cycle at module level; Format belongs
    # in a module below both).
    from patcher.formats import editblocks, envelope, unified, wholefile

    register(Format("unified", unified.looks_unified, unified.parse_unified))
    for module in (envelope, editblocks, wholefile):
        for fmt in module.FORMATS:
            register(fmt)


def get_format(name: str) -> Format | None:
    """The registered format ``name`` (``None`` if unknown)."""
    if not FORMATS:
        _load_builtin()
    return FORMATS.get(name)


def format_names() -> list[str]:
    if not FORMATS:
        _load_builtin()
    return sorted(FORMATS)


def detect(data: bytes) -> str:
    """The name of the one format that accepts ``data``.

    Raises:
        ParseError: no format, or more than one, accepts it.
    """
    # Only the light tests: detection must not import the parsers (replays stay cheap).
    detectors: dict[str, Callable[[bytes], bool]] = dict(DETECTORS)
    for name, fmt in FORMATS.items():
        detectors.setdefault(name, fmt.looks)
    hits = [name for name, looks in detectors.items() if looks(data)]
    if not hits:
        raise ParseError("cannot tell the patch format: no known format matches (use --format)",
                         details={"formats": sorted(detectors)})
    if len(hits) > 1:
        raise ParseError(f"patch could be any of {', '.join(sorted(hits))}: name one with --format",
                         details={"formats": sorted(hits)})
    return hits[0]


def parse_patch(data: bytes, fmt: str) -> Patch:
    """Parse with format ``fmt`` and check every path (docs/DESIGN.md section 4, step 1).

    Raises:
        ParseError, UnsafePath, UnsupportedPatch.
    """
    if not FORMATS:
        _load_builtin()
    if fmt not in FORMATS:
        raise ParseError(f"unknown patch format '{fmt}'", details={"formats": format_names()})
    parsed = FORMATS[fmt].parse(data)
    edits = tuple(replace(e, path=check_path(e.path), new_path=None if e.new_path is None else check_path(e.new_path))
                  for e in parsed.edits)
    # A file may give way to a folder of the same name (or back) in one patch.  A path
    # moved or deleted away and written anew by another edit (git's rename away and
    # copy onto it) is one path that stays a file; each format refuses a path changed
    # twice on its own.
    removed = {e.path for e in edits if e.op in ("delete", "rename")}
    renewed = removed & {e.target for e in edits if e.op != "delete"}
    touched = [p for e in edits for p in e.touched if p not in renewed]
    check_paths(touched + sorted(renewed), removed=sorted(removed - renewed))
    return Patch(parsed.format, edits)

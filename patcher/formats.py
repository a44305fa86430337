"""Patch formats: detection and parsing into :class:`patcher.model.Patch` (pure).

Each format registers a cheap ``looks(data)`` test and a ``parse(data)``.
``auto`` picks the one format whose test accepts the input; detection never
guesses between two formats that both accept it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from patcher.errors import ParseError
from patcher.model import Patch
from patcher.paths import check_path, check_paths

__all__ = ["Format", "FORMATS", "register", "detect", "parse_patch", "format_names"]


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    looks: Callable[[bytes], bool]
    parse: Callable[[bytes], Patch]


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> None:
    FORMATS[fmt.name] = fmt


def _load_builtin() -> None:
    from patcher import unified

    register(Format("unified", unified.looks_unified, unified.parse_unified))
    try:
        from patcher import envelope
    except ImportError:  # pragma: no cover - optional format module
        return
    for fmt in envelope.FORMATS:
        register(fmt)


def format_names() -> list[str]:
    if not FORMATS:
        _load_builtin()
    return sorted(FORMATS)


def detect(data: bytes) -> str:
    """The name of the one format that accepts ``data``.

    Raises:
        ParseError: no format, or more than one, accepts it.
    """
    if not FORMATS:
        _load_builtin()
    hits = [f.name for f in FORMATS.values() if f.looks(data)]
    if not hits:
        raise ParseError("cannot tell the patch format: no known format matches (use --format)",
                         details={"formats": format_names()})
    if len(hits) > 1:
        raise ParseError(f"patch could be any of {', '.join(sorted(hits))}: name one with --format",
                         details={"formats": sorted(hits)})
    return hits[0]


def parse_patch(data: bytes, fmt: str) -> Patch:
    """Parse with format ``fmt`` and check every path (DESIGN.md section 4, step 1).

    Raises:
        ParseError, UnsafePath, UnsupportedPatch.
    """
    if not FORMATS:
        _load_builtin()
    if fmt not in FORMATS:
        raise ParseError(f"unknown patch format '{fmt}'", details={"formats": format_names()})
    parsed = FORMATS[fmt].parse(data)
    edits = tuple(
        dataclasses.replace(
            e,
            path=check_path(e.path),
            new_path=None if e.new_path is None else check_path(e.new_path),
        )
        for e in parsed.edits
    )
    # A file may give way to a folder of the same name (or back) in one patch.
    check_paths([p for e in edits for p in e.touched],
                removed=[e.path for e in edits if e.op in ("delete", "rename")])
    return Patch(parsed.format, edits)

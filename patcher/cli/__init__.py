"""``oncepatch`` command line (docs/DESIGN.md section 6).

:func:`main` is the command (``patcher/__main__.py``).  Run from the command
line it first asks a running ``oncepatch serve`` (:mod:`patcher.connect`, a few
standard modules only) and, when the server answers, exits with its status
there and then (:func:`patcher.connect.leave`); it runs the command in this
process (:mod:`patcher.cli.run`) when there is none.  Called with an explicit
``argv`` it always runs in process and returns the exit status.
"""

from __future__ import annotations

import sys

__all__ = ["main", "build_parser"]


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        from patcher import connect

        code = connect.call(sys.argv[1:])
        if code is not None:
            connect.leave(code)  # the server answered: this process has nothing left to do
    from patcher.cli import run

    return run.main(argv)


def __getattr__(name: str) -> object:
    if name == "build_parser":
        from patcher.cli import parser

        return parser.build_parser
    raise AttributeError(f"module 'patcher.cli' has no attribute '{name}'")

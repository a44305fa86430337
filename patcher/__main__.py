#!/usr/bin/env python3
"""``python -m patcher``, and the ``oncepatch`` command itself.

pyproject.toml installs this file as ``bin/oncepatch`` (a wheel's shared
script; the installer points the first line at the environment's Python)
instead of a console-script entry point, whose launcher imports ``re`` to
tidy ``argv[0]``: with ``enum``, which ``re`` brings, ≈ 5 ms of every cold
command here, the largest single import of a replay (docs/DECISIONS.md).
"""

import sys

from patcher.cli import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""``python -m patcher``, and the ``oncepatch`` command itself.

pyproject.toml installs this file as ``bin/oncepatch`` (a wheel's shared
script: the installer points its first line at the environment's Python)
rather than as a console-script entry point, whose launcher imports ``re``
to tidy ``argv[0]``: the thin client (:mod:`patcher.connect`) would carry
``re`` and ``enum`` on every call through ``oncepatch serve``
(docs/DECISIONS.md, "The server and the broker").
"""

import sys

from patcher.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m patcher``: the ``oncepatch`` command (pyproject installs ``patcher.cli:main`` as it)."""

import sys

from patcher.cli import main

if __name__ == "__main__":
    sys.exit(main())

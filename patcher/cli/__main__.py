"""``python -m patcher.cli``: the ``oncepatch`` command."""

import sys

from patcher.cli import main

sys.exit(main())

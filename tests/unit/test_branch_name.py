"""The branch-name check without ``re`` refuses exactly what git's pattern refuses."""

from __future__ import annotations

import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from patcher.args import BAD_REF_PATTERN, bad_branch_name

_PIECES = ["a", "b/", "/", ".", "..", ".lock", "lock", "@", "{", "@{", "~", "^", ":", "?", "*", "[", "\\", "\x7f",
           " ", "\t", "\n", "\x00", "\x1f", "!", "é", "-", "_"]
_names = st.lists(st.sampled_from(_PIECES), max_size=8).map("".join) | st.text(max_size=12)


@settings(max_examples=3000, deadline=None)
@given(_names)
@example("")
@example("a.lock\n")
@example("a/\n")
@example("feature/x.lock")
@example("feature/x.locked")
@example("x/.hidden")
@example("x.y")
def test_bad_branch_name_is_the_pattern(name: str) -> None:
    assert bad_branch_name(name) == (re.search(BAD_REF_PATTERN, name) is not None)

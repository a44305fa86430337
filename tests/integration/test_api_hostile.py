"""The Python API given arguments of types no call can mean: a usage error naming the argument, nothing changed.

Before, a ``branch`` or ``repo`` of the wrong type failed deep inside as an
``internal`` error (exit 1, "AttributeError: ..."), ``Client(5)`` raised a bare
``TypeError``, and a ``strict="no"`` was taken as true.  Through a server the
arguments become a command line, so a ``branch=3`` became the branch ``"3"``:
the types are checked before a call is sent anywhere (``patcher.args.check_types``).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

import patcher
from conftest import Repo, snapshot
from patcher import Client, OncepatchError
from receipts.policy import Caller

EDIT = "--- a/src/app.py\n+++ b/src/app.py\n@@ -1,3 +1,3 @@\n line 1\n-line 2\n+line two\n line 3\n"

APPLY_CASES: list[tuple[str, dict[str, Any]]] = [
    ("key", {"key": 5}),
    ("key", {"key": b"bytes-key"}),
    ("branch", {"branch": 3}),
    ("branch", {"branch": ["main"]}),
    ("contract_sha256", {"contract_sha256": 5}),
    ("format", {"format": 1}),
    ("check", {"check": ["true"]}),
    ("message", {"message": b"bytes"}),
    ("strict", {"strict": "no"}),
    ("strict", {"strict": 1}),
    ("remote", {"remote": 7}),
    ("repo", {"repo": 5}),
    ("repo", {"repo": b"/bytes/path"}),
]


def refused(exc: pytest.ExceptionInfo[OncepatchError], argument: str) -> dict[str, Any]:
    env = exc.value.envelope()
    assert env["type"] == "usage" and env["effect_status"] == "not_started" and env["next_action"] == "fix_input"
    assert env["argument"] == argument and f"'{argument}'" in env["message"], env
    assert exc.value.exit_code == 2
    return env


@pytest.mark.parametrize(("argument", "given"), APPLY_CASES, ids=[f"{a}-{type(g[a]).__name__}" for a, g in APPLY_CASES])
def test_an_apply_argument_of_the_wrong_type_is_a_usage_error_naming_it(repo: Repo, argument: str,
                                                                        given: dict[str, Any]) -> None:
    before = snapshot(repo)
    kw = {"key": "typed", **given}
    with Client(repo.path, server="never") as client, pytest.raises(OncepatchError) as exc:
        client.apply(EDIT, **kw)
    env = refused(exc, argument)
    assert env["key"] == (kw["key"] if isinstance(kw["key"], str) else None)
    one_shot = {k: v for k, v in kw.items() if k != "repo"}
    with pytest.raises(OncepatchError) as exc:
        patcher.apply(kw.get("repo", str(repo.path)), EDIT, **one_shot)
    refused(exc, argument)
    assert snapshot(repo) == before


@pytest.mark.parametrize(("argument", "given"), [("branch", {"branch": 3}), ("strict", {"strict": "no"}),
                                                 ("key", {"key": 5})])
def test_a_wrong_type_is_refused_before_the_call_goes_to_a_server(repo: Repo, argument: str,
                                                                  given: dict[str, Any]) -> None:
    """Sent to a server, ``branch=3`` would be '--branch=3': the branch "3"; here no server is even asked."""
    before = snapshot(repo)
    with Client(repo.path, server="require") as client, pytest.raises(OncepatchError) as exc:
        client.apply(EDIT, **{"key": "typed", **given})
    refused(exc, argument)  # not io_error: require would have failed for want of a server
    assert snapshot(repo) == before


def test_the_other_calls_refuse_wrong_types_too(repo: Repo) -> None:
    before = snapshot(repo)
    cases: list[tuple[str, Any]] = [
        ("repo", lambda: Client(5)),
        ("store", lambda: Client(repo.path, store=5)),
        ("lock_timeout", lambda: Client(repo.path, lock_timeout="30")),
        ("key", lambda: Client(repo.path, server="never").status(None)),
        ("key", lambda: Client(repo.path, server="never").status(7)),
        ("key", lambda: patcher.status(None, repo=str(repo.path))),
        ("repo", lambda: Client(repo.path, server="never").status("k", repo=3)),
        ("dry_run", lambda: Client(repo.path, server="never").recover(dry_run="no")),
        ("grace", lambda: Client(repo.path, server="never").verify(grace="1")),
    ]
    for argument, fn in cases:
        with pytest.raises(OncepatchError) as exc:
            fn()
        refused(exc, argument)
    assert snapshot(repo) == before


def test_a_caller_that_is_not_a_caller_is_refused(repo: Repo) -> None:
    before = snapshot(repo)
    with pytest.raises(OncepatchError) as exc:
        patcher.apply(str(repo.path), EDIT, key="typed", caller="root")  # type: ignore[arg-type]
    refused(exc, "caller")
    assert snapshot(repo) == before
    # The right types still work: a path-like repo, a Caller of this process.
    res = patcher.apply(pathlib.Path(repo.path), EDIT, key="typed", caller=Caller.current())  # type: ignore[arg-type]
    assert res.status == "committed" and res.commit == repo.head("main")

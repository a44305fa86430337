"""Numbers from ``ONCEPATCH_*`` variables: a bad value leaves the default (receipts.environ)."""

from __future__ import annotations

import pytest

from receipts.environ import env_float, env_int


@pytest.mark.parametrize("value, expected", [(None, 7), ("", 7), ("12", 12), ("abc", 7), ("1.5", 7), (" 3 ", 3)])
def test_env_int(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: int) -> None:
    if value is None:
        monkeypatch.delenv("ONCEPATCH_T", raising=False)
    else:
        monkeypatch.setenv("ONCEPATCH_T", value)
    assert env_int("ONCEPATCH_T", 7) == expected


@pytest.mark.parametrize("value, expected", [(None, 2.5), ("0.25", 0.25), ("x", 2.5), ("inf", 2.5), ("nan", 2.5)])
def test_env_float(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: float) -> None:
    if value is None:
        monkeypatch.delenv("ONCEPATCH_T", raising=False)
    else:
        monkeypatch.setenv("ONCEPATCH_T", value)
    assert env_float("ONCEPATCH_T", 2.5) == expected

"""``VerifyReport``: a check not made (a git remote unreachable) is told apart from a contradiction found."""

from __future__ import annotations

from receipts.verifier import UNREACHABLE, Failure, VerifyReport

NOT_REACHED = Failure("k", "r.json", f"{UNREACHABLE}remote 'origin' (git://h/x) could not be reached")
WRONG = Failure("k", "r.json", "the remote's receipt has another commit than the local one")


def test_only_checks_not_made_is_its_own_verdict() -> None:
    report = VerifyReport(failures=[NOT_REACHED, NOT_REACHED])
    assert not report.ok and report.only_unreachable
    assert [f["kind"] for f in report.to_json()["failures"]] == ["unreachable", "unreachable"]


def test_a_contradiction_beside_them_is_a_failure() -> None:
    report = VerifyReport(failures=[NOT_REACHED, WRONG])
    assert not report.ok and not report.only_unreachable
    assert "kind" not in report.to_json()["failures"][1]


def test_no_failure_is_not_unreachable() -> None:
    assert VerifyReport().ok and not VerifyReport().only_unreachable

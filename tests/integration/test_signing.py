"""Signed stores (docs/SECURITY.md, "Signed mode"): the forgeries an unsigned store cannot tell.

Each forgery is tried on an unsigned store too, where ``verify`` passes it:
that is the limit the signed mode exists for (issue 26's "Why"), and the
contrast proves the signed mode's failure comes from the signatures.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import Repo, make_repo, run_cli, snapshot

import forgeries
import patcher
from receipts.store import ReceiptStore

BASE: dict[str, str | bytes] = {"README": "hello\n", "src/app.py": "".join(f"line {i}\n" for i in range(1, 21))}


def change(repo: Repo, line: int, word: str) -> bytes:
    """A unified diff replacing ``line N`` of src/app.py with ``word`` against the branch's head."""
    head = repo.head()
    repo.write("src/app.py", (repo.path / "src/app.py").read_text().replace(f"line {line}\n", f"{word}\n"))
    diff = repo.git("diff", "--full-index").encode()
    repo.git("checkout", "-q", head, "--", "src/app.py")
    return diff


def make(tmp_path: Path, *, signed: bool) -> Repo:
    repo = make_repo(tmp_path / "repo", BASE)
    if signed:
        r = run_cli("keys", "init", "--repo", str(repo.path), "--json")
        assert r.code == 0, r.out + r.err
    for key, line in (("one", 3), ("two", 15)):
        patcher.apply(str(repo.path), change(repo, line, key), key=key)
    return repo


def signing_key(repo: Repo) -> str:
    key_id: str = json.loads((repo.store / "allowed_signers.json").read_text())["keys"][0]["key_id"]
    return key_id


def verify(repo: Repo, **env: str) -> Any:
    return run_cli("verify", "--repo", str(repo.path), "--json", "--jobs", "1", env=env)


def ledger_lines(repo: Repo) -> list[dict[str, Any]]:
    return forgeries.ledger_lines(repo.store)


# -- what a signed store writes -----------------------------------------------------------------


def test_a_signed_store_signs_every_receipt_and_event_and_verify_says_so(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=True)
    key_id = json.loads((repo.store / "allowed_signers.json").read_text())["keys"][0]["key_id"]
    for key in ("one", "two"):
        doc = json.loads(Path(ReceiptStore(str(repo.store)).receipt_path(key)).read_text())
        assert doc["signature"]["key_id"] == key_id and doc["signature"]["algorithm"] == "ed25519"
    events = ledger_lines(repo)
    assert len(events) == 5 and all(e["signature"]["key_id"] == key_id for e in events)
    r = verify(repo)
    assert r.code == 0, r.out
    assert r.json["signatures"]["mode"] == "signed"
    assert r.json["signatures"]["keys"] == [{"key_id": key_id, "status": "active"}]
    text = run_cli("verify", "--repo", str(repo.path))
    assert text.code == 0 and "(signed store: allowed signers " in text.out


def test_an_unsigned_store_says_it_proved_consistency_only(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=False)
    r = verify(repo)
    assert r.code == 0 and r.json["signatures"] == {"mode": "unsigned"}
    assert "signature" not in (repo.store / "events.jsonl").read_text()


# -- the forgeries of issue 26 ------------------------------------------------------------------


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_an_event_rewritten_with_its_chain_recomputed(tmp_path: Path, signed: bool) -> None:
    repo = make(tmp_path, signed=signed)
    events = ledger_lines(repo)
    target = forgeries.rewrite_an_event(repo.store, "one")
    r = verify(repo)
    if not signed:
        assert r.code == 0, r.out  # the limit of an unsigned store: consistency, not authorship
        return
    assert r.code == 6, r.out
    reasons = [f["reason"] for f in r.json["failures"]]
    # The rewritten line, and each line after it: a signature covers its line's prev, which changed.
    key_id = events[target]["signature"]["key_id"]
    assert reasons == [f"ledger line {n}: its signature by key '{key_id}' does not verify"
                       for n in range(target + 1, len(events) + 1)], reasons
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--jobs", "1")
    assert rec.code == 6, rec.out


def _fabricate(repo: Repo, tmp_path: Path, forger_store: Path) -> dict[str, Any]:
    """A key that never ran in ``repo.store``: its commit, a key ref made with ``git update-ref``,
    its receipt and two ledger events, all made in ``forger_store`` and carried over."""
    patch = change(repo, 9, "ghost")
    commit = forgeries.fabricate(repo, repo.store, forger_store, patch,
                                 env={"ONCEPATCH_KEY_DIR": str(tmp_path / "forger-keys")})
    return {"patch": patch, "commit": commit}


@pytest.mark.parametrize(("signed", "forger"), [(False, "unsigned"), (True, "unsigned"), (True, "own_key")],
                         ids=["unsigned-store", "signed-store", "signed-store-forger-signs"])
def test_a_fabricated_key_with_its_key_ref_and_two_events(tmp_path: Path, signed: bool, forger: str) -> None:
    repo = make(tmp_path, signed=signed)
    forger_store = tmp_path / "forger-store"
    if forger == "own_key":  # signs with a key of its own, one the store does not list
        r = run_cli("keys", "init", "--store", str(forger_store), "--repo", str(repo.path),
                    env={"ONCEPATCH_KEY_DIR": str(tmp_path / "forger-keys")})
        assert r.code == 0, r.err
    forged = _fabricate(repo, tmp_path, forger_store)
    status = run_cli("status", "--repo", str(repo.path), "ghost", "--json")
    r = verify(repo)
    if not signed:
        # The forgery of issue 26: a key that never ran reads as committed and verifies.
        assert status.code == 0 and status.json["receipt"]["status"] == "committed"
        assert r.code == 0, r.out
        return
    assert r.code == 6, r.out
    why = "unsigned, in a signed store" if forger == "unsigned" else "which is not an allowed signer"
    failures = r.json["failures"]
    assert any(f["key"] == "ghost" and why in f["reason"] for f in failures), failures
    assert sum("ledger line" in f["reason"] for f in failures) == 2, failures  # both forged events
    assert status.code == 6 and status.json["error"]["type"] == "corrupt_receipt", status.out
    # The replay answers nothing from the forged receipt; the branch stays where it is.
    head = repo.head("main")
    replay = run_cli("apply", "--repo", str(repo.path), "--key", "ghost", "--json", "-", input=forged["patch"])
    assert replay.code == 6 and replay.json["error"]["type"] == "corrupt_receipt", replay.out
    assert "commit" not in replay.json and repo.head("main") == head
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--jobs", "1")
    assert rec.code == 6 and any("ghost" in json.dumps(c) or "ledger" in c["reason"] for c in rec.json["corrupt"])


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_receipt_resealed_with_its_digest_recomputed(tmp_path: Path, signed: bool) -> None:
    repo = make(tmp_path, signed=signed)
    # A field git cannot contradict: the receipt's own story of when and by whom it ran.
    forgeries.reseal(repo.store, "one", updated_at="2020-01-01T00:00:00.000000Z",
                     owner={"host": "elsewhere", "pid": 1, "start": 0})
    r = verify(repo)
    status = run_cli("status", "--repo", str(repo.path), "one", "--json")
    if not signed:
        assert r.code == 0, r.out  # the limit of an unsigned store: the digest is no one's
        assert status.code == 0 and status.json["receipt"]["status"] == "committed"
        return
    assert r.code == 6, r.out
    failures = r.json["failures"]
    assert ("one", f"corrupt: its signature by key '{signing_key(repo)}' does not verify") in \
        [(f.get("key"), f["reason"]) for f in failures], failures
    assert any("ledger line" in f["reason"] for f in failures), failures  # the event that named its digest
    assert status.code == 6 and status.json["error"]["type"] == "corrupt_receipt", status.out
    assert run_cli("recover", "--repo", str(repo.path), "--json", "--jobs", "1").code == 6


def test_a_signature_copied_from_another_receipt_does_not_verify(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=True)
    forgeries.copy_signature(repo.store, "one", source="two")
    r = verify(repo)
    assert r.code == 6 and any(f["key"] == "one" and "does not verify" in f["reason"] for f in r.json["failures"])
    status = run_cli("status", "--repo", str(repo.path), "one", "--json")
    assert status.code == 6 and status.json["error"]["type"] == "corrupt_receipt", status.out


# -- keys: rotation, loss, trust outside the store ---------------------------------------------------


def test_rotation_keeps_old_receipts_verifiable(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=True)
    old = json.loads((repo.store / "allowed_signers.json").read_text())["keys"][0]["key_id"]
    r = run_cli("keys", "rotate", "--repo", str(repo.path), "--note", "yearly", "--json")
    assert r.code == 0, r.err
    new = r.json["key_id"]
    assert new != old and r.json["retired"] == [old]
    patcher.apply(str(repo.path), change(repo, 7, "three"), key="three")
    store = ReceiptStore(str(repo.store))
    signed_by = {k: json.loads(Path(store.receipt_path(k)).read_text())["signature"]["key_id"]
                 for k in ("one", "two", "three")}
    assert signed_by == {"one": old, "two": old, "three": new}
    v = verify(repo)
    assert v.code == 0, v.out
    listed = run_cli("keys", "list", "--repo", str(repo.path), "--json").json
    assert [(k["key_id"], k["status"]) for k in listed["keys"]] == [(old, "retired"), (new, "active")]


def test_a_rotation_waits_for_another_and_no_key_is_dropped(tmp_path: Path) -> None:
    """Two rotations at once: the second read the list while the first, stopped between its read and its
    write, still held the old one; the first then wrote its list without the second's key, whose signed
    ``keys_rotated`` event named a key no list held: every later append refused, verify failing for good.
    One change of the list at a time: the second is refused while the first runs (``--lock-timeout 0``)."""
    import signal
    import subprocess
    import sys

    repo = make(tmp_path, signed=True)
    first = subprocess.Popen([sys.executable, "-m", "patcher.cli", "keys", "rotate", "--repo", str(repo.path),
                              "--json"], env={**os.environ, "ONCEPATCH_PAUSE_AT": "keys-listed"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, status = os.waitpid(first.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status  # between its read of the list and its write
        before = snapshot(repo)
        second = run_cli("keys", "rotate", "--repo", str(repo.path), "--json", "--lock-timeout", "0")
        assert second.code == 5 and second.json["error"]["type"] == "in_progress", second.out + second.err
        assert snapshot(repo) == before
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, out + err
    third = run_cli("keys", "rotate", "--repo", str(repo.path), "--json")
    assert third.code == 0, third.out + third.err
    listed = [k["key_id"] for k in json.loads((repo.store / "allowed_signers.json").read_text())["keys"]]
    assert listed[1:] == [json.loads(out)["key_id"], third.json["key_id"]], listed
    patcher.apply(str(repo.path), change(repo, 7, "three"), key="three")
    assert verify(repo).code == 0


def test_a_lost_key_refuses_to_write_until_rotated(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=True)
    key_id = json.loads((repo.store / "allowed_signers.json").read_text())["keys"][0]["key_id"]
    (Path(os.environ["XDG_CONFIG_HOME"]) / "oncepatch" / "keys" / f"{key_id}.key").unlink()
    patch = change(repo, 11, "lost")
    before = snapshot(repo)
    r = run_cli("apply", "--repo", str(repo.path), "--key", "k", "--json", "-", input=patch)
    assert r.code == 2 and "keys rotate" in r.json["error"]["message"], r.out
    assert r.json["error"]["effect_status"] == "not_started"
    assert snapshot(repo) == before
    assert run_cli("keys", "rotate", "--repo", str(repo.path), "--note", "lost").code == 0
    r = run_cli("apply", "--repo", str(repo.path), "--key", "k", "--json", "-", input=patch)
    assert r.code == 0, r.out
    assert verify(repo).code == 0  # the lost key's receipts still verify: its public key is kept


def _other_private_key_pem(kind: str) -> bytes:
    """A PEM private key file's bytes that is not the store's active key."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    if kind == "garbage":
        return b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n"
    if kind == "encrypted":
        return ed25519.Ed25519PrivateKey.generate().private_bytes(
            ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.BestAvailableEncryption(b"secret"))
    private = ec.generate_private_key(ec.SECP256R1()) if kind == "ecdsa" else ed25519.Ed25519PrivateKey.generate()
    return private.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())


@pytest.mark.parametrize("kind", ["another_ed25519", "ecdsa", "encrypted", "garbage", "empty", "group_readable",
                                  "world_writable"])
def test_a_private_key_file_that_cannot_sign_for_the_list_refuses_before_anything_is_written(
        tmp_path: Path, kind: str) -> None:
    """The active key's file replaced by another key (a co-tenant's, one of another algorithm, an encrypted
    one, junk) or left open to other users: the call is refused before the branch moves, never committed
    and then sealed with a signature no one can verify; the key restored, the same call applies."""
    repo = make(tmp_path, signed=True)
    key_file = Path(os.environ["XDG_CONFIG_HOME"]) / "oncepatch" / "keys" / f"{signing_key(repo)}.key"
    real = key_file.read_bytes()
    if kind in ("group_readable", "world_writable"):
        key_file.chmod(0o640 if kind == "group_readable" else 0o666)
    else:
        key_file.write_bytes(b"" if kind == "empty" else _other_private_key_pem(kind))
    patch = change(repo, 11, "replaced")
    before = snapshot(repo)
    r = run_cli("apply", "--repo", str(repo.path), "--key", "k", "--json", "-", input=patch)
    assert r.code == 2, r.out + r.err
    assert r.json["error"]["type"] == "usage" and r.json["error"]["effect_status"] == "not_started", r.out
    assert str(key_file) in r.json["error"]["message"]
    assert snapshot(repo) == before
    assert verify(repo).code == 0
    key_file.write_bytes(real)
    key_file.chmod(0o600)
    r = run_cli("apply", "--repo", str(repo.path), "--key", "k", "--json", "-", input=patch)
    assert r.code == 0 and not r.json["replayed"], r.out
    assert verify(repo).code == 0


@pytest.mark.parametrize("signed", [True, False])
def test_an_earlier_attempts_receipt_put_back_fails_verify_and_is_not_run_again(tmp_path: Path, signed: bool) -> None:
    """A key's receipt rolled back to an earlier attempt's (signed by the store's own key, its digest in the
    ledger): an effect that was rejected as retryable, then committed, has its ``rejected`` receipt put back,
    and the next call sent it again. No key ref stands behind an effect: only the ledger, which records the
    later attempt, tells. Both ``verify`` paths (one process, worker processes) name it, and the next call
    is refused (``corrupt_receipt``) before it runs anything."""
    from patcher.cli.recovery import _adapters
    from receipts.effects import EffectRejected, perform
    from receipts.errors import CorruptReceipt
    from receipts.verifier import verify as verify_store

    store = tmp_path / "store"
    if signed:
        r = run_cli("keys", "init", "--store", str(store), "--json")
        assert r.code == 0, r.out + r.err
    tries: list[int] = []

    def busy_then_sent(call: Any) -> dict[str, Any]:
        tries.append(1)
        if len(tries) == 1:
            raise EffectRejected("rate limited", retryable=True)
        return {"message_id": "m-1"}

    with pytest.raises(EffectRejected):
        perform("send_email", {"to": "a@example.com"}, busy_then_sent, key="welcome", store=store)
    first = forgeries.receipt_file(store, "welcome").read_bytes()
    assert perform("send_email", {"to": "a@example.com"}, busy_then_sent, key="welcome",
                   store=store).fencing_token == 2
    assert run_cli("verify", "--store", str(store), "--json").code == 0
    forgeries.receipt_file(store, "welcome").write_bytes(first)  # the rollback
    r = run_cli("verify", "--store", str(store), "--json")
    assert r.code == 6, r.out + r.err
    assert [(f["key"], f["reason"].split(":")[0]) for f in r.json["failures"]] == [("welcome", "rolled back")]
    assert "attempt 2" in r.json["failures"][0]["reason"]
    rs = ReceiptStore(str(store))
    parallel = verify_store(rs, _adapters(rs), jobs=2, verifiers_factory="patcher.cli.recovery:_adapters",
                            parallel_min=1)
    assert [f.reason for f in parallel.failures] == [r.json["failures"][0]["reason"]]
    # The key's next call runs nothing again over it: the effect was sent once.
    before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and "locks" not in p.parts}
    with pytest.raises(CorruptReceipt, match="rolled back"):
        perform("send_email", {"to": "a@example.com"}, busy_then_sent, key="welcome", store=store)
    assert len(tries) == 2
    assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and "locks" not in p.parts} == before


@pytest.mark.parametrize("where", ["list", "folder"])
def test_a_list_any_user_may_rewrite_is_trusted_by_nothing(tmp_path: Path, where: str) -> None:
    """The allowed-signers list writable by all, or in a folder writable by all (without the sticky bit):
    any user on the machine could list a key of theirs and sign what they like, and verify passed it.
    verify, status and apply refuse it (exit 2, nothing written); a sticky folder (``/tmp``'s 1777) is kept."""
    repo = make(tmp_path, signed=True)
    listed = repo.store / "allowed_signers.json"
    (listed if where == "list" else repo.store).chmod(0o666 if where == "list" else 0o777)
    patch = change(repo, 11, "open")
    before = snapshot(repo)
    v = verify(repo)
    assert v.code == 2 and v.json["error"]["type"] == "usage" and "any user may" in v.json["error"]["message"], v.out
    assert run_cli("status", "one", "--repo", str(repo.path), "--json").code == 2
    r = run_cli("apply", "--repo", str(repo.path), "--key", "k", "--json", "-", input=patch)
    assert r.code == 2 and r.json["error"]["effect_status"] == "not_started", r.out
    assert snapshot(repo) == before
    (listed if where == "list" else repo.store).chmod(0o644 if where == "list" else 0o1777)
    assert verify(repo).code == 0
    repo.store.chmod(0o755)


def test_keys_init_refuses_a_store_that_holds_unsigned_receipts(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=False)
    r = run_cli("keys", "init", "--repo", str(repo.path))
    assert r.code == 2 and "written unsigned" in r.err
    assert not (repo.store / "allowed_signers.json").exists()


def test_a_list_kept_outside_the_store_still_catches_a_forger_who_removes_the_stores_own(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=True)
    pinned = tmp_path / "pinned_signers.json"
    shutil.copyfile(repo.store / "allowed_signers.json", pinned)
    forged = _fabricate(repo, tmp_path, tmp_path / "forger-store")
    assert forged["commit"]
    (repo.store / "allowed_signers.json").unlink()  # the store now claims to be unsigned
    assert verify(repo).code == 0  # read without the pinned list: an unsigned store, so said
    r = verify(repo, ONCEPATCH_ALLOWED_SIGNERS=str(pinned))
    assert r.code == 6 and r.json["signatures"]["allowed_signers"] == str(pinned)
    assert any(f["key"] == "ghost" for f in r.json["failures"]), r.out


def test_a_list_replaced_in_the_store_is_caught_by_a_pinned_one_only(tmp_path: Path) -> None:
    """The store's own list vouches for whatever it lists: a writer of the store who puts its own key
    there (the real one kept, as retired) signs a fabricated key that passes; the pinned list fails it."""
    repo = make(tmp_path, signed=True)
    pinned = tmp_path / "pinned_signers.json"
    shutil.copyfile(repo.store / "allowed_signers.json", pinned)
    forger = {"ONCEPATCH_KEY_DIR": str(tmp_path / "forger-keys")}
    r = run_cli("keys", "init", "--store", str(tmp_path / "forger-store"), "--repo", str(repo.path), env=forger)
    assert r.code == 0, r.err
    theirs = json.loads((tmp_path / "forger-store" / "allowed_signers.json").read_text())["keys"]
    doc = json.loads((repo.store / "allowed_signers.json").read_text())
    doc["keys"] = [{**k, "status": "retired", "retired_at": "2026-01-01T00:00:00.000000Z"} for k in doc["keys"]]
    doc["keys"] += theirs
    (repo.store / "allowed_signers.json").write_text(json.dumps(doc))
    r = run_cli("apply", "--repo", str(repo.path), "--key", "ghost", "--json", "-", input=change(repo, 9, "ghost"),
                env=forger)
    assert r.code == 0, r.out + r.err
    assert verify(repo).code == 0  # docs/SECURITY.md, "Where the list is trusted from"
    r = verify(repo, ONCEPATCH_ALLOWED_SIGNERS=str(pinned))
    assert r.code == 6, r.out
    failures = r.json["failures"]
    assert any(f["key"] == "ghost" and "not an allowed signer" in f["reason"] for f in failures), failures
    assert sum("ledger line" in f["reason"] for f in failures) == 2, failures
    status = run_cli("status", "--repo", str(repo.path), "ghost", "--json",
                     env={"ONCEPATCH_ALLOWED_SIGNERS": str(pinned)})
    assert status.code == 6 and status.json["error"]["type"] == "corrupt_receipt", status.out


def test_recover_settles_a_crashed_call_of_a_signed_store_with_signatures(tmp_path: Path) -> None:
    repo = make(tmp_path, signed=True)
    r = run_cli("apply", "--repo", str(repo.path), "--key", "crash", "-", input=change(repo, 5, "crash"),
                env={"ONCEPATCH_CRASH_AT": "after-ref"})
    assert r.code == 137, r.err
    rec = run_cli("recover", "--repo", str(repo.path), "--json", "--jobs", "1")
    assert rec.code == 0, rec.out
    doc = json.loads(Path(ReceiptStore(str(repo.store)).receipt_path("crash")).read_text())
    assert doc["status"] == "committed" and doc["signature"]["algorithm"] == "ed25519"
    assert all("signature" in e for e in ledger_lines(repo))
    assert verify(repo).code == 0

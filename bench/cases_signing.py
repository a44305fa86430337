"""Signing cost per call (issue 26): Ed25519 through ``cryptography`` beside ``ssh-keygen -Y``, and whole calls.

* **primitives**: one signature made and checked, as a receipt's (over its
  digest) and as a ledger event's (over its canonical JSON), in process; the
  same through ``ssh-keygen -Y sign`` and ``-Y verify`` (a process each, the
  mechanism of git's ``gpg.format=ssh``), the alternative weighed in
  docs/DECISIONS.md;
* **import**: what loading the Ed25519 module costs a cold process (once per
  process, only in a signed store);
* **a call's signing work**: the allowed-signers list read, the private key
  loaded, four signatures made (what a signed store adds to a call, apart
  from checking the receipts it reads);
* **per call**: ``patcher.apply`` in process, a new file per call, into an
  unsigned store and a signed one of the same repository, alternated round by
  round; a call signs four times (``prepared`` and ``committed``, each a
  receipt and its event) and checks the signature of each receipt it reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.stats import median

__all__ = ["section_signing"]


def _per_op(fn: Callable[[], Any], n: int) -> float:
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n)
    return median(samples)


def _ssh(tmp: str, n: int) -> tuple[float, float] | None:
    if shutil.which("ssh-keygen") is None:
        return None
    key, msg = os.path.join(tmp, "ssh_key"), os.path.join(tmp, "msg")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key, "-C", "bench"], check=True)
    with open(key + ".pub") as fh:
        allowed = os.path.join(tmp, "allowed")
        with open(allowed, "w") as out:
            out.write("bench@oncepatch " + " ".join(fh.read().split()[:2]) + "\n")
    with open(msg, "wb") as fh:
        fh.write(b"a" * 64)
    sign = ["ssh-keygen", "-q", "-Y", "sign", "-f", key, "-n", "oncepatch", msg]
    check = ["ssh-keygen", "-Y", "verify", "-f", allowed, "-I", "bench@oncepatch", "-n", "oncepatch", "-s", msg + ".sig"]

    def one_sign() -> None:
        if os.path.exists(msg + ".sig"):
            os.unlink(msg + ".sig")
        subprocess.run(sign, check=True, capture_output=True)

    def one_check() -> None:
        with open(msg, "rb") as fh:
            subprocess.run(check, stdin=fh, check=True, capture_output=True)

    one_sign()
    return _per_op(one_sign, n), _per_op(one_check, n)


def _import_cost(rounds: int) -> float:
    code = ("import time; t = time.perf_counter(); "
            "from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey; "
            "print(time.perf_counter() - t)")
    return median([float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        check=True).stdout) for _ in range(rounds)])


def _calls(tmp: str, rounds: int) -> tuple[float, float]:
    import patcher
    from receipts.signing import init_keys

    repo = os.path.join(tmp, "sign-repo")
    subprocess.run(["git", "init", "-q", "-b", "main", repo], check=True)
    with open(os.path.join(repo, "README"), "w") as fh:
        fh.write("signing bench\n")
    subprocess.run(["git", "-C", repo, "add", "README"], check=True)
    subprocess.run(["git", "-C", repo, "commit", "-q", "-m", "initial"], check=True)
    unsigned, signed = os.path.join(tmp, "store-unsigned"), os.path.join(tmp, "store-signed")
    os.makedirs(signed)
    init_keys(signed)
    times: dict[str, list[float]] = {unsigned: [], signed: []}
    n = 0
    for i in range(rounds + 1):
        for store in (unsigned, signed) if i % 2 else (signed, unsigned):
            n += 1
            patch = f"--- /dev/null\n+++ b/f{n}.txt\n@@ -0,0 +1 @@\n+{n}\n".encode()
            t = time.perf_counter()
            patcher.apply(repo, patch, key=f"k{n}", store=store)
            if i:  # the first round warms up (imports, the signing key)
                times[store].append(time.perf_counter() - t)
    return median(times[unsigned]), median(times[signed])


def section_signing(env: Any, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    from receipts.canonical import canonical_json
    from receipts.signing import init_keys, load_signing

    tmp = os.path.join(env.tmp, "signing")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "store"))
    init_keys(os.path.join(tmp, "store"))
    signing = load_signing(os.path.join(tmp, "store"))
    assert signing is not None
    log("signing: primitives")
    digest = "ab" * 32
    sig = signing.sign_receipt(digest)
    event = {"at": "2026-12-03T00:00:00.000000Z", "call_id": "opc1:" + "c" * 64, "commit": "d" * 40,
             "event": "committed", "fencing_token": 1, "key": "k", "prev": "e" * 64, "receipt_sha256": digest,
             "seq": 7, "status": "committed", "tool": "apply_patch"}
    event["signature"] = signing.sign_event(canonical_json(event))
    body = {k: v for k, v in event.items() if k != "signature"}
    res: dict[str, Any] = {
        "rounds": rounds,
        "receipt_sign_s": _per_op(lambda: signing.sign_receipt(digest), 500),
        "receipt_check_s": _per_op(lambda: signing.receipt_problem(digest, sig), 500),
        "event_sign_s": _per_op(lambda: signing.sign_event(canonical_json(body)), 500),
        "event_check_s": _per_op(lambda: signing.event_problem(event), 500),
    }
    root = os.path.join(tmp, "store")

    def call_work() -> None:  # what a call adds: the list read, the key loaded, four signatures
        fresh = load_signing(root)
        assert fresh is not None
        fresh.ready()
        for _ in range(2):
            fresh.sign_receipt(digest)
            fresh.sign_event(canonical_json(body))

    res["call_work_s"] = _per_op(call_work, 200)
    log("signing: ssh-keygen -Y")
    ssh = _ssh(tmp, 10)
    if ssh is not None:
        res["ssh_sign_s"], res["ssh_check_s"] = ssh
    log("signing: import")
    res["import_s"] = _import_cost(5)
    log("signing: calls, unsigned and signed store")
    res["call_unsigned_s"], res["call_signed_s"] = _calls(tmp, rounds)
    return res

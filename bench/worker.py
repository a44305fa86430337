"""Code the harness runs in child processes: ``python -m bench.worker COMMAND ...``.

``apply REPO PATCH_FILE BRANCH`` — one API call in a fresh process (the parent
reads its memory peak through GNU ``time``); prints JSON with the in-process
elapsed time and the peak RSS right after the imports (the fixed floor).

``batch REPO BRANCH PATCH_FILE...`` — apply the patch files in turn through the
API in one process (an agent); prints JSON counts and the elapsed time.
"""

from __future__ import annotations

import resource
import sys
import time

import orjson


def _apply(repo: str, patch_file: str, branch: str) -> None:
    from patcher.protocol import apply

    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(patch_file, "rb") as fh:
        data = fh.read()
    t0 = time.perf_counter()
    res = apply(repo, data, branch=branch, _stores={})
    elapsed = time.perf_counter() - t0
    if res.replayed or res.status != "committed":
        raise SystemExit(f"not committed: {res}")
    sys.stdout.buffer.write(orjson.dumps({"elapsed_s": elapsed, "maxrss_after_import_kib": floor}) + b"\n")


def _batch(repo: str, branch: str, files: list[str]) -> None:
    """Apply each patch file in turn through the API (one long-lived caller); print counts and time."""
    from cas.errors import OncepatchError
    from patcher.protocol import apply

    stores: dict[str, object] = {}
    ok = rejected = 0
    errors: dict[str, int] = {}
    started = time.time()
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        try:
            res = apply(repo, data, branch=branch, _stores=stores)
            ok += res.status == "committed" and not res.replayed
        except OncepatchError as exc:
            rejected += 1
            errors[exc.error_type] = errors.get(exc.error_type, 0) + 1
    doc = {"ok": ok, "rejected": rejected, "errors": errors, "elapsed_s": time.perf_counter() - t0,
           "started": started, "ended": time.time()}
    sys.stdout.buffer.write(orjson.dumps(doc) + b"\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["batch"] and len(argv) >= 3:
        _batch(argv[1], argv[2], argv[3:])
        return 0
    if argv[:1] == ["apply"] and len(argv) == 4:
        _apply(*argv[1:])
        return 0
    sys.stderr.write("usage: python -m bench.worker apply REPO PATCH_FILE BRANCH\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

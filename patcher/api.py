"""The public Python API (docs/DESIGN.md section 7): one-shot :func:`apply`, and a long-lived :class:`Client`.

The CLI and the MCP server are thin layers over this module.  Every error is
an :class:`~cas.errors.OncepatchError` carrying the envelope fields
(``error_type``, ``message``, ``retryable``, ``effect_status``, ``key``,
``next_action``; ``envelope()`` gives the dict, ``exit_code`` the CLI status).

:class:`Client` keeps repositories open between calls.  pygit2's
``Repository`` is not safe to share between threads, so each thread gets its
own open repository per path (a per-thread cache); everything else a call
touches is either immutable or guarded by file locks that work between
threads as between processes (each lock acquisition opens its own file
description, and ``flock`` excludes per description).  So one ``Client`` may
serve many threads, and many processes may use one repository and store.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

from cas.errors import EffectStatus, OncepatchError, UsageError
from cas.gitdir import discover
from receipts import jsonio
from receipts.engine import error_from_envelope
from receipts.errors import (AmbiguousCallId, Forbidden, IdempotencyConflict, InProgress, NotResolvable,
                             ReceiptNotFound, StillUnknown)
from receipts.lookup import status as _status
from receipts.receipt import Receipt, parse_receipt
from receipts.recovery import DEFAULT_TMP_AGE, RecoveryReport, RecoveryRow, recover
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore
from receipts.verifier import DEFAULT_GRACE, Failure, VerifyReport, verify
# The server's client, by a name apply's ``remote=`` argument (a git remote) does not shadow.
from patcher import remote as server_client
from patcher.args import check_types
from patcher.git_adapter import adapters
from patcher.outcome import REJECTIONS
from patcher.protocol import ApplyResult, Caller, apply, foreign_error, store_root_for

__all__ = ["apply", "ApplyResult", "Client", "OncepatchError", "status"]

#: The error classes an answer from a server is rebuilt as, by type (else :class:`OncepatchError` of that type).
_ANSWER_CLASSES: tuple[type[OncepatchError], ...] = (*REJECTIONS, IdempotencyConflict, InProgress, StillUnknown,
                                                     Forbidden, UsageError, ReceiptNotFound, NotResolvable,
                                                     AmbiguousCallId)
_ANSWERS: dict[str, type[OncepatchError]] = {cls.type: cls for cls in _ANSWER_CLASSES}

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _translated(effect_status: EffectStatus) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """No raw ``OSError`` (nor libgit2's error) out of the API: the tree's error, with ``effect_status``.

    (``apply`` translates its own, knowing how far the call went: :func:`patcher.protocol.apply`.)
    """

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def call(*args: _P.args, **kw: _P.kwargs) -> _R:
            try:
                return fn(*args, **kw)
            except OncepatchError:
                raise
            except Exception as exc:
                raise foreign_error(exc, effect_status=effect_status, key=None) from exc

        return call

    return wrap


@_translated("not_started")
def status(key: str, *, repo: str = ".", store: str | None = None) -> Receipt:
    """The verified receipt of ``key`` (or a call_id) for ``repo``'s store; a committed one only where git agrees.

    Raises:
        ReceiptNotFound, CorruptReceipt, UsageError.
    """
    check_types(frozenset({"key", "repo"}), key=key, repo=repo, store=store)
    return _status(key, store=store, repo=repo, adapters=lambda rstore: adapters(rstore, {}, read_only=True))


class Client:
    """A long-lived caller: repositories and stores stay open between calls; thread-safe.

    ``repo``, ``store`` and ``branch`` are defaults that each call may override.
    Use it as a context manager, or call :meth:`close` once no call is running.

    ``server``: how :meth:`apply` and :meth:`status` choose between a running
    ``oncepatch serve`` (or broker) and this process — the CLI's rules, ``auto``
    (a server of this version when one answers, else in process), ``never``,
    ``start``, ``require``; ``None`` reads ``$ONCEPATCH_SERVER`` at each call
    (default ``auto``).  Through a server the answer is rebuilt from its envelope:
    the same :class:`ApplyResult`, the same error classes (docs/DECISIONS.md).
    """

    def __init__(
        self,
        repo: str | os.PathLike[str] = ".",
        *,
        store: str | os.PathLike[str] | None = None,
        branch: str | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        check_timeout: float = 600.0,
        server: str | None = None,
    ) -> None:
        check_types(frozenset({"repo"}), repo=repo, store=store, branch=branch, lock_timeout=lock_timeout,
                    check_timeout=check_timeout, server=server)
        self.repo = os.path.abspath(os.fspath(repo))
        self.store = os.path.abspath(os.fspath(store)) if store is not None else None
        self.branch = branch
        self.lock_timeout = lock_timeout
        self.check_timeout = check_timeout
        self.server = server
        self._local = threading.local()
        self._guard = threading.Lock()
        self._caches: list[dict[str, Any]] = []
        self._roots: dict[str, str] = {}
        self._closed = False

    # -- caches --------------------------------------------------------------

    def _stores(self) -> dict[str, Any]:
        """This thread's open repositories (``{repo path: GitStore}``)."""
        if self._closed:
            raise RuntimeError("client is closed")
        cache: dict[str, Any] | None = getattr(self._local, "stores", None)
        if cache is None:
            with self._guard:
                cache = {}
                self._caches.append(cache)
            self._local.stores = cache
        return cache

    def _repo(self, repo: str | os.PathLike[str] | None) -> str:
        return os.path.abspath(os.fspath(repo)) if repo is not None else self.repo

    @_translated("not_started")
    def store_root(self, repo: str | os.PathLike[str] | None = None) -> str:
        """The receipt store of ``repo`` (``store=``, ``$ONCEPATCH_STORE``, or ``<git-common-dir>/oncepatch``)."""
        path = self._repo(repo)
        with self._guard:
            root = self._roots.get(path)
        if root is None:
            root = store_root_for(discover(path).common_dir, self.store)
            with self._guard:
                self._roots[path] = root
        return root

    def receipt_store(self, repo: str | os.PathLike[str] | None = None) -> ReceiptStore:
        return ReceiptStore(self.store_root(repo))

    def _adapters(self, rstore: ReceiptStore, *, read_only: bool) -> dict[str, Any]:
        return adapters(rstore, self._stores(), read_only=read_only, lock_timeout=self.lock_timeout)

    # -- calls ---------------------------------------------------------------

    def apply(
        self,
        patch: str | bytes,
        *,
        key: str | None = None,
        repo: str | os.PathLike[str] | None = None,
        branch: str | None = None,
        contract_sha256: str | None = None,
        attempt: int = 1,
        format: str = "auto",
        check: str | None = None,
        message: str | None = None,
        common_dir: str | None = None,
        strict: bool = False,
        caller: Caller | None = None,
        dir: str | os.PathLike[str] | None = None,
        remote: str | None = None,
    ) -> ApplyResult:
        """:func:`patcher.protocol.apply` with this client's defaults and open repositories.

        ``dir``: a directory target (docs/DIRECTORIES.md) instead of ``repo``.

        ``common_dir``, ``strict``, ``caller``, ``remote``: see :func:`patcher.protocol.apply`.  A call
        with an explicit ``caller`` always runs in process (a server judges its own peer).

        Raises:
            OncepatchError: as :func:`apply` (conflict 3, rejected 4, in progress / unknown 5).
        """
        try:
            # Before the server's argv: a branch 3 would go as '--branch=3', a strict "no" as '--strict'.
            check_types(key=key, repo=repo, branch=branch, contract_sha256=contract_sha256, format=format,
                        check=check, message=message, common_dir=common_dir, strict=strict, dir=dir, remote=remote)
        except UsageError as exc:
            raise exc.with_key(key) if isinstance(key, str) else exc
        if dir is not None:
            repo = _objects_of(dir)
        if caller is None:
            how = server_client.choose(self.server)
            if how != "never":
                path = self._repo(repo)
                # '--flag=value': a key or message that starts with '-' stays a value.
                argv = ["apply", "-", "--json", f"--repo={path}", f"--format={format}", f"--attempt={attempt}",
                        f"--lock-timeout={self.lock_timeout!r}", f"--check-timeout={self.check_timeout!r}"]
                branch = branch if branch is not None else self.branch
                for flag, value in (("--key", key), ("--branch", branch), ("--contract-sha256", contract_sha256),
                                    ("--check", check), ("--message", message), ("--common-dir", common_dir),
                                    ("--store", self.store), ("--remote", remote)):
                    if value is not None:
                        argv.append(f"{flag}={value}")
                if strict:
                    argv.append("--strict")
                data = patch.encode("utf-8", "surrogateescape") if isinstance(patch, str) else patch
                doc = self._through(argv, how, data)
                if doc is not None:
                    return _result(doc)
        return apply(
            self._repo(repo), patch, key=key, branch=branch if branch is not None else self.branch,
            contract_sha256=contract_sha256, attempt=attempt, format=format, check=check, message=message,
            common_dir=common_dir, store=self.store, lock_timeout=self.lock_timeout, check_timeout=self.check_timeout,
            strict=strict, caller=caller, remote=remote, _stores=self._stores(),
        )

    @_translated("not_started")
    def status(self, key: str, *, repo: str | os.PathLike[str] | None = None) -> Receipt:
        """The verified receipt of ``key`` or a call_id; a committed one only where git agrees.

        Raises:
            ReceiptNotFound, CorruptReceipt, UsageError.
        """
        check_types(frozenset({"key"}), key=key, repo=repo)
        how = server_client.choose(self.server)
        if how != "never":
            argv = ["status", "--json", f"--repo={self._repo(repo)}"]
            if self.store is not None:
                argv.append(f"--store={self.store}")
            argv += ["--", key]
            doc = self._through(argv, how)
            if doc is not None:
                return parse_receipt(jsonio.dumps(doc["receipt"]), path=str(doc["path"]))
        rstore = self.receipt_store(repo)
        return _status(key, store=rstore, adapters=lambda r: self._adapters(r, read_only=True))

    def _through(self, argv: list[str], how: str, stdin: bytes = b"", *,
                 report: bool = False) -> dict[str, Any] | None:
        """The envelope of ``argv`` run by a server (an error envelope raised as its error), or None: in process.

        ``report``: ``recover``/``verify``, whose ``ok: false`` is a report, not an error.
        """
        if any("\0" in a for a in argv):
            return None  # a NUL cannot cross the wire: refused in process
        try:
            doc = server_client.run(argv, how, stdin=stdin)
        except OSError as exc:  # an in-memory file or the folder could not be made: nothing was sent
            raise foreign_error(exc, effect_status="not_started", key=None) from exc
        if doc is None or ("error" not in doc if report else doc.get("ok")):
            return doc
        found = doc.get("error")
        err: dict[str, Any] = found if isinstance(found, dict) else {"type": "internal", "message": str(doc)}
        raise error_from_envelope(err, err.get("key"), _ANSWERS, OncepatchError, replayed=False)

    def _report(self, argv: list[str], repo: str | os.PathLike[str] | None) -> dict[str, Any] | None:
        """The report of ``recover``/``verify`` run by a server (``ok: false`` is a report, not an error), or None."""
        how = server_client.choose(self.server)
        if how == "never":
            return None
        argv = [*argv, f"--repo={self._repo(repo)}"] + ([f"--store={self.store}"] if self.store is not None else [])
        return self._through(argv, how, report=True)

    @_translated("unknown")  # it may have settled some receipts before it failed
    def recover(self, *, repo: str | os.PathLike[str] | None = None, dry_run: bool = False,
                tmp_age: float = DEFAULT_TMP_AGE,
                adapters: Mapping[str, Any] | None = None,
                dir: str | os.PathLike[str] | None = None) -> RecoveryReport:
        """Settle every ``prepared``/``unknown`` receipt (git and the built-in generic tools; more via ``adapters``).

        ``dir``: a directory target; then a switch a crash left undone is finished and a dead
        build's leftovers removed too (:func:`patcher.dirs.repair_leftovers`).

        Without ``adapters`` nor ``dir`` the call goes to a running server as the
        CLI's ``recover --json`` (chosen as :meth:`apply` chooses).
        """
        check_types(repo=repo, dry_run=dry_run, tmp_age=tmp_age, dir=dir)
        if dir is not None:
            repo = _objects_of(dir)
        if adapters is None and dir is None:  # (a directory target's repair runs here)
            argv = ["recover", "--json", f"--tmp-age={tmp_age!r}", "--jobs=1", f"--lock-timeout={self.lock_timeout!r}"]
            doc = self._report(argv + (["--dry-run"] if dry_run else []), repo)
            if doc is not None:
                return RecoveryReport(
                    dry_run=bool(doc["dry_run"]), scanned=int(doc["scanned"]),
                    rows=[RecoveryRow(r["key"], r["call_id"], r["from"], r["to"], r["reason"], r.get("commit"),
                                      tuple(r.get("notes") or ())) for r in doc["rows"]],
                    skipped=list(doc["skipped"]), corrupt=list(doc["corrupt"]), removed=list(doc["removed"]),
                    ledger_repaired=list(doc["ledger_repaired"]))
        rstore = self.receipt_store(repo)
        known = self._adapters(rstore, read_only=dry_run)
        known.update(adapters or {})
        report = recover(rstore, known, dry_run=dry_run, tmp_age=tmp_age,
                         extra_cleanup=known["apply_patch"].cleanup)
        if dir is not None:
            from patcher.dirs import repair_leftovers

            repair_leftovers(os.fspath(dir), dry_run=dry_run)
        return report

    @_translated("not_started")
    def verify(self, *, repo: str | os.PathLike[str] | None = None, grace: float = DEFAULT_GRACE,
               verifiers: Mapping[str, Any] | None = None,
               dir: str | os.PathLike[str] | None = None) -> VerifyReport:
        """Prove every receipt matches what it claims (read-only).

        ``dir``: a directory target (docs/DIRECTORIES.md); the folder is proved too, as ``verify --dir``
        does (:func:`patcher.dirs.verify_dir`): each problem (a path written outside oncepatch, a
        switch left undone, a generation's folder gone) is a failure whose ``path`` is the folder.
        Then the call runs in process.

        Without ``verifiers`` nor ``dir`` the call goes to a running server as the CLI's
        ``verify --json`` (chosen as :meth:`apply` chooses); its report's
        ``quarantined_keys`` is then empty (the CLI's JSON does not carry it).
        """
        check_types(repo=repo, grace=grace, dir=dir)
        if dir is not None:
            repo = _objects_of(dir)
        if verifiers is None and dir is None:
            doc = self._report(["verify", "--json", f"--grace={grace!r}", "--jobs=1"], repo)
            if doc is not None:
                return VerifyReport(
                    failures=[Failure(f.get("key"), f.get("receipt"), f["reason"]) for f in doc["failures"]],
                    receipts=int(doc["receipts"]), ledger_events=int(doc["ledger_events"]),
                    quarantined=list(doc.get("quarantined") or ()), signatures=dict(doc["signatures"]))
        rstore = self.receipt_store(repo)
        known = self._adapters(rstore, read_only=True)
        known.update(verifiers or {})
        report = verify(rstore, known, grace=grace)
        if dir is not None:
            from cas.generations import layout_of
            from patcher.dirs import verify_dir

            folder = layout_of(os.fspath(dir)).path
            report.failures += [Failure(None, folder, problem) for problem in verify_dir(folder)]
        return report

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Free every open repository (call when no call is running); later calls raise."""
        with self._guard:
            self._closed = True
            caches, self._caches = self._caches, []
        for cache in caches:
            for gstore in cache.values():
                free = getattr(getattr(gstore, "repo", None), "free", None)
                if free is not None:
                    free()
            cache.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _objects_of(path: str | os.PathLike[str]) -> str:
    from patcher.dirs import objects_of  # (pygit2: loaded only for a directory target)

    return objects_of(os.fspath(path))


def _result(doc: Mapping[str, Any]) -> ApplyResult:
    """An :class:`ApplyResult` from ``apply --json``'s envelope (its ``to_json``, read back)."""
    return ApplyResult(
        key=doc["key"], call_id=doc["call_id"], status=doc["status"], replayed=bool(doc["replayed"]),
        commit=doc.get("commit"), tree=doc.get("tree"), outputs=tuple(doc.get("outputs") or ()),
        receipt=doc["receipt"], already_applied=bool(doc.get("already_applied", False)),
        warnings=tuple(doc.get("warnings") or ()), grades=doc.get("grades"), remote=doc.get("remote"),
    )

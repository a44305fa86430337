"""The apply protocol for a git branch: its public face and the replay (docs/DESIGN.md section 4).

:func:`apply` is what the CLI and the MCP server call: normalise, authorize
(before the key is looked up, so a refused call never replays), then the
replay fast path (a final receipt is read without the lock, and a committed
one answered only where git agrees).  The protocol's generic steps are
:class:`receipts.engine.Call`'s, as for every tool; the git steps are
:mod:`patcher.execute`'s, imported by the first call that is not a replay.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

from cas.errors import SHOWN_PATH_CHARS, OncepatchError, UsageError, clip
from receipts.engine import Call
from receipts.identity import make_identity
from receipts.policy import Caller, Request, authorize, load_policy
from receipts.store import DEFAULT_LOCK_TIMEOUT, ReceiptStore
from patcher.args import TOOL, TOOL_VERSION, CallArgs, check_types, normalise_args, repository_path
from patcher.errors import PatchError
from patcher.formats import detect
from patcher.grades import STRICT
from receipts.errors import InProgress
from patcher.outcome import KEY_REF_PREFIX, REJECTIONS, ApplyResult, foreign_error, replay_final

__all__ = ["ApplyResult", "Caller", "apply", "store_root_for", "replay_final", "foreign_error", "KEY_REF_PREFIX", "REJECTIONS"]

def store_root_for(common_dir: str, store: str | None = None) -> str:
    """``--store``, else ``$ONCEPATCH_STORE``, else ``<git-common-dir>/oncepatch``.

    Raises:
        UsageError: a store inside the git directory but outside its ``oncepatch`` folder: git reads
            every file there as its own (a receipt under ``refs/`` is a broken ref that fails `git gc`).
    """
    default = os.path.join(common_dir, "oncepatch")
    root = os.path.abspath(store or os.environ.get("ONCEPATCH_STORE") or default)
    real, git_dir = os.path.realpath(root), os.path.realpath(common_dir)
    if _is_within(real, git_dir) and not _is_within(real, os.path.realpath(default)):
        raise UsageError(f"cannot use the store '{root}': it lies inside the git directory '{common_dir}', "
                         f"where git reads every file as its own (use '{default}' or a folder outside it)")
    return root


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def apply(
    repo: str,
    patch: str | bytes,
    *,
    key: str | None = None,
    branch: str | None = None,
    contract_sha256: str | None = None,
    attempt: int = 1,
    format: str = "auto",
    check: str | None = None,
    message: str | None = None,
    common_dir: str | None = None,
    store: str | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    check_timeout: float = 600.0,
    strict: bool = False,
    caller: Caller | None = None,
    compensates: str | None = None,
    remote: str | None = None,
    _stores: dict[str, Any] | None = None,
) -> ApplyResult:
    """Apply ``patch`` (its content, never a file name) to ``branch`` of ``repo`` effectively once.

    Returns the committed (or replayed) outcome.

    ``common_dir``: the common git dir (a real path) of the repository the
    caller checked ``repo`` against; the repository ``repo`` opens as here must
    be that one, else nothing is done (a usage error).  Race guarded: a caller
    that checks a path and then hands it over (the MCP server) would otherwise
    act on whatever the path names by then.

    ``strict``: a hunk that would apply only below the ``exact`` grade is
    refused (``inexact_match``) instead.  It is not part of the call's
    identity: a strict call makes the same change, and replays the key's
    final receipt as any call does (docs/DECISIONS.md).

    ``compensates``: the key whose change this call undoes (:mod:`patcher.revert`);
    part of the args, so of the identity: the same key with another
    ``compensates`` is an idempotency conflict.

    ``remote``: the git remote the key is claimed on (docs/REMOTE.md); default
    ``oncepatch.remote`` of the repository's config, else none (a local call).

    ``caller``: who asks, for the store's policy (the broker's ``SO_PEERCRED``
    peer, :meth:`Caller.of`); default: this process (:meth:`Caller.current`).

    Raises:
        OncepatchError: a subclass with the envelope fields; ``exit_code`` gives
            the CLI's exit status (conflict 3, rejected 4, in progress/unknown 5).
    """
    if _stores is None:
        _stores = {}  # one open repository for the whole call, even for one-shot callers
    for round_ in range(1, PACK_ROUNDS + 1):
        try:
            return _apply(repo, patch, key, branch, contract_sha256, attempt, format, check, message, common_dir,
                          store, lock_timeout, check_timeout, strict, caller, _stores, compensates, remote)
        except OncepatchError as exc:
            _name_key(exc, key)
            if exc.effect_status not in ("not_started", "not_applied") or not _pack_vanished(exc.__cause__):
                raise
            # The open repositories' pack lists are stale: a long-lived caller
            # would meet the same failure on every later call.  Nothing was applied,
            # so this call is run again on freshly opened ones, as git re-reads
            # its packs and retries a read whose pack went away.
            _stores.clear()
            if round_ == PACK_ROUNDS:
                # git's maintenance replaced the packs under every read: busy, not broken.
                raise InProgress(f"git maintenance replaced the repository's packs while this call read them, "
                                 f"{PACK_ROUNDS} times: nothing was done; retry", effect_status=exc.effect_status,
                                 next_action="retry", key=exc.key, details={"reason": "packs_replaced"}) from exc
        except Exception as exc:
            # Only what fails before the key's receipt is read gets here (the replay and
            # patcher.execute translate the rest, knowing how far they went): nothing was written.
            raise foreign_error(exc, effect_status="not_started", key=key) from exc
    raise AssertionError("unreachable")


#: Times a call whose reads met a pack that git's maintenance replaced meanwhile is run on freshly
#: opened repositories (nothing applied yet) before it answers ``in_progress``, retryable: a
#: repack loop on a loaded machine replaced the packs under two rounds in a row.
PACK_ROUNDS = 5


def _name_key(exc: OncepatchError, key: str | None) -> None:
    """Name the call's key in an error raised before anything knew it (an unreadable argument), if it is text."""
    if isinstance(key, str):
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            return  # not text: the envelope could not carry it
        exc.with_key(key)


def _pack_vanished(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is libgit2 failing to read a pack that git maintenance replaced.

    ``git repack -a -d``, ``gc`` and ``multi-pack-index expire`` delete and write packs
    beside readers; libgit2 retries a lookup that finds nothing after rescanning the
    pack folder, but not a read from a pack it listed before and that changed or
    went away meanwhile ("invalid packfile").
    """
    pygit2 = sys.modules.get("pygit2")
    for _ in range(8):  # (a chain is a few links long)
        if exc is None or pygit2 is None:
            return False
        if isinstance(exc, pygit2.GitError) and ("packfile" in str(exc) or "pack file" in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _apply(repo: str, patch: str | bytes, key: str | None, branch: str | None, contract_sha256: str | None,
           attempt: int, format: str, check: str | None, message: str | None, common_dir: str | None,
           store: str | None, lock_timeout: float, check_timeout: float, strict: bool, caller: Caller | None,
           _stores: dict[str, Any], compensates: str | None = None, remote: str | None = None) -> ApplyResult:
    try:
        check_types(frozenset({"repo"}), repo=repo, key=key, branch=branch, contract_sha256=contract_sha256,
                    format=format, check=check, message=message, common_dir=common_dir, store=store,
                    lock_timeout=lock_timeout, check_timeout=check_timeout, strict=strict, remote=remote,
                    compensates=compensates)
        if caller is not None and not isinstance(caller, Caller):
            raise UsageError(f"'caller' must be a Caller (Caller.of(uid, gid)), not {type(caller).__name__}",
                             details={"argument": "caller"})
        _check_options(attempt, lock_timeout, check_timeout, store)
        args = normalise_args(repo, patch, branch=branch, format=format, check=check, message=message,
                              detect=detect, remote=remote)
        if compensates is not None:
            args = replace(args, compensates=compensates)
        if common_dir is not None and args.layout.common_dir != common_dir:
            raise UsageError(f"'{clip(repo, SHOWN_PATH_CHARS)}' is no longer the repository it was checked as "
                             f"('{clip(common_dir, SHOWN_PATH_CHARS)}'): "
                             f"it is '{args.layout.common_dir}' now; nothing was done")
    except OncepatchError as exc:
        raise exc.with_key(key) if isinstance(key, str) else exc
    identity = make_identity(TOOL, TOOL_VERSION, args.as_dict(), contract_sha256=contract_sha256, attempt=attempt)
    rstore = ReceiptStore(store_root_for(args.layout.common_dir, store))
    call = Call(rstore, None, identity, key, errors=REJECTIONS, default_error=PatchError)
    try:
        _authorize(rstore, args, call.key, caller)  # authorize, then idempotency
    except OncepatchError as exc:
        raise exc.with_key(call.key)

    # Fast path: a final receipt is immutable, so it can be read without the lock.
    for round_ in range(1, PACK_ROUNDS + 1):
        try:
            final = call.lookup()
            if final is None:
                break
            from patcher.git_adapter import GitAdapter

            # The receipt is answered from only where git agrees (its key ref, commit and outputs).
            call.adapter = GitAdapter(rstore, _stores, lock_timeout=lock_timeout)
            return replay_final(call, final)
        except OncepatchError:
            raise
        except Exception as exc:  # the key's receipt, or git's side of it, could not be read: not known
            if _pack_vanished(exc):
                _stores.clear()  # (a replay only reads: read again, as apply() runs a call again)
                if round_ < PACK_ROUNDS:
                    continue
                raise InProgress(f"git maintenance replaced the repository's packs while this replay read them, "
                                 f"{PACK_ROUNDS} times: retry", effect_status="unknown", next_action="retry",
                                 key=call.key, details={"reason": "packs_replaced"}) from exc
            raise foreign_error(exc, effect_status="unknown", key=call.key, next_action="retry") from exc

    strictness = None
    try:
        # Deferred: executing loads libgit2, which a replay (above) never needs.
        from patcher.execute import locked_apply

        if strict:
            strictness = STRICT.set(True)
        if args.remote is not None:  # remote mode (docs/REMOTE.md): the same call, pushed
            from patcher.remote_push import execute_remote

            return locked_apply(call, args, lock_timeout, check_timeout, _stores, remote_steps=execute_remote)
        return locked_apply(call, args, lock_timeout, check_timeout, _stores)
    finally:
        if strictness is not None:
            STRICT.reset(strictness)
        # The index locks' mark files kept between this call's two locks (cas.index_lock).
        worktree = sys.modules.get("cas.index_lock")
        if worktree is not None:
            worktree.drop_lock_marks()


def _authorize(rstore: ReceiptStore, args: CallArgs, key: str, caller: Caller | None) -> None:
    """Refuse a call the store's policy does not allow its caller (:func:`receipts.policy.authorize`).

    Judged first without the patch's paths (caller, repository, branch, format,
    size: nothing parsed for a caller the policy never names), then with them
    (a copy's source included).
    No policy: one failed ``open``.

    Raises:
        Forbidden: refused, one ``forbidden`` event noted; nothing else written.
        UsageError: the policy cannot be read.
        PatchError: the patch cannot be parsed (or names an unsafe path): nothing written.
    """
    policy = load_policy(rstore.root)
    if policy is None:
        return
    who = caller if caller is not None else Caller.current()
    remote = args.repo if args.remote is not None else None  # (remote mode: args.repo is the remote's URL)
    request = Request(TOOL, args.repo if remote is None else repository_path(args.layout), args.branch, args.format,
                      len(args.patch), key=key, patch_sha256=args.patch_sha256, remote=remote)
    authorize(rstore, who, request, policy)
    from patcher.formats import parse_patch

    # Every path the patch names: what it changes, and a copy's source, which it reads into
    # the tree (a secret copied into an allowed folder is a secret written there).
    paths = tuple(dict.fromkeys(p for e in parse_patch(args.patch, args.format).edits for p in (e.path, *e.touched)))
    authorize(rstore, who, replace(request, paths=paths), policy)


def _check_options(attempt: int, lock_timeout: float, check_timeout: float, store: str | None) -> None:
    """Refuse options no call can mean (before anything is read or written).

    Raises:
        UsageError: ``attempt`` below 1 (or not an integer), a negative or NaN
            lock timeout, a check timeout that is not positive, an empty store path.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise UsageError(f"attempt must be an integer of at least 1, not {attempt!r}")
    if not lock_timeout >= 0:  # (NaN too)
        raise UsageError(f"lock timeout must be 0 or more seconds, not {lock_timeout!r}")
    if not check_timeout > 0:
        raise UsageError(f"check timeout must be more than 0 seconds, not {check_timeout!r}")
    if store is not None and not str(store):
        raise UsageError("store must be a path, not empty (leave it out for the default)")

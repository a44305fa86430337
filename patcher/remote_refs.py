"""Remote mode's refs: fetch, the atomic push, the receipt on the remote (docs/REMOTE.md).

What a remote-mode call (:mod:`patcher.remote_push`) and the git adapter
(:class:`patcher.git_adapter.GitAdapter`: ``recover``, ``verify``) share.
On the remote, per key hash ``<h>``, one atomic push creates:

* ``refs/oncepatch/keys/<h>``: the commit the key made (create-only);
* ``refs/oncepatch/receipts/<h>``: a parentless commit whose tree holds the
  committed receipt as ``receipt.json`` (create-only).

Locally, a fetch copies them to ``refs/oncepatch/remotes/<name>/{keys,receipts}/<h>``
(never to ``refs/oncepatch/keys/``: that is the local key ref, created only
with a local ``committed`` receipt), and the branch to its remote-tracking ref.
The remote's key ref and receipt are the truth: :func:`query_remote` settles
a crashed call from them, :func:`verify_remote` checks a local committed
receipt against them, :func:`verify_rejected_remote` a local rejected one
(a push that landed after all).  The git CLI does the fetch and the push (pygit2's push has no
``--atomic`` nor lease), with a fixed argv and no shell.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import ClassVar

import pygit2

from cas.errors import EXIT_REJECTED, CasError, EffectStatus, GitStoreError, NextAction, UsageError
from cas.objects import GitStore, TreeEntry
from receipts.adapter import QueryResult
from receipts.environ import env_float
from receipts.errors import CorruptReceipt
from receipts.identity import key_hash
from receipts.receipt import DIGEST_FIELD, SIGNATURE_FIELD, Receipt, parse_receipt, receipt_doc_bytes
from receipts.store import ReceiptStore
from receipts.verifier import UNREACHABLE
from patcher.evidence import KEY_REF_PREFIX, contradictions, trailer_problems
# The outputs' check of contradictions(), which also asks the local branch (not the remote's).
from patcher.evidence import _output_problems as output_problems
from patcher.remote_mode import Remote

__all__ = ["RECEIPTS_REF_PREFIX", "RECEIPT_FILE", "Pushed", "RemoteUnreachable", "RemoteRejected", "tracking_ref",
           "mirror_prefix",
           "fetch", "push", "receipt_commit", "read_remote_receipt", "remote_problems", "follow", "remote_of",
           "repointed", "query_remote", "settle_remote", "verify_remote", "verify_rejected_remote"]

RECEIPTS_REF_PREFIX = "refs/oncepatch/receipts/"
RECEIPT_FILE = "receipt.json"
#: How long one fetch or push may take before it is given up (its outcome then unknown).
GIT_TIMEOUT = env_float("ONCEPATCH_REMOTE_TIMEOUT", 120.0)


def tracking_ref(remote: Remote, branch: str) -> str:
    """The remote-tracking ref of ``branch`` (``refs/heads/x`` → ``refs/remotes/<name>/x``)."""
    return f"refs/remotes/{remote.name}/{branch.removeprefix('refs/heads/')}"


def mirror_prefix(remote: Remote) -> str:
    """Where the remote's ``refs/oncepatch/*`` of the fetched keys are copied (never ``refs/oncepatch/keys/``)."""
    return f"refs/oncepatch/remotes/{remote.name}/"


# -- the git CLI -----------------------------------------------------------------------------


class RemoteUnreachable(CasError):
    """A fetch from (or a push to) the remote failed before anything was sent: nothing changed there."""

    type = "remote_unreachable"
    exit_code = EXIT_REJECTED
    default_retryable = True
    default_effect_status: ClassVar[EffectStatus] = "not_started"
    default_next_action: ClassVar[NextAction] = "retry"


class RemoteRejected(CasError):
    """The server refused a push for its own reason (a hook, a lock left on it, a ref in the way): nothing changed.

    Not a lost lease: the branch and the key's refs are as the push expected
    them.  Retryable (the key stays open: the same call lands once the server
    accepts it), but nothing is gained by retrying before a person has acted
    on the server's reason, which the message quotes.
    """

    type = "remote_rejected"
    exit_code = EXIT_REJECTED
    default_retryable = True
    default_effect_status: ClassVar[EffectStatus] = "not_applied"
    default_next_action: ClassVar[NextAction] = "none"


def _git(gstore: GitStore, *argv: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        return subprocess.run(["git", "--git-dir", gstore.common_dir, *argv], capture_output=True, env=env,
                              timeout=GIT_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        raise GitStoreError(f"git {argv[0]} timed out after {GIT_TIMEOUT:g}s") from exc


def _text(res: subprocess.CompletedProcess[bytes]) -> str:
    return res.stderr.decode("utf-8", "replace").strip().replace("\n", "; ")


def fetch(gstore: GitStore, remote: Remote, branch: str, h: str) -> tuple[str | None, str | None, str | None]:
    """Fetch the remote's ``branch`` and the key's two refs; ``(head, key commit, receipt commit)`` as fetched.

    The branch is fetched into a ref of the key's own (``heads/<h>`` under
    :func:`mirror_prefix`, removed once read), not into the shared
    remote-tracking ref: calls of other keys in the clone, and a person's
    ``git fetch``, update that one at the same moment, and git refuses a
    fetch whose ref another process moved or holds.  The tracking ref then
    follows when it can (:func:`_move_tracking`).

    Raises:
        UsageError: the remote has no such branch.
        RemoteUnreachable: the fetch failed.
    """
    mirror = mirror_prefix(remote)
    mine, tracking = f"{mirror}heads/{h}", tracking_ref(remote, branch)
    seen = gstore.resolve(tracking)
    res = _git(gstore, "fetch", "--quiet", "--no-tags", "--prune", "--no-write-fetch-head", "--refmap=",
               remote.name, f"+{branch}:{mine}",
               f"+{KEY_REF_PREFIX}{h}*:{mirror}keys/{h}*",
               f"+{RECEIPTS_REF_PREFIX}{h}*:{mirror}receipts/{h}*")
    if res.returncode != 0:
        text = _text(res)
        if "couldn't find remote ref" in text:
            raise UsageError(f"branch '{branch}' does not exist on remote '{remote.name}': push it first",
                             details={"remote": remote.name})
        raise RemoteUnreachable(f"cannot fetch from remote '{remote.name}' ({remote.url}): {text}")
    gstore.reopen_objects()  # a pack git just wrote
    head = gstore.resolve(mine)
    if head is not None and not _move_tracking(gstore, tracking, head, seen, also=f"delete {mine} {head}"):
        _update_refs(gstore, [f"delete {mine} {head}"])
    return head, gstore.resolve(f"{mirror}keys/{h}"), gstore.resolve(f"{mirror}receipts/{h}")


def _update_refs(gstore: GitStore, lines: list[str]) -> bool:
    """One ``git update-ref --stdin`` transaction (all or nothing); whether it went through."""
    res = subprocess.run(["git", "--git-dir", gstore.common_dir, "update-ref", "--stdin"],
                         input=("\n".join(lines) + "\n").encode(), capture_output=True, check=False)
    return res.returncode == 0


def _move_tracking(gstore: GitStore, tracking: str, new: str, seen: str | None, *, also: str = "") -> bool:
    """The remote-tracking ref from ``seen`` (as read before) to ``new``, where nobody moved or holds it since.

    A convenience for the person (``git pull``, ``drift``), never what a call
    reads: another process that moved or locked it meanwhile (a fetch of its
    own) wins, and this one leaves it.  ``also``: a line of the same
    transaction.  Whether the transaction went through (``False``: nothing of it did).
    """
    lines = [f"update {tracking} {new} {seen or '0' * 40}"] if new != seen else []
    lines += [also] if also else []
    return not lines or _update_refs(gstore, lines)


@dataclass(frozen=True, slots=True)
class Pushed:
    outcome: str  # "pushed", "rejected" (every ref refused: nothing changed), "unreachable" (nothing sent), "unknown"
    detail: str = ""
    server: str = ""  # what the server said ("remote: ..." lines): a hook's or receive-pack's reason


def _server_said(text: str) -> str:
    """The server's own lines of a push's stderr (``remote: ...``), joined; git's padding dropped."""
    said = [line.removeprefix("remote:").strip() for line in text.splitlines() if line.startswith("remote:")]
    return "; ".join(line for line in said if line)


_UNREACHABLE = ("connection refused", "could not resolve host", "unable to connect", "does not appear to be a git",
                "no route to host", "network is unreachable")


def push(gstore: GitStore, remote: Remote, branch: str, base: str, candidate: str, h: str,
         receipt_commit: str) -> Pushed:
    """One ``git push --atomic``: the branch from ``base`` to ``candidate``, the key's two refs created."""
    key_ref, receipts_ref = KEY_REF_PREFIX + h, RECEIPTS_REF_PREFIX + h
    res = _git(gstore, "push", "--atomic", "--porcelain", "--no-verify",
               f"--force-with-lease={branch}:{base}", f"--force-with-lease={key_ref}:",
               f"--force-with-lease={receipts_ref}:", remote.name,
               f"{candidate}:{branch}", f"{candidate}:{key_ref}", f"{receipt_commit}:{receipts_ref}")
    out = res.stdout.decode("utf-8", "replace")
    flags: dict[str, tuple[str, str]] = {}  # the porcelain report: "<flag>\t<src>:<dst>\t<summary>" per ref
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and len(parts[0]) == 1 and ":" in parts[1]:
            flags[parts[1].rsplit(":", 1)[1]] = (parts[0], parts[2])
    report = "; ".join(f"{ref} {summary}" for ref, (_flag, summary) in flags.items())
    landed = {ref for ref, (flag, _s) in flags.items() if flag in " *+"}
    if res.returncode == 0 and flags.get(key_ref, ("",))[0] == "*" and flags.get(receipts_ref, ("",))[0] == "*":
        return Pushed("pushed")
    text = _text(res)
    if "does not support --atomic" in text:
        raise UsageError(f"remote '{remote.name}' does not support atomic pushes, which remote mode needs",
                         details={"remote": remote.name})
    if flags and "Done" in out.splitlines()[-1:] and not landed:
        # Every ref refused (a lease, a ref another push locked or moved, or "up to date": the
        # same commit already there, claimed by another call; or the server's own refusal, a
        # hook's): an atomic push changed nothing.  The caller fetches to tell which.
        summaries = {summary for _flag, summary in flags.values()}
        said = _server_said(res.stderr.decode("utf-8", "replace"))
        return Pushed("rejected", summaries.pop() if len(summaries) == 1 else report, said)
    if not flags and any(word in text.lower() for word in _UNREACHABLE):
        return Pushed("unreachable", text)
    return Pushed("unknown", report or text)


# -- the receipt on the remote ------------------------------------------------------------------

def receipt_commit(rstore: ReceiptStore, gstore: GitStore, receipt: Receipt) -> str:
    """A parentless commit holding ``receipt`` (signed as the store signs) as ``receipt.json``; staged."""
    doc = receipt.to_doc()
    signing = rstore.signing
    if signing is not None:
        doc[SIGNATURE_FIELD] = signing.sign_receipt(str(doc[DIGEST_FIELD]))
    blob = gstore.write_blob(receipt_doc_bytes(doc))
    tree = gstore.edit_tree(None, {RECEIPT_FILE: TreeEntry(blob, 0o100644)})
    return gstore.create_commit(tree, [], f"oncepatch receipt: {key_hash(receipt.key)}\n\n"
                                          f"Oncepatch-Call: {receipt.call_id}\n")

def read_remote_receipt(rstore: ReceiptStore | None, gstore: GitStore, remote: Remote, h: str,
                        receipt_commit: str) -> Receipt:
    """The receipt in the remote's receipt commit, verified as a local one (its signature in a signed store).

    Raises:
        CorruptReceipt: missing, unparsable, another key's, or a bad signature.
    """
    where = f"{remote.url}#{RECEIPTS_REF_PREFIX}{h}"
    try:
        entry = gstore.lookup_file(gstore.commit_tree(receipt_commit), RECEIPT_FILE)
        if entry is None:
            raise CorruptReceipt(where, f"the receipt commit {receipt_commit[:12]} holds no {RECEIPT_FILE}")
        data = gstore.read_blob(entry.oid)
    except GitStoreError as exc:
        raise CorruptReceipt(where, f"the receipt commit cannot be read: {exc}") from exc
    if rstore is None:
        return parse_receipt(data, path=where, expected_key_hash=h)
    parsed: Receipt = rstore.parse(data, where, h)
    return parsed


def remote_problems(gstore: GitStore, receipt: Receipt, key_commit: str | None, head: str | None) -> list[str]:
    """Why the remote's committed ``receipt`` is not to be believed here: its commit, trailer, tree, outputs."""
    if receipt.status != "committed" or not receipt.commit:
        return [f"the remote's receipt is {receipt.status}, not committed"]
    commit = receipt.commit
    problems: list[str] = []
    if key_commit != commit:
        problems.append(f"the remote's key ref points at {str(key_commit)[:12]}, its receipt names {commit[:12]}")
    try:
        found = gstore.repo.get(pygit2.Oid(hex=commit))
    except (ValueError, pygit2.GitError) as exc:
        return [*problems, f"commit {commit} is unreadable: {exc}"]
    if not isinstance(found, pygit2.Commit):
        return [*problems, f"commit {commit} was not fetched from the remote"]
    problems += trailer_problems(found.raw_message, receipt)
    tree = str(found.tree_id)
    if receipt.tree and receipt.tree != tree:
        problems.append(f"tree {receipt.tree[:12]} differs from the commit's {tree[:12]}")
    problems += output_problems(gstore, receipt, commit, tree)
    if head is not None and not gstore.is_ancestor(commit, head):
        problems.append(f"commit {commit[:12]} is not on the remote's branch")
    return problems


# -- the call -------------------------------------------------------------------------------------

def follow(gstore: GitStore, remote: Remote, branch: str, h: str, commit: str, receipt_commit: str | None) -> None:
    """The local refs follow the remote: the key's mirrored refs, and its tracking branch (forward, when free).

    Raises:
        GitStoreError: the mirrored refs could not be updated.
    """
    mirror = mirror_prefix(remote)
    lines = [f"update {mirror}keys/{h} {commit}"]
    if receipt_commit is not None:
        lines.append(f"update {mirror}receipts/{h} {receipt_commit}")
    res = subprocess.run(["git", "--git-dir", gstore.common_dir, "update-ref", "--stdin"],
                         input=("\n".join(lines) + "\n").encode(), capture_output=True, check=False)
    if res.returncode != 0:
        raise GitStoreError(f"cannot update the local copies of the remote's refs: {_text(res)}")
    tracking = tracking_ref(remote, branch)
    tip = gstore.resolve(tracking)
    if tip is None or (tip != commit and gstore.is_ancestor(tip, commit)):
        _move_tracking(gstore, tracking, commit, tip)


def remote_of(receipt: Receipt) -> Remote:
    """The remote a receipt names (``extra.remote``: its name and URL)."""
    named = receipt.extra.get("remote")
    named = named if isinstance(named, dict) else {}
    return Remote(str(named.get("name") or "origin"), str(named.get("url") or ""))


def repointed(gstore: GitStore, remote: Remote) -> str | None:
    """Why the remote's name no longer reaches the URL a receipt recorded (``remote.url``), or ``None``.

    The fetches name the remote (its config: ``insteadOf``, proxies, ...), so
    a remote re-pointed since (``git remote set-url``) would have the receipt
    judged by another repository: a claim absent there is no proof of anything.
    """
    res = _git(gstore, "config", "--get", f"remote.{remote.name}.url")
    now = res.stdout.decode("utf-8", "surrogateescape").strip() if res.returncode == 0 else ""
    if remote.url and now == remote.url:
        return None
    return (f"remote '{remote.name}' names {repr(now) if now else 'no URL'} today, not '{remote.url}' that the "
            f"receipt recorded: not checked against another repository (point '{remote.name}' back with "
            f"'git remote set-url {remote.name} {remote.url}')")


def query_remote(rstore: ReceiptStore | None, gstore: GitStore, receipt: Receipt, remote: Remote) -> QueryResult:
    """Whether the remote holds this call's claim: its key ref, and its receipt naming this call.

    The remote's key ref is created only with the branch's move (one atomic
    push): absent, this call's push never landed.  Asked only of the URL the
    receipt recorded: a remote re-pointed since cannot tell (``unknown``).
    """
    if not receipt.candidate:
        return QueryResult("not_applied", "crashed_before_commit")
    try:
        why = repointed(gstore, remote)
    except GitStoreError as exc:
        return QueryResult("unknown", f"remote_unreachable: {exc.message}")
    if why is not None:
        return QueryResult("unknown", f"remote_repointed: {why}")
    h = key_hash(receipt.key)
    try:
        head, key_commit, receipt_commit = fetch(gstore, remote, str(receipt.args.get("branch")), h)
    except (GitStoreError, RemoteUnreachable, UsageError) as exc:
        return QueryResult("unknown", f"remote_unreachable: {exc.message}")
    if key_commit is None and receipt_commit is None:
        return QueryResult("not_applied", "remote_key_absent")
    if key_commit is None or receipt_commit is None:
        return QueryResult("unknown", "remote_key_half_claimed")
    theirs = read_remote_receipt(rstore, gstore, remote, h, receipt_commit)
    if theirs.call_id != receipt.call_id:
        # The key was claimed by another call (other args): this one never landed.
        return QueryResult("not_applied", "remote_key_claimed_by_another_call")
    problems = remote_problems(gstore, theirs, key_commit, head)
    if problems:
        raise CorruptReceipt(f"{remote.url}#{RECEIPTS_REF_PREFIX}{h}", "; ".join(problems), key=receipt.key)
    return QueryResult("applied", "remote_key_ref", {"commit": theirs.commit, "tree": theirs.tree,
                                                      "outputs": theirs.outputs, "notes": []})


def settle_remote(gstore: GitStore, receipt: Receipt, remote: Remote) -> list[str]:
    """After ``committed`` from the remote: the local refs follow and the local key ref is created."""
    commit = receipt.commit
    if not commit:
        return []
    h = key_hash(receipt.key)
    done: list[str] = []
    receipt_commit = gstore.resolve(f"{mirror_prefix(remote)}receipts/{h}")
    follow(gstore, remote, str(receipt.args.get("branch")), h, commit, receipt_commit)
    if gstore.resolve(KEY_REF_PREFIX + h) is None:
        gstore.create_key_ref(KEY_REF_PREFIX + h, commit, f"oncepatch recover: {receipt.call_id}")
        done.append(f"created '{KEY_REF_PREFIX}{h}'")
    return done


def verify_remote(rstore: ReceiptStore | None, gstore: GitStore, receipt: Receipt, remote: Remote,
                  fetched: dict[tuple[str, str, str], tuple[str | None, str | None, str | None]]) -> list[str]:
    """Why the local committed ``receipt`` disagrees with the remote, or ``[]``.

    Locally: the commit, its trailer, the local key ref, the tree and outputs.
    On the remote (fetched now): its key ref at the commit, its receipt naming
    the same call, commit, tree and outputs, the commit on its branch.  Only
    the URL the receipt recorded is asked: a remote re-pointed since is a
    failure (:func:`repointed`), not another repository's word.
    """
    problems = contradictions(gstore, receipt, cheap=True)
    if receipt.extra.get("already_applied"):
        return problems  # nothing was claimed on the remote for it
    h = key_hash(receipt.key)
    got = _fetched(gstore, receipt, remote, h, fetched)
    if isinstance(got, str):
        return [*problems, got]
    head, key_commit, receipt_commit = got
    if key_commit is None or receipt_commit is None:
        return [*problems, f"remote '{remote.name}' has no claim of key '{receipt.key}' "
                           f"({KEY_REF_PREFIX}{h} or {RECEIPTS_REF_PREFIX}{h} missing)"]
    try:
        theirs = read_remote_receipt(rstore, gstore, remote, h, receipt_commit)
    except CorruptReceipt as exc:
        return [*problems, exc.message]
    for name in ("call_id", "commit", "tree", "outputs"):
        if getattr(theirs, name) != getattr(receipt, name):
            problems.append(f"the remote's receipt has another {name} than the local one")
    return problems + remote_problems(gstore, theirs, key_commit, head)


def verify_rejected_remote(rstore: ReceiptStore | None, gstore: GitStore, receipt: Receipt, remote: Remote,
                           fetched: dict[tuple[str, str, str], tuple[str | None, str | None, str | None]]
                           ) -> list[str]:
    """Why the local ``rejected`` ``receipt`` is contradicted by the remote, or ``[]``.

    A push the server finished after its client died (docs/REMOTE.md,
    "Limits") lands after ``recover`` asked the remote and settled the call
    ``rejected``: the remote's key ref then names this call's candidate, or
    its receipt this call.  ``rejected`` is settled (docs/DESIGN.md section
    3's states): nothing here rewrites it; the failure says what does.
    """
    if not receipt.candidate:
        return []  # never staged: nothing of it could have been pushed
    h = key_hash(receipt.key)
    got = _fetched(gstore, receipt, remote, h, fetched)
    if isinstance(got, str):
        return [got]
    _head, key_commit, receipt_commit = got
    if key_commit is None:
        return []
    ours = key_commit == receipt.candidate
    if not ours and receipt_commit is not None:
        try:
            ours = read_remote_receipt(rstore, gstore, remote, h, receipt_commit).call_id == receipt.call_id
        except CorruptReceipt:
            pass  # another call's claim, checked where that call is recorded
    if not ours:
        return []
    return [f"key '{receipt.key}' landed on remote '{remote.name}' after this receipt was settled rejected: "
            f"{KEY_REF_PREFIX}{h} there names this call's commit {key_commit[:12]} (a push the server finished "
            f"after its client died, before or during 'oncepatch recover'); recover does not reopen a rejected "
            f"receipt: send the same call again (same key and args), it answers from the remote and records "
            f"committed"]


def _fetched(gstore: GitStore, receipt: Receipt, remote: Remote, h: str,
             fetched: dict[tuple[str, str, str], tuple[str | None, str | None, str | None]]
             ) -> tuple[str | None, str | None, str | None] | str:
    """The key's refs on the remote, fetched once per verify; or why they could not be (a failure's reason).

    A remote that cannot be reached is a check not made (:data:`receipts.verifier.UNREACHABLE`),
    not a contradiction: the reason says so, and that the receipt itself was not found wrong.
    """
    place = (gstore.common_dir, remote.name, h)
    try:
        asked = (gstore.common_dir, remote.name, "url " + remote.url)  # once per remote and run, as the fetches
        if asked not in fetched:
            fetched[asked] = (repointed(gstore, remote), None, None)
    except (GitStoreError, UsageError) as exc:
        return f"cannot check the receipt against remote '{remote.name}': {exc.message}"
    why = fetched[asked][0]
    if why is not None:
        return f"cannot check the receipt against the remote: {why}"
    if place not in fetched:
        try:
            fetched[place] = fetch(gstore, remote, str(receipt.args.get("branch")), h)
        except (GitStoreError, RemoteUnreachable) as exc:
            return (f"{UNREACHABLE}remote '{remote.name}' ({remote.url}) could not be reached, so the receipt "
                    f"was not checked against it (nothing was found wrong with it): {exc.message}; run "
                    f"'oncepatch verify' again once the remote can be reached")
        except UsageError as exc:
            return f"cannot check the receipt against remote '{remote.name}': {exc.message}"
    return fetched[place]

"""Docs that run: every command block in README.md and docs/*.md runs as written.

Which fenced blocks run (the same rule is in docs/DECISIONS.md, "Docs"):

* ```sh, ```bash, ```shell: a shell script. Each command (a line, or the lines
  it needs to be complete, e.g. a here-document) runs in order in one bash, as a
  reader pasting the block would; each must exit 0, unless its own trailing
  comment says otherwise (``oncepatch apply other.diff --key k   # exit 3``).
  A command whose comment says ``Ctrl-C ends it`` is sent SIGINT after a
  second, as the reader would, and must then end with 0 or 130.
* ```console: a transcript. Lines starting with ``$ `` are the commands (same
  rules); the other lines are sample output and are not compared.
* ```python: a complete program, run with the project's Python in the
  scratch repository; it must exit 0.
* Any other tag (json, toml, text, diff, ...) and an untagged block: not run
  (output, file contents, formats). An untagged block that starts with a
  command is an error: tag it ``sh`` or ``console`` so that it runs.

Where they run, as on a fresh machine after ``scripts/demo``: a scratch folder
holding ``repo``, a fresh git repository (``greet.py`` and ``README``, one
commit on ``main``, as in scripts/demo) that is the current folder; HOME an
empty folder; the identity in GIT_AUTHOR_*/GIT_COMMITTER_*; PATH with the
project's ``.venv/bin`` first; stdin empty. The placeholders
``/abs/path/to/repo`` and ``/abs/path/to/venv`` stand for that repository and
the project's ``.venv``, ``/abs/path/to/oncepatch`` for the project's folder (a clone).

An HTML comment right before a block gives its context, options separated by ``;``:

* ``<!-- docs-test: skip (REASON) -->``: not run; the reason stays visible in the doc.
* ``<!-- docs-test: skip-line=PREFIX (REASON) -->``: commands starting with PREFIX are
  not run; the rest of the block is.
* ``<!-- docs-test: cwd=project -->``: run in the project's root instead of the repository.
* ``<!-- docs-test: setup=NAME,NAME -->``: prepare the repository first with these
  fixtures of SETUPS below (files a block names but does not make, crashed calls, ...).
* ``<!-- docs-test: output -->`` (console blocks): the sample output must be what the
  commands print: each sample line matches a line of their stdout, in order (other
  lines may come between), with the parts that differ from run to run as wildcards:
  hex ids, numbers, times, the scratch folder's path and ``…``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL_TAGS = {"sh", "bash", "shell"}
RUN_TAGS = SHELL_TAGS | {"console", "python"}
# Words an untagged block must not start with: such a block is a command someone meant to run.
COMMAND_WORDS = {"oncepatch", "git", "python", "python3", "pip", "scripts/demo", "scripts/test",
                 "scripts/bench", "scripts/recover", "scripts/torture", "cd", "export", "claude", "codex"}
BLOCK_TIMEOUT = 120.0

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
COMMENT = re.compile(r"^\s*<!--\s*docs-test:(?P<opts>.*?)-->\s*$")
OPTION = re.compile(r"^(?P<name>[a-z-]+)(?:=(?P<value>[^\s(]+))?\s*(?:\((?P<reason>.+)\))?$")
EXIT_NOTE = re.compile(r"\bexit (\d+)\b")


@dataclass
class Block:
    path: Path
    line: int                      # line of the opening fence, 1-based
    tag: str
    text: str
    options: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    skip_lines: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def split_outside_parens(text: str) -> list[str]:
    """Splits on ``;``, but not inside a reason's parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def parse_options(path: Path, line: int, text: str) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Reads ``docs-test:`` options; every skip must say why."""
    options: dict[str, str] = {}
    reasons: dict[str, str] = {}
    skip_lines: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in split_outside_parens(text))):
        m = OPTION.match(item)
        if not m or m["name"] not in {"skip", "skip-line", "cwd", "setup", "output"}:
            raise AssertionError(f"{path.name}:{line}: unknown docs-test option {item!r}")
        name, value, reason = m["name"], m["value"] or "", (m["reason"] or "").strip()
        if name.startswith("skip") and not reason:
            raise AssertionError(f"{path.name}:{line}: {name} needs its reason in parentheses")
        if name == "skip-line":
            skip_lines[value] = reason
        else:
            options[name] = value
            if reason:
                reasons[name] = reason
    return options, reasons, skip_lines


def find_blocks(path: Path) -> list[Block]:
    """Every top-level fenced block of a Markdown file (a fence inside a longer one is content)."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    pending: tuple[int, str] | None = None   # the last docs-test comment not yet used
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            c = COMMENT.match(lines[i])
            if c:
                pending = (i + 1, c["opts"])
            elif lines[i].strip():
                pending = None            # a comment applies only to the block right after it
            i += 1
            continue
        fence, start = m["fence"], i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and set(lines[i].strip()) == {fence[0]}):
            body.append(lines[i])
            i += 1
        i += 1
        block = Block(path, start + 1, m["info"].lower(), textwrap.dedent("\n".join(body)) + "\n")
        if pending is not None:
            block.options, block.reasons, block.skip_lines = parse_options(path, pending[0], pending[1])
        pending = None
        blocks.append(block)
    return blocks


ALL_BLOCKS = [b for doc in DOCS for b in find_blocks(doc)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.tag in RUN_TAGS]
UNTAGGED = [b for b in ALL_BLOCKS if not b.tag]


# -- fixtures a block may name in setup= ------------------------------------------------------------

FIX_DIFF = '--- a/greet.py\n+++ b/greet.py\n@@ -1,2 +1,2 @@\n def greet(name):\n-    return "hello " + name\n+    return f"hello, {name}!"\n'
OTHER_DIFF = "--- a/README\n+++ b/README\n@@ -1 +1 @@\n-greet\n+greetings\n"

CRASHED_CALLS = r"""
# Two calls killed (as in scripts/demo's step 5): one before its branch moved, then one after
# (in this order: a later call on the branch would settle the earlier one).
printf -- '--- a/README\n+++ b/README\n@@ -1 +1 @@\n-greet\n+greet, typo fixed\n' > ../fix-typo.diff
printf -- '--- /dev/null\n+++ b/NOTES\n@@ -0,0 +1 @@\n+notes\n' > ../add-file.diff
if ONCEPATCH_CRASH_AT=after-prepare oncepatch apply ../add-file.diff --key add-file; then exit 1; fi
if ONCEPATCH_CRASH_AT=after-ref oncepatch apply ../fix-typo.diff --key fix-typo; then exit 1; fi
oncepatch status fix-typo | grep -q '^prepared'
oncepatch status add-file | grep -q '^prepared'
"""

UNKNOWN_EFFECTS = r"""
# Two effects whose outcome is unknown (each tool timed out after sending), in the store ./receipts.
python - <<'EOF'
from receipts.effects import perform

def lost(call):
    raise TimeoutError("the server did not answer")

for tool, key in (("send_email", "welcome:7"), ("http_post", "order-7")):
    try:
        perform(tool, {"key": key}, lost, key=key, store="receipts")
    except Exception:
        pass
EOF
oncepatch status welcome:7 --store receipts | grep -q '^unknown'
oncepatch status order-7 --store receipts | grep -q '^unknown'
"""

#: docs/LIFECYCLE.md's two calls and retention policy (its first block), for its later blocks.
LIFECYCLE_CALLS = r"""
printf -- '--- a/greet.py\n+++ b/greet.py\n@@ -1,2 +1,2 @@\n def greet(name):\n-    return "hello " + name\n+    return f"hello, {name}!"\n' > ../fix.diff
oncepatch apply ../fix.diff --key task-7/fix-greeting
printf -- '--- a/README\n+++ b/README\n@@ -1 +1 @@\n-greet\n+greetings\n' > ../readme.diff
oncepatch apply ../readme.diff --key task-8/readme -m "readme: greetings (ticket 4711)"
printf '[remove]\nolder_than_days = 0\nkey_prefixes = ["task-7/"]\n\n[redact]\nfields = ["args.message"]\n' > ../retention.toml
"""

SETUPS: dict[str, str] = {
    "fix.diff": f"cat > fix.diff <<'EOF'\n{FIX_DIFF}EOF\n",
    "other.diff": f"cat > other.diff <<'EOF'\n{OTHER_DIFF}EOF\n",
    "crashed-calls": CRASHED_CALLS,
    "unknown-effects": UNKNOWN_EFFECTS,
    "lifecycle-calls": LIFECYCLE_CALLS,
}


# -- running -----------------------------------------------------------------------------------------

def split_comment(line: str) -> tuple[str, str]:
    """A shell line's code and its trailing ``#`` comment (quotes respected)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:]
    return line.rstrip(), ""


def is_complete(script: str) -> bool:
    res = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
    return res.returncode == 0 and not res.stderr


@dataclass
class Command:
    line: int          # line in the doc
    code: str
    expected: int
    until_stopped: bool


def commands_of(block: Block) -> list[Command]:
    """The block's commands in order, each with the exit status its comment documents."""
    lines = block.text.splitlines()
    if block.tag == "console":
        lines = [ln[2:] if ln.startswith("$ ") else "" for ln in lines]
    out: list[Command] = []
    chunk: list[str] = []
    notes = ""
    first = 0
    for n, raw in enumerate(lines):
        code, note = split_comment(raw) if not chunk else (raw, "")
        if not chunk:
            if not code.strip():
                continue
            first = n
        chunk.append(code)
        notes += " " + note
        text = "\n".join(chunk) + "\n"
        if is_complete(text):
            m = EXIT_NOTE.search(notes)
            out.append(Command(block.line + 1 + first, text, int(m[1]) if m else 0, "Ctrl-C ends it" in notes))
            chunk, notes = [], ""
    assert not chunk, f"{block.name}: the block ends inside a command: {''.join(chunk)!r}"
    return out


def scratch_env(scratch: Path) -> dict[str, str]:
    """A fresh machine: nothing inherited but the system's PATH."""
    home = scratch / "home"
    tmp = scratch / "tmp"
    runtime = scratch / "run"  # a login's own: the per-user server's default folder is in it
    home.mkdir()
    tmp.mkdir()
    runtime.mkdir(mode=0o700)
    return {
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "XDG_RUNTIME_DIR": str(runtime),
        "LANG": "C.UTF-8",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "Docs Reader",
        "GIT_AUTHOR_EMAIL": "reader@example.com",
        "GIT_COMMITTER_NAME": "Docs Reader",
        "GIT_COMMITTER_EMAIL": "reader@example.com",
    }


def make_repo(repo: Path, env: dict[str, str]) -> None:
    """The repository of scripts/demo."""
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)

    repo.mkdir()
    git("init", "-q", "-b", "main")
    (repo / "greet.py").write_text('def greet(name):\n    return "hello " + name\n')
    (repo / "README").write_text("greet\n")
    git("add", "-A")
    git("commit", "-q", "-m", "initial")


def substitute(text: str, repo: Path) -> str:
    return (text.replace("/abs/path/to/repo", str(repo)).replace("/abs/path/to/venv", str(VENV_BIN.parent))
            .replace("/abs/path/to/oncepatch", str(ROOT)))


def run_shell(block: Block, cwd: Path, env: dict[str, str], repo: Path, scratch: Path) -> list[str]:
    """Runs the block's commands one after another in one bash; returns the mismatches."""
    commands = commands_of(block)
    for prefix in block.skip_lines:
        assert any(c.code.lstrip().startswith(prefix) for c in commands), \
            f"{block.name}: skip-line={prefix} matches no command of the block"
    status = scratch / "status"
    parts = []
    for i, cmd in enumerate(commands):
        if any(cmd.code.lstrip().startswith(prefix) for prefix in block.skip_lines):
            continue
        code = substitute(cmd.code, repo).rstrip("\n")
        if cmd.until_stopped:
            # The reader's Ctrl-C, a second after the start.
            code = f"timeout --preserve-status -s INT 1 {code}"
        parts.append(f"{code}\nprintf '%s %s\\n' {i} $? >> {shlex.quote(str(status))}\n")
    res = subprocess.run(["bash", "-c", "".join(parts)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=False)
    seen = {}
    if status.exists():
        for row in status.read_text().splitlines():
            index, rc = row.split()
            seen[int(index)] = int(rc)
    problems = []
    for i, cmd in enumerate(commands):
        if any(cmd.code.lstrip().startswith(prefix) for prefix in block.skip_lines):
            continue
        if i not in seen:
            problems.append(f"line {cmd.line}: never ran: {cmd.code.strip()}")
            continue
        ok = seen[i] in (0, 130) if cmd.until_stopped else seen[i] == cmd.expected
        if not ok:
            problems.append(f"line {cmd.line}: exit {seen[i]}, documented {cmd.expected}: {cmd.code.strip()}")
    if "output" in block.options:
        assert block.tag == "console", f"{block.name}: output= compares a console block's sample output"
        problems += output_mismatches(block, res.stdout)
    if problems:
        problems.append(f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}")
    return problems


_VARIABLE = [  # (what varies, as it reads in the doc) -> a wildcard; applied in this order
    (re.compile(r"…"), ".*"),                                           # elided by the doc
    (re.compile(r"(?:/tmp|/abs/path/to)/\S*?/repo\b"), r"\S*/repo"),      # the scratch repository
    (re.compile(r"\d{8}T\d{6}\.\d{6}Z"), r"\d{8}T\d{6}\.\d{6}Z"),         # a quarantine's time
    (re.compile(r"(?<=receipts/)[0-9a-f]{2}/[0-9a-f]*"), "[0-9a-f]{2}/[0-9a-f]*"),  # a key's hash
    (re.compile(r"[0-9a-f]{7,64}"), "[0-9a-f]+"),                       # commits, key hashes
    (re.compile(r"(?<![\w\[+])\d+(?=s\b|[^\w\]]|$)"), r"\d+"),             # counts, ages (0s), pids
]


def sample_pattern(line: str) -> re.Pattern[str]:
    """A sample output line as a pattern: literal, but for the parts that vary from run to run."""
    text = line.rstrip()
    wildcards: list[str] = []

    def hold(wildcard: str) -> Callable[[re.Match[str]], str]:
        def put(_m: re.Match[str]) -> str:
            wildcards.append(wildcard)
            return f"\x00{chr(0xE000 + len(wildcards) - 1)}\x00"  # no digit, no hex: later rules pass it
        return put

    for pattern, wildcard in _VARIABLE:
        text = pattern.sub(hold(wildcard), text)
    parts = re.split("\x00(.)\x00", text)  # literal, placeholder, literal, ...
    return re.compile("".join(wildcards[ord(p) - 0xE000] if k % 2 else re.escape(p) for k, p in enumerate(parts)))


def output_mismatches(block: Block, stdout: str) -> list[str]:
    """Sample lines of a console block that its commands' stdout does not show, in order."""
    samples = [ln for ln in block.text.splitlines() if ln.strip() and not ln.startswith("$ ")]
    lines = stdout.splitlines()
    at = 0
    for sample in samples:
        want = sample_pattern(sample)
        while at < len(lines) and not want.fullmatch(lines[at].rstrip()):
            at += 1
        if at == len(lines):
            return [f"sample line not printed (in this order): {sample!r}"]
        at += 1
    return []


def run_setup(names: str, cwd: Path, env: dict[str, str]) -> None:
    for name in filter(None, names.split(",")):
        assert name in SETUPS, f"unknown setup {name!r} (known: {sorted(SETUPS)})"
        res = subprocess.run(["bash", "-ec", SETUPS[name]], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=False)
        assert res.returncode == 0, f"setup {name} failed:\n{res.stdout}\n{res.stderr}"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.name for b in RUN_BLOCKS])
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if "skip" in block.options:
        pytest.skip(f"{block.name}: {block.reasons['skip']}")
    env = scratch_env(tmp_path)
    repo = tmp_path / "repo"
    make_repo(repo, env)
    where = block.options.get("cwd", "repo")
    assert where in {"repo", "project"}, f"{block.name}: cwd is repo or project, not {where!r}"
    cwd = ROOT if where == "project" else repo
    run_setup(block.options.get("setup", ""), cwd, env)
    if block.tag == "python":
        program = tmp_path / "example.py"
        program.write_text(substitute(block.text, repo))
        res = subprocess.run(["python", str(program)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=False)
        assert res.returncode == 0, f"{block.name}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        return
    problems = run_shell(block, cwd, env, repo, tmp_path)
    assert not problems, f"{block.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", UNTAGGED, ids=[b.name for b in UNTAGGED])
def test_untagged_block_is_not_a_command(block: Block) -> None:
    first = next((ln.strip() for ln in block.text.splitlines() if ln.strip()), "")
    word = first[2:].split()[0] if first.startswith("$ ") else (first.split() or [""])[0]
    assert not first.startswith("$ ") and word not in COMMAND_WORDS, (
        f"{block.name}: starts with the command {first!r}: tag it sh or console so that it runs")


def test_walker_finds_the_blocks() -> None:
    """The walker sees the blocks this test exists for (a broken parser would pass vacuously)."""
    assert any(b.path.name == "README.md" and "oncepatch apply fix.diff" in b.text for b in RUN_BLOCKS)
    assert any(b.path.name == "AGENTS.md" and b.tag == "python" for b in RUN_BLOCKS)
    assert any(b.path.name == "EFFECTS.md" and b.tag == "python" for b in RUN_BLOCKS)
    assert any(b.tag == "console" for b in RUN_BLOCKS)
    # docs/FORMATS.md shows a ```python fence inside a ````-fence: content, not a block of its own.
    assert not any(b.path.name == "FORMATS.md" and b.tag == "python" for b in RUN_BLOCKS)
    assert any(b.path.name == "FORMATS.md" and "```python" in b.text for b in ALL_BLOCKS)


def test_documented_exit_status_is_read_from_the_comment() -> None:
    block = Block(ROOT / "README.md", 1, "sh",
                  "a --x   # first call\n   # more words\nb 'q # not a comment'  # same key: exit 3, nothing\n"
                  "c <<'EOF'\nbody\nEOF\nd   # flag them; Ctrl-C ends it\n")
    assert [(c.line, c.expected, c.until_stopped) for c in commands_of(block)] == [
        (2, 0, False), (4, 3, False), (5, 0, False), (8, 0, True)]


def test_sample_output_is_compared_with_wildcards_only_where_runs_differ() -> None:
    block = Block(ROOT / "docs" / "RECOVERY.md", 1, "console",
                  "$ x\nrecovered: 2 receipt(s) of 2\n  fix-typo: prepared -> committed (key_ref) d3e8f67fce3b\n"
                  "  removed /tmp/crashm-demo/repo/.git/index.lock\n")
    printed = ("recovered: 2 receipt(s) of 2\n  add-file: prepared -> rejected\n"
               "  fix-typo: prepared -> committed (key_ref) 0123456789ab\n  removed /tmp/pytest-1/x/repo/.git/index.lock\n")
    assert output_mismatches(block, printed) == []
    assert output_mismatches(block, printed.replace("committed", "rejected"))  # the words must be there
    assert output_mismatches(block, printed.replace("(key_ref)", "(reachable_from_branch)"))


def test_agents_install_line_installs_from_a_clone(tmp_path: Path) -> None:
    """The package is not on PyPI: AGENTS.md's pip line names the clone, and pip can install from it."""
    [line] = [c.code.strip() for b in RUN_BLOCKS if b.path.name == "AGENTS.md" and b.tag in SHELL_TAGS
              for c in commands_of(b)
              if c.code.lstrip().startswith("pip install")]
    argv = shlex.split(substitute(line, tmp_path))
    assert argv[:2] == ["pip", "install"] and argv[2].startswith(str(ROOT))
    res = subprocess.run([str(VENV_BIN / "pip"), *argv[1:], "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
                          "--disable-pip-version-check"], capture_output=True, text=True, timeout=BLOCK_TIMEOUT,
                         check=False)
    assert res.returncode == 0, res.stderr


def _json_blocks(path: Path) -> list[dict[str, object]]:
    import json

    return [json.loads(b.text) for b in find_blocks(path) if b.tag == "json"]


def test_readme_json_samples_are_what_the_commands_print(tmp_path: Path) -> None:
    """README shows a first call's JSON and a conflict's envelope: the commands print exactly those,
    but for what differs from run to run (the commit, the call's receipt path)."""
    import json

    first_doc, conflict_doc = _json_blocks(ROOT / "README.md")[:2]
    env = scratch_env(tmp_path)
    repo = tmp_path / "repo"
    make_repo(repo, env)
    run_setup("fix.diff,other.diff", repo, env)

    def run(*args: str) -> tuple[int, dict[str, object]]:
        res = subprocess.run(["oncepatch", *args], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=BLOCK_TIMEOUT, check=False)
        return res.returncode, json.loads(res.stdout)

    code, first = run("apply", "fix.diff", "--key", "fix-greeting", "--json")
    assert code == 0 and set(first) == set(first_doc)
    varies = {"commit", "receipt", "call_id"}  # the call_id names the scratch repository's path
    assert {k: v for k, v in first.items() if k not in varies} == {k: v for k, v in first_doc.items()
                                                                   if k not in varies}
    code, conflict = run("apply", "other.diff", "--key", "fix-greeting", "--json")
    assert code == 3
    err, want = dict(conflict["error"]), dict(conflict_doc["error"])  # type: ignore[call-overload]
    err.pop("existing_call_id"), err.pop("existing_tool")
    assert conflict["ok"] is False and err == want

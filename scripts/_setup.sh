# Sourced by scripts/*: makes .venv (if missing) and installs the project with [dev,test].
# Re-installs only when pyproject.toml is newer than the stamp.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.oncepatch-installed"
# A .venv half made (interrupted, or made without pip) is made again, not used broken for good.
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "$VENV has no working pip (a set-up interrupted?): making it again" >&2
  rm -f "$STAMP"
  "$PY" -m venv --clear "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setting up $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# What the stamp holds: the set-up's own version, so that a .venv made by an older set-up is redone.
# 2: pip >= 25.2 first, whose console-script launcher does not import `re` (about 8 ms of every
#    one-shot call; docs/DECISIONS.md, "The command stays a console-script entry point").
SETUP_VERSION=2
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$(cat "$STAMP")" != "$SETUP_VERSION" ]; then
  echo "installing oncepatch and its dependencies into $VENV (first run only: about a minute)" >&2
  "$VENV/bin/python" -m pip install -qq --disable-pip-version-check 'pip>=25.2' >&2
  "$VENV/bin/python" -m pip install -qq --disable-pip-version-check -e "$ROOT[dev,test]" >&2
  echo "$SETUP_VERSION" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

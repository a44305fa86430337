# Sourced by scripts/*: makes .venv (if missing) and installs the project with [dev].
# Re-installs only when pyproject.toml is newer than the stamp.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setting up $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.oncepatch-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[dev]" >&2
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

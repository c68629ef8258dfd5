#!/usr/bin/env bash
# Create or refresh the project's Python 3.12 venv in .venv (MaxText needs 3.12). Idempotent: reinstalls
# only when pyproject.toml changed since the last install. Source it or run it; prints the venv's python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DFLASH_VENV:-$root/.venv}"

find_python312() {
  local c
  for c in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    # pyenv shims exist even when 3.12 is not the selected version: check that it really runs.
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      command -v "$c" 2>/dev/null || echo "$c"; return 0
    fi
  done
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python312)" || { echo "error: Python 3.12 not found (set PYTHON312=/path/to/python3.12)" >&2; exit 1; }
  echo "[setup] creating $venv with $py" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.dflash-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dflash-jax and its dependencies into $venv (first time: ~3 min, ~2 GB)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -e "$root[dev,maxtext]" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"

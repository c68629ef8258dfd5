#!/usr/bin/env bash
# Create (or refresh) the separate Python 3.11 + PyTorch environment used ONLY to
# produce reference fixtures, then run tools/make_references.py with it.
#
# torch is never a dependency of dflash-jax itself: the reference numbers are made
# here, saved under tests/fixtures/, and the JAX tests compare against those files.
#
# Usage:
#   tools/reference_env.sh [make_references.py args...]
#     e.g. tools/reference_env.sh --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Environment:
#   REFENV            venv location (default: <repo>/.cache/refenv)
#   PYTHON311         a python3.11 interpreter to use (default: searched for)
#   TORCH_INDEX_URL   extra pip index for torch, e.g. https://download.pytorch.org/whl/cpu
#                     (PyPI's Linux torch is the multi-GB CUDA build; the CPU build suffices)
#   REFENV_SETUP_ONLY=1  only create/refresh the venv, do not run the script
#
# Idempotent: the venv is created once; the pinned packages are (re)installed only
# when the pin list changed or an import check fails.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REFENV="${REFENV:-$REPO_ROOT/.cache/refenv}"

# Exact versions the committed fixtures were generated with.  Changing a pin may change
# the reference numbers (and the SmolLM2 greedy text): regenerate and review the diff.
REQUIREMENTS=(
  "torch==2.13.0"
  "transformers==5.23.0"
  "gguf==0.19.0"
  "safetensors==0.8.0"
  "numpy==2.4.6"
  "sentencepiece==0.2.3"
  "accelerate==1.15.0"  # transformers requires it to load a GGUF checkpoint
)

is_py311() {
  # True when "$1" runs and is CPython 3.11 (a pyenv shim may exist but fail to run).
  [ -n "$1" ] && "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
    >/dev/null 2>&1
}

find_python311() {
  local cand
  local -a cands=()
  [ -n "${PYTHON311:-}" ] && cands+=("$PYTHON311")
  cands+=("$(command -v python3.11 2>/dev/null || true)")
  # pyenv installs, newest patch release first.
  for cand in $(ls -d "$HOME"/.pyenv/versions/3.11*/bin/python3.11 2>/dev/null | sort -rV); do
    cands+=("$cand")
  done
  cands+=(/usr/local/bin/python3.11 /usr/bin/python3.11)
  cands+=("$(command -v python3 2>/dev/null || true)")
  for cand in "${cands[@]}"; do
    if is_py311 "$cand"; then
      echo "$cand"
      return 0
    fi
  done
  return 1
}

venv_ok() {
  [ -x "$REFENV/bin/python" ] && is_py311 "$REFENV/bin/python"
}

if ! venv_ok; then
  PY311="$(find_python311)" || {
    echo "error: no working Python 3.11 found (set PYTHON311=/path/to/python3.11)" >&2
    exit 1
  }
  echo "Creating reference venv at $REFENV with $PY311"
  rm -rf "$REFENV"
  mkdir -p "$(dirname "$REFENV")"
  "$PY311" -m venv "$REFENV"
fi

STAMP="$REFENV/.dflash-reference-requirements"
WANT="$(printf '%s\n' "${REQUIREMENTS[@]}")"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ] \
  || ! "$REFENV/bin/python" -c 'import torch, transformers, gguf, safetensors, numpy, sentencepiece, accelerate' \
    >/dev/null 2>&1; then
  echo "Installing reference packages into $REFENV"
  PIP_ARGS=()
  [ -n "${TORCH_INDEX_URL:-}" ] && PIP_ARGS+=(--extra-index-url "$TORCH_INDEX_URL")
  "$REFENV/bin/python" -m pip install --quiet ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "${REQUIREMENTS[@]}"
  echo "$WANT" >"$STAMP"
fi

if [ "${REFENV_SETUP_ONLY:-0}" = "1" ]; then
  echo "Reference venv ready: $REFENV"
  exit 0
fi

cd "$REPO_ROOT"
exec "$REFENV/bin/python" tools/make_references.py "$@"

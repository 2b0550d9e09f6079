#!/usr/bin/env bash
# Issue 61 on one CUDA GPU in one device call, priority first, within BUDGET_S seconds (default 540): the varlen
# attention kernel against FlexAttention and float32, the compiled batch-8 step profiled, and bench/throughput.py
# side by side with the compiled HF Trainer (batch 8 and 16, float8 tensorwise and rowwise, seq 8192, eager).
# A step that would not fit in the time left is skipped and named in skipped.txt: run those in a second call with
# `bash bench/one_gpu_checks/issue61.sh STEP ...`. Every log, JSON result and (gzipped) trace goes into one
# archive, $OUT/issue61.tgz (the device tool returns at most 8 files).
#
# Set-up here, once (the GPU image lacks these wheels):
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download -q --no-deps -d .whl tomli-w datasets==5.2.0 "dill<0.4.2" torchao==0.18.0
#   .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "multiprocess<0.70.20"
# Device call (carry [".whl"], timeout_s 600):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export
#   PYTHONPATH=/tmp/site; bash bench/one_gpu_checks/issue61.sh
#
# Once the varlen check passes and varlen's batch-8 run is faster than flex's, the later meshtron runs use varlen
# (what `auto` would then choose); KERNEL=flex|varlen forces one.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/issue61}
LOGS=/tmp/issue61-logs
KEEP=/tmp/issue61-keep
mkdir -p "$OUT" "$LOGS" "$KEEP"
rm -f "$LOGS/skipped.txt"  # a second call on the same machine keeps the first one's results (b8.json: the kernel)
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET_S:-540}))
ONLY=" $* "
KERNEL=${KERNEL:-}

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
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  code=$?
  echo "   exit $code"
  tail -n "${TAIL:-14}" "$LOGS/$name.log"
  return 0
}

# throughput NAME ESTIMATE_S ARGS...: bench/throughput.py, keeping each runner's log, planned-vs-measured line and
# profiler trace.
throughput() {
  local name=$1 estimate=$2 dir runner trace
  shift 2
  TAIL=6 step "$name" "$estimate" python3 bench/throughput.py --timeout "$estimate" --json "$LOGS/$name.json" \
    --keep "$KEEP/$name" "$@"
  for dir in "$KEEP/$name"/*/; do
    [[ -d $dir ]] || continue
    runner=$(basename "$dir")
    cp "$dir/log.txt" "$LOGS/$name--$runner.log" 2>/dev/null
    grep -h "planned vs measured\|profile of steps\|kept .* of activations" "$dir/log.txt" 2>/dev/null | head -4
    for trace in "$dir"/run/profile/rank-*.json; do
      [[ -f $trace ]] && gzip -9c "$trace" > "$LOGS/$name--$runner.trace.json.gz"
    done
    rm -rf "$dir/run/profile"
  done
}

# tokens/s of meshtron's runner in a throughput JSON (0 when it has none)
tokens_per_s() {
  python3 -c "import json,sys
try: r=[x for x in json.load(open(sys.argv[1]))['results'] if x['runner'].startswith('meshtron')]
except Exception: r=[]
print(int(r[0].get('tokens_per_s', 0)) if r else 0)" "$1"
}

if wanted info; then
  nvidia-smi -L
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "from meshtron.models import varlen; print('varlen_attn:', varlen.VARLEN)" 2>&1 | tail -1
fi

step attention 60 python3 bench/attention_kernels.py
throughput b8 200 --batch 8 --runners meshtron-compile hf-trainer-compile --meshtron-set run.profile_steps=3-4
if wanted b8 && (($(tokens_per_s "$LOGS/b8.json") == 0)); then  # the profiler broke the run? measure without it
  throughput b8-unprofiled 110 --batch 8 --runners meshtron-compile
fi
throughput b8-varlen 110 --batch 8 --runners meshtron-compile --meshtron-set model.attention_kernel=varlen \
  run.profile_steps=3-4

if [[ -z $KERNEL ]]; then
  flex=$(tokens_per_s "$LOGS/b8.json")
  ((flex > 0)) || flex=$(tokens_per_s "$LOGS/b8-unprofiled.json" 2> /dev/null)
  varlen=$(tokens_per_s "$LOGS/b8-varlen.json" 2> /dev/null)
  KERNEL=flex
  if grep -q "check: PASS" "$LOGS/attention.log" 2> /dev/null && ! grep -q "FAILED\|varlen: n/a" "$LOGS/attention.log" \
    && ((${varlen:-0} > flex)); then
    KERNEL=varlen
  fi
  echo "== batch 8: flex ${flex} tokens/s, varlen ${varlen:-?} tokens/s: the later meshtron runs use $KERNEL"
fi
echo "$KERNEL" > "$LOGS/kernel.txt"
K="model.attention_kernel=$KERNEL"

throughput float8 110 --batch 8 --runners meshtron-compile --meshtron-set "$K" precision.float8=true
throughput s8192 200 --seq-len 8192 --batch 2 --runners meshtron-compile hf-trainer-compile --meshtron-set "$K"
throughput b16 220 --batch 16 --runners meshtron-compile hf-trainer-compile --meshtron-set "$K"
throughput eager 150 --batch 8 --runners meshtron hf-trainer --meshtron-set "$K"
throughput float8-rowwise 110 --batch 8 --runners meshtron-compile --meshtron-set "$K" precision.float8=true \
  precision.float8_recipe=rowwise
other=$([[ $KERNEL == varlen ]] && echo flex || echo varlen)
throughput s8192-$other 110 --seq-len 8192 --batch 2 --runners meshtron-compile \
  --meshtron-set model.attention_kernel=$other
step attention-8192 60 python3 bench/attention_kernels.py --seq-len 8192 --batch 2 --documents 28
step attention-1-document 60 python3 bench/attention_kernels.py --documents 1
step attention-64-documents 60 python3 bench/attention_kernels.py --documents 64

echo "== [t+$(($(date +%s) - T0))s] done; skipped: $(cat "$LOGS/skipped.txt" 2> /dev/null | tr '\n' ' ')"
tar czf "$OUT/issue61.tgz" -C "$LOGS" .

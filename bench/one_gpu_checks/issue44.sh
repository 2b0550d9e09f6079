#!/usr/bin/env bash
# Issue 44's checks on one CUDA GPU, from the repository root, priority first (~9 min on one H100; each step has its
# own time limit and writes under OUT, default /tmp/issue44, so a call cut short keeps what it measured). None of
# these paths has run on a GPU yet: the session that built them had none. Compare with BENCHMARKS.md and
# ../shared/gpu-measurements/ (the figures the planner is calibrated on).
#   1. varlen attention against the float32 reference and FlexAttention (bench/attention_kernels.py)
#   2. the profile summary that counts kernels, on a real run (run.profile_steps); the planned-vs-measured line;
#      which operators still launch float32 adds / copies (bench/gradient_passes.py)
#   3. throughput: defaults, varlen, float8, micro-batch 1 (the planner's efficiency model), seq 8192, the HF peers
# Usage: bash bench/one_gpu_checks/issue44.sh [STEP ...]; STEPs (default all, in this order): attention profile b8
# variants s8192 plan. All of them take more than one device call's 10 minutes: run "attention profile b8" in one
# and "variants s8192 plan" in the next.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/issue44}; mkdir -p "$OUT"
T0=$(date +%s); step() { echo "== [t+$(( $(date +%s) - T0 ))s] $*"; }
LLAMA1B=(--model.preset=llama-1b --data.seq_len=2048 --data.max_documents=400 --model.dtype=float32
  --precision.mixed_precision=bf16 --train.compile=true --data.mask_documents=true --run.device=cuda
  --train.global_batch_size=8 --run.progress=false)

STEPS=" ${*:-attention profile b8 variants s8192 plan} "
wants() { [[ $STEPS == *" $1 "* ]]; }

if wants attention; then
step "varlen vs flex vs the float32 reference, seq 2048 and 8192"
timeout 120 python3 bench/attention_kernels.py 2>&1 | tee "$OUT/attention-2048.log" | tail -15
timeout 120 python3 bench/attention_kernels.py --seq-len 8192 --batch 2 --documents 28 2>&1 | tee "$OUT/attention-8192.log" | tail -15

fi
if wants profile; then
step "a profiled llama-1b b8 run: the kernel summary, the planned-vs-measured line, the gradients' passes"
timeout 150 python3 -m meshtron train "${LLAMA1B[@]}" --train.steps=8 --run.profile_steps=5-7 \
  --run.output_dir="$OUT/profile" > "$OUT/profile.log" 2>&1
grep -E -A10 "profile of steps" "$OUT/profile.log"; grep "planned vs measured" "$OUT/profile.log"
timeout 60 python3 bench/gradient_passes.py "$OUT/profile/profile/rank-0.json" --steps 3 2>&1 | tail -15
gzip -9 "$OUT"/profile/profile/*.json 2>/dev/null

fi
if wants b8; then
step "throughput: meshtron-compile defaults against hf-trainer-compile"
timeout 330 python3 bench/throughput.py --batch 8 --runners meshtron-compile hf-trainer-compile --timeout 160 \
  --json "$OUT/b8.json" > "$OUT/b8.log" 2>&1; tail -6 "$OUT/b8.log"
fi
if wants variants; then
step "throughput: meshtron-compile with varlen, float8, micro-batch 1"
for setting in model.attention_kernel=varlen precision.float8=true train.micro_batch_size=1; do
  timeout 150 python3 bench/throughput.py --batch 8 --runners meshtron-compile --timeout 140 \
    --json "$OUT/b8-$setting.json" --meshtron-set "$setting" > "$OUT/b8-$setting.log" 2>&1; tail -3 "$OUT/b8-$setting.log"
done
fi
if wants s8192; then
step "seq 8192 batch 2, flex and varlen, against hf-trainer-compile"
timeout 200 python3 bench/throughput.py --seq-len 8192 --batch 2 --runners meshtron-compile hf-trainer-compile \
  --timeout 95 --json "$OUT/s8192.json" > "$OUT/s8192.log" 2>&1; tail -4 "$OUT/s8192.log"
timeout 120 python3 bench/throughput.py --seq-len 8192 --batch 2 --runners meshtron-compile --timeout 110 \
  --meshtron-set model.attention_kernel=varlen --json "$OUT/s8192-varlen.json" > "$OUT/s8192-varlen.log" 2>&1
tail -3 "$OUT/s8192-varlen.log"
fi
if wants plan; then
step "the planner's row for the same run"
python3 -m meshtron plan --model llama-1b --gpus 1 --seq-len 2048 --global-batch 8 2>&1 | tail -12
fi
step done

#!/usr/bin/env bash
# Issue 60 on one CUDA GPU in one device call, priority first, within BUDGET_S seconds (default 420: a 15-minute
# device budget less the machine's start, the wheels and a margin):
#   1. distillation throughput and peak memory: llama-1b (fp32 master weights, bf16 compute, compiled blocks: the
#      meshtron-compile runner of bench/throughput.py, warm-up steps left out) distilled from llama-8b (random
#      weights, distill.teacher_dtype=bfloat16), seq 2048, the fused loss (train.loss_chunk_size=4096, the default)
#      against the unfused one (0): both at batch 4 (planned 56 / 68 GB of the H200's 138), then fused at batch 16
#      (planned 87 GB), unfused and fused at batch 8 (planned 101 / 66 GB: the unfused one may not fit);
#   2. the standing one-GPU queue's `distill` check (the GPU against the CPU in fp32, the teacher's bytes as planned,
#      fused = unfused in bf16 compiled), after the batch-4 pair.
# Meanwhile, on the CPU, `meshtron plan --objective distill --teacher llama-8b` plans each run (plan-*.json); at the
# end table.md puts tokens/s and measured peak memory beside the run's own planned figures (metrics.jsonl's
# planned_peak_gb / planned_step_s) and `meshtron plan`'s.
# A step that would not fit in the time left is skipped and named in skipped.txt: run those in a second call with
# `bash bench/one_gpu_checks/issue60.sh STEP ...` (steps: info fused-b4 unfused-b4 queue fused-b16 unfused-b8
# fused-b8; the plans and the table always run). Every log and JSON goes into one archive, $OUT/issue60.tgz.
#
# Set-up here, once (the GPU image lacks these wheels):
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download -q --no-deps -d .whl tomli-w datasets==5.2.0 "dill<0.4.2" torchao==0.18.0
#   .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "multiprocess<0.70.20"
# Device call (carry [".whl"], timeout_s 600):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export
#   PYTHONPATH=/tmp/site; bash bench/one_gpu_checks/issue60.sh
#
# Without a CUDA GPU (or with TINY=1) it runs the same steps tiny on the CPU (llama-tiny from llama-small, seq 64,
# eager; the queue's check with GPU_QUEUE_ON_CPU=1), so that a CPU run finds a typo here.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/issue60}
LOGS=/tmp/issue60-logs
KEEP=/tmp/issue60-keep
mkdir -p "$OUT" "$LOGS" "$KEEP"
rm -f "$LOGS/skipped.txt"  # a second call on the same machine keeps the first one's results: the table shows both
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET_S:-420}))
ONLY=" $* "
if [[ -z ${TINY:-} ]]; then  # TINY=1: the CPU run below; TINY=0: the GPU's steps, wherever it runs
  TINY=$(python3 -c "import torch; print(0 if torch.cuda.is_available() else 1)")
fi
if [[ $TINY == 1 ]]; then
  PRESET=llama-tiny TEACHER=llama-small SEQ=64 STEPS=4 WARMUP=2 DOCUMENTS=40 RUNNER=meshtron CHUNK=16
  export GPU_QUEUE_ON_CPU=1
else
  PRESET=llama-1b TEACHER=llama-8b SEQ=2048 STEPS=12 WARMUP=4 DOCUMENTS=400 RUNNER=meshtron-compile CHUNK=4096
fi
# NAME CHUNK BATCH of every distillation run, in the order they run
CASES="fused-b4 $CHUNK 4
unfused-b4 0 4
fused-b16 $CHUNK 16
unfused-b8 0 8
fused-b8 $CHUNK 8"
echo "$CASES" > "$LOGS/cases.txt"

left() { echo $((DEADLINE - $(date +%s))); }
wanted() { [[ $ONLY == "  " || $ONLY == *" $1 "* ]]; }
# the case's CHUNK BATCH
case_of() { echo "$CASES" | awk -v name="$1" '$1 == name {print $2, $3}'; }

# step NAME ESTIMATE_S COMMAND...: runs COMMAND (output in $LOGS/NAME.log) if ESTIMATE_S seconds are left, for at
# most twice that; otherwise names it in skipped.txt. LIMIT is what it got.
step() {
  local name=$1 estimate=$2 remaining code
  shift 2
  wanted "$name" || return 0
  remaining=$(left)
  if ((remaining < estimate)); then
    echo "== $name: skipped, ${remaining} s left of the budget, needs about ${estimate} s"
    echo "$name" >> "$LOGS/skipped.txt"
    return 0
  fi
  echo "== [t+$(($(date +%s) - T0))s] $name (at most $(limit_for "$estimate") s)"
  local started=$(date +%s)
  timeout "$(limit_for "$estimate")" "$@" > "$LOGS/$name.log" 2>&1
  code=$?
  echo "$(($(date +%s) - started))" > "$LOGS/$name.seconds"
  echo "   exit $code"
  tail -n "${TAIL:-14}" "$LOGS/$name.log"
  return 0
}

# limit_for ESTIMATE_S: the seconds a step of that estimate gets now (twice it, at most what is left)
limit_for() {
  local remaining
  remaining=$(left)
  echo $((2 * $1 < remaining ? 2 * $1 : remaining))
}

# distill NAME ESTIMATE_S: bench/throughput.py's $RUNNER distilling $PRESET from $TEACHER (bf16) at the case's loss
# chunk and batch; the run's log and metrics.jsonl kept (its planned-vs-measured figures are in both), dynamo's
# recompiles logged (the teacher's no_grad forward and the loss's chunks may each add graphs: the log says why).
distill() {
  local name=$1 estimate=$2 chunk batch
  read -r chunk batch <<< "$(case_of "$name")"
  TORCH_LOGS=${TORCH_LOGS:-recompiles} TAIL=4 step "$name" "$estimate" python3 bench/throughput.py --preset "$PRESET" --seq-len "$SEQ" --batch "$batch" \
    --steps "$STEPS" --warmup "$WARMUP" --documents "$DOCUMENTS" --runners "$RUNNER" \
    --timeout "$(($(limit_for "$estimate") - 15))" --json "$LOGS/$name.json" --keep "$KEEP/$name" \
    --meshtron-set train.objective=distill "distill.teacher=$TEACHER" distill.teacher_dtype=bfloat16 \
    "train.loss_chunk_size=$chunk"
  local dir="$KEEP/$name/$RUNNER-$batch"
  cp "$dir/log.txt" "$LOGS/$name--run.log" 2> /dev/null
  cp "$dir/run/metrics.jsonl" "$LOGS/$name--metrics.jsonl" 2> /dev/null
  grep -h "planned vs measured\|distill from" "$dir/log.txt" 2> /dev/null | cut -c1-400
  rm -rf "$KEEP/$name"
}

# the planner's figures of every case, on the CPU while the GPU runs (plan-NAME.json: `meshtron plan --json`)
plans() {
  local name chunk batch
  while read -r name chunk batch; do
    python3 -m meshtron plan --model "$PRESET" --gpus 1 --gpu h200 --seq-len "$SEQ" --global-batch "$batch" \
      --objective distill --teacher "$TEACHER" --teacher-dtype bfloat16 --loss-chunk-size "$chunk" --json \
      > "$LOGS/plan-$name.json" 2> "$LOGS/plan-$name.err"
  done <<< "$CASES"
}

if wanted info; then
  nvidia-smi -L 2> /dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
fi
plans &
PLANS=$!

distill fused-b4 150
distill unfused-b4 130
TAIL=4 step queue 100 python3 bench/one_gpu_checks/gpu_queue.py --only distill --budget 190 --json "$LOGS/queue.json" \
  --out "$KEEP/queue"
find "$KEEP/queue" -type f \( -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.jsonl' \) -size -4M \
  2> /dev/null | while read -r file; do
  mkdir -p "$LOGS/queue-runs/$(dirname "${file#"$KEEP/queue/"}")"
  cp "$file" "$LOGS/queue-runs/${file#"$KEEP/queue/"}"
done
distill fused-b16 150
distill unfused-b8 130
distill fused-b8 130

wait "$PLANS"
python3 - "$LOGS" "$PRESET" "$TEACHER" "$SEQ" << 'EOF' | tee "$LOGS/table.md"
import json, sys
from pathlib import Path

logs, preset, teacher, seq = Path(sys.argv[1]), *sys.argv[2:]
GIB = 2**30


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def planned_by_cli(name, batch):
    """`meshtron plan`'s candidate of the run's own layout: one GPU, micro-batch = batch, no checkpointing."""
    plan = read_json(logs / f"plan-{name}.json") or {}
    for row in plan.get("candidates", []):
        if row["layout"]["micro_batch"] == batch and row["layout"]["activation_checkpointing"] == "none":
            return row
    return None


def planned_by_run(name):
    """The run's own planned figures (metrics.jsonl from its steady step) and its measured step time there."""
    try:
        rows = [json.loads(line) for line in (logs / f"{name}--metrics.jsonl").read_text().splitlines() if line]
    except OSError:
        return None
    rows = [row for row in rows if "planned_peak_gb" in row]
    return rows[-1] if rows else None


print(f"{preset} distilled from {teacher} (bf16), seq {seq}, one GPU; memory in GiB (2^30 bytes); (run): the run's "
      "own planned figures (metrics.jsonl), (plan): `meshtron plan --gpu h200`'s row of micro-batch = batch\n")
print("| run | loss | batch | tokens/s | MFU (student) | peak GiB | planned GiB (run) | planned GiB (plan) "
      "| teacher GiB (plan) | step s (planned) | loss first -> last |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
for line in (logs / "cases.txt").read_text().splitlines():
    name, chunk, batch = line.split()
    loss = f"fused, chunks of {chunk}" if int(chunk) else "unfused"
    result = ((read_json(logs / f"{name}.json") or {}).get("results") or [{"error": "not run"}])[0]
    plan, run = planned_by_cli(name, int(batch)), planned_by_run(name)
    cli = "n/a" if plan is None else f"{plan['memory_gb']['total'] * 1e9 / GIB:.2f}" + ("" if plan["fits"] else " (no fit)")
    teacher_gib = "n/a" if plan is None else f"{plan['memory_gb']['teacher'] * 1e9 / GIB:.2f}"
    planned_speed = "" if plan is None else f" (plan {plan['tokens_per_s']:,.0f})"
    if "tokens_per_s" not in result:
        status = result.get("error") or result.get("skipped") or "?"
        print(f"| {name} | {loss} | {batch} | {status[:80]}{planned_speed} | | | | {cli} | {teacher_gib} | | |")
        continue
    mfu = f"{result['mfu']:.1%}" if result.get("mfu") is not None else "n/a"
    own = "n/a" if run is None else f"{run['planned_peak_gb']:.2f}"
    step = "n/a" if run is None else f"{run['step_s']:.3f} ({run.get('planned_step_s', 'n/a')})"
    print(f"| {name} | {loss} | {batch} | {result['tokens_per_s']:,.0f}{planned_speed} | {mfu} | {result['peak_memory_gb']:.2f} "
          f"| {own} | {cli} | {teacher_gib} | {step} | {result['loss_first']:.3f} -> {result['loss_last']:.3f} |")
queue = read_json(logs / "queue.json")
for row in (queue or {}).get("checks", []):
    print(f"\nqueue `{row['name']}`: {row['status']} in {row['seconds']} s: {row['reason'] or row['figures']}")
EOF

echo "== [t+$(($(date +%s) - T0))s] done; skipped: $(cat "$LOGS/skipped.txt" 2> /dev/null | tr '\n' ' ')"
tar czf "$OUT/issue60.tgz" -C "$LOGS" .

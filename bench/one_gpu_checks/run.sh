#!/usr/bin/env bash
# Issue 43's one-GPU checks (BENCHMARKS.md, "Issue 43 on one H100"), from the repository root on a machine with one
# CUDA GPU: the GPU against the CPU, the rehearsal, an offloaded MoE rehearsal, the one-GPU parts of the
# NCCL-only fixes, then every layout's rehearsal. Each step has its own time limit; OUT (default /tmp/one-gpu) gets
# the logs.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/one-gpu}; mkdir -p "$OUT"
HERE=bench/one_gpu_checks
step() { echo "== $*"; }
step "meshtron check --nproc 1 (the GPU's one-process run against the CPU's)"
timeout 150 python3 -m meshtron check --nproc 1 2>&1 | tee "$OUT/check.log" | tail -6
step "finding 4: llama-8b TP8 rank 0 rehearsed at seq 8192 (finite losses, no skipped step)"
timeout 180 python3 -m meshtron train --rehearse --nproc 8 --model.preset=llama-8b --parallel.tp=8 --data.seq_len=8192 \
  --train.global_batch_size=1 --run.output_dir="$OUT/r8b" 2>&1 | tee "$OUT/r8b.log" | tail -12
step "finding 3: an FSDP2 cpu_offload rehearsal of deepseekv3-tiny on CUDA"
timeout 90 python3 -m meshtron train --rehearse --nproc 2 --rank 0 --parallel.dp_shard=2 --fsdp.cpu_offload=true \
  --model.preset=deepseekv3-tiny --data.seq_len=32 --data.max_documents=40 --train.global_batch_size=4 \
  --run.device=cuda --run.output_dir="$OUT/offload" 2>&1 | tail -3
step "findings 1 and 3"; timeout 60 python3 $HERE/rng_and_offload.py 2>&1 | tail -3
step "findings 6 and 10"; timeout 60 python3 $HERE/watchdog.py 2>&1 | tail -12
step "findings 7 and 8"; timeout 240 python3 $HERE/moe.py 2>&1 | grep -E "^(7|8) "
step "every layout rehearsed (bench/rehearse_layouts.py)"
python3 bench/rehearse_layouts.py --json "$OUT/rehearse.json" --output-dir "$OUT/rehearsals" "$@"

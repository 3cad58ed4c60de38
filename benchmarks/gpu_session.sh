#!/usr/bin/env bash
# One lent GPU, one run, under 10 minutes: the memory and step-time validation (v2 jobs,
# predictions made beforehand on the VM), then the time model's microbenchmarks. Everything
# goes under $OUT (the device tool brings it back); commit it to benchmarks/results/.
#
#   bash benchmarks/gpu_session.sh            # on the device: run(command="bash benchmarks/gpu_session.sh")
set -u
out=${OUT:-benchmarks/results/gpu_session}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
# 7 minutes of jobs at most (no job starts after the budget), then about 2 of microbenchmarks
OUT="$out" timeout 480 python3 benchmarks/gpu_validation.py --budget-s 400 \
    --predictions benchmarks/results/gpu_validation_v2_predictions.json > "$out/gpu_validation.log" 2>&1
echo "gpu_validation exit $?" >> "$out/gpu_validation.log"
timeout 150 python3 benchmarks/gpu_microbench.py "$out" > "$out/microbench.log" 2>&1
echo "microbench exit $?" >> "$out/microbench.log"
ls -la "$out"

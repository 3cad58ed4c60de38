#!/usr/bin/env bash
# The measure engine's CUDA paths through the CLI, on a real GPU: --emulate-gpu capping a
# big GPU to an L4's usable memory (a job that fits, a job that does not), and the
# batch-size search with the measure engine as its oracle beside the formula's answer.
#
#   bash benchmarks/gpu_cli_check.sh benchmarks/results/gpu_cli_check.txt
#
# Each command's output and exit status go to the file named (default: stdout).
out=${1:-/dev/stdout}
export COLUMNS=110 PYTHONUNBUFFERED=1
run() {
    echo "\$ vramplan $*"
    python3 -m vramplan "$@" 2>&1
    echo "exit status $?"
    echo
}
{
    python3 -c "import torch; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)"
    run measure qwen2.5-0.5b -b 2 -s 1024 --steps 2 --warmup 1 --emulate-gpu L4
    run measure qwen2.5-0.5b -b 16 -s 2048 --steps 1 --warmup 0 --emulate-gpu L4
    run search batch-size qwen2.5-0.5b -s 1024 --gpu L4 --engine measure --maximum 64
    run search batch-size qwen2.5-0.5b -s 1024 --gpu L4 --engine formula --maximum 64
} >"$out"

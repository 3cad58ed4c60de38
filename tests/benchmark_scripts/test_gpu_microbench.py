"""benchmarks/gpu_microbench.py runs end to end (on the CPU, tiny sizes) and writes its file."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_microbench.py"


def test_quick_cpu_run_writes_every_section(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--quick", "--device",
                           "cpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "microbench.json").read_text())
    assert data["machine"]["device"] == "cpu"
    gemm = [g for g in data["gemm"] if "tflops" in g]
    assert {g["dtype"] for g in gemm} >= {"fp32", "bf16"}
    for g in gemm:  # the rate is the GEMM's FLOPs over its measured time
        assert abs(g["tflops"] - 2 * g["m"] * g["n"] * g["k"] / g["seconds"] / 1e12) < 1e-9
    assert data["attention"][0]["tflops"] > 0
    assert data["bandwidth"]["copy_gb_s"] > 0 and data["launch"]["host_us_per_launch"] > 0
    lora = data["lora_vs_full"]
    assert {(r["attention"], r["lora"]) for r in lora} == {
        (a, lo) for a in ("eager", "sdpa") for lo in (False, True)}
    assert all(r["seconds"] > 0 and r["backward_top"] for r in lora)

"""Timing microbenchmarks for the performance model's factors, on one GPU in a few minutes.

What it measures (each a fact efficiency.toml can take, with this file as its source):
  * GEMM TFLOP/s by shape and dtype (bf16, fp16, fp32/TF32 off, fp8 where torch has
    torch._scaled_mm): square sizes and LLM-like shapes, small M and K, misaligned sizes;
    the GEMM shape model (planning/gemm.py) is refitted from these;
  * attention: torch SDPA forward + backward by head size, sequence length and mask, 16k
    tokens a call as the FlashAttention-3 paper sizes them (efficiency.toml
    [attention_shape]; benchmarks/attention_shape_check.py --microbench compares them),
    with SDPA's own kernel and with FlashAttention-2's and cuDNN's forced (CUDA);
  * HBM bandwidth: device-to-device copy and an elementwise add (STREAM-like);
  * host cost per kernel launch: a chain of tiny kernels, eager, timed on the host;
  * LoRA against full fine-tuning: one training step (forward, backward, no optimizer) of
    Llama-2-7B-shaped blocks (HF transformers + peft, LoRA r 8 on q_proj, v_proj, the
    model in 16-bit), by tokens, eager and SDPA attention, and the backward's top kernels
    under torch.profiler: published HF Trainer runs put LoRA's cost per token at full
    fine-tuning's on an A100 (docs/performance.md, optimum-benchmark), where the model
    gives it two thirds of the matmuls;
  * collectives, when several GPUs are visible and torch.distributed can start NCCL:
    all-reduce bus bandwidth by message size (run under torchrun; skipped on one GPU).

    python benchmarks/gpu_microbench.py OUT_DIR            # on a CUDA machine, < 10 min
    python benchmarks/gpu_microbench.py OUT_DIR --quick --device cpu   # the script works

It writes OUT_DIR/microbench.json (the machine, torch/CUDA versions and every figure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

from common import host_cpu  # benchmarks/common.py

GEMM_SHAPES = [  # (m, n, k): squares, LLM layers, small M / K, misaligned
    (4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 2048), (1024, 1024, 1024),
    (16384, 4096, 4096), (16384, 14336, 4096), (16384, 4096, 14336), (8192, 1024, 8192),
    (16384, 768, 768), (16384, 3072, 768), (512, 4096, 4096), (128, 4096, 4096),
    (16384, 16, 4096), (16384, 4096, 16), (4095, 4095, 4095), (4100, 4100, 4100),
]
# (head size, sequence, causal): the shapes of efficiency.toml [attention_shape], sized as the
# FlashAttention-3 paper sizes them (batch x sequence = 16k tokens, hidden 2048), and beyond
ATTENTION = [(64, 2048, True), (128, 512, True), (128, 1024, True), (128, 2048, True),
             (128, 2048, False), (128, 8192, True), (128, 32768, True), (256, 4096, True)]


def _timer(torch, device: str):
    def run(fn, repeat: int) -> float:
        fn()  # warm-up (and cuBLAS heuristics)
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(repeat):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    return run


def gemms(torch, device: str, quick: bool, run) -> list[dict]:
    dtypes = ["bf16", "fp16", "fp32"] + (["fp8"] if device == "cuda" and hasattr(
        torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9) else [])
    shapes = [(256, 256, 256), (128, 512, 64)] if quick else GEMM_SHAPES
    out = []
    for dtype in dtypes:
        for m, n, k in shapes:
            try:
                if dtype == "fp8":
                    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
                    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
                    one = torch.ones((), device=device)

                    def fn(a=a, b=b, one=one):
                        return torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                out_dtype=torch.bfloat16)
                else:
                    dt = {"bf16": torch.bfloat16, "fp16": torch.float16,
                          "fp32": torch.float32}[dtype]
                    a = torch.randn(m, k, device=device, dtype=dt)
                    b = torch.randn(k, n, device=device, dtype=dt)

                    def fn(a=a, b=b):
                        return a @ b
                seconds = run(fn, 3 if quick else 20)
                out.append({"dtype": dtype, "m": m, "n": n, "k": k, "seconds": seconds,
                            "tflops": 2 * m * n * k / seconds / 1e12})
            except (RuntimeError, TypeError) as error:  # a dtype or shape the device refuses
                out.append({"dtype": dtype, "m": m, "n": n, "k": k,
                            "error": str(error).splitlines()[0]})
    return out


def attention(torch, device: str, quick: bool, run) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = [(64, 128, True)] if quick else ATTENTION
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    # SDPA's own choice, then each fused kernel forced: FlashAttention-2 against cuDNN's is
    # efficiency.toml's cudnn_attention (a kernel the GPU lacks is recorded as an error)
    backends = ["default"] + (["FLASH_ATTENTION", "CUDNN_ATTENTION"] if device == "cuda"
                              else [])
    out = []
    for head, seq, causal in cases:
        heads = max(1, 2048 // head) if not quick else 2
        batch = max(1, 16384 // seq) if not quick else 1
        q, k, v = (torch.randn(batch, heads, seq, head, device=device, dtype=dt,
                               requires_grad=True) for _ in range(3))

        def fn(q=q, k=k, v=v, causal=causal):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            y.sum().backward()
        # the papers' count: forward 2 matmuls, backward 2.5x the forward, a causal mask half
        flops = 3.5 * 2 * 2 * batch * heads * seq * seq * head / (2 if causal else 1)
        for backend in backends:
            row = {"head_dim": head, "seq": seq, "heads": heads, "batch": batch,
                   "causal": causal, "backend": backend}
            try:
                with (sdpa_kernel(getattr(SDPBackend, backend)) if backend != "default"
                      else contextlib.nullcontext()):
                    seconds = run(fn, 3 if quick else 10)
                row.update(seconds=seconds, tflops=flops / seconds / 1e12)
            except RuntimeError as error:
                row["error"] = str(error).splitlines()[0]
            out.append(row)
    return out


def bandwidth(torch, device: str, quick: bool, run) -> dict:
    n = (1 << 20) if quick else (1 << 28)  # 1 Mi or 256 Mi fp32 elements (1 GiB)
    x = torch.empty(n, device=device)
    y = torch.empty(n, device=device)
    copy = run(lambda: y.copy_(x), 3 if quick else 20)
    add = run(lambda: torch.add(x, y, out=y), 3 if quick else 20)
    return {"bytes": 4 * n, "copy_gb_s": 2 * 4 * n / copy / 1e9,
            "add_gb_s": 3 * 4 * n / add / 1e9}


def launch(torch, device: str, quick: bool) -> dict:
    x = torch.zeros(16, device=device)
    count = 200 if quick else 5000
    for _ in range(100):
        x.add_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    host = (time.perf_counter() - start) / count
    if device == "cuda":
        torch.cuda.synchronize()
    return {"kernels": count, "host_us_per_launch": host * 1e6}


# Llama-2-7B's block shapes, a few blocks of them; (batch, seq) per case
LORA_BLOCKS = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                   num_key_value_heads=32, num_hidden_layers=4, vocab_size=32000)
LORA_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=4, num_hidden_layers=2, vocab_size=256)
LORA_CASES = [(4, 256), (16, 256)]


def lora_vs_full(torch, device: str, quick: bool, run) -> list[dict]:
    """Seconds of one forward + backward, full fine-tuning against LoRA, and the backward's
    five most expensive kernels (self device time) of each."""
    import peft
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    dt = torch.float16 if device == "cuda" else torch.float32
    out = []
    for attention in ("eager", "sdpa"):
        config = LlamaConfig(**(LORA_TINY if quick else LORA_BLOCKS),
                             attn_implementation=attention)
        for lora in (False, True):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).to(device=device, dtype=dt)
            if lora:
                model = peft.get_peft_model(model, peft.LoraConfig(
                    r=8, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                    task_type="CAUSAL_LM"))
            for batch, seq in ([(2, 16)] if quick else LORA_CASES):
                ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)

                def step(model=model, ids=ids):
                    model(input_ids=ids, labels=ids).loss.backward()
                    model.zero_grad(set_to_none=True)
                row = {"attention": attention, "lora": lora, "batch": batch, "seq": seq,
                       "dtype": str(dt).removeprefix("torch.")}
                try:
                    row["seconds"] = run(step, 2 if quick else 5)
                    loss = model(input_ids=ids, labels=ids).loss
                    activities = [ProfilerActivity.CPU] + (
                        [ProfilerActivity.CUDA] if device == "cuda" else [])
                    with profile(activities=activities) as prof:
                        loss.backward()
                    model.zero_grad(set_to_none=True)
                    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
                    top = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0),
                                 reverse=True)[:5]
                    row["backward_top"] = [{"name": e.key[:80], "us": getattr(e, key, 0),
                                            "calls": e.count} for e in top]
                except (RuntimeError, AttributeError) as error:
                    row["error"] = str(error).splitlines()[0]
                out.append(row)
            del model
    return out


def collectives(torch, quick: bool) -> dict | None:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    out = []
    for size in ([1 << 20] if quick else [1 << p for p in range(16, 31, 2)]):
        x = torch.ones(size // 2, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 10
        # nccl-tests' bus bandwidth for all-reduce: bytes x 2 (n - 1) / n / time
        out.append({"bytes": size, "seconds": seconds,
                    "bus_gb_s": size * 2 * (world - 1) / world / seconds / 1e9})
    dist.destroy_process_group()
    return {"world_size": world, "all_reduce": out} if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for microbench.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    run = _timer(torch, device)
    machine = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
               "host": platform.machine(), "host_cpu": host_cpu()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        machine.update(gpu=props.name, sms=props.multi_processor_count,
                       cuda=torch.version.cuda, capability=".".join(
                           map(str, torch.cuda.get_device_capability())))
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, as torch's default
    started = time.perf_counter()
    result = {"machine": machine, "gemm": gemms(torch, device, args.quick, run),
              "attention": attention(torch, device, args.quick, run),
              "bandwidth": bandwidth(torch, device, args.quick, run),
              "launch": launch(torch, device, args.quick),
              "lora_vs_full": lora_vs_full(torch, device, args.quick, run)}
    if device == "cuda":
        result["collectives"] = collectives(torch, args.quick)
    result["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "microbench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'microbench.json'} in {result['seconds']:.1f} s")


if __name__ == "__main__":
    main()

"""Trace engine: traced peaks against real CPU steps (torch.profiler allocator events), the
caching-allocator model, and the bad inputs the engine must refuse clearly."""

from __future__ import annotations

import ast
import os
import sys
import textwrap

import pytest

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module

from tiny_configs import BERT, GPT2, LLAMA, T5, VIT, WHISPER  # noqa: E402

from benchmarks.ground_truth import cpu_profiler_peak  # noqa: E402
from vramplan.engines.allocator import CachingAllocator  # noqa: E402
from vramplan.engines.memory_report import CATEGORIES  # noqa: E402
from vramplan.engines.trace import run_trace, trace  # noqa: E402
from vramplan.errors import EngineError, ModelConfigError  # noqa: E402
from vramplan.job import Job, Parallel, Peft  # noqa: E402

MiB = 2**20


def _job(**changes) -> Job:
    return Job(**{"model": "tiny", "batch_size": 2, "seq_len": 32, **changes})


# --- traced vs real (CPU) -----------------------------------------------------------------------

@pytest.mark.parametrize("config,changes", [
    (LLAMA, dict(precision="fp32")),
    (LLAMA, dict(precision="bf16-mixed", checkpointing="full")),
    (GPT2, dict(precision="bf16-mixed", attention="eager", optimizer="sgd-momentum")),
    (LLAMA, dict(precision="bf16-mixed", peft=Peft(rank=4))),
    (BERT, dict(precision="bf16-mixed", task="masked-lm", grad_accum=2)),
    (LLAMA, dict(precision="bf16-pure", optimizer="adamw-8bit")),
    # eager: with sdpa the trace keeps CUDA's memory-efficient kernel's tensors, which a
    # real CPU step (math kernel) cannot
    (T5, dict(precision="bf16-mixed", target_len=16, attention="eager")),
    (LLAMA, dict(precision="fp32", optimizer_in_backward=True)),
    (WHISPER, dict(precision="bf16-mixed", checkpointing="full")),
    # peft without a task type: its seq2seq wrapper would hand Whisper input_ids twice
    (WHISPER, dict(precision="bf16-mixed", peft=Peft(rank=4, dropout=0.0))),
    (LLAMA, dict(precision="bf16-mixed", checkpointing="selective")),
    # fp32 master weights made at the first step; fp32 gradient copies at every step
    (LLAMA, dict(precision="bf16-master")),
    (LLAMA, dict(precision="fp16-master", grad_accum=2, peft=Peft(rank=4))),
])
def test_traced_peak_matches_real_cpu_step(config, changes):
    job = _job(**changes)
    traced, _ = run_trace(job, model_config=config).peak(rounded=False)
    real = cpu_profiler_peak(job, model_config=config)
    assert abs(traced - real) / real <= 0.02, (traced, real)


def test_t5_sdpa_keeps_the_efficient_kernels_tensors_not_the_scores():
    # T5's trained position bias: CUDA runs sdpa with the memory-efficient kernel (checked on
    # an H200: benchmarks/results/gpu_validation.md); the CPU's math kernel would save the
    # softmax of the s x s scores, which the trace must not count
    def ops(attention):
        result = run_trace(_job(precision="bf16-mixed", target_len=16, attention=attention),
                           model_config=T5)
        return {record.op for _, record in result.events}, result.peak()[0]

    sdpa_ops, sdpa_peak = ops("sdpa")
    eager_ops, eager_peak = ops("eager")
    assert "_softmax" in eager_ops and "_softmax" not in sdpa_ops
    assert sdpa_peak <= eager_peak


def test_untraced_micro_batches_would_not_change_the_peak(monkeypatch):
    import vramplan.engines.trace as engine
    job = _job(precision="bf16-mixed", grad_accum=4, checkpointing="full")
    short = run_trace(job, model_config=LLAMA).peak()
    monkeypatch.setattr(engine, "MICRO_STEPS_TRACED", 4)
    monkeypatch.setattr(engine, "STEPS", 2)
    assert run_trace(job, model_config=LLAMA).peak()[0] == short[0]


# --- the report -----------------------------------------------------------------------------------

def test_report_categories_add_up_and_phases_are_named():
    report = trace(_job(precision="bf16-mixed", optimizer="adamw"), model_config=LLAMA)
    assert report.engine == "trace"
    assert set(report.categories) == set(CATEGORIES)
    # every parameter and buffer, fp32, each storage rounded to 512 B
    assert report.categories["weights"] >= 4 * report.params_total
    assert report.peak_allocated == max(report.phase_peaks.values())
    assert set(report.phase_peaks) == {"forward", "backward", "optimizer"}
    assert report.params_total == report.params_trainable > 0
    assert 0 < len(report.timeline) <= 2000
    assert report.top_modules and report.top_modules[0].bytes > 0
    # AdamW keeps two fp32 states per parameter after step 1
    assert report.categories["optimizer_states"] >= 2 * 4 * report.params_trainable
    assert report.categories["runtime_context"] == job_runtime_default()


def job_runtime_default() -> int:
    return Job().runtime.cuda_context_bytes


def test_config_file_and_folder_are_read_without_the_catalog(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(VIT))
    by_file = trace(_job(model=str(tmp_path / "config.json"), precision="fp32"))
    by_folder = trace(_job(model=str(tmp_path), precision="fp32"))
    assert by_file.categories == by_folder.categories
    assert by_file.tokens_per_step == 2  # vision: samples per step
    assert by_file.job.task is None and by_file.params_total > 0


def test_lora_and_qlora_shrink_trainable_state():
    full = trace(_job(precision="bf16-mixed"), model_config=LLAMA)
    lora = trace(_job(precision="bf16-mixed", peft=Peft(rank=4)), model_config=LLAMA)
    qlora = trace(_job(precision="bf16-mixed", peft=Peft(method="qlora", rank=4)),
                  model_config=LLAMA)
    assert lora.params_trainable < full.params_trainable / 10
    assert lora.categories["optimizer_states"] < full.categories["optimizer_states"] / 10
    assert qlora.categories["weights"] < lora.categories["weights"]
    assert any("QLoRA" in note for note in qlora.notes)


def test_8bit_adamw_states_are_a_quarter_of_fp32_states():
    wide = dict(LLAMA, hidden_size=128, intermediate_size=256)  # tensors >= 4096 values
    fp32 = trace(_job(optimizer="adamw"), model_config=wide)
    int8 = trace(_job(optimizer="adamw-8bit"), model_config=wide)
    ratio = int8.categories["optimizer_states"] / fp32.categories["optimizer_states"]
    assert 0.24 < ratio < 0.32


def test_fsdp_traces_one_rank_with_sharded_state():
    wide = dict(LLAMA, hidden_size=128, intermediate_size=256)
    one = trace(_job(precision="bf16-pure"), model_config=wide)
    four = trace(_job(precision="bf16-pure", parallel=Parallel(strategy="fsdp", num_gpus=4)),
                 model_config=wide)
    ratio = four.categories["optimizer_states"] / one.categories["optimizer_states"]
    assert 0.2 < ratio < 0.35, ratio
    assert four.per_gpu_of == 4 and any("fake process group of 4" in n for n in four.notes)
    ddp = trace(_job(precision="bf16-pure", parallel=Parallel(strategy="ddp", num_gpus=4)),
                model_config=wide)
    assert ddp.categories["weights"] == one.categories["weights"]
    assert any("gradient buckets" in n for n in ddp.notes)
    zero1 = trace(_job(precision="bf16-pure", parallel=Parallel(strategy="zero1", num_gpus=4)),
                  model_config=wide)
    assert zero1.categories["optimizer_states"] < one.categories["optimizer_states"] / 2
    with pytest.raises(EngineError, match="tensor or context parallelism"):
        trace(_job(parallel=Parallel(strategy="fsdp", num_gpus=4, tensor_parallel=2)),
              model_config=LLAMA)


# --- the allocator model --------------------------------------------------------------------------

def test_allocator_rounds_pools_and_reuses():
    alloc = CachingAllocator()
    alloc.malloc("a", 1)            # small pool: a 2 MiB segment
    assert alloc.allocated == 512 and alloc.reserved == 2 * MiB
    alloc.malloc("b", 3 * MiB)      # large request < 10 MiB: a 20 MiB segment, split
    assert alloc.reserved == 22 * MiB
    alloc.malloc("c", 5 * MiB)      # fits in the 17 MiB remainder
    assert alloc.reserved == 22 * MiB
    alloc.free("b")
    alloc.free("c")
    alloc.malloc("d", 15 * MiB)     # merged free blocks are reused
    assert alloc.reserved == 22 * MiB
    alloc.malloc("e", 11 * MiB + 1)  # >= 10 MiB: its own segment rounded to 2 MiB
    assert alloc.reserved == 22 * MiB + 12 * MiB
    # the 12 MiB block is not split (remainder <= 1 MiB): CUDA counts all of it allocated
    assert alloc.peak_allocated == 512 + 15 * MiB + 12 * MiB


# --- bad input ------------------------------------------------------------------------------------

@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "vp_user_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self, data_dependent=False):
                super().__init__()
                self.conv = nn.Conv2d(3, 8, 3, padding=1)
                self.fc = nn.Linear(8, 10)
                self.data_dependent = data_dependent

            def forward(self, x):
                h = self.conv(x).relu()
                if self.data_dependent:
                    h = h[h > 0]  # output size depends on values
                    return h.sum()
                return self.fc(h.mean((2, 3)))

        def cnn():
            return {"model": Net(), "input_shapes": {"x": (3, 16, 16)}}

        def mlp():
            net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
            return {"model": net, "input_shapes": (32,)}

        def cnn_with_batch():
            return Net(), lambda batch, device: torch.randn(batch, 3, 16, 16, device=device)

        def masked():
            return {"model": Net(data_dependent=True), "input_shapes": (3, 16, 16)}

        def raises():
            raise RuntimeError("checkpoint not found")

        def not_a_module():
            return 42

        def exits():
            import sys
            sys.exit(3)

        def slow():
            import time
            class Slow(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(8, 8)
                def forward(self, x):
                    for _ in range(10**7):
                        x = x + 1
                    return self.fc(x)
            return {"model": Slow(), "input_shapes": (8,)}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "vp_user_models"
    sys.modules.pop("vp_user_models", None)


def test_factory_models_are_traced(user_module):
    for name in ("cnn", "cnn_with_batch"):
        report = trace(_job(model=f"{user_module}:{name}", precision="fp32"))
        assert report.params_total == 8 * 3 * 9 + 8 + 8 * 10 + 10
        assert report.categories["activations"] > 0
    # CPU convolutions and bf16 matmuls use oneDNN scratch buffers that dispatch never sees,
    # so the real-step comparison uses an fp32 MLP
    job = _job(model=f"{user_module}:mlp", precision="fp32", batch_size=64)
    traced, _ = run_trace(job).peak(rounded=False)
    assert abs(traced - cpu_profiler_peak(job)) / traced <= 0.02


def test_compile_of_a_model_without_transformer_blocks_is_refused(user_module):
    with pytest.raises(EngineError, match="has none: drop compile"):
        trace(_job(model=f"{user_module}:mlp", precision="fp32", compile=True))


def test_factory_that_cannot_be_imported():
    with pytest.raises(ModelConfigError, match="cannot load factory"):
        trace(_job(model="vp_no_such_module:build"))


def test_factory_that_raises(user_module):
    with pytest.raises(ModelConfigError, match="raised RuntimeError: checkpoint not found"):
        trace(_job(model=f"{user_module}:raises"))


def test_factory_that_calls_sys_exit(user_module):
    # vramplan ended silently with the factory's exit code 3
    with pytest.raises(ModelConfigError, match=r"called sys.exit\(3\)"):
        trace(_job(model=f"{user_module}:exits"))


def test_factory_that_returns_no_module(user_module):
    with pytest.raises(ModelConfigError, match="returned int, not a torch.nn.Module"):
        trace(_job(model=f"{user_module}:not_a_module"))


def test_data_dependent_op_names_the_op_and_suggests_formula(user_module):
    with pytest.raises(EngineError, match=r"op aten\.\w+.*--engine formula"):
        trace(_job(model=f"{user_module}:masked", precision="fp32"))


def test_time_limit_stops_the_trace(user_module):
    with pytest.raises(EngineError, match="time limit of 0.5 s"):
        trace(_job(model=f"{user_module}:slow", precision="fp32"), time_limit_s=0.5)


def test_unknown_lora_targets_list_the_linears():
    with pytest.raises(ModelConfigError, match="c_attn"):
        trace(_job(peft=Peft(rank=4)), model_config=GPT2)


def test_import_vramplan_does_not_import_torch():
    import subprocess
    code = "import sys, vramplan.job, vramplan.engines; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_trace_restores_every_patch_and_leaves_no_warning_filters():
    import warnings

    import torch.nn.functional as F
    job = Job(model="tiny", batch_size=1, seq_len=16, precision="bf16-mixed")
    run_trace(job, model_config=LLAMA)  # libraries imported on first use add their filters
    before = (F.dropout, F.scaled_dot_product_attention, list(warnings.filters))
    run_trace(job, model_config=LLAMA)
    run_trace(job, model_config=LLAMA)
    assert (F.dropout, F.scaled_dot_product_attention, list(warnings.filters)) == before


def test_two_traces_in_threads_give_the_same_answer_as_one():
    from concurrent.futures import ThreadPoolExecutor

    import vramplan
    job = Job(model="tiny", batch_size=2, seq_len=16, precision="bf16-mixed")
    alone = trace(job, model_config=LLAMA).peak_allocated
    with ThreadPoolExecutor(3) as pool:
        traced = [pool.submit(trace, job, model_config=LLAMA) for _ in range(2)]
        estimated = pool.submit(vramplan.estimate, Job(model="gpt2"))  # no lock needed
        assert [f.result().peak_allocated for f in traced] == [alone, alone]
        assert estimated.result().peak_allocated > 0


def test_a_compiled_job_traced_first_in_a_process_gives_the_later_traces_answer():
    # the CLI traces a job in a fresh process, the web server's worker after other jobs: a
    # reference cycle the collector found at a moment that depends on the process's past
    # held Llama's position ids (seq_len x 8 bytes) past their use in all but the first
    import subprocess
    code = textwrap.dedent("""
        from tiny_configs import LLAMA
        from vramplan.engines.trace import trace
        from vramplan.job import Job
        job = Job(model="x", batch_size=1, seq_len=128, compile=True,
                  compile_components="blocks")
        print([trace(job, model_config=LLAMA).peak_allocated for _ in range(2)])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    first, second = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert first == second


def test_reserved_memory_never_exceeds_the_gpus_capacity():
    from vramplan.engines.runtime import runtime_context_bytes
    from vramplan.hardware import get_gpu
    job = _job(batch_size=8, seq_len=64, precision="fp32")
    free = trace(job, model_config=LLAMA)
    # a made-up GPU just big enough for the allocated peak: the replay must release its
    # cache instead of reserving past the device
    l4 = get_gpu("L4")
    context = runtime_context_bytes(job.runtime, l4)
    tight = l4.usable_bytes - context - free.peak_allocated - 1024
    capped = trace(job.with_changes(gpu="L4", runtime={"cuda_context_bytes": context + tight}),
                   model_config=LLAMA)
    capacity = l4.usable_bytes - capped.categories["runtime_context"]
    assert free.peak_reserved > capacity >= capped.peak_reserved >= capped.peak_allocated


def test_flash_attn_kernels_trace_as_sdpa_and_say_so():
    """flash-attn and cuDNN's kernels are CUDA's: the trace runs SDPA in their place (they
    keep the same tensors) and its report says so."""
    sdpa = run_trace(_job(precision="bf16-mixed"), model_config=LLAMA)
    flash = run_trace(_job(precision="bf16-mixed", attention="flash-attn-2"), model_config=LLAMA)
    assert flash.peak() == sdpa.peak()
    assert any("flash-attn-2: run as SDPA here" in n for n in flash.notes)
    assert not any("run as SDPA" in n for n in sdpa.notes)

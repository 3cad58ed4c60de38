"""Real low-bit kernels vs stand-ins: which one a run picks (training/kernels.py), the real
QLoRA build on the CPU, and each stand-in's tensor layout against the library's CPU path.
The library tests skip where bitsandbytes / torchao are not installed."""

from __future__ import annotations

import math
import sys
import types
import warnings

import pytest
import torch
from torch import nn

from vramplan.errors import EngineError
from vramplan.job import Job
from vramplan.training import kernels as kernels_mod
from vramplan.training.kernels import STAND_IN, Kernels, select_kernels

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module


QLORA_8BIT = Job(model="tiny", batch_size=2, seq_len=32, optimizer="adamw-8bit",
                 peft={"method": "qlora", "rank": 8})
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}


def _missing(*names):
    real = kernels_mod.library_version
    return lambda name: None if name in names else real(name)


# --- selection ---------------------------------------------------------------------------------

def test_cpu_runs_the_stand_ins_and_records_versions():
    k = select_kernels(QLORA_8BIT, torch.device("cpu"))
    assert (k.qlora, k.optimizer, k.fp8) == (STAND_IN, STAND_IN, "")
    assert not k.real and k.libraries["torch"] == torch.__version__
    assert "stand-ins" in k.note()


def test_a_job_without_low_bit_pieces_needs_no_library(monkeypatch):
    monkeypatch.setattr(kernels_mod, "library_version", _missing("bitsandbytes", "torchao"))
    k = select_kernels(Job(model="tiny"), "cuda")
    assert (k.qlora, k.optimizer, k.fp8, k.note()) == ("", "", "", "")


@pytest.mark.parametrize("fields, package, what", [
    (dict(peft={"method": "qlora"}, optimizer="adamw"), "bitsandbytes", "QLoRA's 4-bit base"),
    (dict(optimizer="paged-adamw-8bit"), "bitsandbytes", "optimizer paged-adamw-8bit"),
    (dict(optimizer="paged-adamw"), "bitsandbytes", "optimizer paged-adamw"),
    (dict(optimizer="adamw-4bit"), "torchao", "optimizer adamw-4bit"),
    (dict(optimizer="adamw-fp8"), "torchao", "optimizer adamw-fp8"),
    (dict(precision="fp8"), "torchao", "fp8 training"),
])
def test_a_missing_library_on_cuda_names_the_package(monkeypatch, fields, package, what):
    monkeypatch.setattr(kernels_mod, "library_version", _missing("bitsandbytes", "torchao"))
    with pytest.raises(EngineError) as error:
        select_kernels(Job(model="tiny", **fields), torch.device("cuda", 0))
    message = str(error.value)
    assert "\n" not in message
    assert f"{what} needs the {package} package on cuda: pip install {package}" in message
    assert "--engine trace still works" in message


def test_fake_libraries_are_picked_and_their_versions_recorded(monkeypatch):
    for name, version in (("bitsandbytes", "9.8.7"), ("torchao", "0.99.0")):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(__version__=version))
    job = Job(model="tiny", precision="fp8", optimizer="adamw-4bit")
    k = select_kernels(job, "cuda")
    assert (k.qlora, k.optimizer, k.fp8) == ("", "torchao", "torchao") and k.real
    assert k.libraries["torchao"] == "0.99.0" and "bitsandbytes" not in k.libraries
    k = select_kernels(QLORA_8BIT, "cuda")
    assert (k.qlora, k.optimizer) == ("bitsandbytes", "bitsandbytes")
    assert k.libraries["bitsandbytes"] == "9.8.7"
    assert k.note() == ("library kernels are real kernels: QLoRA base: bitsandbytes, "
                        "optimizer: bitsandbytes")


@pytest.mark.parametrize("attention, package, install, implementation", [
    ("flash-attn-2", "flash_attn", "pip install flash-attn", "flash_attention_2"),
    ("flash-attn-3", "flash_attn_interface", "build flash-attn-3", "flash_attention_3"),
])
def test_flash_attn_jobs_run_the_package_on_cuda_and_sdpa_elsewhere(
        monkeypatch, attention, package, install, implementation):
    from vramplan.training import hf_model

    job = Job(model="tiny", precision="bf16-mixed", attention=attention)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels_mod, "library_version", _missing(package))
        with pytest.raises(EngineError, match=f"attention {attention} needs the {package} "
                           f"package on cuda: {install}"):
            select_kernels(job, "cuda")
    asked = []
    auto = types.SimpleNamespace(from_config=lambda config, attn_implementation, dtype: (
        asked.append(attn_implementation) or nn.Linear(1, 1)))
    config = types.SimpleNamespace(model_type="llama")
    monkeypatch.setitem(sys.modules, package, types.SimpleNamespace(__version__="9.9"))
    for device, wanted in (("cuda", implementation), ("cpu", "sdpa")):
        kernels, notes = select_kernels(job, device), []
        hf_model._from_config(auto, config, job, torch.bfloat16, "causal-lm", notes,
                              torch.device("meta"), kernels)
        assert asked.pop() == wanted
        assert any("run as SDPA here" in n for n in notes) == (device == "cpu")
    assert select_kernels(job, "cuda").attention == package
    assert select_kernels(job, "cpu").attention == STAND_IN


def test_a_library_that_fails_to_import_counts_as_missing(monkeypatch):
    import importlib

    def broken(name):
        raise RuntimeError("libcudart.so not found")  # bitsandbytes without its binaries
    monkeypatch.setattr(importlib, "import_module", broken)
    assert kernels_mod.library_version("bitsandbytes") is None


def test_measure_on_cuda_refuses_before_building_when_a_library_is_missing(monkeypatch):
    from vramplan.engines import measure as measure_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels_mod, "library_version", _missing("bitsandbytes"))

    def must_not_build(*args, **kwargs):
        raise AssertionError("built the model before checking the libraries")
    monkeypatch.setattr(measure_mod, "build_training_setup", must_not_build)
    with pytest.raises(EngineError, match="pip install bitsandbytes"):
        measure_mod.measure(QLORA_8BIT, device="cuda")


def test_measure_passes_the_real_kernels_on_cuda(monkeypatch):
    from vramplan.engines import measure as measure_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.SimpleNamespace(__version__="1.2.3"))
    seen = {}

    def capture(job, device, model_config=None, kernels=None):
        seen.update(device=device, kernels=kernels)
        raise EngineError("stop here")
    monkeypatch.setattr(measure_mod, "build_training_setup", capture)
    with pytest.raises(EngineError, match="stop here"):
        measure_mod.measure(QLORA_8BIT, device="cuda")
    assert seen["kernels"].qlora == "bitsandbytes" and seen["kernels"].optimizer == "bitsandbytes"
    assert seen["kernels"].libraries["bitsandbytes"] == "1.2.3"


# --- the real libraries on the CPU ---------------------------------------------------------------


def _bnb():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("bitsandbytes")


def _nbytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            n += t.untyped_storage().nbytes()
    return n


def test_real_qlora_builds_layer_by_layer_and_trains_on_the_cpu():
    _bnb()
    from vramplan.engines.measure import measure_setup, tensor_bytes
    from vramplan.training.real_kernels import quant_state_tensors
    from vramplan.training.setup import build_training_setup

    job = QLORA_8BIT
    real = build_training_setup(job, "cpu", model_config=TINY_LLAMA,
                                kernels=select_kernels(job, "cpu", real=True))
    stand_in = build_training_setup(job, "cpu", model_config=TINY_LLAMA)
    bases = [m for m in real.model.modules() if type(m).__name__ == "Linear4bit"
             and type(m).__module__.startswith("bitsandbytes")]
    assert len(bases) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    wrapped = [m for m in real.model.modules() if type(m).__module__ == "peft.tuners.lora.bnb"]
    assert len(wrapped) == 2 * 4  # the default targets q, k, v, o: peft's bnb LoRA layers
    assert not any(type(m) is nn.Linear and m.weight.dtype == torch.bfloat16
                   and m.weight.shape[0] != 512 for m in real.model.modules())  # no 16-bit base
    assert real.params_total == stand_in.params_total
    assert real.params_trainable == stand_in.params_trainable
    # the real rotary buffers, not uninitialised memory: 1 / 10000^(2i / head_dim 16)
    inv_freq = real.model.base_model.model.model.rotary_emb.inv_freq
    assert torch.allclose(inv_freq, 1 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    # weights: 14 packed weights of 64x64..64x128 plus their quant states, counted
    sizes = tensor_bytes(real)
    params = _nbytes([*real.model.parameters(), *real.model.buffers()])
    assert sizes["weights"] == params + _nbytes(quant_state_tensors(real.model))
    report = measure_setup(real, job, steps=1, warmup=1)
    assert report.measured.complete and all(math.isfinite(x) for x in report.measured.losses)


def test_nf4_weight_layout_matches_bitsandbytes():
    bnb = _bnb()
    from vramplan.training.emulate.lowbit import Packed4bitLinear
    from vramplan.training.real_kernels import quant_state_tensors

    for double_quant in (False, True):
        layer = bnb.nn.Linear4bit(256, 512, bias=False, compress_statistics=double_quant,
                                  quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(torch.randn(512, 256, dtype=torch.bfloat16),
                                         requires_grad=False, compress_statistics=double_quant,
                                         quant_type="nf4")
        layer = layer.to("cpu")
        state = layer.weight.quant_state
        stand_in = Packed4bitLinear(nn.Linear(256, 512, bias=False), double_quant)
        # codes: 512 * 256 / 2 bytes in both
        assert layer.weight.untyped_storage().nbytes() == stand_in.packed.nbytes == 65_536
        # absmax per 64 values: 2048 fp32, or uint8 + 8 fp32 (one per 256 absmax)
        assert state.absmax.nbytes == stand_in.absmax.nbytes == (2048 if double_quant else 8192)
        if double_quant:
            assert state.state2.absmax.nbytes == stand_in.absmax2.nbytes == 32
        # what the stand-in leaves out: the 16-entry fp32 NF4 code map, and with double
        # quantisation the 256-entry fp32 map of the absmax codes + an fp32 offset (1092 B)
        real = layer.weight.untyped_storage().nbytes() + _nbytes(quant_state_tensors(layer))
        stand = sum(p.nbytes for p in stand_in.parameters())
        assert real - stand == (64 + 1024 + 4 if double_quant else 64)


def test_adamw_8bit_state_layout_matches_bitsandbytes():
    bnb = _bnb()
    from vramplan.training.emulate.lowbit import AdamW8bit
    from vramplan.training.real_kernels import tensor_leaves

    def states(cls):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(4000))]
        opt = cls(params, lr=1e-3)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        return [{k: (v.dtype, v.nbytes) for k, v in opt.state[p].items()
                 if isinstance(v, torch.Tensor) and not k.startswith("qmap")} for p in params], \
            _nbytes(tensor_leaves(list(opt.state.values())))

    (real, real_total), (ours, ours_total) = states(bnb.optim.AdamW8bit), states(AdamW8bit)
    # 8192 values: uint8 codes + one fp32 absmax per 256 for each state
    assert real[0] == ours[0] == {"state1": (torch.uint8, 8192), "state2": (torch.uint8, 8192),
                                  "absmax1": (torch.float32, 128),
                                  "absmax2": (torch.float32, 128)}
    # under 4096 values: fp32 states (bitsandbytes names them state1/state2)
    assert list(real[1].values()) == list(ours[1].values()) == [(torch.float32, 16000)] * 2
    # bitsandbytes' two 256-entry fp32 quantisation maps, shared by every parameter
    assert real_total - ours_total == 2 * 256 * 4


@pytest.mark.parametrize("kind", ["4bit", "fp8", "8bit"])
def test_torchao_low_bit_state_layout_matches(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optim = pytest.importorskip("torchao.optim")
    from vramplan.engines.optimizer_states import state_bytes as formula_bytes
    from vramplan.training.emulate.torchao_optim import LowBitAdamW
    from vramplan.training.real_kernels import tensor_leaves

    def state_bytes(make):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(100))]
        opt = make(params)
        for p in params:
            p.grad = torch.randn_like(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        return [sorted((str(t.dtype), t.nbytes) for t in tensor_leaves(
            {k: v for k, v in opt.state[p].items() if k != "step"})) for p in params]

    cls = {"4bit": optim.AdamW4bit, "fp8": optim.AdamWFp8, "8bit": optim.AdamW8bit}[kind]
    real = state_bytes(cls)
    ours = state_bytes(lambda ps: LowBitAdamW(ps, kind=kind))
    assert real == ours
    if kind == "4bit":  # 8192 values: 4096 B of codes, 64 fp32 scales (block 128), 16-entry map
        assert real[0] == sorted([("torch.uint8", 4096), ("torch.float32", 256),
                                  ("torch.float32", 64)] * 2)
    elif kind == "fp8":  # float8 codes, one fp32 scale per 256
        assert real[0] == sorted([("torch.float8_e4m3fn", 8192), ("torch.float32", 128)] * 2)
    else:  # uint8 codes, one fp32 scale per 256, a 256-entry fp32 map
        assert real[0] == sorted([("torch.uint8", 8192), ("torch.float32", 128),
                                  ("torch.float32", 1024)] * 2)
    assert real[1] == [("torch.float32", 400)] * 2  # too small: plain states
    # the formula's per-tensor layout is the same bytes
    name = {"4bit": "adamw-4bit", "fp8": "adamw-fp8", "8bit": "adamw-8bit-torchao"}[kind]
    assert formula_bytes(name, 8192, 4) == (sum(n for _, n in real[0]), 0.0)
    assert formula_bytes(name, 100, 4) == (800, 0.0)


def test_the_trace_runs_torchao_float8_only_in_compiled_blocks(monkeypatch):
    compiled = Job(model="tiny", precision="fp8", compile=True, optimizer="adamw-8bit")
    k = kernels_mod.trace_kernels(compiled)
    assert (k.fp8, k.optimizer, k.qlora) == ("torchao", STAND_IN, "")
    assert k.note() == ("library kernels: optimizer: stand-in, fp8: torchao (the stand-ins "
                        "keep the libraries' tensor layout)")
    assert kernels_mod.trace_kernels(Job(model="tiny", precision="fp8")) is None
    assert kernels_mod.trace_kernels(Job(model="tiny", compile=True)) is None
    monkeypatch.setattr(kernels_mod, "library_version", _missing("torchao"))
    with pytest.raises(EngineError, match="pip install torchao, or use --engine formula"):
        kernels_mod.trace_kernels(compiled)


def test_kernels_default_is_all_stand_in_free():
    assert Kernels().note() == "" and Kernels().real


def test_real_fp8_converts_the_block_linears_with_torchao():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchao.float8")
    from vramplan.training.setup import build_training_setup

    job = Job(model="tiny", batch_size=2, seq_len=32, precision="fp8")
    setup = build_training_setup(job, "cpu", model_config=TINY_LLAMA,
                                 kernels=select_kernels(job, "cpu", real=True))
    converted = [m for m in setup.model.modules() if type(m).__name__ == "Float8Linear"]
    assert len(converted) == 2 * 7  # every block linear; the 512-wide head stays nn.Linear
    assert type(setup.model.get_output_embeddings()) is nn.Linear
    assert any("torchao Float8Linear" in note for note in setup.notes)


@pytest.mark.parametrize("real", [False, True])
def test_measure_counts_low_bit_states_held_in_dicts_and_tensor_subclasses(real):
    if real:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pytest.importorskip("torchao.optim")
    from vramplan.engines.measure import tensor_bytes
    from vramplan.training.setup import build_training_setup, train_step

    job = Job(model="tiny", batch_size=2, seq_len=32, optimizer="adamw-4bit", peft={"rank": 8})
    setup = build_training_setup(job, "cpu", model_config=TINY_LLAMA,
                                 kernels=select_kernels(job, "cpu", real=real))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_step(setup, 1)
    # LoRA rank 8 on q, k, v, o of 2 layers: per layer q 8x64 + 64x8, k and v 8x64 + 32x8,
    # o 8x64 + 64x8 = 3584 values; every tensor is under 4096 values, so both states are
    # plain fp32: 2 x 7168 x 4 B. torchao also keeps a 4-byte step tensor per parameter (16).
    assert setup.params_trainable == 7168
    assert tensor_bytes(setup)["optimizer_states"] == 2 * 7168 * 4 + (16 * 4 if real else 0)


def test_paged_states_are_unified_memory_not_optimizer_states():
    from vramplan.engines.measure import tensor_bytes
    from vramplan.training.setup import TrainingSetup

    model = nn.Linear(256, 256, bias=False)
    opt = torch.optim.SGD(model.parameters())
    paged, plain = torch.zeros(65536, dtype=torch.uint8), torch.zeros(256, dtype=torch.float32)
    paged.is_paged = True  # what bitsandbytes' get_paged sets on cudaMallocManaged buffers
    opt.state[model.weight] = {"state1": paged, "absmax1": plain, "step": 1}
    setup = TrainingSetup(model, opt, lambda: {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
                          lambda m, b: m(b), None, torch.device("cpu"), "linear")
    sizes = tensor_bytes(setup)
    assert (sizes["optimizer_states"], sizes["unified_memory"]) == (1024, 65536)


def test_measure_with_the_real_kernels_on_the_cpu_records_them():
    _bnb()
    from vramplan.engines.measure import measure

    job = QLORA_8BIT
    real = measure(job, steps=1, warmup=1, device="cpu", model_config=TINY_LLAMA,
                   real_kernels=True)
    stand_in = measure(job, steps=1, warmup=1, device="cpu", model_config=TINY_LLAMA)
    import bitsandbytes

    assert real.measured.complete
    assert real.measured.libraries["bitsandbytes"] == bitsandbytes.__version__
    assert real.measured.kernels.startswith("library kernels are real kernels")
    assert stand_in.measured.kernels.startswith("library kernels are vramplan's stand-ins")
    assert "bitsandbytes" not in stand_in.measured.libraries
    # the same tensors but bitsandbytes' code maps: 14 double-quantised weights x (16 + 256
    # fp32 map entries + an fp32 offset) = 14 x 1092 B
    assert real.categories["weights"] - stand_in.categories["weights"] == 14 * 1092
    # optimizer states: every LoRA tensor is under 4096 values, so fp32 states in both and
    # no 8-bit tensor for which bitsandbytes would make its code maps
    assert real.categories["optimizer_states"] == stand_in.categories["optimizer_states"]

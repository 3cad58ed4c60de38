"""Efficiency factors per GPU architecture (efficiency.toml beside this file)."""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vramplan.errors import JobError
from vramplan.fit import attention_problem
from vramplan.hardware import get_gpu
from vramplan.hardware.gpu import GPU
from vramplan.planning.gemm import GemmModel

# The most of its datasheet peak a GPU's tensor cores may reach: GeForce cards boost past
# their datasheet clock (the RTX 3090 measures 1.08x, efficiency.toml [gpu_ceilings]).
MAX_OF_PEAK = 1.5


class Factors(BaseModel):
    """What a training step reaches of the datasheet peaks (see efficiency.toml)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    matmul: float = Field(gt=0, le=MAX_OF_PEAK)
    attention: float = Field(gt=0, le=MAX_OF_PEAK)
    memory: float = Field(gt=0, le=1)
    kernel_us: float = Field(ge=0)
    module_us: float = Field(0.0, ge=0)  # host time per nn.Module call
    collective: float = Field(gt=0, le=1)
    overlap: float = Field(ge=0, le=1)
    host_link: float = Field(gt=0, le=1)  # of the GPU's host link (gpus.toml host_link_gb_s)
    cpu_adam_params_per_s: float = Field(gt=0)
    # the 80% interval's (low, high) multipliers of a predicted time: efficiency.toml's,
    # unless `vramplan calibrate` measured a narrower one on the user's own GPU
    interval: tuple[float, float] | None = None
    source: str = ""  # which table (architecture, measured or assumed) they came from
    calibrated: bool = False  # fitted on the user's own runs (vramplan calibrate)


def architecture_of(gpu: GPU) -> str:
    """The architecture family of a GPU, from its compute capability (NVIDIA) or name."""
    if gpu.vendor == "amd":
        return "cdna2" if "250" in gpu.name else "cdna3"
    cc = gpu.compute_capability
    if cc == "8.9":
        return "ada"
    return {"7.0": "volta", "7.5": "turing"}.get(cc) or {
        "8": "ampere", "9": "hopper", "10": "blackwell", "12": "blackwell"}.get(
        cc.split(".")[0], "unknown")


@functools.lru_cache(maxsize=1)
def _data() -> dict:
    path = resources.files("vramplan.planning").joinpath("efficiency.toml")
    return tomllib.loads(path.read_text())


def _table() -> dict[str, dict]:
    return _data()["architectures"]


def gemm_model(peak_per_sm: float | None = None) -> GemmModel:
    """The GEMM shape model's constants ([gemm] of efficiency.toml). A tile's fixed work
    (loading its first operands, writing its result) takes about the same time on a faster
    SM, whose steps of K are shorter: given the dense peak per SM (FLOP/s) of the GPU and
    dtype, k0 grows with it over the reference GPU's bf16 (gemm_shape_fit.py checks it on
    the B200's bf16 and fp8 shapes). It is not lowered for slower SMs: no shape table
    measures them, and lowered, the published runs we collected were predicted worse
    (measured ad hoc; docs/performance.md)."""
    g = _data()["gemm"]
    k0 = float(g["k0"])
    if peak_per_sm:
        k0 *= max(1.0, peak_per_sm / _reference_peak_per_sm())
    return GemmModel(k0=k0, overhead_us=float(g["overhead_us"]))


@functools.lru_cache(maxsize=1)
def _reference_peak_per_sm() -> float:
    """The dense bf16 peak per SM of the GPU the [gemm] constants were measured on."""
    gpu = get_gpu(_data()["gemm"]["reference_gpu"])
    return gpu.tflops["bf16"] * 1e12 / sm_count(gpu)


# the three 80% intervals ([interval] of efficiency.toml), each from its own published rows
INTERVAL_BUCKETS = ("single_gpu", "multi_gpu", "multi_gpu_other")


def interval_bucket(num_gpus: int, decoder: bool, adapters: bool) -> str:
    """Which interval a job's times carry. Several GPUs have two: a decoder training its own
    weights is what the multi-GPU shares were fitted on (LLM pre-training); anything else
    (an encoder, adapters on a frozen or quantised base) is not, and its published runs
    miss by more (benchmarks/published_accuracy.py)."""
    if num_gpus == 1:
        return "single_gpu"
    return "multi_gpu" if decoder and not adapters else "multi_gpu_other"


def takes_single_gpu_shares(bucket: str) -> bool:
    """Whether a job of `bucket` (interval_bucket) runs at the single-GPU shares
    ([training_single_gpu]). The multi-GPU shares are fitted on LLM pre-training (a decoder
    training its own weights on 8-6144 GPUs); an encoder or adapters fine-tuned on several
    GPUs is nearer one GPU's rates (their published rows, out of sample: docs/performance.md
    'The step from one GPU to two'), and it carries its own interval too."""
    return bucket != "multi_gpu"


def interval(bucket: str) -> tuple[float, float]:
    """(low, high) multipliers of a predicted time that hold the measured one 80% of the
    time, for a job of `bucket` (interval_bucket)."""
    iv = _data()["interval"]
    return math.exp(iv[f"{bucket}_log_low"]), math.exp(iv[f"{bucket}_log_high"])


def nvlink_mesh_max_gpus() -> int:
    """The largest NVLink node without an NVSwitch: a full mesh ([topology])."""
    return int(_data()["topology"]["nvlink_mesh_max_gpus"])


@functools.lru_cache(maxsize=1)
def nccl_latency() -> dict[str, float]:
    """NCCL's ring and tree latencies per call and per step, in seconds ([nccl])."""
    return {k[:-3]: float(v) * 1e-6 for k, v in _data()["nccl"].items() if k.endswith("_us")}


def sac_host_scale() -> float:
    """How many times a plain eager forward's host time a block's forward and recompute take
    under torch's selective activation checkpointing policy ([selective_checkpointing])."""
    return float(_data()["selective_checkpointing"]["host_scale"])


def nvls_all_reduce_speedup(architecture: str) -> float:
    """How much faster than a ring an all-reduce runs under NCCL's NVLS inside a switched
    node of `architecture` ([nvls_all_reduce]); 1 where none is known."""
    return float(_data()["nvls_all_reduce"].get(architecture, 1.0))


@functools.lru_cache(maxsize=1)
def cpu_adam_loop_share() -> float:
    """torch's for-loop AdamW on CPU tensors, as a share of the vectorised CPU rate
    ([cpu_adam])."""
    return float(_data()["cpu_adam"]["loop_share"])


@functools.lru_cache(maxsize=1)
def collective_calls() -> dict[str, float]:
    """Bucket sizes that set how many NCCL calls a gradient collective takes
    ([collective_calls]): DDP's in bytes, ZeRO's in elements."""
    c = _data()["collective_calls"]
    return {"ddp_bucket_bytes": float(c["ddp_bucket_mib"]) * 2**20,
            "zero_bucket_elements": float(c["zero_bucket_elements"])}


def attention_shape_table() -> dict:
    """Fused attention kernels' measured rates by sequence length, head size and mask
    ([attention_shape]; planning/attention_shape.py reads them)."""
    return _data()["attention_shape"]


def sm_count(gpu: GPU) -> int | None:
    """Streaming multiprocessors of `gpu` ([sm_count]); None when not listed."""
    return _data()["sm_count"].get(gpu.name)


def fp8_ratio(gpu: GPU) -> float:
    """How much less of its fp8 peak than of its bf16 peak the architecture's best matmul
    reaches (mamf_fp8 / mamf; 1 where fp8 was not measured)."""
    row = _lender(gpu)
    return row.get("mamf_fp8", row["mamf"]) / row["mamf"]


def gpu_ceiling(gpu_name: str, table: str = "gpu_ceilings") -> float | None:
    """The GPU's measured matmul ceiling / its dense peak ([gpu_ceilings], or the fp32 one
    of [gpu_fp32_ceilings]), if any: its own, or that of the sibling it names."""
    rows = _data()[table]
    value = rows.get(gpu_name)
    return rows[value] if isinstance(value, str) else value


def _lender(gpu: GPU) -> dict:
    """The [architectures] row whose ceilings the GPU's architecture uses."""
    data = _data()
    arch = architecture_of(gpu)
    return data["architectures"][arch if arch in data["architectures"]
                                 else data["borrowed"].get(arch, "hopper")]


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """The fused attention kernel a job runs on a GPU, and its speed beside
    FlashAttention-2's (efficiency.toml `flash`, what the attention factor is a share of)."""

    name: str
    speedup: float = 1.0
    note: str = ""  # why, where it is not FlashAttention-2 at its own rate


FLASH_2 = "FlashAttention-2"
CUDNN = "cuDNN's fused attention"


def attention_kernel(attention: str, gpu: GPU) -> AttentionKernel:
    """Which kernel the job's fused `attention` (job.Attention, not eager) runs on `gpu` and
    how fast, from its architecture's measurements (cudnn_attention, flash_attn_3)."""
    problem = attention_problem(attention, gpu)
    if problem:  # the fit table says the job cannot run there; a time is still asked for
        return AttentionKernel(FLASH_2, note=f"{problem}; timed at FlashAttention-2's rate")
    row = _lender(gpu) if gpu.vendor == "nvidia" else {}
    cc = gpu.compute_capability
    cudnn = row.get("cudnn_attention")
    if attention == "sdpa":
        # torch's SDPA takes cuDNN's kernel first on compute capability 9.0 and 10.0 only
        # (sdp_utils.cpp check_prefer_cudnn_attention); FlashAttention-2 elsewhere
        if cudnn and cc in ("9.0", "10.0"):
            return AttentionKernel(CUDNN, cudnn, f"SDPA runs cuDNN's attention on {gpu.name} "
                                   f"(torch takes it first on compute capability {cc}): "
                                   f"{cudnn:g}x FlashAttention-2's rate")
        return AttentionKernel(FLASH_2)
    if attention in ("cudnn", "flash-attn-3"):
        name, speedup = ((CUDNN, cudnn) if attention == "cudnn"
                         else ("FlashAttention-3", row.get("flash_attn_3")))
        if speedup:
            return AttentionKernel(name, speedup, f"{name}: {speedup:g}x FlashAttention-2's "
                                   "rate")
        return AttentionKernel(name, note=f"{name} was not measured on "
                               f"{architecture_of(gpu).capitalize()}: timed at "
                               "FlashAttention-2's rate")
    return AttentionKernel(FLASH_2)  # flash-attn-2


def fp32_ratio(gpu: GPU) -> tuple[float, str]:
    """An fp32 matmul's share of the fp32 (CUDA-core) peak over the share of the tensor-core
    peak the matmul factor stands for, and whose measurement it is: the GPU's own
    ([gpu_fp32_ceilings]), its architecture flagship's, or none (1: the 16-bit share kept)."""
    row = _lender(gpu)
    tensor = gpu_ceiling(gpu.name) or row["mamf"]
    own = gpu_ceiling(gpu.name, "gpu_fp32_ceilings")
    fp32 = own if own is not None else row.get("mamf_fp32")
    if fp32 is None:
        return 1.0, (f"no fp32 matmul rate measured for {gpu.name} or its architecture: "
                     "the 16-bit matmuls' share of the peak")
    sibling = _data()["gpu_fp32_ceilings"].get(gpu.name)
    whose = (f"the {sibling} (the same chip)" if isinstance(sibling, str) else gpu.name
             ) if own is not None else f"its architecture's flagship ({gpu.name}: not measured)"
    return fp32 / tensor, (f"{fp32:.0%} of the fp32 peak, as torch.mm measures on {whose} "
                           "(efficiency.toml, gpu_fp32_ceilings)")


def ceiling_sibling(gpu_name: str) -> str | None:
    """The GPU whose measured ceiling `gpu_name` takes (the same chip and peak), if any."""
    value = _data()["gpu_ceilings"].get(gpu_name)
    return value if isinstance(value, str) else None


def shipped_factors(arch: str, training: dict | None = None, *,
                    single_gpu: bool = False, gpu: str | None = None) -> Factors:
    """The factors of an architecture: its measured matmul ceiling (or the one it borrows;
    `gpu`'s own, where it has one) times the training shares of efficiency.toml (a
    single-GPU job's own where it has them; `training`, when fitting)."""
    data = _data()
    table = data["architectures"]
    lender = arch if arch in table else data["borrowed"].get(arch, "hopper")
    own = data["training_single_gpu"] if single_gpu else {}
    shares = {**{k: v for k, v in data["training"].items() if k != "sources"},
              **{k: v for k, v in own.items() if k != "sources"}, **(training or {})}
    row = table[lender]
    own_ceiling = gpu_ceiling(gpu) if gpu else None
    ceiling = row["mamf"] if own_ceiling is None else own_ceiling
    matmul = min(max(1.0, ceiling), ceiling * shares.pop("matmul_share"))
    flash_from = lender if "flash" in row else data["borrowed_flash"].get(lender, "hopper")
    # a GPU's own ceiling scales its attention rate as well (efficiency.toml [gpu_ceilings])
    flash = table[flash_from]["flash"] * ceiling / row["mamf"]
    attention = min(1.0, flash * shares.pop("attention_share"))
    fitted = "shares fitted on published runs (efficiency.toml)"
    if own_ceiling is not None:
        sibling = ceiling_sibling(gpu)
        whose = (f"the {sibling}'s measured matmul ceiling (the same chip and peak)" if sibling
                 else "its own measured matmul ceiling")
        source = (f"{gpu}: {whose}; {fitted}; attention rate "
                  f"{flash_from.capitalize()}'s, scaled by that ceiling")
    elif lender == arch:
        source = f"{arch}: measured matmul ceiling; {fitted}"
    else:
        source = (f"{arch}: no measured matmul ceiling; {lender.capitalize()}'s borrowed "
                  "(efficiency.toml)")
    if own_ceiling is None and flash_from != lender:
        source += f"; attention rate borrowed from {flash_from.capitalize()}"
    if single_gpu and training is None:
        source += "; single-GPU shares"
    return Factors(matmul=matmul, attention=attention, **shares, source=source)


@functools.lru_cache(maxsize=1)
def _user_tables(path: str, mtime: float) -> dict[str, dict]:
    return read_user_factors(Path(path))


def clear_cache() -> None:
    _user_tables.cache_clear()


# factors calibrate stores but does not fit, added after its first tables were written
# (host_link replaced host_link_gb_s on 2026-12-07): an older table takes the shipped ones
ADDED_FACTORS = ("host_link",)


def _calibrated(gpu: GPU) -> Factors | None:
    """Factors `vramplan calibrate` stored for this GPU in the user's config folder."""
    path = user_file()
    if not path.is_file():
        return None
    values = _user_tables(str(path), path.stat().st_mtime).get(gpu.name)
    if not values:
        return None
    try:  # a hand-edited or older file must not break every estimate on this GPU
        fields = {k: v for k, v in values.items()
                  if k in Factors.model_fields and k != "calibrated"}
        numbers = [v for k, v in fields.items()
                   if k not in ("source", "interval")] + list(values.get("interval") or [])
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
            raise ValueError("a factor that is not a finite number")
        # factors added since calibrate first wrote its tables: an older table lacks them
        lacking = [k for k in ADDED_FACTORS if k not in fields]
        if lacking:
            shipped = factors_for(gpu, calibrated=False)
            fields |= {k: getattr(shipped, k) for k in lacking}
        return Factors(**fields, calibrated=True)
    except (ValidationError, ValueError, TypeError) as error:
        problem = ("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in
                             error.errors()[:3]) if isinstance(error, ValidationError)
                   else str(error))[:160]
        return _ignored(gpu, f"{path}: the table for {gpu.name} is invalid ({problem}) and "
                             "was ignored; run vramplan calibrate again")


def _ignored(gpu: GPU, note: str) -> Factors:
    base = factors_for(gpu, calibrated=False)
    return base.model_copy(update={"source": f"{base.source}; {note}"})


def factors_for(gpu: GPU, *, calibrated: bool = True, num_gpus: int = 2,
                decoder: bool = True, adapters: bool = False) -> Factors:
    """The factors calibrated on the user's own runs of `gpu` if any (and `calibrated`);
    else those of its architecture, or of the architecture it borrows from, for a job on
    `num_gpus` of them training a `decoder` (or an encoder) with or without `adapters` (one
    GPU, and an encoder or adapters on several, take the single-GPU shares), and `source`
    says which."""
    own = _calibrated(gpu) if calibrated else None
    if own is not None:
        return own
    single = takes_single_gpu_shares(interval_bucket(num_gpus, decoder, adapters))
    return shipped_factors(architecture_of(gpu), single_gpu=single, gpu=gpu.name)


# ------------------------------------------------------------ the user's calibration store
# `vramplan calibrate` writes, per GPU, the factors fitted on the user's runs here; they
# live with the shipped factors so that reading them needs nothing above this module.
USER_FILE = "efficiency.toml"


def user_file() -> Path:
    """The user's efficiency.toml in their config folder."""
    from vramplan.config import user_config_dir

    return user_config_dir() / USER_FILE


def read_user_factors(path: Path | None = None) -> dict[str, dict]:
    path = path or user_file()
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text()).get("gpus", {})
    except tomllib.TOMLDecodeError as error:
        raise JobError(f"{path}: not valid TOML ({error}); delete it and calibrate again") \
            from None

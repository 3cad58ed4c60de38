"""Which kernels a step runs: the real libraries (bitsandbytes, torchao) or our stand-ins.

`measure` on CUDA runs what the user will run: bitsandbytes Linear4bit for QLoRA and its
8-bit and paged optimizers, torchao's low-bit optimizers and float8 training. The trace
(fake tensors) and CPU runs keep the stand-ins of training/emulate/, which hold the same
tensors (tests/training/test_kernels.py checks their layouts against the libraries' CPU paths).

    kernels = select_kernels(job, torch.device("cuda"))   # EngineError if a library is missing
    kernels.qlora, kernels.optimizer, kernels.fp8           # "bitsandbytes", "torchao", ...
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace

from vramplan.errors import EngineError
from vramplan.job import COMPILED_MXFP8_REFUSED, Job

STAND_IN = "stand-in"
BNB, TORCHAO = "bitsandbytes", "torchao"  # import name = pip package name for both
FLASH_ATTN_2, FLASH_ATTN_3 = "flash_attn", "flash_attn_interface"  # import names
# the flash-attn package's kernels, by the job's attention: (import name, transformers'
# attn_implementation, what to install; transformers 5.24 utils/import_utils.py
# is_flash_attn_2_available / is_flash_attn_3_available)
FLASH_ATTN = {"flash-attn-2": (FLASH_ATTN_2, "flash_attention_2", "pip install flash-attn"),
              "flash-attn-3": (FLASH_ATTN_3, "flash_attention_3",
                               "build flash-attn-3 from the flash-attention repository's "
                               "hopper/ directory")}
BNB_OPTIMIZERS = ("adamw-8bit", "paged-adamw-8bit", "paged-adamw")
TORCHAO_OPTIMIZERS = ("adamw-4bit", "adamw-fp8", "adamw-8bit-torchao")
ALWAYS_RECORDED = ("torch", "transformers", "peft")


@dataclass(frozen=True)
class Kernels:
    """The implementation of each low-bit piece of a job ("" where the job has none)."""

    qlora: str = ""      # the 4-bit frozen base: bitsandbytes or stand-in
    optimizer: str = ""  # low-bit / paged optimizer: bitsandbytes, torchao or stand-in
    fp8: str = ""        # float8 training: torchao or stand-in
    attention: str = ""  # the flash-attn package (flash-attn-2 / -3 jobs), or stand-in: SDPA
    libraries: dict[str, str] = field(default_factory=dict)  # import name -> version

    @property
    def real(self) -> bool:
        return STAND_IN not in (self.qlora, self.optimizer, self.fp8, self.attention)

    def note(self) -> str:
        parts = [f"{what}: {how}" for what, how in (
            ("QLoRA base", self.qlora), ("optimizer", self.optimizer), ("fp8", self.fp8),
            ("attention", self.attention)) if how]
        if not parts:
            return ""
        if self.real:
            return "library kernels are real kernels: " + ", ".join(parts)
        if {self.qlora, self.optimizer, self.fp8, self.attention} <= {STAND_IN, ""}:
            return ("library kernels are vramplan's stand-ins (same tensor layout): "
                    + ", ".join(parts))
        return ("library kernels: " + ", ".join(parts)
                + " (the stand-ins keep the libraries' tensor layout)")


def needed_libraries(job: Job) -> dict[str, str]:
    """What of the job needs a library: {piece: import name}."""
    needs = {}
    if job.peft is not None and job.peft.method == "qlora":
        needs["qlora"] = BNB
    if job.optimizer in BNB_OPTIMIZERS:
        needs["optimizer"] = BNB
    elif job.optimizer in TORCHAO_OPTIMIZERS:
        needs["optimizer"] = TORCHAO
    if job.precision == "fp8":
        needs["fp8"] = TORCHAO
    if job.attention in FLASH_ATTN:
        needs["attention"] = FLASH_ATTN[job.attention][0]
    return needs


_WHY = {"qlora": "QLoRA's 4-bit base", "optimizer": "optimizer {optimizer}",
        "fp8": "fp8 training", "attention": "attention {attention}"}


def select_kernels(job: Job, device, real: bool | None = None) -> Kernels:
    """Real libraries on CUDA (or when `real` says so), stand-ins elsewhere. A library the
    job needs but the machine lacks is an EngineError naming the package to install."""
    kind = getattr(device, "type", str(device).split(":")[0])
    real = kind == "cuda" if real is None else real
    needs = needed_libraries(job)
    if not real:
        return Kernels(**dict.fromkeys(needs, STAND_IN),
                       libraries=_versions(ALWAYS_RECORDED))
    for piece, library in needs.items():
        if library_version(library) is None:
            why = _WHY[piece].format(optimizer=job.optimizer, attention=job.attention)
            install = (FLASH_ATTN[job.attention][2] if piece == "attention"
                       else f"pip install {library}")
            raise EngineError(f"{why} needs the {library} package on {kind}: {install} "
                              "(--engine trace still works without it)")
    return Kernels(**needs, libraries=_versions((*ALWAYS_RECORDED, *sorted(set(needs.values())))))


def trace_kernels(job: Job) -> Kernels | None:
    """What the trace runs (fake tensors): the stand-ins (None), but torchao's own
    Float8Linear in compiled blocks. Its float8 casts run on fake tensors, and Inductor's
    partitioner recomputes them in backward; the stand-ins' casts are custom autograd
    functions it cannot see into, so they would save other tensors."""
    if not (job.compiles_blocks and job.precision == "fp8"):
        return None
    if job.fp8.recipe == "mxfp8":
        raise EngineError(COMPILED_MXFP8_REFUSED)
    if library_version(TORCHAO) is None:
        raise EngineError("the trace runs compiled fp8 blocks with torchao's Float8Linear: "
                          "pip install torchao, or use --engine formula")
    return replace(select_kernels(job, "cpu"), fp8=TORCHAO,
                   libraries=_versions((*ALWAYS_RECORDED, TORCHAO)))


def library_version(name: str) -> str | None:
    """The installed version of a library, None when it cannot be imported (bitsandbytes
    can fail at import time without its CUDA binaries: that counts as missing too)."""
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure means we cannot use it
        return None
    return str(getattr(module, "__version__", "unknown"))


def _versions(names) -> dict[str, str]:
    return {name: version for name in names if (version := library_version(name)) is not None}

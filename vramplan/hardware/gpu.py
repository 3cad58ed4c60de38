"""GPU: one catalog entry. The data and their sources live in gpus.toml beside this file."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPU:
    name: str                    # short catalog name, e.g. "H100-SXM"
    vendor: str                  # "nvidia" | "amd"
    memory_bytes: int            # nominal (datasheet) memory in bytes; the marketed "80 GB" of DRAM is 80 GiB
    usable_bytes: int            # what the driver reports as total (nvidia-smi / rocm-smi)
    memory_type: str             # "HBM3", "GDDR6", ...
    bandwidth_bytes_s: float     # memory bandwidth, bytes/s
    tflops: dict[str, float]     # dense TFLOP/s per dtype: fp32, tf32, fp16, bf16, fp8 (missing = unsupported)
    interconnect_bytes_s: float  # per-GPU GPU-to-GPU bandwidth, ONE direction (NVLink / Infinity Fabric / PCIe), bytes/s
    interconnect: str            # "NVLink 4", "PCIe 4.0 x16", ...
    compute_capability: str      # "9.0" for Hopper; "" for AMD
    price_per_hour: float | None  # typical on-demand USD per GPU-hour
    price_date: str              # when the price was read, YYYY-MM-DD
    aliases: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)  # fact -> URL / document
    usable_estimated: bool = False  # usable_bytes derived by a rule (see notes), not a reported figure
    price_provider: str = ""     # where price_per_hour was read (cloud, instance type, region)
    notes: str = ""
    # a server of the usual kind (sources["node"]): collectives inside it use the
    # interconnect, between servers the network (bytes/s per GPU, one direction)
    gpus_per_node: int = 8
    network_bytes_s: float = 12.5e9              # caveats: ECC, per-GCD devices, how an estimate was made

"""GPU: one catalog entry, and GpuEntry: the same entry as written in gpus.toml (units as
the datasheets print them), validated by pydantic. The data and sources live in gpus.toml."""

from __future__ import annotations

import datetime as _dt
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

Vendor = Literal["nvidia", "amd", "intel"]
Dtype = Literal["fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "fp6", "fp4", "int8"]
NonEmpty = Annotated[str, Field(min_length=1)]


class GPU(BaseModel):
    """One GPU as the engines use it: bytes and bytes/s, dense TFLOP/s per dtype."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str                    # short catalog name, e.g. "H100-SXM"
    vendor: Vendor
    memory_bytes: int            # nominal memory; the marketed "80 GB" of DRAM is 80 GiB
    usable_bytes: int            # what the driver reports as total (nvidia-smi / rocm-smi)
    memory_type: str             # "HBM3", "GDDR6", ...
    bandwidth_bytes_s: float     # memory bandwidth
    tflops: dict[str, float]     # dense TFLOP/s per dtype (missing = unsupported)
    interconnect_bytes_s: float  # GPU-to-GPU bandwidth per GPU, one direction
    interconnect: str            # "NVLink 4", "PCIe 4.0 x16", ...
    compute_capability: str      # "9.0" for Hopper; "" for AMD
    price_per_hour: float | None  # typical on-demand USD per GPU-hour
    price_date: str              # when the price was read, YYYY-MM-DD
    aliases: tuple[str, ...] = ()
    sources: dict[str, str] = Field(default_factory=dict)  # fact -> URL / document
    usable_estimated: bool = False  # usable_bytes derived by a rule (see notes)
    price_provider: str = ""     # where price_per_hour was read (cloud, instance, region)
    notes: str = ""              # caveats: ECC, per-GCD devices, how an estimate was made
    # a server of the usual kind (sources["node"]): collectives inside it use the
    # interconnect, between servers the network (bytes/s per GPU, one direction)
    gpus_per_node: int = 8
    network_bytes_s: float = 12.5e9
    # peer-to-peer access between its GPUs in a node; False (GeForce): NCCL stages every
    # exchange through host memory, and interconnect_bytes_s is that rate
    p2p: bool = True
    # GPU counts of the on-demand instances price_provider rents; () when not known
    rentable_gpus: tuple[int, ...] = ()
    # the link to CPU memory that offloading copies over (datasheet rate, one direction)
    host_link: str = "PCIe 4.0 x16"
    host_link_bytes_s: float = 31.5e9
    # cards sold in NVLink-bridged pairs (H100 NVL): the bridge to the one partner, one
    # direction; a group of two neighbouring GPUs exchanges over it, any larger group over
    # interconnect_bytes_s (PCIe). None: no such bridge
    pair_link_bytes_s: float | None = None


class GpuEntry(BaseModel):
    """A [gpus.NAME] table of gpus.toml; the units are described at the top of that file."""

    model_config = ConfigDict(extra="forbid")

    vendor: Vendor
    memory: ByteSize
    usable: ByteSize
    usable_estimated: bool = False
    memory_type: NonEmpty
    bandwidth_gb_s: PositiveFloat
    interconnect: NonEmpty
    interconnect_gb_s: PositiveFloat
    gpus_per_node: PositiveInt = 8        # GPUs in one server of the usual kind
    network_gb_s: PositiveFloat = 12.5    # per GPU between nodes, one direction
    p2p: bool = True                      # peer-to-peer access inside a node (not GeForce)
    rentable_gpus: list[PositiveInt] = Field(default_factory=list)  # on-demand instance sizes
    host_link: NonEmpty = "PCIe 4.0 x16"  # the link to CPU memory
    host_link_gb_s: PositiveFloat = 31.5  # its datasheet rate, one direction
    pair_link_gb_s: PositiveFloat | None = None  # NVLink bridge to a pair partner, one direction
    compute_capability: str = ""
    price_per_hour: PositiveFloat | None = None
    price_date: _dt.date
    price_provider: str = ""
    aliases: list[NonEmpty] = Field(default_factory=list)
    notes: str = ""
    tflops: dict[Dtype, PositiveFloat] = Field(min_length=1)
    sources: dict[str, str] = Field(default_factory=dict)

    @field_validator("vendor", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("memory", "usable", mode="before")
    @classmethod
    def _positive_size(cls, value: object) -> object:
        if isinstance(value, bool) or (isinstance(value, (int, float)) and value <= 0):
            raise ValueError("must be a size with a unit, e.g. \"80 GiB\", or a number of "
                             "bytes above 0")
        return value

    @model_validator(mode="after")
    def _usable_within_memory(self) -> GpuEntry:
        if self.usable > self.memory:
            raise ValueError(f"usable ({self.usable.human_readable()}) is more than memory "
                             f"({self.memory.human_readable()}); memory is the nominal size, "
                             "usable what the driver reports")
        return self

    def gpu(self, name: str) -> GPU:
        return GPU(
            name=name, vendor=self.vendor, memory_bytes=int(self.memory),
            usable_bytes=int(self.usable), memory_type=self.memory_type,
            bandwidth_bytes_s=self.bandwidth_gb_s * 1e9, tflops=dict(self.tflops),
            interconnect_bytes_s=self.interconnect_gb_s * 1e9, interconnect=self.interconnect,
            compute_capability=self.compute_capability, price_per_hour=self.price_per_hour,
            price_date=self.price_date.isoformat(), aliases=tuple(self.aliases),
            sources=dict(self.sources), usable_estimated=self.usable_estimated,
            price_provider=self.price_provider, notes=self.notes,
            gpus_per_node=self.gpus_per_node, network_bytes_s=self.network_gb_s * 1e9,
            p2p=self.p2p, host_link=self.host_link,
            host_link_bytes_s=self.host_link_gb_s * 1e9,
            pair_link_bytes_s=self.pair_link_gb_s * 1e9 if self.pair_link_gb_s else None,
            rentable_gpus=tuple(self.rentable_gpus))

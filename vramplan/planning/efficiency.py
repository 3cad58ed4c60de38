"""Efficiency factors per GPU architecture (efficiency.toml beside this file)."""

from __future__ import annotations

import functools
import math
import tomllib
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vramplan.hardware.gpu import GPU


class Factors(BaseModel):
    """What a training step reaches of the datasheet peaks (see efficiency.toml)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    matmul: float = Field(gt=0, le=1)
    attention: float = Field(gt=0, le=1)
    memory: float = Field(gt=0, le=1)
    kernel_us: float = Field(ge=0)
    module_us: float = Field(0.0, ge=0)  # host time per nn.Module call
    collective: float = Field(gt=0, le=1)
    overlap: float = Field(ge=0, le=1)
    host_link_gb_s: float = Field(gt=0)
    cpu_adam_params_per_s: float = Field(gt=0)
    source: str = ""  # which table (architecture, measured or assumed) they came from


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
def _table() -> dict[str, dict]:
    path = resources.files("vramplan.planning").joinpath("efficiency.toml")
    return tomllib.loads(path.read_text())["architectures"]


@functools.lru_cache(maxsize=1)
def _user_tables(path: str, mtime: float) -> dict[str, dict]:
    from pathlib import Path

    from vramplan.planning.calibrate import read_user_factors

    return read_user_factors(Path(path))


def clear_cache() -> None:
    _user_tables.cache_clear()


def _calibrated(gpu: GPU) -> Factors | None:
    """Factors `vramplan calibrate` stored for this GPU in the user's config folder."""
    from vramplan.planning.calibrate import user_file

    path = user_file()
    if not path.is_file():
        return None
    values = _user_tables(str(path), path.stat().st_mtime).get(gpu.name)
    if not values:
        return None
    try:  # a hand-edited or older file must not break every estimate on this GPU
        numbers = [v for k, v in values.items() if k in Factors.model_fields and k != "source"]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
            raise ValueError("a factor that is not a finite number")
        return Factors(**{k: v for k, v in values.items() if k in Factors.model_fields})
    except (ValidationError, ValueError, TypeError) as error:
        problem = ("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in
                             error.errors()[:3]) if isinstance(error, ValidationError)
                   else str(error))[:160]
        return _ignored(gpu, f"{path}: the table for {gpu.name} is invalid ({problem}) and "
                             "was ignored; run vramplan calibrate again")


def _ignored(gpu: GPU, note: str) -> Factors:
    base = factors_for(gpu, calibrated=False)
    return base.model_copy(update={"source": f"{base.source}; {note}"})


def factors_for(gpu: GPU, *, calibrated: bool = True) -> Factors:
    """The factors calibrated on the user's own runs of `gpu` if any (and `calibrated`);
    else those of its architecture; Hopper's (our only measured one) otherwise, and
    `source` says which."""
    own = _calibrated(gpu) if calibrated else None
    if own is not None:
        return own
    table = _table()
    arch = architecture_of(gpu)
    if arch in table:
        values, source = table[arch], f"{arch}: measured (efficiency.toml)"
    else:
        values = table["hopper"]
        source = f"{arch}: not measured; Hopper's factors (efficiency.toml)"
    return Factors(**{k: v for k, v in values.items() if k != "sources"}, source=source)

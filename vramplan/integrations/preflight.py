"""preflight: before the first step, estimate the live model with the live training
arguments, compare with the device, and warn or stop with the fix.

    import vramplan
    result = vramplan.preflight(model, training_args, seq_len=2048, on_oom_risk="warn")
    result.fits, result.message, result.fix   # fix: the TrainingArguments keys to change

The model is read from its config (`model.config.to_dict()`, a PEFT model's `peft_config`,
a bitsandbytes 4-bit base), the arguments through the TrainingArguments reader of
`vramplan.frameworks.configs` (a dict works too); the formula engine does the estimate, so
this costs milliseconds and never touches the model's weights. The device is the `gpu`
named (a catalog name), else the CUDA device this process sees, else none (no verdict).
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.runtime import SAFETY_MARGIN
from vramplan.errors import JobError, VramplanError
from vramplan.job import Job

GiB = 2**30
OnOomRisk = Literal["warn", "stop", "ignore"]


class OomRisk(VramplanError):
    """The job is predicted not to fit the device (on_oom_risk="stop")."""


class OomRiskWarning(UserWarning):
    """The job is predicted not to fit the device (on_oom_risk="warn")."""


@dataclass(frozen=True)
class PreflightResult:
    job: Job                 # as estimated (its model: a config folder that is gone after)
    report: MemoryReport     # the formula's report, with the fit on the device
    gpu: str | None          # the catalog GPU checked against
    fits: bool | None        # None: no device to check against
    fix: str | None          # make-it-fit's first fix, as TrainingArguments keys
    message: str


def preflight(model: Any, args: Any, *, seq_len: int | None = None, gpu: str | None = None,
              margin: float = SAFETY_MARGIN, on_oom_risk: OnOomRisk = "warn",
              world_size: int | None = None) -> PreflightResult:
    """Estimate `model` trained with `args` (TrainingArguments or its dict) on this device;
    warn (OomRiskWarning) or raise OomRisk with the fix when it is predicted not to fit."""
    if on_oom_risk not in ("warn", "stop", "ignore"):
        raise JobError(f"on_oom_risk must be 'warn', 'stop' or 'ignore', not {on_oom_risk!r}")
    from vramplan.engines.registry import run_engine
    from vramplan.frameworks.configs import read_config_text

    data = _args_dict(args)
    peft = _peft_config(model)
    if peft is not None:
        data["peft_config"] = peft
        data["load_in_4bit"] = _is_4bit(model) or None
    device = _device_gpu(gpu)
    with tempfile.TemporaryDirectory(prefix="vramplan-preflight-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(_model_config(model)))
        read = read_config_text(json.dumps(data), path=Path("TrainingArguments.json"),
                                format="hf-trainer", model=folder)
        changes: dict[str, Any] = {"gpu": device}
        if seq_len is not None:
            changes["seq_len"] = seq_len
        processes = world_size or int(getattr(args, "world_size", 1) or 1)
        if processes > 1:
            strategy = read.data.get("parallel", {}).get("strategy", "ddp")
            changes["parallel"] = {"num_gpus": processes, "strategy": strategy}
        job = read.job(**changes)
        report = run_engine(job, "formula")
        fits, fix = None, None
        if device is not None:
            fit = report.fits[0]
            fits = fit.supported and fit.required_bytes <= (1 - margin) * fit.usable_bytes
            if not fits:
                fix = _fix(read, job, margin)
    message = _message(report, device, fits, fix, margin)
    if fits is False and on_oom_risk == "stop":
        raise OomRisk(message)
    if fits is False and on_oom_risk == "warn":
        warnings.warn(message, OomRiskWarning, stacklevel=2)
    return PreflightResult(job=job, report=report, gpu=device, fits=fits, fix=fix,
                           message=message)


def _fix(read, job: Job, margin: float) -> str | None:
    from vramplan.frameworks.configs.write import config_changes
    from vramplan.hardware import get_gpu
    from vramplan.planning.make_fit import make_it_fit
    from vramplan.planning.techniques import ALLOW_NAMES

    fixes = make_it_fit(job, get_gpu(job.gpu), margin=margin, allow=ALLOW_NAMES, limit=10)
    for fix in fixes:  # make-it-fit's order; first the fixes TrainingArguments can express
        changes, missing = config_changes(read, job, fix.job)
        if changes and not missing:
            return ", ".join(f"{k}={v!r}" for k, v in changes.items()) + f" ({fix.summary})"
    return f"{fixes[0].flags} ({fixes[0].summary})" if fixes else None


def _message(report: MemoryReport, gpu: str | None, fits: bool | None, fix: str | None,
             margin: float) -> str:
    need = f"{report.device_total / GiB:.1f} GiB"
    if gpu is None:
        return f"vramplan preflight: the step needs {need} per GPU (no GPU to check against)"
    fit = report.fits[0]
    room = f"{(1 - margin) * fit.usable_bytes / GiB:.1f} GiB"
    if fits:
        return f"vramplan preflight: fits on {gpu} ({need} of {room})"
    return (f"vramplan preflight: predicted not to fit on {gpu} ({need} of {room}); "
            f"to fit: {fix or 'no change found (a bigger GPU: vramplan plan)'}")


def _args_dict(args: Any) -> dict[str, Any]:
    if isinstance(args, dict):
        return dict(args)
    if hasattr(args, "to_json_string"):  # TrainingArguments: its JSON, enums as values
        return json.loads(args.to_json_string())
    raise JobError(f"preflight takes TrainingArguments or a dict of them, not "
                   f"{type(args).__name__}")


def _model_config(model: Any) -> dict[str, Any]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise JobError(f"preflight reads the model's config (model.config, a transformers "
                       f"PretrainedConfig); {type(model).__name__} has none: use vramplan "
                       "estimate with a config.json")
    return json.loads(json.dumps(config.to_dict(), default=str))


def _peft_config(model: Any) -> dict[str, Any] | None:
    """The active adapter's LoraConfig as a dict (peft keeps target_modules as a set)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else next(iter(configs.values()))
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.loads(json.dumps(data, default=lambda v: sorted(v) if isinstance(v, set)
                                 else str(v)))


def _is_4bit(model: Any) -> bool:
    """A bitsandbytes 4-bit base (QLoRA)."""
    if getattr(model, "is_loaded_in_4bit", False):
        return True
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if hasattr(quant, "to_dict"):
        quant = quant.to_dict()
    return isinstance(quant, dict) and bool(quant.get("load_in_4bit"))


def _device_gpu(name: str | None) -> str | None:
    """The catalog GPU: the one named, else this process's CUDA device if the catalog
    knows it (driver names such as "NVIDIA H100 80GB HBM3" match)."""
    from vramplan.hardware import get_gpu

    if name is not None:
        return get_gpu(name).name
    torch = sys.modules.get("torch")  # a training process has it; never imported here
    if torch is None or not torch.cuda.is_available():
        return None
    try:
        return get_gpu(torch.cuda.get_device_name()).name
    except VramplanError:
        warnings.warn(f"vramplan preflight: {torch.cuda.get_device_name()} is not in the GPU "
                      "catalog; name one with gpu=", OomRiskWarning, stacklevel=3)
        return None

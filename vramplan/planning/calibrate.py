"""Calibration: fit the performance model's efficiency factors to measured step times.

From `measure` reports (`vramplan measure --json --out run.json`; MemoryReport JSON with
its job and measured step time), or a gpu_validation.json-style file of rows. With three
runs or more, matmul, memory and host time per kernel are fitted; with fewer, one factor
scales the GPU's current ones (too few runs to tell them apart). The result is stored in
the user's config folder (vramplan.config.user_config_dir()/efficiency.toml, one table per
GPU), and later predictions on that GPU use it and say so in `factors`.

    >>> result = calibrate(["run1.json", "run2.json"])
    >>> save(result)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning.efficiency import (
    MAX_OF_PEAK,
    Factors,
    clear_cache,
    read_user_factors,
    user_file,
)

MIN_RUNS_FOR_THREE_FACTORS = 3


class Calibration(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str
    runs: int
    factors: Factors
    median_error_before: float   # |predicted / measured - 1| with the factors in use before
    median_error_after: float    # in sample: the same runs the factors were fitted on
    files: list[str]


MAX_RUN_FILE_BYTES = 50_000_000  # a measure report is kilobytes; /dev/zero never ends
STEP_RANGE_S = (1e-4, 86_400.0)   # a step under 0.1 ms or over a day is not a training step


def _read_json(path: str | Path):
    try:
        with Path(path).open("rb") as handle:
            raw = handle.read(MAX_RUN_FILE_BYTES + 1)
    except FileNotFoundError:
        raise JobError(f"calibrate: {str(path)!r} does not exist") from None
    except OSError as error:
        raise JobError(f"calibrate: cannot read {str(path)!r}: {error.strerror or error}") \
            from None
    if len(raw) > MAX_RUN_FILE_BYTES:
        raise JobError(f"calibrate: {str(path)!r} is too large to be a measure report")
    try:  # Infinity / NaN are not JSON: a report holding them is refused here
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        raise JobError(f"calibrate: cannot read {str(path)!r} as JSON: {error}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def load_runs(paths: list[str | Path]) -> list[tuple[Job, float, str | None]]:
    """(job, measured step seconds, device name) of every timed run in the files."""
    runs = []
    for path in paths:
        data = _read_json(path)
        rows = data.get("rows") if isinstance(data, dict) and "rows" in data else [data]
        if not isinstance(rows, list):
            rows = [rows]
        for row in rows:
            measured = row.get("measured") if isinstance(row, dict) else None
            step = measured.get("step_time_median_s") if isinstance(measured, dict) else None
            if not isinstance(row, dict) or not isinstance(row.get("job"), dict) or not step:
                raise JobError(f"calibrate: {path} has no job with a measured step time; give "
                               "`vramplan measure --json` reports (track() results, sweeps "
                               "and estimates carry none)")
            if isinstance(step, bool) or not isinstance(step, (int, float)) \
                    or not STEP_RANGE_S[0] <= step <= STEP_RANGE_S[1]:
                raise JobError(f"calibrate: {path}: step time {step!r} s is not a plausible "
                               f"measured step ({STEP_RANGE_S[0]:g} s to {STEP_RANGE_S[1]:g} s)")
            machine = data.get("machine") if isinstance(data, dict) else None
            device = measured.get("device_name") or (
                machine.get("gpu") if isinstance(machine, dict) else None)
            runs.append((Job.model_validate(row["job"]), float(step),
                         device if isinstance(device, str) else None))
    if not runs:
        raise JobError("calibrate: no runs found in the files given")
    return runs


def _factors(base: Factors, matmul: float, memory: float, kernel_us: float) -> Factors:
    # the runs cannot tell attention from matmul apart: attention moves with matmul
    return base.model_copy(update=dict(matmul=min(matmul, MAX_OF_PEAK),
                                       attention=min(base.attention * matmul / base.matmul,
                                                     MAX_OF_PEAK),
                                       memory=min(memory, 1.0), kernel_us=kernel_us))


def _loss(terms: list, measured: list[float], factors: Factors) -> float:
    """Mean |log(predicted / measured)|: relative errors, symmetric in over and under."""
    from vramplan.planning.performance import step_time

    return sum(abs(math.log(step_time(t, factors) / m))
               for t, m in zip(terms, measured)) / len(terms)


def fit(base: Factors, terms: list, measured: list[float],
        module_us: tuple[float, ...] | None = None) -> Factors:
    """Factors that best predict `measured` from the step `terms` (performance.step_terms):
    a coarse-to-fine grid over (matmul, memory, host time per kernel), or one common scale
    with fewer than three runs. `module_us`: host times per module call to try (the
    three factors are fitted at each; the best fit wins); default: the base's."""
    if module_us is not None:
        fits = [fit(base.model_copy(update={"module_us": m}), terms, measured)
                for m in module_us]
        return min(fits, key=lambda f: _loss(terms, measured, f))
    if len(terms) < MIN_RUNS_FOR_THREE_FACTORS:
        scales = [0.25 * 1.02 ** i for i in range(140)]
        best = min(scales, key=lambda s: _loss(terms, measured, _factors(
            base, base.matmul / s, base.memory / s, base.kernel_us * s)))
        return _factors(base, base.matmul / best, base.memory / best, base.kernel_us * best)

    def grid(lo, hi, n):
        return [lo + (hi - lo) * i / (n - 1) for i in range(n)]

    def loss(point):
        return _loss(terms, measured, _factors(base, *point))

    # up to the shipped matmul factor at least: a GeForce card's passes 0.95
    best = min(((a, b, c) for a in grid(0.3, max(0.95, base.matmul), 14)
                for b in grid(0.3, 1.0, 15)
                for c in grid(0.0, 140.0, 15)), key=loss)
    steps = (0.05, 0.05, 10.0)
    for _ in range(3):  # refine around the best point
        axes = [[max(1e-3, v + s * k / 4) for k in range(-4, 5)] for v, s in zip(best, steps)]
        best = min(((a, b, c) for a in axes[0] for b in axes[1] for c in axes[2]), key=loss)
        steps = tuple(s / 4 for s in steps)
    return _factors(base, *best)


def calibrate(paths: list[str | Path], gpu: str | None = None) -> Calibration:
    """Fit factors for one GPU type from measured runs (all runs must be on it)."""
    from vramplan.planning.performance import job_factors, job_interval, step_terms, step_time

    runs = load_runs(paths)
    devices = {d for _, _, d in runs if d}
    if gpu is None:
        if len(devices) != 1:
            raise JobError("calibrate: the runs name "
                           + (f"several GPUs ({', '.join(sorted(devices))})" if devices
                              else "no GPU") + "; give the GPU with --gpu")
        gpu = devices.pop()
    chosen = get_gpu(gpu)
    for device in devices:  # runs of another device would fit this GPU's factors to them
        other = _catalog_name(device)
        if other != chosen.name:
            raise JobError(f"calibrate: a run was measured on {device!r}, not on "
                           f"{chosen.name}: give runs of one GPU type (and --gpu for it)")
    base = job_factors(runs[0][0], chosen)
    terms = [step_terms(job, chosen) for job, _, _ in runs]
    measured = [m for _, m, _ in runs]
    # a step faster than the datasheet peaks allow (every factor at 100%) was not this job
    # on this GPU, or its timer is broken: fitted, it would halve every later cost
    peak = base.model_copy(update=dict(matmul=1.0, attention=1.0, memory=1.0, kernel_us=0.0,
                                       module_us=0.0, collective=1.0, overlap=1.0))
    for (job, m, _), t in zip(runs, terms):
        fastest = step_time(t, peak)
        if m < 0.9 * fastest:  # 10%: datasheet rounding
            raise JobError(f"calibrate: {job.model} measured {m:g} s per step, faster than "
                           f"{chosen.name}'s datasheet peaks allow ({fastest:.3g} s at 100% "
                           "efficiency): not a run of this job on this GPU, or a broken timer")
    fitted = fit(base, terms, measured)
    update = {"source": f"{chosen.name}: calibrated on {len(runs)} of your runs",
              "calibrated": True}
    if len(runs) >= MIN_RUNS_FOR_THREE_FACTORS:
        # your runs' own spread around the fit (measured / predicted), never wider than the
        # shipped interval: a narrower 80% range for this GPU
        ratios = [m / step_time(t, fitted) for t, m in zip(terms, measured)]
        shipped = [job_interval(job) for job, _, _ in runs]
        low, high = min(lo for lo, _ in shipped), max(hi for _, hi in shipped)
        update["interval"] = (max(low, min(ratios)), min(high, max(ratios)))
    fitted = fitted.model_copy(update=update)

    def median_error(factors: Factors) -> float:
        errors = sorted(abs(step_time(t, factors) / m - 1) for t, m in zip(terms, measured))
        return errors[len(errors) // 2] if len(errors) % 2 else sum(
            errors[len(errors) // 2 - 1: len(errors) // 2 + 1]) / 2

    return Calibration(gpu=chosen.name, runs=len(runs), factors=fitted,
                       median_error_before=median_error(base),
                       median_error_after=median_error(fitted),
                       files=[str(p) for p in paths])


def _catalog_name(device: str) -> str | None:
    """The catalog name of a run's device ('NVIDIA H200' -> 'H200'); None: not a GPU we know
    (the CPU, an unknown card)."""
    from vramplan.errors import VramplanError

    try:
        return get_gpu(device).name
    except (VramplanError, KeyError, ValueError):
        return None


def save(result: Calibration, path: Path | None = None) -> Path:
    """Write (or replace) the GPU's table in the user's efficiency.toml."""
    path = path or user_file()
    tables = read_user_factors(path)
    tables[result.gpu] = {**result.factors.model_dump(exclude={"source", "interval", "calibrated"},
                                                      exclude_none=True),
                          **({"interval": list(result.factors.interval)}
                             if result.factors.interval else {}),
                          "source": result.factors.source, "files": result.files}
    lines = ["# vramplan calibrate: efficiency factors fitted on your own runs, per GPU", ""]
    for name, values in sorted(tables.items()):
        lines.append(f'[gpus."{name}"]')
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    clear_cache()
    return path

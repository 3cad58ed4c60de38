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
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning.efficiency import Factors, factors_for

USER_FILE = "efficiency.toml"
MIN_RUNS_FOR_THREE_FACTORS = 3


class Calibration(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str
    runs: int
    factors: Factors
    median_error_before: float   # |predicted / measured - 1| with the factors in use before
    median_error_after: float    # in sample: the same runs the factors were fitted on
    files: list[str]


def load_runs(paths: list[str | Path]) -> list[tuple[Job, float, str | None]]:
    """(job, measured step seconds, device name) of every timed run in the files."""
    runs = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise JobError(f"calibrate: {str(path)!r} does not exist") from None
        except (OSError, json.JSONDecodeError) as error:
            raise JobError(f"calibrate: cannot read {str(path)!r} as JSON: {error}") from None
        rows = data.get("rows") if isinstance(data, dict) and "rows" in data else [data]
        for row in rows:
            measured = row.get("measured") or {}
            step = measured.get("step_time_median_s")
            if "job" not in row or not step:
                raise JobError(f"calibrate: {path} has no job with a measured step time; give "
                               "`vramplan measure --json` reports (track() results carry no "
                               "job)")
            device = measured.get("device_name") or (data.get("machine") or {}).get("gpu")
            runs.append((Job.model_validate(row["job"]), float(step), device))
    if not runs:
        raise JobError("calibrate: no runs found in the files given")
    return runs


def _factors(base: Factors, matmul: float, memory: float, kernel_us: float) -> Factors:
    # the runs cannot tell attention from matmul apart: attention moves with matmul
    return base.model_copy(update=dict(matmul=min(matmul, 1.0),
                                       attention=min(base.attention * matmul / base.matmul, 1.0),
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

    best = min(((a, b, c) for a in grid(0.3, 0.95, 14) for b in grid(0.3, 1.0, 15)
                for c in grid(0.0, 140.0, 15)), key=loss)
    steps = (0.05, 0.05, 10.0)
    for _ in range(3):  # refine around the best point
        axes = [[max(1e-3, v + s * k / 4) for k in range(-4, 5)] for v, s in zip(best, steps)]
        best = min(((a, b, c) for a in axes[0] for b in axes[1] for c in axes[2]), key=loss)
        steps = tuple(s / 4 for s in steps)
    return _factors(base, *best)


def calibrate(paths: list[str | Path], gpu: str | None = None) -> Calibration:
    """Fit factors for one GPU type from measured runs (all runs must be on it)."""
    from vramplan.planning.performance import step_terms, step_time

    runs = load_runs(paths)
    devices = {d for _, _, d in runs if d}
    if gpu is None:
        if len(devices) != 1:
            raise JobError("calibrate: the runs name "
                           + (f"several GPUs ({', '.join(sorted(devices))})" if devices
                              else "no GPU") + "; give the GPU with --gpu")
        gpu = devices.pop()
    chosen = get_gpu(gpu)
    base = factors_for(chosen)
    terms = [step_terms(job, chosen) for job, _, _ in runs]
    measured = [m for _, m, _ in runs]
    fitted = fit(base, terms, measured)
    update = {"source": f"{chosen.name}: calibrated on {len(runs)} of your runs"}
    if len(runs) >= MIN_RUNS_FOR_THREE_FACTORS:
        # your runs' own spread around the fit (measured / predicted), never wider than the
        # shipped interval: a narrower 80% range for this GPU
        from vramplan.planning.efficiency import interval

        ratios = [m / step_time(t, fitted) for t, m in zip(terms, measured)]
        low, high = interval()
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


def user_file() -> Path:
    from vramplan.config import user_config_dir

    return user_config_dir() / USER_FILE


def save(result: Calibration, path: Path | None = None) -> Path:
    """Write (or replace) the GPU's table in the user's efficiency.toml."""
    path = path or user_file()
    tables = read_user_factors(path)
    tables[result.gpu] = {**result.factors.model_dump(exclude={"source", "interval"},
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
    from vramplan.planning.efficiency import clear_cache

    clear_cache()
    return path


def read_user_factors(path: Path | None = None) -> dict[str, dict]:
    path = path or user_file()
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text()).get("gpus", {})
    except tomllib.TOMLDecodeError as error:
        raise JobError(f"{path}: not valid TOML ({error}); delete it and calibrate again") \
            from None

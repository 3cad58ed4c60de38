"""Largest batch size / sequence length that fits, and grids of jobs (sweeps).

Engine-agnostic: an *oracle* is any callable Job -> peak bytes (an int, or a MemoryReport
whose `device_total` is used). Raising an out-of-memory error means "does not fit": the
search catches it, frees memory and goes on. So formula and trace answer instantly, and
measure answers for real (on CUDA, or on the CPU with a byte budget).

    >>> from vramplan.engines.formula import estimate
    >>> result = max_batch_size(job, estimate, parse_bytes("24GiB"))
    >>> result.best, len(result.trials)

The search grows the value (doubling), then narrows the bracket (bisection). When the
oracle returns peaks, the next trial is where the line through the nearest measured
points crosses the limit (memory is close to affine in batch size and smooth in sequence
length), which finds the exact answer in a handful of trials; every step is clamped
inside the bracket and falls back to doubling / bisection when a trial ran out of memory
or the prediction did not shrink the bracket enough.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

from pydantic import ValidationError

from vramplan.engines.memory_report import TENSOR_CATEGORIES, MemoryReport
from vramplan.engines.oom import is_out_of_memory, release_memory, require_complete
from vramplan.errors import JobError
from vramplan.fit import SAFETY_MARGIN, check_margin, limit_bytes
from vramplan.job import Job
from vramplan.search.suggestions import suggestions_for

Oracle = Callable[[Job], "int | MemoryReport"]

DEFAULT_MARGIN = SAFETY_MARGIN  # one margin everywhere (vramplan/fit.py)
# Never jump more than this factor past the largest value that fits: a wild extrapolation
# would cost a huge trial (a CPU measurement only learns it is over budget at the end).
_GROWTH_CAP = 8
# Job's own field bounds
_JOB_LIMITS = {"batch_size": 1_000_000, "seq_len": 100_000_000, "peft.rank": 4096}


# --- trials and results --------------------------------------------------------------------


@dataclass
class Trial:
    value: int
    peak: int | None  # bytes; None when the trial ran out of memory
    fits: bool
    error: str = ""   # the out-of-memory message, when there was one


@dataclass
class SearchResult:
    parameter: str               # "batch_size", "seq_len" or "peft.rank"
    best: int | None             # largest value that fits; None when even the smallest fails
    budget_bytes: int
    margin: float
    limit_bytes: int             # budget x (1 - margin): a trial fits iff peak <= limit
    trials: list[Trial] = field(default_factory=list)
    capped: bool = False         # best == the maximum asked for (the true limit may be higher)
    limited_by: str = ""         # a larger value was refused by the job or model (not memory)
    largest_category: str = ""   # when nothing fits: what fills memory at the smallest value
    suggestions: list[str] = field(default_factory=list)  # when nothing fits: what may help
    interrupted: str = ""        # Ctrl-C stopped the search: best is the largest seen to fit

    @property
    def fits(self) -> bool:
        return self.best is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"fits": self.fits}


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a search: the result so far (its trials; best is the largest value
    seen to fit, a lower bound)."""

    def __init__(self, result: SearchResult):
        super().__init__(result.interrupted)
        self.result = result


def peak_of(answer: int | MemoryReport) -> int:
    """An oracle's answer as bytes: what the device would show (device_total) for reports."""
    return answer.device_total if isinstance(answer, MemoryReport) else int(answer)


def _ask(oracle: Oracle, job: Job) -> tuple[int | None, MemoryReport | None, str]:
    try:
        answer = oracle(job)
    except Exception as error:  # noqa: BLE001 - only out-of-memory is swallowed
        if not is_out_of_memory(error):
            raise
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        del error  # the traceback holds the failed step's tensors
        release_memory()
        return None, None, message
    report = answer if isinstance(answer, MemoryReport) else None
    require_complete(report, job)
    return peak_of(answer), report, ""


# --- the search ------------------------------------------------------------------------------


def max_batch_size(job: Job, oracle: Oracle, budget_bytes: int, *, margin: float = DEFAULT_MARGIN,
                   maximum: int | None = None,
                   explain: Callable[[Job], MemoryReport] | None = None) -> SearchResult:
    """Largest micro-batch size (exact) whose peak stays within budget x (1 - margin).

    explain: an engine used only when batch size 1 does not fit and the oracle gave no
    report (it ran out of memory), to say which category fills memory (e.g. formula).
    """
    return _search(job, "batch_size", 1, oracle, budget_bytes, margin, maximum, explain)


def max_seq_len(job: Job, oracle: Oracle, budget_bytes: int, *, margin: float = DEFAULT_MARGIN,
                granularity: int = 64, maximum: int | None = None,
                explain: Callable[[Job], MemoryReport] | None = None) -> SearchResult:
    """Largest sequence length, a multiple of `granularity`, that fits (at the job's batch)."""
    if granularity < 1:
        raise JobError(f"granularity must be at least 1 token (got {granularity})")
    return _search(job, "seq_len", granularity, oracle, budget_bytes, margin, maximum, explain)


def max_value(job: Job, parameter: str, oracle: Oracle, budget_bytes: int, *,
              margin: float = DEFAULT_MARGIN, step: int = 1, maximum: int | None = None,
              explain: Callable[[Job], MemoryReport] | None = None) -> SearchResult:
    """The search primitive: the largest value of `parameter` (batch_size, seq_len,
    peft.rank), a multiple of `step`, whose peak stays within budget x (1 - margin).
    Memory must grow with the value (it does for all three)."""
    return _search(job, parameter, step, oracle, budget_bytes, margin, maximum, explain)


def with_value(job: Job, parameter: str, value: int) -> Job:
    """`job` with one searched field set ("peft.rank" sets the adapters' rank)."""
    if parameter == "peft.rank":
        if job.peft is None:
            raise JobError("peft.rank: the job has no adapters (--peft lora)")
        return job.with_changes(peft={**job.peft.model_dump(), "rank": value})  # validated
    return job.with_changes(**{parameter: value})


def _search(job: Job, parameter: str, step: int, oracle: Oracle, budget_bytes: int,
            margin: float, maximum: int | None, explain) -> SearchResult:
    check_margin(margin)
    if budget_bytes <= 0:
        raise JobError(f"the memory budget must be positive (got {budget_bytes} bytes)")
    limit = limit_bytes(budget_bytes, margin)
    result = SearchResult(parameter, None, budget_bytes, margin, limit)
    # Work in units of `step` (k x granularity tokens); k_max bounds the search when asked.
    maximum = min(maximum or _JOB_LIMITS[parameter], _JOB_LIMITS[parameter])
    k_max = maximum // step
    if k_max < 1:
        raise JobError(f"maximum {maximum} is below the smallest value tried ({step})")
    points: dict[int, int | None] = {}  # k -> peak (None: out of memory)

    def trial(k: int) -> bool:
        try:
            peak, report, error = _ask(oracle, with_value(job, parameter, k * step))
        except (JobError, ValidationError) as invalid:
            if k == 1:
                raise
            # A value the model refuses (longer than its positions): a limit, like memory.
            result.limited_by = str(invalid).splitlines()[0]
            peak, report, error = None, None, f"invalid: {result.limited_by}"
        fits = peak is not None and peak <= limit
        result.trials.append(Trial(k * step, peak, fits, error))
        points[k] = peak
        if k == 1 and not fits:
            _explain(result, with_value(job, parameter, step), report, explain)
        return fits

    lo, hi = 1, None  # lo fits; hi (when known) does not
    try:
        if not trial(1):
            return result
        _bracket(result, points, trial, lo, hi, k_max, limit, step)
    except KeyboardInterrupt:
        fitting = [t.value for t in result.trials if t.fits]
        result.best = max(fitting) if fitting else None
        result.interrupted = (f"interrupted after {len(result.trials)} trials; "
                              + (f"{result.best} fits, larger values were not settled"
                                 if fitting else "nothing was seen to fit yet"))
        raise SearchInterrupted(result) from None
    return result


def _bracket(result: SearchResult, points: dict, trial, lo: int, hi: int | None, k_max: int,
             limit: int, step: int) -> None:
    """Grow, then narrow, the bracket [lo fits, hi does not] until it is one step wide."""
    stalls = 0  # consecutive trials that neither doubled lo nor halved the bracket
    while hi is None or hi - lo > 1:
        if lo >= k_max:
            result.capped = True
            break
        k = _next(points, lo, hi, limit, k_max, stalls)
        before = (lo, hi)
        if trial(k):
            lo = k
        else:
            hi = k
        if before[1] is None:
            progressed = hi is not None or lo >= 2 * before[0]
        else:
            progressed = hi - lo <= (before[1] - before[0]) / 2
        stalls = 0 if progressed else stalls + 1
    result.best = lo * step


def _next(points: dict[int, int | None], lo: int, hi: int | None, limit: int,
          k_max: int, stalls: int) -> int:
    """The next value to try, strictly inside (lo, hi) and at most k_max.

    The model's prediction is tried while it keeps making progress; after two trials that
    did not, plain doubling / bisection guarantees the worst case (about 2 log2(max)).
    """
    upper = (hi - 1) if hi is not None else min(k_max, lo * _GROWTH_CAP)
    default = lo * 2 if hi is None else (lo + hi) // 2  # doubling, then bisection
    guess = _predict(points, lo, hi, limit) if stalls < 2 else None
    if guess is None:
        k = default
    elif guess <= lo:
        k = lo + 1  # the model puts the edge at lo: test lo + 1
    elif hi is not None and guess >= hi:
        k = default  # the model says hi fits, yet it failed (out of memory): no information
    else:
        k = guess
    return max(lo + 1, min(k, upper))


def _predict(points: dict[int, int | None], lo: int, hi: int | None, limit: int) -> int | None:
    """Largest k whose peak the model through the measured points nearest the edge keeps
    within the limit: a line through two points (batch size), a quadratic through three
    (attention grows with seq_len^2) when it lands inside the bracket, or None when there
    is no usable slope."""
    fitting = [k for k in sorted(points) if k <= lo and points[k] is not None]
    if hi is not None and points.get(hi) is not None:
        # Across the bracket. For convex growth the chord crosses the limit at or below
        # the true edge, so it is a safe floor for the quadratic's guess.
        line = _line(points, lo, hi, limit)
        if len(fitting) >= 2:
            quad = _solve_quadratic([fitting[-2], lo, hi], points, limit)
            if quad is not None and line is not None and line <= quad < hi:
                return quad
        return line
    if len(fitting) < 2:
        return None
    return _line(points, fitting[-2], fitting[-1], limit)  # extrapolate the last slope


def _line(points: dict[int, int | None], a: int, b: int, limit: int) -> int | None:
    if points[b] <= points[a]:  # flat or noisy: no slope to follow
        return None
    # exact rational arithmetic: peaks are ints, so an affine oracle is predicted exactly
    return math.floor(a + Fraction(limit - points[a]) * (b - a) / (points[b] - points[a]))


def _solve_quadratic(ks: list[int], points: dict[int, int | None], limit: int) -> int | None:
    (x0, x1, x2), (y0, y1, y2) = ks, [Fraction(points[k]) for k in ks]
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)  # divided differences
    c2 = (d12 - d01) / (x2 - x0)
    if c2 <= 0:  # not convex: a line is the safer model
        return None
    c1 = d01 - c2 * (x0 + x1)
    c0 = y0 - c1 * x0 - c2 * x0 * x0
    disc = float(c1 * c1 - 4 * c2 * (c0 - limit))
    if disc < 0:
        return None
    root = (-float(c1) + math.sqrt(disc)) / (2 * float(c2))
    k = math.floor(root)
    # float rounding at an exact edge: settle the integer with exact arithmetic
    while c0 + c1 * (k + 1) + c2 * (k + 1) ** 2 <= limit:
        k += 1
    while k > 0 and c0 + c1 * k + c2 * k * k > limit:
        k -= 1
    return k


def _explain(result: SearchResult, job: Job, report: MemoryReport | None, explain) -> None:
    if report is None and explain is not None:
        try:
            report = explain(job)
        except Exception:  # noqa: BLE001 - the explanation is optional
            report = None
    if report is None:
        result.suggestions = ["run the same search with the formula or trace engine to see "
                              "what fills memory", *suggestions_for(job, "activations")[:1],
                              *suggestions_for(job, "weights")[:1]]
        return
    cats = {c: report.categories.get(c, 0) for c in (*TENSOR_CATEGORIES, "runtime_context")}
    ranked = sorted(cats, key=cats.get, reverse=True)
    result.largest_category = ranked[0]
    result.suggestions = suggestions_for(job, ranked[0])
    # A second category of similar size decides whether the first fix is enough.
    if cats[ranked[1]] > 0.25 * cats[ranked[0]]:
        result.suggestions += [s for s in suggestions_for(job, ranked[1])[:2]
                               if s not in result.suggestions]

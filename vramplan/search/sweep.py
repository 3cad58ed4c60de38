"""Grids of jobs: one row per (batch size, sequence length), from any engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.oom import is_out_of_memory, release_memory, require_complete
from vramplan.fit import fits_within
from vramplan.job import Job
from vramplan.search.core import DEFAULT_MARGIN

SWEEP_FIELDS = ("batch_size", "seq_len", "peak_allocated", "peak_reserved", "device_total",
                "fits", "step_time_s", "samples_per_s", "tokens_per_s", "final_loss", "error")


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep: the rows of the points completed before it."""

    def __init__(self, rows: list[dict[str, Any]], total: int):
        super().__init__(f"interrupted after {len(rows)} of {total} points")
        self.rows, self.total = rows, total


def sweep(job: Job, oracle_report: Callable[[Job], MemoryReport], batch_sizes: Iterable[int],
          seq_lens: Iterable[int] | None = None, *, budget_bytes: int | None = None,
          margin: float = DEFAULT_MARGIN,
          on_row: Callable[[dict], None] | None = None) -> list[dict[str, Any]]:
    """One row per (batch size, sequence length): peak memory, and time/throughput/loss when
    the report was measured. A point that runs out of memory is a row with `error`.

    on_row: called after each point (a progress bar).
    """
    seq_lens = list(seq_lens) if seq_lens else [job.seq_len]
    batch_sizes = list(batch_sizes)
    rows: list[dict[str, Any]] = []
    try:
        _sweep_points(job, oracle_report, batch_sizes, seq_lens, budget_bytes, margin, on_row,
                      rows)
    except KeyboardInterrupt:  # an interrupted point is not a result: keep the completed
        raise SweepInterrupted(rows, len(batch_sizes) * len(seq_lens)) from None
    return rows


def _sweep_points(job: Job, oracle_report: Callable[[Job], MemoryReport],
                  batch_sizes: list[int], seq_lens: list, budget_bytes: int | None,
                  margin: float, on_row: Callable[[dict], None] | None,
                  rows: list[dict[str, Any]]) -> None:
    for seq_len in seq_lens:
        for batch in batch_sizes:
            row = dict.fromkeys(SWEEP_FIELDS)
            row.update(batch_size=batch, seq_len=seq_len, error="")
            try:
                report = oracle_report(job.with_changes(batch_size=batch, seq_len=seq_len))
            except Exception as error:  # noqa: BLE001 - only out-of-memory is swallowed
                if not is_out_of_memory(error):
                    raise
                row.update(fits=False, error=f"{type(error).__name__}: {error}".splitlines()[0])
                del error
                release_memory()
            else:
                require_complete(report, job.with_changes(batch_size=batch, seq_len=seq_len))
                row.update(peak_allocated=report.peak_allocated,
                           peak_reserved=report.peak_reserved, device_total=report.device_total)
                if seq_len is None:  # the model's default length, as the engine chose it
                    row["seq_len"] = _tokens_per_sample(report)
                if budget_bytes is not None:
                    row["fits"] = fits_within(report.device_total, budget_bytes, margin)
                m = report.measured
                if m is not None:
                    row.update(step_time_s=m.step_time_median_s, samples_per_s=m.samples_per_s,
                               tokens_per_s=m.tokens_per_s,
                               final_loss=m.losses[-1] if m.losses else None)
            rows.append(row)
            if on_row:
                on_row(row)


def _tokens_per_sample(report: MemoryReport) -> int | None:
    """Text tokens per sample of a report (None for images: one 'token' per sample)."""
    job = report.job
    samples = job.batch_size * job.grad_accum * job.parallel.data_parallel
    tokens = report.tokens_per_step // max(1, samples)
    return tokens if tokens > 1 else None

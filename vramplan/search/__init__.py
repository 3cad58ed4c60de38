"""Largest batch size / sequence length that fits (core), grids of jobs (sweep), and the
files written from them (views). Engine-agnostic: any engine is the oracle (oracle)."""

from vramplan.engines.oom import describe_oom, is_out_of_memory, release_memory
from vramplan.search.core import (
    DEFAULT_MARGIN,
    Oracle,
    SearchInterrupted,
    SearchResult,
    Trial,
    max_batch_size,
    max_seq_len,
    peak_of,
)
from vramplan.search.suggestions import suggestions_for
from vramplan.search.sweep import SWEEP_FIELDS, SweepInterrupted, sweep
from vramplan.search.views import plot, rows_csv, write_csv, write_json

__all__ = [
    "DEFAULT_MARGIN", "Oracle", "SWEEP_FIELDS", "SearchInterrupted", "SearchResult",
    "SweepInterrupted", "Trial", "describe_oom",
    "is_out_of_memory", "max_batch_size", "max_seq_len", "peak_of", "plot", "release_memory",
    "rows_csv", "suggestions_for", "sweep", "write_csv", "write_json",
]

"""track(): record peak memory and step times of any training loop, write a JSON report.

    with vramplan.track("run.json") as tracker:
        for batch in loader:
            loss = train_step(batch)
            tracker.step(loss=loss, samples=len(batch))

The report is written on exit, also when the loop raises or is interrupted (then it says
so). On CUDA it holds torch's peak allocated / reserved and NVML's used memory and
utilization; on the CPU the process's peak resident memory (VmHWM, reset on entry on Linux).
torch is imported only when tracking starts.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from vramplan.hardware.nvml import NvmlSampler
from vramplan.units import p90


class Tracker:
    def __init__(self, path: str | Path | None = None, *, device: Any = None,
                 samples_per_step: int | None = None, tokens_per_step: int | None = None,
                 sync: bool = True):
        self.path = Path(path) if path else None
        self._device_arg = device
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.sync = sync  # wait for the GPU at each step, so step times are real
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.samples = 0
        self.tokens = 0
        self.error = ""
        self.result: dict[str, Any] = {}

    # --- the loop's side ---------------------------------------------------------------------

    def __enter__(self) -> Tracker:
        import torch

        self._torch = torch
        cuda = torch.cuda.is_available() and str(self._device_arg or "cuda").startswith("cuda")
        self.device = torch.device(self._device_arg or ("cuda" if cuda else "cpu"))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._sampler = NvmlSampler(self.device, interval=0.2)
            self._sampler.start()
        else:
            self._rss_at_start = _reset_peak_rss()
        self._started = self._last = time.perf_counter()
        return self

    def step(self, loss: Any = None, samples: int | None = None, tokens: int | None = None) -> None:
        """Mark the end of one optimizer step (loss: a float or a tensor)."""
        if self.sync and self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.step_times.append(now - self._last)
        self._last = now
        if loss is not None:
            self.losses.append(float(loss.detach().float().item() if hasattr(loss, "detach")
                                     else loss))
        self.samples += samples if samples is not None else (self.samples_per_step or 0)
        self.tokens += tokens if tokens is not None else (self.tokens_per_step or 0)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is KeyboardInterrupt:
            self.error = "interrupted (Ctrl-C)"
        elif exc_type is not None:
            self.error = f"{exc_type.__name__}: {exc}"
        if self.device.type == "cuda":
            self._sampler.stop()
        self.result = self.report()
        if self.path:
            self.write(self.path)
        return False  # never swallow the loop's exception

    # --- the report -----------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The run so far as a Measured document (vramplan.engines.memory_report.Measured, source
        "track"), as a JSON-ready dict."""
        from vramplan.engines.memory_report import Measured

        torch = self._torch
        elapsed = time.perf_counter() - self._started
        timed = self.step_times[1:] or self.step_times  # the first step warms up
        median = statistics.median(timed) if timed else None
        data: dict[str, Any] = {
            "source": "track", "device": str(self.device), "complete": not self.error,
            "stopped": self.error, "elapsed_s": elapsed, "steps": len(self.step_times),
            "step_times_s": self.step_times,
            "step_time_median_s": median, "step_time_p90_s": p90(timed),
            "losses": self.losses,
            "non_finite_losses": sum(not math.isfinite(x) for x in self.losses),
            "samples_per_s": self.samples / sum(self.step_times) if self.samples else None,
            "tokens_per_s": self.tokens / sum(self.step_times) if self.tokens else None,
        }
        if self.device.type == "cuda":
            s = self._sampler
            reserved = torch.cuda.max_memory_reserved(self.device)
            data.update(
                device_name=torch.cuda.get_device_name(self.device),
                peak_allocated=torch.cuda.max_memory_allocated(self.device),
                peak_reserved=reserved, nvml_used_max=s.max_used or None,
                context_overhead=max(0, s.max_used - reserved) if s.max_used else None,
                gpu_util_mean=sum(s.gpu_util) / len(s.gpu_util) if s.gpu_util else None,
                mem_bandwidth_util_mean=sum(s.mem_util) / len(s.mem_util) if s.mem_util
                else None)
        else:
            peak = _peak_rss()
            data.update(process_peak_rss=peak, process_rss_at_start=self._rss_at_start,
                        peak_rss_increase=max(0, peak - self._rss_at_start) if peak else None)
        return Measured(**data).model_dump(mode="json")

    def write(self, path: str | Path) -> None:
        """Write the final report, or the figures so far while the loop still runs."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.result or self.report(), indent=2) + "\n")


def track(path: str | Path | None = None, **options: Any) -> Tracker:
    """A Tracker to use as a context manager; see the module docstring."""
    return Tracker(path, **options)


# --- process memory on the CPU (Linux /proc; None elsewhere) ----------------------------------


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def _peak_rss() -> int | None:
    return _status_bytes("VmHWM")


def _reset_peak_rss() -> int | None:
    """Reset the high-water mark (Linux >= 4.0: write 5 to clear_refs); return RSS now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")

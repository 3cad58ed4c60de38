"""NVML, written once: used memory and utilization of a CUDA device, sampled in a thread
(measure and track), or read once. torch's NVML bindings are imported only when used."""

from __future__ import annotations

import threading
from typing import Any


def nvml_used(device: Any) -> int | None:
    """NVML's used memory of the device now (the whole device's), or None without NVML."""
    import torch

    try:
        return int(torch.cuda.device_memory_used(device))
    except Exception:  # noqa: BLE001 - pynvml missing or no NVML
        return None


class NvmlSampler:
    """Samples NVML used memory and utilization every `interval` s in a daemon thread.
    NVML's utilization is the share of time a kernel ran (or memory was read or written)
    over its own sample window, not SM occupancy."""

    def __init__(self, device: Any, interval: float = 0.05):
        import torch

        self._cuda = torch.cuda
        self.device, self.interval = device, interval
        self.max_used = 0
        self.gpu_util: list[float] = []
        self.mem_util: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sample()  # at least one sample, even for a very short run

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        try:
            self.max_used = max(self.max_used, int(self._cuda.device_memory_used(self.device)))
            self.gpu_util.append(float(self._cuda.utilization(self.device)))
            self.mem_util.append(float(self._cuda.memory_usage(self.device)))
        except Exception:  # noqa: BLE001 - NVML missing: memory stats still come from torch
            self._stop.set()

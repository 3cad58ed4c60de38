"""Traces for the web app: one at a time, in a worker process, with a time limit.

The trace patches torch process-wide while it runs, so it never runs in the server's
request threads: a single worker process (spawned, so it inherits no server state) runs
the queued traces in order. The queue has a length limit (the caller answers 429 past it).
A trace that overruns its limit by more than `grace_s` (stuck outside the trace engine's
own checks, e.g. while building a huge model) has its worker killed and replaced.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

KEEP_FINISHED = 64  # finished traces kept for their results


class QueueFull(Exception):
    """More traces are waiting than the queue allows."""


@dataclass
class TraceTask:
    id: str
    job: dict
    time_limit_s: float
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    future: Future | None = None
    result: dict | None = None
    error: str | None = None


def run_trace(job: dict, config: dict | None, time_limit_s: float) -> dict:
    """In the worker: {'report': MemoryReport JSON} or {'error': message} (no traceback)."""
    from vramplan.engines.registry import run_engine
    from vramplan.errors import VramplanError
    from vramplan.job import Job

    try:
        report = run_engine(Job.model_validate(job), "trace", time_limit_s=time_limit_s,
                            model_config=config)
    except VramplanError as error:
        return {"error": str(error)}
    except ImportError as error:
        return {"error": f"the trace needs torch and transformers on the server ({error.name})"}
    except Exception as error:  # noqa: BLE001 - a message for the page, never a traceback
        return {"error": f"the trace failed: {type(error).__name__}: {str(error)[:300]}"}
    return {"report": report.to_json_dict()}


class TraceQueue:
    """Submit traces, ask for their state. Thread-safe; the worker starts on first use."""

    def __init__(self, max_pending: int = 3, grace_s: float = 30.0):
        self.max_pending = max_pending  # running + waiting
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._tasks: OrderedDict[str, TraceTask] = OrderedDict()
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return self._executor

    def pending(self) -> list[TraceTask]:
        return [t for t in self._tasks.values() if t.finished is None]

    def submit(self, job: dict, config: dict | None, time_limit_s: float) -> TraceTask:
        with self._lock:
            self._refresh()
            if len(self.pending()) >= self.max_pending:
                raise QueueFull(f"{self.max_pending} traces are already queued or running; "
                                "try again when one has finished")
            task = TraceTask(uuid.uuid4().hex, job, time_limit_s)
            try:
                task.future = self._pool().submit(run_trace, job, config, time_limit_s)
            except BrokenProcessPool:  # the worker died (killed for memory, say): a new one
                self._discard_pool()
                task.future = self._pool().submit(run_trace, job, config, time_limit_s)
            self._tasks[task.id] = task
            self._forget_old()
            return task

    def get(self, task_id: str) -> tuple[TraceTask, int] | None:
        """The task and how many traces are ahead of it, or None when unknown."""
        with self._lock:
            self._refresh()
            task = self._tasks.get(task_id)
            if task is None:
                return None
            ahead = 0
            for other in self.pending():
                if other.id == task_id:
                    break
                ahead += 1
            return task, ahead

    def _refresh(self) -> None:
        """Collect finished futures, mark the oldest pending one as running, kill overruns."""
        for task in self.pending():
            if task.future.done():
                self._finish(task)
        pending = self.pending()
        if not pending:
            return
        head = pending[0]
        if head.started is None:
            head.started = time.monotonic()
        if time.monotonic() - head.started > head.time_limit_s + self.grace_s:
            self._restart_worker(head)

    def _finish(self, task: TraceTask) -> None:
        task.finished = time.monotonic()
        if task.started is None:
            task.started = task.finished
        try:
            outcome = task.future.result()
        except Exception as error:  # noqa: BLE001 - a dead worker, reported as a message
            if isinstance(error, BrokenProcessPool):
                self._discard_pool()
            if task.finished - task.started >= task.time_limit_s:
                # the worker died while its limit stopped the trace (torch can abort in C++
                # when the limit interrupts it): that is the time limit, not memory
                outcome = {"error": f"the trace passed its time limit of {task.time_limit_s:g}"
                                    " s and was stopped; raise the limit or use the formula"}
            else:
                outcome = {"error": f"the trace worker stopped ({type(error).__name__}: it "
                                    "may have run out of memory); run the trace again"}
        task.result, task.error = outcome.get("report"), outcome.get("error")

    def _discard_pool(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            for process in list((getattr(executor, "_processes", None) or {}).values()):
                process.kill()
            executor.shutdown(wait=False, cancel_futures=True)

    def _restart_worker(self, stuck: TraceTask) -> None:
        self._discard_pool()
        now = time.monotonic()
        for task in self.pending():
            task.finished = now
            task.error = (f"the trace passed its time limit of {stuck.time_limit_s:g} s and "
                          "was stopped" if task is stuck else
                          "stopped while waiting: the worker was restarted; run it again")

    def _forget_old(self) -> None:
        finished = [t for t in self._tasks.values() if t.finished is not None]
        for task in finished[:max(0, len(finished) - KEEP_FINISHED)]:
            del self._tasks[task.id]

    def close(self) -> None:
        self._discard_pool()

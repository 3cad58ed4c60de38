"""A Hugging Face Trainer callback that records what vramplan.track records.

    from vramplan.integrations.hf_trainer import VramplanCallback
    trainer = Trainer(..., callbacks=[VramplanCallback("vramplan-track.json")])

The report is written at the end of training and after every log, so a run that crashes
(the Trainer calls no callback then) still leaves its latest figures on disk.

With `on_oom_risk="warn"` or `"stop"` it first runs vramplan.preflight on the model and
the arguments (before the first step): a job predicted not to fit the device warns, or
stops training with the fix (OomRisk), in TrainingArguments keys.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from vramplan.tracking import Tracker

DEFAULT_NAME = "vramplan-track.json"


class VramplanCallback(TrainerCallback):
    def __init__(self, path: str | Path | None = None, tokens_per_step: int | None = None, *,
                 on_oom_risk: str | None = None, seq_len: int | None = None,
                 gpu: str | None = None):
        self.path = Path(path) if path else None
        self.tokens_per_step = tokens_per_step
        self.tracker: Tracker | None = None
        self.on_oom_risk, self.seq_len, self.gpu = on_oom_risk, seq_len, gpu
        self.preflight = None  # its PreflightResult, when on_oom_risk is set

    def on_train_begin(self, args, state, control, **kwargs):
        if self.on_oom_risk and kwargs.get("model") is not None:
            from vramplan.integrations.preflight import preflight

            self.preflight = preflight(kwargs["model"], args, seq_len=self.seq_len,
                                       gpu=self.gpu, on_oom_risk=self.on_oom_risk)
        samples = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                   * max(1, args.world_size))
        self.path = self.path or Path(args.output_dir) / DEFAULT_NAME
        self.tracker = Tracker(self.path if state.is_world_process_zero else None,
                               samples_per_step=samples,
                               tokens_per_step=self.tokens_per_step).__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker:
            self.tracker.step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.tracker and logs and "loss" in logs:
            self.tracker.losses.append(float(logs["loss"]))  # the mean since the last log
        if self.tracker and self.tracker.path:
            self.tracker.write(self.tracker.path)  # the figures so far

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker:
            self.tracker.__exit__(None, None, None)
            self.tracker = None

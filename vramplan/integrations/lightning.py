"""A Lightning callback that records what vramplan.track records.

    from vramplan.integrations.lightning import VramplanCallback
    trainer = lightning.Trainer(callbacks=[VramplanCallback("vramplan-track.json")])

Works with `lightning` or the older `pytorch_lightning` package, whichever is installed.
"""

from __future__ import annotations

from pathlib import Path

from vramplan.tracking import Tracker

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback
    except ImportError:
        Callback = None

DEFAULT_NAME = "vramplan-track.json"

if Callback is None:
    class VramplanCallback:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise ImportError("the Lightning callback needs Lightning: pip install lightning")
else:
    class VramplanCallback(Callback):  # type: ignore[no-redef, valid-type, misc]
        def __init__(self, path: str | Path | None = None, tokens_per_step: int | None = None):
            self.path = Path(path) if path else None
            self.tokens_per_step = tokens_per_step
            self.tracker: Tracker | None = None

        def on_train_start(self, trainer, pl_module):
            self.path = self.path or Path(trainer.default_root_dir) / DEFAULT_NAME
            self.tracker = Tracker(self.path if trainer.is_global_zero else None,
                                   tokens_per_step=self.tokens_per_step).__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.tracker is None:
                return
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.tracker.step(loss=loss, samples=_batch_size(batch))

        def on_train_end(self, trainer, pl_module):
            self._finish(None)

        def on_exception(self, trainer, pl_module, exception):
            self._finish(exception)

        def _finish(self, exception) -> None:
            if self.tracker is not None:
                self.tracker.__exit__(type(exception) if exception else None, exception, None)
                self.tracker = None


def _batch_size(batch) -> int | None:
    """Samples in a batch: the first dimension of its first tensor."""
    if hasattr(batch, "shape"):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(
        batch, (list, tuple)) else ()
    for item in items:
        if (n := _batch_size(item)) is not None:
            return n
    return None

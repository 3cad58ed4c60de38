"""Formula engine: closed-form memory of a training step, from the architecture alone.

No torch: it answers in well under a millisecond for any model size. Every figure is per
GPU. The step is modelled as three phases and the peak is the largest of them:

  forward   weights + optimizer states + (grads kept across micro-steps) + activations
            + 16-bit weight copies (autocast) + logits and loss buffers
  backward  at its start, the same plus the loss gradient buffers; with checkpointing,
            while one block is recomputed; at its end, all grads
  optimizer weights + states + grads + the step's temporaries

It reads the step description (engines/step.py: task, shapes, dtypes, parameter memory,
pipeline stages), and its parts are one module each:

  phases.py    the phase table of one stage on one GPU, and the peak (estimate)
  per_gpu.py   parameter memory per GPU: sharding, offload, gathered blocks, buckets
  saved.py     saved activations of the blocks and around them
  dora.py      what DoRA adds to a LoRA step
  loss.py      logits and loss buffers
  notes.py     the notes a report carries
  checks.py    what the formula refuses
"""

from vramplan.engines.formula.phases import (
    ALLOCATOR_OVERHEAD,
    RECOMPUTE_PHASES,
    estimate,
    stage_report,
)
from vramplan.engines.param_memory import CLASSIFIER_TASKS, ParamMemory
from vramplan.engines.step import Shapes

__all__ = ["ALLOCATOR_OVERHEAD", "CLASSIFIER_TASKS", "RECOMPUTE_PHASES", "ParamMemory",
           "Shapes", "estimate", "stage_report"]

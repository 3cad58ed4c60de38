"""DoRA (peft's use_dora; peft 5d602fd, tuners/lora/dora.py DoraLinearLayer and
variants.py DoraLinearVariant): what it adds to a LoRA step's memory.

Each adapted linear's forward, after the base layer's own output `result`:

    delta = lora_B(lora_A(eye(in))).T                  the adapter as an out x in matrix
    norm  = ||W + scaling delta|| per output row       detached (DoRA, section 4.3)
    base  = result (lora_dropout 0) or F.linear(dropout(x), W)
    out   = result + (m / norm - 1) base + (m / norm) lora_B(lora_A(x)) scaling

Kept for backward (autograd's saved tensors, listed with saved_tensors_hooks on peft's
layer): `base` and lora_B(lora_A(x)), tokens x out each, which the magnitude's gradient
reads; with dropout, F.linear's weight, which its input gradient reads (its input is not
kept: the frozen weight needs no gradient): a 16-bit copy under autocast (the cache keeps
trained weights only), the dequantised weight under QLoRA, or without autocast the weight
cast to the adapters' dtype where it has another. The magnitude and the norm are per
output: small, left out.

Transient while the layer's forward runs (freed before the next layer's): eye(in) in the
adapters' dtype with lora_A's copy of it, the delta (lora_B's output, its transpose cast
to x's dtype, the scaled delta, the sum the norm reads) and the weight in x's dtype. x is
the adapters' dtype (peft casts the input to lora_A's).
"""

from __future__ import annotations

from vramplan.engines.precision import Dtypes, adapter_bytes, frozen_base_bytes
from vramplan.engines.step import dora_linears as adapted
from vramplan.job import Job
from vramplan.models import Architecture, Stack


def _weight_copy_bytes(job: Job, dt: Dtypes) -> int:
    """Bytes per weight element of the copy F.linear keeps when dropout feeds it its own
    input (0: the parameter itself is kept)."""
    if dt.autocast or job.peft.method == "qlora":
        return dt.compute  # autocast's uncached cast; QLoRA's dequantised weight
    a = adapter_bytes(job)
    return a if a != frozen_base_bytes(job) else 0


def saved(job: Job, stack: Stack, tokens: int, dt: Dtypes) -> list[tuple[str, int]]:
    """What one block's DoRA layers keep for backward beyond LoRA's."""
    out = []
    a = adapter_bytes(job)
    dropout = job.peft is not None and job.peft.dropout > 0
    for ln in adapted(job, stack):
        # base: the base output (compute dtype), or F.linear in the adapters' dtype; the
        # adapter's output: compute dtype under autocast, else the adapters'
        base = dt.compute if dt.autocast or not dropout else a
        lora = dt.compute if dt.autocast else a
        out.append((f"{ln.name} dora outputs", tokens * ln.out_features * (base + lora)))
        if dropout:
            copy = _weight_copy_bytes(job, dt)
            if copy:
                out.append((f"{ln.name} dora weight copy", ln.in_features * ln.out_features
                             * copy))
    return out


def transient(job: Job, arch: Architecture, dt: Dtypes) -> int:
    """The most one DoRA layer's forward holds at once beyond what it keeps, the larger of
    two moments (checked against the trace on fake tensors, within 4%):
      building the delta: eye(in) (adapters' dtype), autocast's copy of it, lora_B's output;
      taking the norm: the eye lora_A keeps (its copy under autocast), the delta in x's
      dtype, the scaled delta and the sum, and the weight in x's dtype where it differs
      (QLoRA: the dequantised weight too)."""
    a, w = adapter_bytes(job), frozen_base_bytes(job)
    cast = dt.compute if dt.autocast and dt.compute != a else 0  # autocast's copy of eye(in)
    lora_out = dt.compute if dt.autocast else a
    most = 0
    for stack in arch.stacks:
        for ln in adapted(job, stack):
            n, eye = ln.in_features * ln.out_features, ln.in_features ** 2
            building = eye * (a + cast) + n * lora_out
            weight = (n * dt.compute if job.peft.method == "qlora" else 0) + (
                n * a if (w != a or job.peft.method == "qlora") else 0)
            norm = eye * (cast or a) + 3 * n * a + weight
            most = max(most, building, norm)
    return most

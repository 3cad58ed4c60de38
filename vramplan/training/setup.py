"""The training setup of a Job (model, optimizer, batches, loss) and one train step.

The trace engine (fake tensors) and the measure engine (a real device) share these builders,
so both run the same step:

    setup = build_training_setup(job, device="cuda")          # real tensors on a device
    setup = build_training_setup(job, device="cpu", empty=True)  # inside FakeTensorMode
    train_step(setup, job.grad_accum, mark=lambda phase: ...)  # phases: inputs, forward,
                                                               # backward, optimizer, end
`empty=True` builds the model (and peft adapters) on the meta device, outside any active
dispatch mode, then materialises uninitialised tensors on `device` by reassignment: what
FakeTensorMode needs for peft, and what makes a 405B model build in seconds.
`model_config` (a Hugging Face config dict) overrides the lookup of `job.model`, for tests
and benchmarks. `job.model` may also be "package.module:factory", a function returning an
nn.Module (see training/factory.py for the forms it may return).

What each precision means here (Hugging Face Trainer conventions):
  fp32         fp32 weights, no autocast
  fp16/bf16-mixed  fp32 weights + torch.autocast; with peft the frozen base is stored in
               the 16-bit dtype and the adapters in fp32 (peft's autocast_adapter_dtype)
  bf16-pure    every weight, gradient and optimizer state in bf16
  bf16-master / fp16-master  a 16-bit model; the optimizer keeps fp32 master weights and
               states (training/master.py), as DeepSpeed's bf16 / fp16 do
  fp8          as bf16-mixed, with block linears run on float8 copies (training/emulate/lowbit.py)
On a CPU the autocast op lists differ from CUDA's; train_step applies CUDA's lists there
(training/emulate/autocast.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vramplan.errors import EngineError
from vramplan.job import Job
from vramplan.models.derive import language_model_config
from vramplan.models.families import prequantized
from vramplan.training.batches import hf_batch_factory, text_len
from vramplan.training.compiled import apply_compile, trace_backend
from vramplan.training.emulate import lowbit
from vramplan.training.emulate.autocast import cuda_autocast_policy, cuda_dropout_kernels
from vramplan.training.factory import from_factory, is_factory_ref
from vramplan.training.hf_model import build_hf_model, load_model_config, task_of_config
from vramplan.training.kernels import Kernels
from vramplan.training.losses import LOSSES
from vramplan.training.optimizers import build_optimizer
from vramplan.training.tensors import SIXTEEN_BIT

MAX_GRAD_NORM = 1.0       # Hugging Face Trainer default


@dataclass
class TrainingSetup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[], Any]                 # one micro-batch on the device
    compute_loss: Callable[[nn.Module, Any], torch.Tensor]
    autocast_dtype: torch.dtype | None
    device: torch.device
    model_name: str
    clip_foreach: bool = True
    notes: list[str] = field(default_factory=list)
    task: str = ""  # the Hugging Face task; "" for factory models
    tokens_per_sample: int = 0  # text tokens per sample; 0 for vision, speech and factories
    mark: Callable[[str], None] = lambda phase: None  # the running train_step's phase marker
    keep_grads: bool = False  # zero_grad(set_to_none=False): grads live into the next step
    no_sync: bool = False  # FSDP: reduce-scatter the last micro-batch's gradients only
    kernels: Kernels | None = None  # real low-bit libraries in use (None: the stand-ins)

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def params_total(self) -> int:
        return sum(_logical_numel(m, p) for m, p in _named_params(self.model))

    @property
    def params_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def _cuda_policy(setup: TrainingSetup) -> contextlib.AbstractContextManager:
    # for the whole step: checkpointing recomputes forward under autocast inside backward
    stack = contextlib.ExitStack()
    if setup.device.type == "cpu":
        stack.enter_context(cuda_dropout_kernels())
        if setup.autocast_dtype is not None:
            stack.enter_context(cuda_autocast_policy())
    return stack


def train_step(setup: TrainingSetup, grad_accum: int,
               mark: Callable[[str], None] = lambda phase: None) -> None:
    """One optimizer step of `grad_accum` micro-batches, as the HF Trainer runs it."""
    setup.mark = mark  # optimizer-in-backward hooks report their phase through it
    with _cuda_policy(setup):
        _micro_steps(setup, grad_accum, mark)
    mark("optimizer")
    nn.utils.clip_grad_norm_(setup.trainable, MAX_GRAD_NORM, foreach=setup.clip_foreach)
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=not setup.keep_grads)
    mark("end")


def _micro_steps(setup: TrainingSetup, grad_accum: int, mark: Callable[[str], None]) -> None:
    for i in range(grad_accum):
        if setup.no_sync:  # FSDP2 (job.parallel.fsdp_no_sync): as the HF Trainer's no_sync
            setup.model.set_requires_gradient_sync(i == grad_accum - 1)
        mark("inputs")
        batch = setup.make_batch()
        mark("forward")
        with setup.autocast():
            loss = setup.compute_loss(setup.model, batch)
        del batch  # the data loader's reference goes; saved tensors keep what backward needs
        mark("backward")
        (loss / grad_accum).backward()
        del loss


def build_training_setup(job: Job, device: str | torch.device = "cpu", *,
                         model_config: dict | None = None, empty: bool = False,
                         kernels: Kernels | None = None) -> TrainingSetup:
    """kernels: the real low-bit libraries to run (training/kernels.select_kernels, what
    measure passes on CUDA); None: the stand-ins, as the trace runs."""
    _check_modelled(job)
    if job.compiles_blocks and job.precision == "fp8" and kernels is None:
        # the stand-ins' float8 casts are custom autograd functions whose saved tensors and
        # temporaries are not torchao's under Inductor (which fuses the casts and amax):
        # the trace passes torchao's (kernels.trace_kernels)
        raise EngineError("compiled blocks with fp8 run torchao's Float8Linear, not the "
                          "float8 stand-ins: pass kernels (training/kernels.py)")
    device = torch.device(device)
    notes: list[str] = []
    task, config = "", {}
    if model_config is None and is_factory_ref(job.model):
        model, make_batch, compute_loss = from_factory(job, device, notes)
        name = job.model
    else:
        config = model_config if model_config is not None else load_model_config(job.model)
        text = language_model_config(config, job.model)
        if text is not None:  # a vision-language config: its language model, as the formula
            config = text[0]
            notes.append(text[1])
        quantized = prequantized(config, job.model, job.peft.method if job.peft else None,
                                 job.peft.double_quant if job.peft else False)
        if quantized:  # built unquantised and quantised as the QLoRA job, as it loads
            notes.append(quantized)
        task = job.task or task_of_config(config)
        model = build_hf_model(config, task, job, device=device, empty=empty, notes=notes,
                               kernels=kernels)
        make_batch = hf_batch_factory(config, task, job, device, notes)
        if job.loss == "chunked:liger":  # the formula's only: its kernel is Triton's
            raise EngineError("loss chunked:liger (Liger-Kernel's fused linear cross-entropy, "
                              "a Triton kernel) is modelled by the formula engine only: use "
                              "--engine formula, or loss standard here")
        compute_loss = LOSSES[job.loss]
        if job.loss.startswith("chunked") and task != "causal-lm":
            raise EngineError(f"chunked loss is implemented for causal-lm only (task {task})")
        name = config.get("_name_or_path") or (job.model if model_config is None
                                                else config["model_type"])
    model.train()
    if job.compile:
        # fake tensors: the trace's backend; a real device: Inductor itself
        compute_loss = apply_compile(model, job, trace_backend() if empty else "inductor",
                                     notes, compute_loss)
    if job.activation_offload:
        from vramplan.training.offload import offloading_loss

        compute_loss = offloading_loss(compute_loss, model, device)
        notes.append("activation offload as torchtune's OffloadActivations: saved tensors "
                     "of >= 1 KiB go to host memory, the last 5 stay on the GPU until "
                     "backward starts; the output head and the loss keep theirs")
    if job.offload.optimizer:
        notes.append("optimizer offload: the optimizer states and step live on the CPU; "
                     "updated values are written into the GPU's parameters")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(job, trainable, notes, kernels)
    if kernels is not None and kernels.note():
        notes.append(kernels.note())
    autocast = SIXTEEN_BIT[job.precision] if job.precision in (
        "fp16-mixed", "bf16-mixed", "fp8") else None
    tokens = text_len(job.seq_len, config, "seq_len", []) if task in (
        "causal-lm", "masked-lm", "seq-classification", "seq2seq") else 0
    setup = TrainingSetup(model, optimizer, make_batch, compute_loss, autocast, device, name,
                          clip_foreach=job.optimizer_impl != "loop", notes=notes, task=task,
                          tokens_per_sample=tokens, keep_grads=job.keep_grads_between_steps,
                          no_sync=job.parallel.fsdp_no_sync, kernels=kernels)
    if job.optimizer_in_backward:
        setup.optimizer = _optimizer_in_backward(setup, job, trainable)
    return setup


class _StepsInBackward(torch.optim.Optimizer):
    """What train_step sees when each parameter is stepped by its own optimizer in a
    post-accumulate-grad hook: nothing is left to do after backward."""

    def __init__(self, per_param: dict):
        self.per_param = per_param
        super().__init__(list(per_param), {})

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None


def _optimizer_in_backward(setup: TrainingSetup, job: Job, trainable: list) -> _StepsInBackward:
    per_param = {p: build_optimizer(job, [p], [], setup.kernels) for p in trainable}

    def step_now(p: torch.Tensor) -> None:
        setup.mark("optimizer")
        per_param[p].step()
        per_param[p].zero_grad(set_to_none=True)
        setup.mark("backward")

    for p in trainable:
        p.register_post_accumulate_grad_hook(step_now)
    setup.notes.append("optimizer in backward: each parameter is stepped (and its gradient "
                       "freed) as soon as it is ready; gradient clipping is not possible")
    return _StepsInBackward(per_param)


def _named_params(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Parameter]]:
    seen = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield module, p


def _logical_numel(module: nn.Module, p: nn.Parameter) -> int:
    """Parameters as the model counts them: a packed 4-bit weight holds out x in of them."""
    if isinstance(module, lowbit.Packed4bitLinear):
        return module.in_features * module.out_features if p is module.packed else 0
    state = getattr(p, "quant_state", None)  # a bitsandbytes Params4bit
    return math.prod(state.shape) if state is not None else p.numel()


def _check_modelled(job: Job) -> None:
    """Job settings this step does not run yet: refuse rather than report another step."""
    if job.offload.params and not job.offload.optimizer:
        # FSDP2's CPUOffloadPolicy steps the optimizer on the CPU parameters
        raise EngineError("the trace runs offload.params as FSDP2's CPUOffloadPolicy, whose "
                          "optimizer steps the CPU parameters: set offload.optimizer too "
                          "(--offload-optimizer), or use --engine formula")

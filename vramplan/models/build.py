"""Build the torch training setup of a Job: model, optimizer, batches, loss, one train step.

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
nn.Module (see _from_factory for the forms it may return).

What each precision means here (Hugging Face Trainer conventions):
  fp32         fp32 weights, no autocast
  fp16/bf16-mixed  fp32 weights + torch.autocast; with peft the frozen base is stored in
               the 16-bit dtype and the adapters in fp32 (peft's autocast_adapter_dtype)
  bf16-pure    every weight, gradient and optimizer state in bf16
  fp8          as bf16-mixed, with block linears run on float8 copies (models/lowbit.py)
On a CPU the autocast op lists differ from CUDA's; train_step applies CUDA's lists there
(models/autocast.py).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.errors import EngineError, ModelConfigError
from vramplan.job import CHUNKED_LOSS_CHUNKS, Job
from vramplan.models import families, lowbit
from vramplan.models.derive import architecture_from_config
from vramplan.models.families import TRAINED_ATTENTION_BIAS
from vramplan.models.autocast import cuda_autocast_policy, cuda_dropout_kernels

AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq-classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
}
# HF class-name suffix -> task, to pick a default task for a bare config.json
_TASK_BY_SUFFIX = {
    "ForCausalLM": "causal-lm", "LMHeadModel": "causal-lm", "ForMaskedLM": "masked-lm",
    "ForSequenceClassification": "seq-classification", "ForImageClassification":
    "image-classification", "ForConditionalGeneration": "seq2seq",
}
_TASK_ORDER = (  # encoder-decoders first, encoders (which also have LM heads) before decoders
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("seq-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
)
# Whisper gets no task type: peft's seq2seq wrapper passes input_ids, which Whisper's
# decoder then receives twice (Hugging Face's Whisper LoRA recipes leave task_type unset)
_PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM",
                    "seq-classification": "SEQ_CLS"}
MAX_GRAD_NORM = 1.0       # Hugging Face Trainer default
SIXTEEN_BIT = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
               "bf16-pure": torch.bfloat16, "fp8": torch.bfloat16}


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
    setup.optimizer.zero_grad(set_to_none=True)
    mark("end")


def _micro_steps(setup: TrainingSetup, grad_accum: int, mark: Callable[[str], None]) -> None:
    for _ in range(grad_accum):
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
                         model_config: dict | None = None, empty: bool = False) -> TrainingSetup:
    device = torch.device(device)
    notes: list[str] = []
    task, config = "", {}
    if model_config is None and _is_factory_ref(job.model):
        model, make_batch, compute_loss = _from_factory(job, device, notes)
        name = job.model
    else:
        config = model_config if model_config is not None else load_model_config(job.model)
        task = job.task or task_of_config(config)
        model = build_hf_model(config, task, job, device=device, empty=empty, notes=notes)
        make_batch = hf_batch_factory(config, task, job, device, notes)
        compute_loss = chunked_causal_lm_loss if job.loss == "chunked" else hf_loss
        if job.loss == "chunked" and task != "causal-lm":
            raise EngineError(f"chunked loss is implemented for causal-lm only (task {task})")
        name = config.get("_name_or_path") or (job.model if model_config is None
                                                else config["model_type"])
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(job, trainable, notes)
    autocast = SIXTEEN_BIT[job.precision] if job.precision in (
        "fp16-mixed", "bf16-mixed", "fp8") else None
    tokens = text_len(job.seq_len, config, "seq_len", []) if task in (
        "causal-lm", "masked-lm", "seq-classification", "seq2seq") else 0
    setup = TrainingSetup(model, optimizer, make_batch, compute_loss, autocast, device, name,
                          clip_foreach=job.optimizer_impl != "loop", notes=notes, task=task,
                          tokens_per_sample=tokens)
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
    per_param = {p: build_optimizer(job, [p], []) for p in trainable}

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


# --- model source -----------------------------------------------------------------------------

def _is_factory_ref(ref: str) -> bool:
    module, sep, attr = ref.partition(":")
    return bool(sep) and bool(attr) and "/" not in module and "\\" not in module \
        and not Path(ref).exists()


def load_model_config(ref: str) -> dict:
    """The Hugging Face config dict of a catalog name, config.json or model folder."""
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ModelConfigError(f"cannot read {path}: {error}") from None
    from vramplan.models import load_architecture  # the catalog (names, HF ids)
    return dict(load_architecture(ref).extra)


def task_of_config(config: dict) -> str:
    """The config's own task: from its `architectures`, else the first of transformers'
    task mappings (in _TASK_ORDER) that has a class for its model_type."""
    from transformers.models.auto import modeling_auto as auto
    model_type = config.get("model_type")
    if model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return "speech-seq2seq"
    for arch in config.get("architectures") or ():
        for suffix, task in _TASK_BY_SUFFIX.items():
            if arch.endswith(suffix):
                return "seq2seq" if task == "seq2seq" and config.get("is_encoder_decoder", True) \
                    else task
    for task, mapping in _TASK_ORDER:
        if model_type in getattr(auto, mapping):
            return task
    return "causal-lm"


def _hf_config(config: dict, task: str, job: Job):
    from transformers import AutoConfig
    values = {k: v for k, v in config.items() if k not in (
        "model_type", "architectures", "transformers_version", "_name_or_path", "torch_dtype",
        "dtype", "quantization_config", "auto_map")}
    if "model_type" not in config:
        raise ModelConfigError("the model config has no 'model_type': it is needed to pick the "
                               "transformers class")
    if task == "image-classification" and job.image_size:
        values["image_size"] = job.image_size  # position embeddings sized for the job's images
    try:
        hf = AutoConfig.for_model(config["model_type"], **values)
    except (ValueError, KeyError, TypeError) as error:
        raise ModelConfigError(f"transformers cannot build a {config['model_type']!r} config: "
                               f"{error}") from None
    hf.use_cache = False  # training: no KV cache
    if task == "seq-classification" and getattr(hf, "pad_token_id", None) is None:
        hf.pad_token_id = 0  # decoder classifiers need one to find the last token
    return hf


# --- Hugging Face models ----------------------------------------------------------------------

def build_hf_model(config: dict, task: str, job: Job, *, device: torch.device, empty: bool,
                   notes: list[str]) -> nn.Module:
    import transformers
    hf_config = _hf_config(config, task, job)
    auto = getattr(transformers, AUTO_CLASSES[task])
    if job.peft is None:
        dtype = torch.bfloat16 if job.precision == "bf16-pure" else torch.float32
    else:  # frozen base: no master copy needed, stored in the compute dtype
        dtype = SIXTEEN_BIT.get(job.precision, torch.float32)
    # empty: everything up to the materialisation runs on meta, outside the caller's
    # FakeTensorMode (peft cannot swap fake parameters)
    with _no_dispatch_modes() if empty else contextlib.nullcontext():
        model = _build_on(auto, hf_config, job, dtype, torch.device("meta") if empty else device,
                          task, notes)
    if empty:
        _materialize(model, device)
    return model


def _no_dispatch_modes():
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


# models whose sdpa call gets an additive mask that requires grad (a learned bias)


def _build_on(auto, hf_config, job: Job, dtype: torch.dtype, device: torch.device, task: str,
              notes: list[str]) -> nn.Module:
    peft = job.peft
    try:
        with device:
            try:
                model = auto.from_config(hf_config, attn_implementation=job.attention,
                                         dtype=dtype)
            except ValueError as error:
                if "attention implementation" not in str(error) or job.attention == "eager":
                    raise
                model = auto.from_config(hf_config, attn_implementation="eager", dtype=dtype)
                notes.append(f"{hf_config.model_type}: transformers has no {job.attention} "
                             "attention for this model; traced with eager attention")
            if job.attention == "sdpa" and hf_config.model_type in TRAINED_ATTENTION_BIAS:
                notes.append(f"{hf_config.model_type} passes a trained position bias to sdpa: "
                             "CUDA runs it with the memory-efficient kernel, whose tensors the "
                             "trace keeps; a real CPU run takes the math kernel instead, which "
                             "also stores the s x s scores")
    except ValueError as error:
        raise ModelConfigError(f"{hf_config.model_type!r} has no {task} model in transformers: "
                               f"{str(error).splitlines()[0]}") from None
    skip = {id(model.get_output_embeddings())} if model.get_output_embeddings() else set()
    if job.precision == "fp8":
        count = lowbit.convert_to_fp8(model, skip)
        notes.append(f"fp8: {count} linears keep float8 copies of their inputs and weights for "
                     "backward (torchao Float8Linear-like); weights fp32 + bf16 autocast")
    _apply_checkpointing(model, job, notes)
    if peft is not None:
        with device:
            model = _apply_peft(model, task, job, skip, notes)
    return model


def _materialize(model: nn.Module, device: torch.device) -> None:
    """meta -> uninitialised tensors on `device` (Module.to_empty swaps tensors in place,
    which fails for fake tensors)."""
    _replace_tensors(model, lambda t: torch.empty_like(t, device=device)
                     if t.device.type == "meta" else t)


def _replace_tensors(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply fn to every parameter and buffer by reassignment, keeping tied ones tied."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in new:
                    with torch.no_grad():
                        value = fn(t)
                    new[id(t)] = (nn.Parameter(value, requires_grad=t.requires_grad)
                                  if isinstance(t, nn.Parameter) and value is not t else value)
                table[name] = new[id(t)]


def _apply_checkpointing(model: nn.Module, job: Job, notes: list[str]) -> None:
    if job.checkpointing == "none":
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        notes.append(f"{type(model).__name__} does not support gradient checkpointing: "
                     "traced without it")
        return
    kwargs = {"use_reentrant": False}
    if job.checkpointing == "selective":
        kwargs["context_fn"] = _save_matmuls_only
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _save_matmuls_only():
    """Selective checkpointing as torchtitan's "op" policy: inside each block keep the
    outputs of matmuls and attention kernels, recompute everything else in backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    kept = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _apply_peft(model: nn.Module, task: str, job: Job, skip: set[int],
                notes: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from peft.utils import ModulesToSaveWrapper
    spec = job.peft
    targets = "all-linear" if spec.target_modules == ("all-linear",) else list(spec.target_modules)
    # a new image classifier trains whole beside the adapters, as in Hugging Face's LoRA
    # image-classification guide (peft's SEQ_CLS task type does the same for text)
    head = ["classifier"] if task == "image-classification" and hasattr(model, "classifier") \
        else None
    lora = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=targets, task_type=_PEFT_TASK_TYPES.get(task),
                      modules_to_save=head)
    try:
        with warnings.catch_warnings():  # peft still asks for is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(model, lora,
                                   autocast_adapter_dtype=job.precision != "bf16-pure")
    except ValueError as error:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, (nn.Linear, Conv1D))})
        raise ModelConfigError(f"LoRA target_modules {list(spec.target_modules)} do not match "
                               f"this model ({str(error).splitlines()[0]}); its linear layers "
                               f"are named: {', '.join(linears)}") from None
    if spec.method == "qlora":
        for module in model.modules():
            if isinstance(module, ModulesToSaveWrapper):
                skip |= {id(m) for m in module.modules()}
        count = lowbit.pack_frozen_linears(model, skip, spec.double_quant)
        notes.append(f"QLoRA: {count} frozen linears stored as NF4 (uint8 numel/2 + absmax per "
                     "64 values"
                     + (", double-quantised" if spec.double_quant else "")
                     + "); each matmul dequantises its weight to a temporary, as bitsandbytes")
    return model


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
    return p.numel()


# --- batches and losses -----------------------------------------------------------------------

def hf_batch_factory(config: dict, task: str, job: Job, device: torch.device,
                     notes: list[str]) -> Callable[[], dict]:
    """Synthetic micro-batch, as a data loader delivers it (no padding, so no attention mask:
    Hugging Face then skips building a [B, 1, L, L] mask, as it does for all-ones masks)."""
    b, vocab = job.batch_size, int(config.get("vocab_size") or 2)
    seq = text_len(job.seq_len, config, "seq_len", notes)
    floats = torch.bfloat16 if job.precision == "bf16-pure" else torch.float32
    num_labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)

    def tokens(length: int) -> torch.Tensor:
        return torch.randint(1, vocab, (b, length), device=device)

    if task in ("causal-lm", "masked-lm"):
        return lambda: (lambda ids: {"input_ids": ids, "labels": tokens(seq)})(tokens(seq))
    if task == "seq-classification":
        return lambda: {"input_ids": tokens(seq),
                        "labels": torch.randint(0, num_labels, (b,), device=device)}
    if task == "seq2seq":
        target = job.target_len or seq
        return lambda: {"input_ids": tokens(seq), "labels": tokens(target),
                        "decoder_input_ids": tokens(target)}
    if task == "image-classification":
        size = job.image_size or int(config.get("image_size") or 224)
        channels = int(config.get("num_channels") or 3)
        return lambda: {"pixel_values": torch.randn(b, channels, size, size, dtype=floats,
                                                    device=device),
                        "labels": torch.randint(0, num_labels, (b,), device=device)}
    if task == "speech-seq2seq":
        mels = int(config.get("num_mel_bins") or 80)
        frames = 2 * int(config.get("max_source_positions") or 1500)  # stride-2 conv frontend
        if job.audio_seconds:
            frames = round(job.audio_seconds * 100)  # 10 ms hop of the log-mel features
        limit = int(config.get("max_target_positions") or seq)
        target = job.target_len or min(job.seq_len or limit, limit)
        if not job.target_len and job.seq_len and job.seq_len > limit:
            notes.append(f"decoder tokens capped at the model's max_target_positions={limit}")
        return lambda: {"input_features": torch.randn(b, mels, frames, dtype=floats,
                                                      device=device),
                        "labels": tokens(target), "decoder_input_ids": tokens(target)}
    raise ModelConfigError(f"no batch factory for task {task!r}")


# models whose positions are a learned table: longer sequences index past its end
def text_len(requested: int | None, config: dict, field: str, notes: list[str]) -> int:
    """The job's text length, by the formula engine's rule and the model length it derives
    (families.text_len); a config of a family it does not know gives its own length."""
    name = config.get("_name_or_path") or config.get("model_type") or "the model"
    try:
        limit = architecture_from_config(config, name).max_positions
    except ModelConfigError:
        limit = config.get("max_position_embeddings") or config.get("n_positions")
    return families.text_len(requested, limit, config.get("model_type", ""), name, field, notes)


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    # The model's own loss (logits upcast to fp32 inside); the output, with its logits,
    # is dropped on return, as in Trainer.compute_loss.
    return model(**batch).loss


def chunked_causal_lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy over sequence chunks, each chunk's logits recomputed in backward."""
    from torch.utils.checkpoint import checkpoint
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state
    head = base.get_output_embeddings()
    labels = nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # next token

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                           ignore_index=-100, reduction="sum")

    total = sum(checkpoint(chunk_loss, h, y, use_reentrant=False) for h, y in zip(
        hidden.chunk(CHUNKED_LOSS_CHUNKS, dim=1), labels.chunk(CHUNKED_LOSS_CHUNKS, dim=1)))
    return total / labels.numel()


# --- user factories: "package.module:function" -----------------------------------------------

def _from_factory(job: Job, device: torch.device, notes: list[str]):
    """Call a user factory. It returns an nn.Module, (module, batch_fn), or a dict with
    'model' and optionally 'batch' (callable(batch_size, device)), 'input_shapes'
    ({name: per-sample shape} or one shape) and 'loss' (callable(output, batch))."""
    module_name, _, attr = job.model.partition(":")
    try:
        factory: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except Exception as error:  # any import-time failure of the user's module
        raise ModelConfigError(f"cannot load factory {job.model!r}: {type(error).__name__}: "
                               f"{error}") from None
    try:
        wants_job = len(inspect.signature(factory).parameters) > 0
        result = factory(job) if wants_job else factory()
    except Exception as error:
        raise ModelConfigError(f"factory {job.model!r} raised {type(error).__name__}: "
                               f"{error}") from None
    batch_fn, shapes, loss_fn = None, None, None
    if isinstance(result, tuple) and len(result) == 2:
        result, batch_fn = result
    elif isinstance(result, dict):
        batch_fn, shapes, loss_fn = result.get("batch"), result.get("input_shapes"), \
            result.get("loss")
        result = result.get("model")
    if not isinstance(result, nn.Module):
        raise ModelConfigError(f"factory {job.model!r} returned {type(result).__name__}, not a "
                               "torch.nn.Module (return a module, (module, batch_fn) or "
                               "{'model': module, 'input_shapes': ...})")
    model = result
    floats = torch.bfloat16 if job.precision == "bf16-pure" else None
    _replace_tensors(model, lambda t: t.to(device, floats if t.is_floating_point() else None))
    if job.peft is not None:
        raise EngineError("peft on a factory model is not supported yet: apply LoRA inside "
                          "the factory")
    if job.checkpointing != "none":
        notes.append("checkpointing is applied to Hugging Face models only: a factory model "
                     "has to checkpoint itself")
    if batch_fn is None and shapes is None:
        raise ModelConfigError(f"factory {job.model!r} gave no inputs: return (module, "
                               "batch_fn) or {'model': module, 'input_shapes': {...}}")
    floats = torch.bfloat16 if job.precision == "bf16-pure" else torch.float32
    if batch_fn is not None:
        make_batch = lambda: batch_fn(job.batch_size, device)  # noqa: E731
    elif isinstance(shapes, dict):
        make_batch = lambda: {k: torch.randn(job.batch_size, *s, dtype=floats,  # noqa: E731
                                             device=device) for k, s in shapes.items()}
    else:
        make_batch = lambda: torch.randn(job.batch_size, *shapes, dtype=floats,  # noqa: E731
                                         device=device)
    return model, make_batch, lambda m, batch: _generic_loss(m, batch, loss_fn)


def _generic_loss(model: nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    if loss_fn is not None:
        return loss_fn(output, batch)
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if isinstance(output, (tuple, list)):
        output = output[0]
    return output.float().mean()  # stands in for the user's loss: same backward graph


# --- optimizers -------------------------------------------------------------------------------

class _ValueFreeAdafactor(torch.optim.Adafactor):
    """torch's Adafactor, whose step reads its step count and norms with .item() to scale the
    update. Fake tensors have no values, so in the trace those reads give 1.0: the step
    allocates the same tensors, only the scale differs. Real tensors are untouched."""

    def step(self, closure=None):
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._python_dispatch import TorchDispatchMode

        class ItemsOfFakeTensorsAreOne(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
                    return 1.0
                return func(*args, **(kwargs or {}))

        fake = any(is_fake(p) for g in self.param_groups for p in g["params"])
        with ItemsOfFakeTensorsAreOne() if fake else contextlib.nullcontext():
            return super().step(closure)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): one momentum buffer in the parameter's dtype."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.lerp(p.grad, 1 - beta1).sign_(), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)


def fully_shard_setup(setup: TrainingSetup, job: Job, mesh=None) -> int:
    """Shard the model with FSDP2 as the job's strategy asks, each repeated block its own
    unit, then rebuild the optimizer over the sharded parameters. Returns the block count.

    zero2 keeps parameters gathered after the forward; zero3 / fsdp / hybrid-shard reshard
    them. Under mixed precision FSDP gathers 16-bit parameters and reduces gradients in
    fp32 (as accelerate and torchtitan set FSDP2 up), so autocast has nothing to cast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = job.parallel.strategy != "zero2"
    policy = MixedPrecisionPolicy(param_dtype=setup.autocast_dtype, reduce_dtype=torch.float32)
    blocks = repeated_blocks(setup.model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(setup.model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    setup.optimizer = build_optimizer(job, setup.trainable, [])  # over the sharded params
    return len(blocks)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the classes a Hugging Face model names in
    _no_split_modules, else the children of the largest nn.ModuleList."""
    names = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def build_optimizer(job: Job, params: list[nn.Parameter], notes: list[str]):
    if not params:
        raise ModelConfigError("the model has no trainable parameters")
    impl = {"foreach": dict(foreach=True), "fused": dict(fused=True),
            "loop": dict(foreach=False)}[job.optimizer_impl]
    name = job.optimizer
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "sgd-momentum" else 0,
                               **impl)
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=1e-4, **impl)
    if name in ("adamw-8bit", "paged-adamw-8bit"):
        notes.append("8-bit AdamW: bitsandbytes layout (uint8 states + fp32 absmax per 256 "
                     "values; tensors under 4096 values keep fp32 states)")
        if name == "paged-adamw-8bit":
            notes.append("paged-adamw-8bit: states live in CUDA unified memory outside the "
                         "caching allocator; counted here as resident on the GPU")
        return lowbit.AdamW8bit(params, lr=1e-4)
    if name == "adafactor":
        return _ValueFreeAdafactor(params, lr=1e-2, foreach=job.optimizer_impl == "foreach")
    if name == "lion":
        notes.append("lion: per-parameter loop implementation (torch has none)")
        return Lion(params)
    raise EngineError(f"optimizer {name!r} is not supported by the trace engine")

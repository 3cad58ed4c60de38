"""Hugging Face models from a config dict: the config, the task, the model with its
checkpointing, peft adapters and low-bit layers, built on a device or on meta."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from vramplan.errors import ModelConfigError
from vramplan.job import Job
from vramplan.models.families import family_traits
from vramplan.training.checkpointing import apply_checkpointing
from vramplan.training.emulate import lowbit
from vramplan.training.hf_config import to_hf_config
from vramplan.training.kernels import BNB, FLASH_ATTN, STAND_IN, TORCHAO, Kernels
from vramplan.training.peft import apply_peft
from vramplan.training.tensors import SIXTEEN_BIT, model_dtype, replace_tensors

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
    from vramplan.models.derive import transformers_gaps
    gaps = transformers_gaps(config)
    if gaps:
        # the trace would measure another model than the config describes
        raise ModelConfigError(
            f"transformers' {config['model_type']!r} class ignores what this config asks for "
            f"({'; '.join(gaps)}) and would build another model: use --engine formula, which "
            "reads the config as its publisher builds it")
    overrides = {}
    if task == "image-classification" and job.image_size:
        overrides["image_size"] = job.image_size  # position embeddings sized for the job's images
    hf = to_hf_config(config, "the model config", **overrides)
    hf.use_cache = False  # training: no KV cache
    if task == "seq-classification" and getattr(hf, "pad_token_id", None) is None:
        hf.pad_token_id = 0  # decoder classifiers need one to find the last token
    return hf


# --- Hugging Face models ----------------------------------------------------------------------

def build_hf_model(config: dict, task: str, job: Job, *, device: torch.device, empty: bool,
                   notes: list[str], kernels: Kernels | None = None) -> nn.Module:
    """kernels: the real libraries to use (training/kernels.py); None: the stand-ins."""
    import transformers
    hf_config = _hf_config(config, task, job)
    auto = getattr(transformers, AUTO_CLASSES[task])
    if job.peft is None:
        dtype = model_dtype(job)
    else:  # frozen base: no master copy needed, stored in the compute dtype
        dtype = SIXTEEN_BIT.get(job.precision, torch.float32)
    # empty: everything up to the materialisation runs on meta, outside the caller's
    # FakeTensorMode (peft cannot swap fake parameters)
    kernels = kernels or Kernels()
    if kernels.qlora == BNB and not empty:
        return _build_qlora(auto, hf_config, job, dtype, device, task, notes, kernels)
    with _no_dispatch_modes() if empty else contextlib.nullcontext():
        model = _build_on(auto, hf_config, job, dtype, torch.device("meta") if empty else device,
                          task, notes, kernels)
    if empty:
        _materialize(model, device)
    return model


def _build_qlora(auto, hf_config, job: Job, dtype: torch.dtype, device: torch.device, task: str,
                 notes: list[str], kernels: Kernels) -> nn.Module:
    """QLoRA with bitsandbytes, as from_pretrained(quantization_config=...) leaves it: the
    model is built on meta, its linears quantised one by one on the device, the rest made
    and initialised there, then peft wraps the Linear4bit layers (its bnb LoRA layers)."""
    from vramplan.training import real_kernels

    model = _from_config(auto, hf_config, job, dtype, task, notes, torch.device("meta"),
                         kernels)
    head = model.get_output_embeddings()
    skip = {id(m) for m in (head, getattr(model, "classifier", None)) if m is not None}
    count = real_kernels.quantize_linears_4bit(model, skip, job.peft.double_quant, device,
                                               compute_dtype=dtype)
    _materialize(model, device)
    for module in model.modules():  # built on meta: transformers marked them initialised
        if type(module).__name__ != "Linear4bit":
            module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()  # its own init rules, rotary buffers included
    model.is_loaded_in_4bit = True  # what peft reads to pick its bitsandbytes LoRA layers
    notes.append(f"QLoRA: {count} linears are bitsandbytes Linear4bit (nf4"
                 + (", double-quantised" if job.peft.double_quant else "")
                 + "), quantised layer by layer on the device")
    apply_checkpointing(model, job, notes)
    with device:
        return apply_peft(model, task, job, skip, notes, kernels)


def _no_dispatch_modes():
    from vramplan.training.private_api import _disable_current_modes
    return _disable_current_modes()


# models whose sdpa call gets an additive mask that requires grad (a learned bias)


def _build_on(auto, hf_config, job: Job, dtype: torch.dtype, device: torch.device, task: str,
              notes: list[str], kernels: Kernels) -> nn.Module:
    model = _from_config(auto, hf_config, job, dtype, task, notes, device, kernels)
    skip = {id(model.get_output_embeddings())} if model.get_output_embeddings() else set()
    recipe = job.fp8.recipe
    if job.precision == "fp8" and kernels.fp8 == TORCHAO:
        from vramplan.training import real_kernels
        count = real_kernels.convert_to_fp8(model, skip, recipe,
                                            job.fp8.fsdp_float8_all_gather)
        kind = "MXFP8Linear" if recipe == "mxfp8" else "Float8Linear"
        notes.append(f"fp8: {count} linears are torchao {kind} (recipe {recipe})")
    elif job.precision == "fp8":
        count = lowbit.convert_to_fp8(model, skip, recipe)
        notes.append(f"fp8: {count} linears save their high-precision inputs and weights and "
                     f"cast both to float8 per matmul (torchao recipe {recipe}, stand-in); "
                     "weights fp32 + bf16 autocast")
    apply_checkpointing(model, job, notes)
    if job.peft is not None:
        with device:
            model = apply_peft(model, task, job, skip, notes, kernels)
    return model


def _from_config(auto, hf_config, job: Job, dtype: torch.dtype, task: str, notes: list[str],
                 device: torch.device, kernels: Kernels) -> nn.Module:
    # flash-attn's kernels are CUDA's: measure on CUDA runs them (kernels.attention); the
    # trace and CPU runs take SDPA, whose fused kernels keep the same tensors. cudnn: SDPA,
    # which takes cuDNN's kernel itself on compute capability 9.0 / 10.0
    real = kernels.attention not in ("", STAND_IN)
    attention = ("eager" if job.attention == "eager" else
                 FLASH_ATTN[job.attention][1] if real else "sdpa")
    if job.attention not in ("eager", "sdpa") and not real:
        notes.append(f"attention {job.attention}: run as SDPA here, whose fused kernels "
                     "keep the same tensors")
    try:
        with device:
            try:
                model = auto.from_config(hf_config, attn_implementation=attention,
                                         dtype=dtype)
            except ValueError as error:
                if "attention implementation" not in str(error) or attention == "eager":
                    raise
                model = auto.from_config(hf_config, attn_implementation="eager", dtype=dtype)
                notes.append(f"{hf_config.model_type}: transformers has no {attention} "
                             "attention for this model; traced with eager attention")
            if attention == "sdpa" and family_traits(hf_config.model_type,
                                                        {}).trained_attention_bias:
                notes.append(f"{hf_config.model_type} passes a trained position bias to sdpa: "
                             "CUDA runs it with the memory-efficient kernel, whose tensors the "
                             "trace keeps; a real CPU run takes the math kernel instead, which "
                             "also stores the s x s scores")
    except ValueError as error:
        raise ModelConfigError(f"{hf_config.model_type!r} has no {task} model in transformers: "
                               f"{str(error).splitlines()[0]}") from None
    return model


def _materialize(model: nn.Module, device: torch.device) -> None:
    """meta -> uninitialised tensors on `device` (Module.to_empty swaps tensors in place,
    which fails for fake tensors)."""
    replace_tensors(model, lambda t: torch.empty_like(t, device=device)
                     if t.device.type == "meta" else t)

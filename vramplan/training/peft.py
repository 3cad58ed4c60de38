"""LoRA and QLoRA adapters on a Hugging Face model (peft), with the 4-bit base packed."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from vramplan.engines.precision import adapter_bytes
from vramplan.errors import ModelConfigError
from vramplan.job import Job
from vramplan.training.emulate import lowbit
from vramplan.training.kernels import BNB, Kernels
from vramplan.training.tensors import SIXTEEN_BIT

# Whisper gets no task type: peft's seq2seq wrapper passes input_ids, which Whisper's
# decoder then receives twice (Hugging Face's Whisper LoRA recipes leave task_type unset)
_PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM",
                    "seq-classification": "SEQ_CLS"}


def apply_peft(model: nn.Module, task: str, job: Job, skip: set[int],
               notes: list[str], kernels: Kernels | None = None) -> nn.Module:
    """LoRA adapters by peft; QLoRA packs the frozen base with the stand-in, unless the
    base is already bitsandbytes Linear4bit (kernels.qlora, training/hf_model.py)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import ModulesToSaveWrapper
    spec = job.peft
    targets = "all-linear" if spec.target_modules == ("all-linear",) else list(spec.target_modules)
    # a new image classifier trains whole beside the adapters, as in Hugging Face's LoRA
    # image-classification guide (peft's SEQ_CLS task type does the same for text)
    head = ["classifier"] if task == "image-classification" and hasattr(model, "classifier") \
        else []
    saved = head + [_module_name(model, role) for role in spec.modules_to_save]
    lora = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=targets, task_type=_PEFT_TASK_TYPES.get(task),
                      modules_to_save=saved or None, use_dora=spec.dora)
    try:
        with warnings.catch_warnings():  # peft still asks for is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            # fp32 adapters: peft upcasts 16-bit ones (autocast_adapter_dtype); else they
            # keep the base's dtype (torchtune); engines/precision.adapter_bytes decides both
            model = get_peft_model(model, lora, autocast_adapter_dtype=adapter_bytes(job) == 4)
    except ValueError as error:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, (nn.Linear, Conv1D))})
        raise ModelConfigError(f"LoRA target_modules {list(spec.target_modules)} do not match "
                               f"this model ({str(error).splitlines()[0]}); its linear layers "
                               f"are named: {', '.join(linears)}") from None
    if adapter_bytes(job) != 4:
        _cast_adapters(model, SIXTEEN_BIT.get(job.precision))  # the base's dtype
    if spec.method == "qlora" and (kernels is None or kernels.qlora != BNB):
        for module in model.modules():
            if isinstance(module, ModulesToSaveWrapper):
                skip |= {id(m) for m in module.modules()}
        count = lowbit.pack_frozen_linears(model, skip, spec.double_quant)
        notes.append(f"QLoRA: {count} frozen linears stored as NF4 (uint8 numel/2 + absmax per "
                     "64 values"
                     + (", double-quantised" if spec.double_quant else "")
                     + "); each matmul dequantises its weight to a temporary, as bitsandbytes")
    if spec.method == "qlora" and spec.quant_library == "torchao":
        notes.append("QLoRA run with bitsandbytes' 4-bit layers: torchao's NF4Tensor "
                     "(torchtune) stores the same bytes, but its eager dequantising holds 12 "
                     "bytes a weight more for the largest linear, which only the formula "
                     "counts (engines/param_memory.py nf4_dequantise_peak)")
    return model


def _module_name(model: nn.Module, role: str) -> str:
    """This model's own name for a Job's modules_to_save entry (GPT-2's token embedding is
    wte, GPT-NeoX's head embed_out): the last part of the input / output embedding's path,
    which peft matches by suffix."""
    module = model.get_input_embeddings() if role == "embed_tokens" else \
        model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is module and n), None)
    if name is None:
        raise ModelConfigError(f"peft.modules_to_save {role}: this model has no "
                               f"{'token embedding' if role == 'embed_tokens' else 'LM head'} "
                               "to train")
    return name.rsplit(".", 1)[-1]


def _cast_adapters(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Adapters in the model's dtype, as torchtune builds them. peft leaves them fp32 when
    it creates them on the meta device, whatever autocast_adapter_dtype says."""
    if dtype is None:
        return
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_" in name and param.dtype != dtype:
            param.data = param.data.to(dtype)

"""The formula's Architecture read from a model transformers builds on the meta device.

derive.py knows a fixed table of families. For any other config transformers can build
(GPT-NeoX/Pythia, OPT, Falcon, a family added later), this module builds the model on the
meta device (no memory, no weights, nothing downloaded) and reads the shapes from it: the
repeated blocks (the longest ModuleList of identical layers), each block's linears (in/out
features, bias), its norms and parameters, the embeddings and the task head. Heads, key/value
heads and the head size come from the config and the attention projections.

vramplan/__init__.py passes this reader to vramplan.models (which never imports training); it
runs only when derive.py has no builder, so the catalog and the formula stay torch-free for
every family derive.py knows.
"""

from __future__ import annotations

import torch
from torch import nn

from vramplan.errors import ModelConfigError
from vramplan.models.arch import Architecture, Linear, Stack
from vramplan.training.hf_config import refuse_defaulted_shapes, to_hf_config

# causal-lm first: the formula models the decoder's language-model loss
_AUTO = {"causal-lm": "AutoModelForCausalLM", "seq-classification":
         "AutoModelForSequenceClassification", "masked-lm": "AutoModelForMaskedLM"}
_ATTENTION_WORDS = ("attn", "attention")


def _first(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def build_on_meta(config: dict, name: str) -> tuple[nn.Module, object, str]:
    """(model, transformers config, task) of a config dict, built on the meta device."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    mt = config.get("model_type")
    hf = to_hf_config(config, name, check_shapes=False)
    if _first(hf, "num_attention_heads", "n_head", "num_heads") is None:
        # RWKV, Mamba and other recurrent or state-space blocks
        raise ModelConfigError(f"{name}: {mt!r} has no attention heads (its transformers "
                               "config has no num_attention_heads): the formula models "
                               "softmax-attention transformers and its blocks are not: use "
                               "--engine trace")
    refuse_defaulted_shapes(config, hf, name)
    hf.use_cache = False
    mappings = {"causal-lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                "seq-classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                "masked-lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES}
    task = next((t for t, m in mappings.items() if mt in m), None)
    if task is None:
        raise ModelConfigError(f"{name}: the formula reads decoder/encoder language models "
                               f"only; {mt!r} has none in transformers: use --engine trace")
    if task == "seq-classification" and getattr(hf, "pad_token_id", None) is None:
        hf.pad_token_id = 0
    try:
        with torch.device("meta"):
            model = getattr(transformers, _AUTO[task]).from_config(hf)
    except Exception as error:  # any failure of the family's constructor
        raise ModelConfigError(f"{name}: transformers cannot build {mt!r} "
                               f"({type(error).__name__}: {str(error).splitlines()[0]}): "
                               "use --engine trace") from None
    return model, hf, task


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The longest ModuleList whose entries are all the same class: the transformer blocks."""
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 \
                and len({type(m) for m in module}) == 1 \
                and any(isinstance(m, nn.Linear) for m in module[0].modules()) \
                and (best is None or len(module) > len(best)):
            best = module
    if best is None:
        raise ModelConfigError("no repeated transformer blocks found: use --engine trace")
    sizes = sorted({_params(m) for m in best})
    if len(sizes) > 1:
        # e.g. DeepSeek-V3's dense first layers before its MoE layers: not one uniform stack
        raise ModelConfigError(f"its blocks differ in size ({', '.join(f'{n:,}' for n in sizes)} "
                               "parameters); the formula models one uniform stack: use "
                               "--engine trace")
    return best


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _linears(block: nn.Module) -> list[Linear]:
    """Every linear of one block in registration order, with its role for the activation
    model: attention projections (the last one of the attention is its output), then the MLP
    (its last linear is its output)."""
    found = [(path, m) for path, m in block.named_modules() if isinstance(m, nn.Linear)]
    attn = [(p, m) for p, m in found if any(w in p.lower() for w in _ATTENTION_WORDS)]
    mlp = [(p, m) for p, m in found if (p, m) not in attn]
    if not attn or not mlp:
        raise ModelConfigError("the blocks have no separate attention and MLP linears the "
                               "formula can read: use --engine trace")
    out = []
    for group, first, last in ((attn, "attn_in", "attn_out"), (mlp, "mlp_in", "mlp_out")):
        for i, (path, m) in enumerate(group):
            out.append(Linear(path.split(".")[-1], m.in_features, m.out_features,
                              m.bias is not None, 1, last if i == len(group) - 1 else first))
    return out


def _norm_kind(block: nn.Module) -> str:
    names = [type(m).__name__.lower() for m in block.modules()]
    return "rmsnorm" if any("rmsnorm" in n for n in names) else "layernorm"


def architecture_from_built_model(config: dict, name: str, source: str = "") -> Architecture:
    """The Architecture of a config dict whose family derive.py does not know, read from the
    model transformers builds from it on the meta device. Parameter counts are exact."""
    if config.get("kv_lora_rank") or config.get("q_lora_rank"):
        # multi-head latent attention outside DeepSeek-V2/V3 (whose configs derive.py reads):
        # its blocks' linears do not say how the latents feed the heads
        raise ModelConfigError(f"{name}: {config['model_type']!r} uses multi-head latent "
                               "attention (kv_lora_rank); the formula models it for "
                               "deepseek_v2 and deepseek_v3 configs only: use --engine trace")
    model, hf, task = build_on_meta(config, name)
    try:
        blocks = _blocks(model)
        block = blocks[0]
        linears = _linears(block)
    except ModelConfigError as error:
        raise ModelConfigError(f"{name}: {config['model_type']!r}: {error}") from None
    if any(p.dim() >= 3 for p in block.parameters()):
        # experts stored as one stacked tensor (transformers 5 MoE): no per-expert linears
        raise ModelConfigError(f"{name}: {config['model_type']!r} keeps mixture-of-experts "
                               "weights the formula cannot read from the built model: use "
                               "--engine trace")
    h = int(_first(hf, "hidden_size", "n_embd", "d_model"))
    nh = int(_first(hf, "num_attention_heads", "n_head", "num_heads"))
    hd = int(_first(hf, "head_dim", default=0) or h // nh)
    q_out = sum(ln.out_features for ln in linears if ln.role == "attn_in")
    # q + k + v outputs = (heads + 2 kv heads) * head size, fused or separate
    kv = (q_out // hd - nh) // 2 if hd else 0
    if kv < 1 or (nh + 2 * kv) * hd != q_out or nh % kv:
        raise ModelConfigError(f"{name}: the attention projections of {config['model_type']!r} "
                               f"({q_out} outputs for {nh} heads of {hd}) are not q, k and v "
                               "the formula can read: use --engine trace")
    mlp_in = [ln for ln in linears if ln.role == "mlp_in"]
    gated = len(mlp_in) >= 2 or any("gate" in ln.name for ln in mlp_in)
    inter = mlp_in[0].out_features // (2 if gated and len(mlp_in) == 1 else 1)
    act = str(_first(hf, "hidden_act", "activation_function", "activation", default="gelu"))
    stack = Stack(role="decoder" if task == "causal-lm" else "encoder",
                  num_layers=len(blocks), hidden_size=h, num_heads=nh, num_kv_heads=kv,
                  head_dim=hd, intermediate_size=inter,
                  mlp="gated" if gated else ("relu" if act == "relu" else "gelu"),
                  norm=_norm_kind(block), linears=tuple(linears),
                  params_per_layer=_params(block))

    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and head.weight is embed.weight
    head_params = 0 if head is None or tied else _params(head)
    if task == "seq-classification":
        head_params = _params(model) - _params(model.base_model)
    in_blocks = {id(p) for p in blocks.parameters()}
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding)
                    for p in m.parameters(recurse=False) if id(p) not in in_blocks)
    total = _params(model)
    other = total - embedding - head_params - stack.params_per_layer * stack.num_layers
    positions = _first(hf, "max_position_embeddings", "n_positions", "max_seq_len")
    return Architecture(
        name=name, model_type=str(config["model_type"]),
        kind="decoder" if task == "causal-lm" else "encoder", stacks=(stack,),
        embedding_params=embedding, other_params=other, head_params={task: head_params},
        default_task=task, vocab_size=int(_first(hf, "vocab_size", default=0)),
        max_positions=int(positions) if positions else None, tied_embeddings=tied,
        hidden_dropout=float(_first(hf, "hidden_dropout", "resid_pdrop", "dropout",
                                    default=0.0) or 0.0),
        attention_dropout=float(_first(hf, "attention_dropout", "attn_pdrop",
                                       default=0.0) or 0.0),
        num_labels=int(getattr(hf, "num_labels", 0) or 0) if task == "seq-classification"
        else 0, source=source, extra=dict(config),
        shapes_from="transformers model built on the meta device")

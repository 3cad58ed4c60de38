"""Default LoRA target modules per model family, for families whose block linears have none
of vramplan's default names (q_proj, k_proj, v_proj, o_proj): a LoRA job on such a model
that names no targets takes these, as peft itself would (peft 0.21.2
utils/constants.py: TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING; ViT and BERT-likes as
the transformers / peft image-classification guides target them). Torch-free data.
"""

from __future__ import annotations

import os
from functools import lru_cache

LORA_TARGETS: dict[str, tuple[str, ...]] = {  # model_type -> peft's default target_modules
    "t5": ("q", "v"), "mt5": ("q", "v"), "gpt2": ("c_attn",), "gpt_bigcode": ("c_attn",),
    "bert": ("query", "value"), "roberta": ("query", "value"),
    "xlm-roberta": ("query", "value"), "electra": ("query", "value"),
    # ViT: transformers 5 names its attention q_proj/k_proj/v_proj, vramplan's default
    "gpt_neox": ("query_key_value",),
    "falcon": ("query_key_value",), "bloom": ("query_key_value",),
}


def family_lora_targets(model: str | None) -> tuple[str, ...] | None:
    """The family's default targets for a catalog name or config path; None when vramplan's
    default applies or the model type cannot be read cheaply (a factory, an unknown id)."""
    if not isinstance(model, str) or not model:
        return None
    return LORA_TARGETS.get(_model_type(model) or "")


@lru_cache(maxsize=256)
def _model_type(model: str) -> str | None:
    from vramplan.errors import VramplanError
    from vramplan.models.catalog import (
        CATALOG_FILE,
        _raw_catalog,
        read_config_file,
        resolve_catalog_name,
    )

    try:
        name = resolve_catalog_name(model)
        if name is not None:
            path = CATALOG_FILE.parent / _raw_catalog()[name]["file"]
        else:
            path = os.path.expanduser(model)
            path = os.path.join(path, "config.json") if os.path.isdir(path) else path
            if not os.path.isfile(path):
                return None
        value = read_config_file(path).get("model_type")
    except (VramplanError, OSError, ValueError, KeyError):
        return None  # the engines report a bad config in their own words
    return value if isinstance(value, str) else None

"""A config dict turned into a transformers config object: the one place it happens (the
trace's and measure's model builder, and the formula's meta-built reader use it).

transformers 5 declares its config classes as huggingface_hub strict dataclasses, which
raise their own errors (StrictDataclassFieldValidationError, not a ValueError) for a value
of the wrong type. Here a whole-number float where the field wants an int (MPT's
`attn_pdrop: 0.0`, which transformers annotates as int) is the same number and is passed
as an int; any other refusal becomes one ModelConfigError line naming the key and types.
A shape key the config leaves out, which the class would fill with a default of its own,
is refused by name.
"""

from __future__ import annotations

import re

from vramplan.errors import ModelConfigError

# keys that describe the checkpoint, not the architecture
DROP = ("model_type", "architectures", "transformers_version", "_name_or_path", "torch_dtype",
        "dtype", "quantization_config", "auto_map")
_FIELD = re.compile(r"[Ff]ield '([^']+)' expected (\w+), got (\w+)(?: \(value: (.*)\))?")
# a config of a few dozen keys needs at most one retry per key
_MAX_RETRIES = 64


def _paths(config: dict, key: str, where: str = "") -> list[str]:
    """Dotted paths of `key` in the config and its nested objects."""
    found = []
    for k, v in config.items():
        if k == key:
            found.append(where + k)
        if isinstance(v, dict):
            found += _paths(v, key, f"{where}{k}.")
    return found


def _as_int(config: dict, key: str) -> bool:
    """Replace whole-number floats under `key` (at any depth) by ints; whether any was."""
    changed = False
    for k, v in config.items():
        if k == key and isinstance(v, float) and v.is_integer():
            config[k], changed = int(v), True
        elif isinstance(v, dict):
            changed |= _as_int(v, key)
    return changed


def _copy(config: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in config.items()}


# shape keys a transformers config class fills with a default of its own when absent
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "vocab_size")


def refuse_defaulted_shapes(config: dict, hf, name: str) -> None:
    """A shape key the config leaves out would silently take transformers' default (a
    pythia-160m config without hidden_size reads as GPT-NeoX-20B's 6144 wide, 2.9B
    parameters): refuse naming the keys. Keys a class derives when absent (a None default,
    e.g. an MLP of 4 x hidden) are not defaults of this kind."""
    cls = type(hf)
    aliases = getattr(cls, "attribute_map", None) or {}
    missing = []
    for key in _SHAPE_KEYS:
        field = aliases.get(key, key)
        default = getattr(cls, field, None)
        if isinstance(default, bool) or not isinstance(default, int):
            continue
        if config.get(key) is None and config.get(field) is None \
                and getattr(hf, field, None) == default:
            missing.append(f"{field!r} (transformers' default {default:,})")
    if missing:
        raise ModelConfigError(f"{name}: config is missing {', '.join(missing)} for model_type "
                               f"{config.get('model_type')!r}; add it to the config.json")


def to_hf_config(config: dict, name: str, *, check_shapes: bool = True, **overrides):
    """The transformers config of a Hugging Face config dict (keys in DROP left out,
    overrides applied), or ModelConfigError in one line. check_shapes=False leaves the
    defaulted-shape check (refuse_defaulted_shapes) to the caller."""
    from transformers import AutoConfig
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub without strict dataclasses
        StrictDataclassError = TypeError  # noqa: N806

    mt = config.get("model_type")
    if not mt:
        raise ModelConfigError(f"{name}: no 'model_type' key: it is needed to pick the "
                               "transformers class")
    values = _copy({k: v for k, v in config.items() if k not in DROP})
    values.update(overrides)
    for _ in range(_MAX_RETRIES):
        try:
            hf = AutoConfig.for_model(str(mt), **values)
            if check_shapes:
                refuse_defaulted_shapes(config, hf, name)
            return hf
        except StrictDataclassError as error:
            text = " ".join(str(error).split())
            match = _FIELD.search(text)
            if match and match[2] == "int" and match[3] == "float" \
                    and _as_int(values, match[1]):
                continue  # 0.0 where transformers wants 0: the same number
            if match:
                key = ", ".join(_paths(config, match[1])) or match[1]
                value = f" {match[4]}" if match[4] else ""
                fix = (f"write it as {match[2]}" if (match[2], match[3]) != ("int", "float")
                       else "transformers' class cannot hold a fraction there (MPT's attn_pdrop, "
                       "a dropout rate it annotates as int): use --engine formula, which "
                       "reads it, or write a whole number")
                raise ModelConfigError(
                    f"{name}: transformers' {mt!r} config wants config key {key!r} as "
                    f"{match[2]}, got {match[3]}{value}: {fix}") from None
            raise ModelConfigError(f"{name}: transformers cannot build a {mt!r} config: "
                                   f"{text[:300]}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            first = (str(error).splitlines() or [type(error).__name__])[0]
            raise ModelConfigError(f"{name}: transformers cannot build a {mt!r} config "
                                   f"({first}); fix the config.json") from None
    raise ModelConfigError(f"{name}: transformers cannot build a {mt!r} config")

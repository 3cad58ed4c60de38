"""Readers (and writers) of the training frameworks' own config files: torchtune recipes,
torchtitan job configs, HF TrainingArguments (+ peft LoraConfig), accelerate, DeepSpeed,
Axolotl and LLaMA-Factory. Each format's key mapping is a data file beside its module,
with the framework repository and commit it was read from. Torch-free.

    >>> from vramplan.frameworks.configs import read_config
    >>> read = read_config("1B_lora_single_device.yaml", overrides=["batch_size=2"])
    >>> job = read.job(gpu="L4")
"""

from vramplan.frameworks.configs.core import ConfigError
from vramplan.frameworks.configs.read import (
    FORMATS,
    ConfigRead,
    detect_format,
    read_config,
    read_config_text,
)

__all__ = ["FORMATS", "ConfigError", "ConfigRead", "detect_format", "read_config",
           "read_config_text"]

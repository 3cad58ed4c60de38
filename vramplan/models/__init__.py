"""Model shapes: the Architecture dataclasses, the catalog and config.json parsing (no torch)."""

from .arch import Architecture, Linear, Stack
from .catalog import CatalogEntry, list_models, load_architecture
from .derive import SUPPORTED_MODEL_TYPES, architecture_from_config

__all__ = ["Architecture", "Stack", "Linear", "CatalogEntry", "load_architecture", "list_models",
           "architecture_from_config", "SUPPORTED_MODEL_TYPES"]

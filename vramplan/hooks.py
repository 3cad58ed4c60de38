"""What a higher layer hands a lower one, without the lower one importing it.

built_model_reader: (config, name, source) -> Architecture for the model types
models/derive.py has no builder for; the package root sets one that imports the torch side
(vramplan.training.meta_architecture) on first use. A module of its own, importing nothing,
so that the root sets it without loading models/ (the command starts in milliseconds).
"""

built_model_reader = None

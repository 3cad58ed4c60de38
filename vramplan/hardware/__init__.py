"""GPU catalog: what each GPU has (memory, bandwidth, FLOP/s, interconnect, price)."""

from vramplan.hardware.catalog import get_gpu, list_gpus, load_gpus
from vramplan.hardware.gpu import GPU

__all__ = ["GPU", "get_gpu", "list_gpus", "load_gpus"]

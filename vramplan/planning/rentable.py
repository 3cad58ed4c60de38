"""Whether a plan's shape can be rented: the performance model puts min(n, gpus_per_node)
GPUs of a job on one interconnect (a server), so each server must be one on-demand
instance the price comes from (the catalog's rentable_gpus). A shape no instance holds is
"owned hardware": it is still priced per GPU-hour at the catalog's price, and says so.

    >>> hardware(get_gpu("GH200"), 4)
    'owned'

"""

from __future__ import annotations

from vramplan.hardware.gpu import GPU


def hardware(gpu: GPU, num_gpus: int) -> str:
    """"rented" or "owned". A GPU whose instance sizes are not in the catalog is assumed
    rentable in servers of gpus_per_node."""
    if not gpu.rentable_gpus:
        return "rented"
    server = min(num_gpus, gpu.gpus_per_node)
    rentable = any(size >= server and num_gpus % size == 0 for size in gpu.rentable_gpus)
    return "rented" if rentable else "owned"


def owned_note(gpu: GPU, counts: list[int]) -> str:
    """The plan's note for the shapes of `gpu` no on-demand instance has."""
    sizes = ", ".join(map(str, gpu.rentable_gpus))
    shown = ", ".join(map(str, sorted(counts)))
    return (f"{shown} x {gpu.name}: owned hardware (no on-demand instance puts them on one "
            f"interconnect: {gpu.price_provider or 'the price provider'} rents {sizes} "
            f"GPU{'s' if sizes != '1' else ''}); priced at {gpu.price_per_hour or 0:g} USD "
            "per GPU-hour all the same")

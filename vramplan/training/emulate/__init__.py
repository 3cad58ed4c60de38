"""CPU stand-ins for CUDA kernels, so a CPU or fake-tensor step keeps the memory CUDA's
would: autocast's op lists and dropout kernels (autocast.py), bitsandbytes NF4 and 8-bit
AdamW layouts and torchao-style float8 / MXFP8 linears (lowbit.py), and torchao's float8
all-gather under FSDP2 (float8_gather.py)."""

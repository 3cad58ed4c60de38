"""The torch side: build a Job's model, peft adapters, synthetic batches, loss, optimizer
and FSDP set-up, and run one training step. The trace (fake tensors) and measure (a real
device) engines share these builders, so both run the same step.

`emulate/` holds the CPU stand-ins for CUDA kernels that only the trace and CPU runs need
(CUDA's autocast lists and dropout kernels, bitsandbytes/torchao low-bit layouts)."""

import torch

from vramplan.training.saved import SavedTensorBytes


def _forward(recorder: SavedTensorBytes, batch: torch.Tensor, weight: torch.Tensor) -> int:
    """One forward that saves `batch` and one 16-element fp32 product for backward."""
    recorder.reset()
    recorder.exclude_batch([batch])
    with recorder.recording():
        out = (batch.float() * weight).sum()  # saves batch (as float) and weight
    recorder.snapshot()
    del out
    return recorder.last_forward_bytes


def test_parameters_are_left_out_for_the_whole_run_and_the_batch_for_its_own_forward():
    weight = torch.ones(16, requires_grad=True)
    recorder = SavedTensorBytes([weight])
    batch = torch.arange(16, dtype=torch.float32)
    # the multiply saves the batch and the weight: both are left out
    assert _forward(recorder, batch, weight) == 0
    # a later forward whose saved tensor sits at the freed batch's address still counts it
    # (the CPU and CUDA allocators hand freed addresses on): the exclusion was that step's
    recorder.reset()
    with recorder.recording():
        (batch * weight).sum()
    recorder.snapshot()
    assert recorder.last_forward_bytes == 16 * 4

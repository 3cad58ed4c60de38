"""Copies between GPU and CPU memory (comm.host_copies): what activation offload and
parameter offload move over PCIe per micro-batch, and how the step times them (copy
engines beside the kernels: only what a copy takes beyond its phase shows)."""

import pytest

from vramplan import Job
from vramplan.engines.formula.saved import stack_activations
from vramplan.engines.step import describe_step
from vramplan.hardware import get_gpu
from vramplan.models import load_architecture
from vramplan.planning.comm import collectives, host_copies
from vramplan.planning.efficiency import factors_for
from vramplan.planning.performance import phase_times, predict, step_terms, step_time

ARCH = load_architecture("llama-3.2-1b")  # 16 blocks, hidden 2048, kv 512, MLP 8192
H100 = get_gpu("H100-SXM")
# per block: q and o 2048 x 2048, k and v 2048 x 512, gate, up and down 2048 x 8192
BLOCK_LINEAR_PARAMS = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192


def _offloading(**changes) -> Job:
    return Job(model="llama-3.2-1b", batch_size=2, seq_len=512, precision="bf16-pure",
               **{"checkpointing": "full", "activation_offload": True, **changes})


def test_under_checkpointing_each_block_input_goes_down_in_forward_and_back_in_backward():
    down, up = host_copies(_offloading(), ARCH, describe_step(_offloading(), ARCH))
    block_input = 2 * 512 * 2048 * 2  # batch x seq x hidden, bf16
    assert down.bytes_per_gpu == up.bytes_per_gpu == 16 * block_input
    assert (down.overlaps, up.overlaps) == ("forward", "backward")
    assert (down.per, down.link, down.kind) == ("micro-batch", "host", "copy")
    # selective checkpointing's own cache stays on the GPU: the hooks see the inputs only
    selective = _offloading(checkpointing="selective")
    assert host_copies(selective, ARCH, describe_step(selective, ARCH))[0].bytes_per_gpu == (
        16 * block_input)


def test_without_checkpointing_the_hooks_take_all_the_blocks_save_and_each_matmuls_weight():
    job = _offloading(checkpointing="none")
    step = describe_step(job, ARCH)
    saved, _ = stack_activations(job, ARCH, step.shapes, step.activations)
    (down, _) = host_copies(job, ARCH, step)
    assert down.bytes_per_gpu == saved + 2 * 16 * BLOCK_LINEAR_PARAMS
    compiled = _offloading(checkpointing="none", compile=True)
    step = describe_step(compiled, ARCH)
    saved, _ = stack_activations(compiled, ARCH, step.shapes, step.activations)
    assert host_copies(compiled, ARCH, step)[0].bytes_per_gpu == saved  # no eager weight views


def test_offloaded_parameters_come_up_in_each_pass_and_their_gradients_go_down():
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, precision="bf16-pure",
              grad_accum=2, checkpointing="full", offload={"params": True, "optimizer": True},
              parallel={"strategy": "fsdp", "num_gpus": 4})
    params = describe_step(job, ARCH).params
    copies = [c for c in collectives(job, ARCH, H100) if c.link == "host"]
    assert [c.name for c in copies] == [
        "host copy: parameters to the GPU, forward (offload.params)",
        "host copy: parameters to the GPU, backward (offload.params)",
        "host copy: gradients to the CPU (offload.params)"]
    assert [c.bytes_per_gpu for c in copies] == [params.total * 2 / 4] * 2 + [
        params.trainable * 2 / 4]
    assert {c.per for c in copies} == {"micro-batch"}
    terms = step_terms(job, H100, ARCH)
    assert not any(c.reduces_gradients for c in terms.collectives if c.host_s)
    # the optimizer step on the CPU no longer copies gradients down and weights up itself
    (optimizer,) = [p for p in terms.phases if p.phase == "optimizer"]
    assert optimizer.offload_s == 0 and optimizer.offload_params == params.trainable / 4
    only_states = job.with_changes(offload={"optimizer": True})
    (optimizer,) = [p for p in step_terms(only_states, H100, ARCH).phases
                    if p.phase == "optimizer"]
    # the updated bf16 weights come up after the CPU's update (H100: PCIe 5.0 x16); fp32
    # ones under autocast; the gradients went down in the backward, every micro-batch
    assert optimizer.offload_s == 2 * params.trainable / 4 / 63e9
    autocast = only_states.with_changes(precision="bf16-mixed")
    (optimizer,) = [p for p in step_terms(autocast, H100, ARCH).phases if p.phase == "optimizer"]
    assert optimizer.offload_s == 4 * params.trainable / 4 / 63e9
    (down,) = [c for c in collectives(autocast, ARCH, H100) if c.link == "host"]
    assert (down.name, down.bytes_per_gpu, down.per, down.overlaps) == (
        "host copy: gradients to the CPU (optimizer offload)", 4 * params.trainable / 4,
        "micro-batch", "backward")


def test_zero_offload_sends_fp32_gradients_down_in_the_backward_and_16_bit_weights_up():
    """DeepSpeed 0.19.8 stage_1_and_2.py copy_grads_in_partition: source.to(fp32) on the GPU,
    copied at the accumulation boundary; the bit16 partition comes back after the step."""
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, precision="bf16-master",
              grad_accum=4, offload={"optimizer": True},
              parallel={"strategy": "zero2", "num_gpus": 2})
    trainable = describe_step(job, ARCH).params.trainable / 2
    (down,) = [c for c in collectives(job, ARCH, H100) if c.link == "host"]
    assert (down.bytes_per_gpu, down.per, down.overlaps) == (4 * trainable, "step",
                                                             "backward")
    (optimizer,) = [p for p in step_terms(job, H100, ARCH).phases if p.phase == "optimizer"]
    assert optimizer.offload_s == 2 * trainable / 63e9 and not optimizer.copies_beside_cpu


def test_a_copy_shorter_than_its_phase_costs_nothing_a_longer_one_its_excess():
    job = _offloading()
    plain = job.with_changes(activation_offload=False)
    factors = factors_for(H100, num_gpus=1)
    assert step_time(step_terms(job, H100, ARCH), factors) == pytest.approx(
        step_time(step_terms(plain, H100, ARCH), factors), rel=1e-12)
    slow = factors.model_copy(update={"host_link": 1e-4})  # 6.3 MB/s: copies dominate
    terms = step_terms(job, H100, ARCH)
    phases, exposed = phase_times(terms, slow)
    by_phase = {p.phase: p.time_s for p in phases}
    copy_s = 16 * 2 * 512 * 2048 * 2 / (1e-4 * 63e9)
    assert exposed == pytest.approx((copy_s - by_phase["forward"])
                                    + (copy_s - by_phase["backward"]))


def test_the_report_says_what_the_offload_copies_and_at_what_rate():
    perf = predict(_offloading(), H100)
    (note,) = [n for n in perf.notes if n.startswith("offload copies")]
    # 64 MiB down and 64 MiB back, at 80% of PCIe 5.0 x16's 63 GB/s
    assert "0.12 GiB a step over the PCIe 5.0 x16 link to CPU memory at 50.4 GB/s" in note
    assert "activations to the CPU (activation_offload)" in note
    assert not any(n.startswith("offload copies") for n in predict(
        _offloading(activation_offload=False), H100).notes)


def test_the_copies_move_at_each_gpus_own_host_link():
    """A Grace superchip's NVLink-C2C is 450 GB/s a direction, PCIe 4.0 x16 31.5: the same
    copies take 450 / 31.5 times as long over the A100's link."""
    job = _offloading(checkpointing="none")
    seconds = {}
    for name in ("GH200", "A100-80GB"):
        gpu = get_gpu(name)
        terms = step_terms(job, gpu, ARCH)
        factors = factors_for(gpu, num_gpus=1)
        seconds[name] = sum(c.seconds(factors) for c in terms.collectives if c.host_s)
    assert seconds["A100-80GB"] / seconds["GH200"] == pytest.approx(450 / 31.5)
    assert (get_gpu("GH200").host_link, get_gpu("T4").host_link_bytes_s) == ("NVLink-C2C",
                                                                            15.75e9)


@pytest.mark.parametrize(("strategy", "impl", "vectorised"), [
    ("none", "foreach", False),  # torch's default on CPU tensors: the for-loop
    ("none", "loop", False),
    ("none", "fused", True),     # torchao's CPUOffloadOptimizer asks for fused
    ("zero2", "foreach", True),  # DeepSpeed's ZeRO-Offload steps its own CPUAdam
])
def test_an_offloaded_adam_step_runs_at_its_implementations_cpu_rate(strategy, impl,
                                                                     vectorised):
    num_gpus = 1 if strategy == "none" else 2
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, optimizer_impl=impl,
              offload={"optimizer": True},
              parallel={"strategy": strategy, "num_gpus": num_gpus})
    terms = step_terms(job, H100, ARCH)
    (optimizer,) = [p for p in terms.phases if p.phase == "optimizer"]
    factors = factors_for(H100, num_gpus=num_gpus)
    share = 1.0 if vectorised else 0.147  # efficiency.toml [cpu_adam] loop_share
    assert optimizer.cpu_rate_share == share
    (timed,) = [p for p in phase_times(terms, factors)[0] if p.phase == "optimizer"]
    cpu = optimizer.offload_params / (2.5e9 * share)  # [training] cpu_adam_params_per_s
    # the CPU's update and the weights' copy up (DeepSpeed's after it, torchao's beside it),
    # and the step's own launches (the GPU does nothing)
    copy = optimizer.offload_s / factors.host_link
    both = copy + cpu if strategy == "zero2" else max(copy, cpu)
    assert timed.time_s == pytest.approx(both + optimizer.kernels * factors.kernel_us * 1e-6)
    note = next(n for n in predict(job, H100).notes if n.startswith("optimizer step on the CPU"))
    assert ("vectorised" in note) == vectorised
    assert not any(n.startswith("host-bound") for n in predict(job, H100).notes)

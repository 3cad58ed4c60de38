"""parallel.grad_reduce_dtype: the width the gradient collectives move, and the frameworks'
defaults for it (Accelerate's FSDP reduces in the compute dtype, torchtitan in fp32)."""

import json

import pytest

from vramplan import Job
from vramplan.frameworks.configs import read_config
from vramplan.hardware import get_gpu
from vramplan.models import load_architecture
from vramplan.planning.comm import collectives

MODEL = "gpt2"  # 124,439,808 parameters, all trained
PARAMS = load_architecture(MODEL).total_params()


def _gradient(job: Job) -> dict[str, float]:
    cs = collectives(job, load_architecture(job.model), get_gpu("H100-SXM"))
    return {c.name: c.bytes_per_gpu for c in cs if c.name.startswith("gradient")}


@pytest.mark.parametrize("precision, choice, width", [
    ("bf16-mixed", "grad", 4),      # autocast over fp32 weights: fp32 gradients
    ("bf16-mixed", "compute", 2),   # FSDP MixedPrecision(reduce_dtype=param_dtype)
    ("bf16-mixed", "fp32", 4),
    ("bf16-pure", "grad", 2),       # a 16-bit model's own gradients
    ("bf16-pure", "fp32", 4),       # torchtitan's reduce dtype over a bf16 model
    ("fp16-mixed", "fp16", 2),
])
def test_fsdp_reduce_scatters_the_gradients_at_the_chosen_width(precision, choice, width):
    job = Job(model=MODEL, precision=precision,
              parallel={"strategy": "fsdp", "num_gpus": 8, "grad_reduce_dtype": choice})
    # a reduce-scatter over 8 ranks sends 7/8 of the buffer from each
    assert _gradient(job) == {"gradient reduce-scatter (fsdp)":
                              pytest.approx(7 / 8 * PARAMS * width)}


def test_ddp_all_reduces_at_the_width_and_keeps_its_buckets():
    def job(choice):
        return Job(model=MODEL, parallel={"strategy": "ddp", "num_gpus": 4,
                                          "grad_reduce_dtype": choice})
    arch, gpu = load_architecture(MODEL), get_gpu("H100-SXM")
    full, half = (next(c for c in collectives(job(x), arch, gpu) if "all-reduce" in c.name)
                  for x in ("grad", "compute"))
    assert full.bytes_per_gpu == pytest.approx(2 * 3 / 4 * PARAMS * 4)
    assert half.bytes_per_gpu == pytest.approx(full.bytes_per_gpu / 2)
    # DDP's 25 MiB buckets are of the fp32 gradients as stored, whatever the hook sends
    assert half.calls == full.calls == -(-PARAMS * 4 // (25 * 2**20))


@pytest.mark.parametrize("framework, strategy, expected", [
    ("hf-trainer", "fsdp", "compute"), ("hf-trainer", "hybrid-shard", "compute"),
    ("hf-trainer", "ddp", "grad"), ("accelerate", "fsdp", "compute"),
    ("torchtitan", "fsdp", "fp32"), ("plain", "fsdp", "grad"),
])
def test_each_framework_reduces_in_its_own_default(framework, strategy, expected):
    job = Job(model=MODEL, framework=framework,
              parallel={"strategy": strategy, "num_gpus": 16})
    assert job.parallel.grad_reduce_dtype == expected
    # the Job's own choice wins over the framework's
    own = Job(model=MODEL, framework=framework,
              parallel={"strategy": strategy, "num_gpus": 16, "grad_reduce_dtype": "fp32"})
    assert own.parallel.grad_reduce_dtype == "fp32"


@pytest.mark.parametrize("value, expected", [("fp32", "fp32"), ("bf16", "bf16"),
                                             ("fp16", "fp16")])
def test_deepspeed_communication_data_type_is_read(value, expected, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2},
                                "communication_data_type": value}))
    assert read_config(path, model="llama-3.1-8b").job().parallel.grad_reduce_dtype == expected
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))  # left out: the grads'
    assert read_config(path, model="llama-3.1-8b").job().parallel.grad_reduce_dtype == "grad"


def test_torchtitan_mixed_precision_reduce_is_read(tmp_path):
    from pathlib import Path
    source = Path(__file__).parents[1] / "data" / "framework_configs" / "torchtitan"
    path = source / "llama3_8b.toml"
    default = read_config(path).job()
    assert default.parallel.grad_reduce_dtype == "fp32"
    bf16 = read_config(path, overrides=["--training.mixed_precision_reduce=bfloat16"]).job()
    assert bf16.parallel.grad_reduce_dtype == "bf16"


def test_a_trainer_job_moved_off_fsdp_reduces_its_own_gradients_again():
    # the planner and make-it-fit change the strategy; the profile decides again
    fsdp = Job(model=MODEL, framework="hf-trainer",
               parallel={"strategy": "fsdp", "num_gpus": 8})
    ddp = fsdp.with_changes(parallel=fsdp.parallel.changed(strategy="ddp"))
    assert (fsdp.parallel.grad_reduce_dtype, ddp.parallel.grad_reduce_dtype) == (
        "compute", "grad")
    back = ddp.with_changes(parallel=ddp.parallel.changed(strategy="fsdp"))
    assert back.parallel.grad_reduce_dtype == "compute"


def test_the_report_says_how_wide_the_reduced_gradients_are():
    from vramplan.planning.performance import predict
    job = Job(model=MODEL, framework="hf-trainer", parallel={"strategy": "fsdp", "num_gpus": 8})
    notes = predict(job, get_gpu("H100-SXM")).notes
    assert "gradient reduce-scatter (fsdp): 2 bytes a gradient (parallel.grad_reduce_dtype " \
           "compute)" in notes
    plain = Job(model=MODEL, parallel={"strategy": "fsdp", "num_gpus": 8})
    assert not any("bytes a gradient" in n for n in predict(plain, get_gpu("H100-SXM")).notes)

"""One estimate: the CLI's --json, vramplan.estimate and POST /api/v1/estimate give the
same report (peak, fit, performance and fixes) for the same jobs."""

from __future__ import annotations

import json

import pytest

import vramplan
from vramplan.job import Job

pytest.importorskip("fastapi")

# (CLI words, the same Job): one that does not fit its GPU (fixes), one priced over an
# amount of training, one that fits
JOBS = [
    (["llama-3.1-8b", "--gpu", "L4"], Job(model="llama-3.1-8b", gpu="L4"), {}),
    (["llama-3.2-1b", "-b", "4", "-s", "2048", "--gpu", "H100-SXM", "--tokens", "2000000000"],
     Job(model="llama-3.2-1b", batch_size=4, seq_len=2048, gpu="H100-SXM"),
     {"tokens": 2_000_000_000}),
    (["qwen2.5-0.5b", "--peft", "lora", "--gpu", "L4"],
     Job(model="qwen2.5-0.5b", peft={"method": "lora"}, gpu="L4"), {}),
    # a GPU with its own measured matmul ceiling, tensor parallelism without sequence
    # parallelism
    (["llama-3.1-8b", "-b", "2", "-s", "4096", "--gpu", "L4", "--num-gpus", "8", "--tp", "8",
      "--checkpointing", "full", "--set", "parallel.sequence_parallel=false"],
     Job(model="llama-3.1-8b", batch_size=2, seq_len=4096, gpu="L4", checkpointing="full",
         parallel={"num_gpus": 8, "tensor_parallel": 8, "sequence_parallel": False}), {}),
    # DeepSpeed's bf16 with ZeRO-2: a 16-bit model with fp32 master weights, and its
    # default overlap_comm false (the gradient reduce-scatter after the backward)
    (["llama-3.1-8b", "-p", "bf16-master", "--gpu", "A100-80GB", "--num-gpus", "4",
      "--strategy", "zero2", "--set", "parallel.overlap_grad_reduce=false"],
     Job(model="llama-3.1-8b", precision="bf16-master", gpu="A100-80GB",
         parallel={"num_gpus": 4, "strategy": "zero2", "overlap_grad_reduce": False}), {}),
    # the flash-attn package's FlashAttention-3 on Hopper: its own attention rate
    (["llama-3.2-1b", "-s", "4096", "--attention", "flash-attn-3", "--gpu", "H200"],
     Job(model="llama-3.2-1b", seq_len=4096, attention="flash-attn-3", gpu="H200"), {}),
    # compiled fp8 blocks, rowwise_with_gw_hp: its saved set and its 16-bit weight gradients
    (["llama-3.2-1b", "-b", "2", "-s", "2048", "--precision", "fp8", "--compile", "--gpu",
      "H100-SXM", "--set", "fp8.recipe=rowwise_with_gw_hp"],
     Job(model="llama-3.2-1b", batch_size=2, seq_len=2048, precision="fp8", compile=True,
         fp8={"recipe": "rowwise_with_gw_hp"}, gpu="H100-SXM"), {}),
    # FSDP over 64 nodes: NCCL's per-call latency on its rings, and the note it earns
    (["llama-3.1-8b", "-b", "1", "-s", "2048", "--gpu", "H100-SXM", "--num-gpus", "512",
      "--strategy", "fsdp"],
     Job(model="llama-3.1-8b", batch_size=1, seq_len=2048, gpu="H100-SXM",
         parallel={"num_gpus": 512, "strategy": "fsdp"}), {}),
    # the HF Trainer's FSDP across nodes: its no_sync and its 16-bit gradient reduction
    # (parallel.grad_reduce_dtype compute, from its profile)
    (["llama-3.1-8b", "-b", "2", "-s", "2048", "--grad-accum", "4", "--gpu", "A100-80GB",
      "--num-gpus", "16", "--strategy", "fsdp", "--framework", "hf-trainer"],
     Job(model="llama-3.1-8b", batch_size=2, seq_len=2048, grad_accum=4, gpu="A100-80GB",
         framework="hf-trainer", parallel={"num_gpus": 16, "strategy": "fsdp"}), {}),
    # torchtune's activation offload under checkpointing, on a Grace superchip: the copies
    # over its NVLink-C2C, and the optimizer offload's CPU step (torchtune's fused AdamW)
    (["llama-3.1-8b", "-b", "2", "-s", "4096", "--gpu", "GH200", "--framework", "torchtune",
      "--checkpointing", "full", "--activation-offload", "--offload-optimizer"],
     Job(model="llama-3.1-8b", batch_size=2, seq_len=4096, gpu="GH200", framework="torchtune",
         checkpointing="full", activation_offload=True, offload={"optimizer": True}), {}),
    # paged AdamW states that do not fit beside the step: paged in and out every step
    (["llama-3.2-1b", "-s", "2048", "-p", "bf16-pure", "--checkpointing", "full", "-o",
      "paged-adamw", "--gpu", "RTX-4070-Ti-SUPER"],
     Job(model="llama-3.2-1b", seq_len=2048, precision="bf16-pure", checkpointing="full",
         optimizer="paged-adamw", gpu="RTX-4070-Ti-SUPER"), {}),
    # an interleaved pipeline (its chunks per GPU), and an amount written as the CLI takes it
    (["llama-3.1-70b", "-s", "4096", "--grad-accum", "8", "--gpu", "H100-SXM", "--num-gpus",
      "32", "--strategy", "fsdp", "--pp", "4", "--pp-schedule", "interleaved", "--set",
      "parallel.pipeline_chunks=4", "--tokens", "2B"],
     Job(model="llama-3.1-70b", seq_len=4096, grad_accum=8, gpu="H100-SXM", parallel={
         "num_gpus": 32, "strategy": "fsdp", "pipeline_parallel": 4,
         "pipeline_schedule": "interleaved", "pipeline_chunks": 4}), {"tokens": "2B"}),
]


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from vramplan.web import create_app
    return TestClient(create_app())


@pytest.mark.parametrize(("words", "job", "amount"), JOBS)
def test_cli_api_and_web_give_the_same_estimate(run_cli, client, words, job, amount):
    code, out, err = run_cli("estimate", *words, "--json")
    cli = json.loads(out)
    api = vramplan.estimate(job, **amount).to_json_dict()
    response = client.post("/api/v1/estimate", json={"job": job.model_dump(mode="json"),
                                                      **amount})
    assert response.status_code == 200, response.text
    web = response.json()["report"]
    assert cli == api == web
    assert code == (0 if any(f["fits"] for f in api["fits"]) else 1), err
    assert api["performance"] is not None and api["performance"]["step_time_s"] > 0
    if not api["fits"][0]["fits"]:
        assert api["to_fit"]  # fixes on every surface
    if amount:
        assert api["performance"]["cost_usd"] > 0


def test_a_gpu_given_beside_the_job_is_the_gpu_it_runs_on(run_cli):
    """vramplan.estimate(job, gpu=X) reports the job on X, as `--gpu X` does: before, the
    report's own total kept the default (Hopper's) cuBLAS workspaces and context while its
    fit on X moved them (llama-3.2-1b on an L4: 25.0 against 24.5 GiB), and a bf16 job on a
    T4 got a time where the CLI refused it."""
    report = vramplan.estimate(Job(model="llama-3.2-1b"), gpu="L4")
    assert report.job.gpu == "L4" and report.runtime_gpu == "L4"
    assert report.device_total == report.fits[0].required_bytes
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--gpu", "L4", "--json")
    assert code == 1 and json.loads(out)["device_total"] == report.device_total  # no fit
    with pytest.raises(vramplan.VramplanError, match="T4 .* has no bf16 tensor cores"):
        vramplan.estimate(Job(model="llama-3.2-1b"), gpu="T4")

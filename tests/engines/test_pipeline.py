"""Pipeline parallelism: the stages' memory, the schedules, the bubble, the sends, and bad
input. Expected values are derived here from the model's shapes."""

from __future__ import annotations

import pytest

from vramplan.engines import formula, pipeline
from vramplan.engines.formula import loss, phases, saved
from vramplan.engines.step import describe_step
from vramplan.errors import EngineError, JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job, Parallel
from vramplan.models import load_architecture
from vramplan.planning.comm import collectives
from vramplan.planning.flops import step_flops
from vramplan.planning.performance import predict

ARCH = load_architecture("llama-3.2-1b")  # 16 blocks, hidden 2048, tied embeddings


def _job(pp: int, m: int, schedule: str = "1f1b", **changes) -> Job:
    return Job(model="llama-3.2-1b", seq_len=2048, grad_accum=m, **changes,
               parallel=Parallel(num_gpus=pp, pipeline_parallel=pp, pipeline_schedule=schedule))


def _stage_reports(job: Job):
    step = describe_step(job, ARCH)
    return {s.name: phases.stage_report(step, None, s) for s in step.stages}, \
        saved.stack_activations(job, ARCH, step.shapes, step.activations)[0]


def test_in_flight_micro_batches_per_schedule():
    # 1F1B: rank r keeps min(p - r, m) micro-batches
    assert [pipeline.in_flight(_job(4, 8), r) for r in range(4)] == [4, 3, 2, 1]
    assert pipeline.in_flight(_job(4, 2), 0) == 2  # fewer micro-batches than stages
    # interleaved, v = 2 chunks: min(2 (p - r - 1) + (v - 1) p + 1, m v) / v;
    # rank 0 of 4: (6 + 4 + 1) / 2 = 5.5 = p (1 + (p - 1) / (p v)) (Korthikanti et al.)
    assert pipeline.in_flight(_job(4, 8, "interleaved"), 0) == 5.5
    assert pipeline.in_flight(_job(4, 8, "interleaved"), 3) == (4 + 1) / 2
    assert pipeline.in_flight(_job(4, 2, "interleaved"), 0) == 4 / 2  # m v = 4 chunks
    # GPipe: every forward runs before the first backward, on every rank
    assert [pipeline.in_flight(_job(4, 8, "gpipe"), r) for r in range(4)] == [8] * 4


def test_pipeline_flushes_split_the_micro_batches():
    """torchtitan runs one schedule per accumulation step: each fills and drains."""
    def flushed(n: int, schedule: str = "1f1b") -> Job:
        return Job(model="llama-3.2-1b", seq_len=2048, grad_accum=8, parallel=Parallel(
            num_gpus=4, pipeline_parallel=4, pipeline_schedule=schedule, pipeline_flushes=n))
    assert pipeline.bubble_fraction(flushed(2)) == 3 / (4 + 3)   # 4 micro-batches a schedule
    assert pipeline.in_flight(flushed(4), 0) == 2
    assert pipeline.head_in_flight(flushed(2, "gpipe")) == 4
    with pytest.raises(JobError, match="multiple of pipeline_flushes"):
        pipeline.check_pipeline(flushed(3), ARCH)


def test_bubble_fraction():
    assert pipeline.bubble_fraction(_job(1, 8)) == 0
    assert pipeline.bubble_fraction(_job(4, 8)) == 3 / 11          # (p - 1) / (m + p - 1)
    # interleaved, v = 2: idle (p - 1) / (v m) = 3/16 of the busy time (Narayanan et al.
    # 2021), i.e. 3 / 19 of the step (it was 3/22: the share / v, not the idle time / v)
    assert pipeline.bubble_fraction(_job(4, 8, "interleaved")) == 3 / 19
    assert pipeline.bubble_fraction(_job(4, 8, "gpipe")) == 3 / 11   # 1F1B's fill and drain


def test_first_stage_weights_and_activations():
    job = _job(2, 4, batch_size=4)
    reports, layer_acts = _stage_reports(job)
    first, last = reports["first"], reports["last"]
    block = ARCH.stacks[0].params_per_layer
    # bf16-mixed keeps fp32 weights: 8 of 16 blocks and the embedding on the first stage;
    # 8 blocks, the final norm and a copy of the tied embedding (the head) on the last
    assert first.categories["weights"] == 4 * (8 * block + ARCH.embedding_params)
    assert last.categories["weights"] == 4 * (8 * block + ARCH.other_params
                                              + ARCH.vocab_size * 2048)
    assert first.categories["gradients"] == first.categories["weights"]  # fp32, accumulating
    # 1F1B, 2 stages, 4 micro-batches: stage 0 keeps 2 micro-batches of its 8 blocks, as
    # much as the whole model's blocks for one (llama has no embedding dropout)
    assert first.peak_phase in ("forward", "backward")  # activations are all live
    assert first.categories["activations"] == round(layer_acts * 8 / 16 * 2)
    whole = formula.estimate(job.with_changes(parallel=Parallel()))
    assert whole.categories["weights"] == 4 * ARCH.total_params("causal-lm")
    # the report is that of the larger stage
    assert formula.estimate(job).device_total == max(first.device_total, last.device_total)


def test_interleaved_first_stage_keeps_more():
    job = _job(4, 8, "interleaved", batch_size=4)
    reports, layer_acts = _stage_reports(job)
    # 4 of 16 blocks, 5.5 micro-batches in flight
    assert reports["first"].categories["activations"] == round(layer_acts * 4 / 16 * 5.5)


def test_gpipe_keeps_every_micro_batch():
    job = _job(4, 8, "gpipe", batch_size=2)
    reports, layer_acts = _stage_reports(job)
    # 4 of 16 blocks, all 8 micro-batches in flight on the first and on the last stage
    assert reports["first"].categories["activations"] == round(layer_acts * 4 / 16 * 8)
    one_f_one_b = _stage_reports(_job(4, 8, batch_size=2))[0]
    assert one_f_one_b["first"].categories["activations"] == round(layer_acts * 4 / 16 * 4)
    # the last stage keeps each micro-batch's head input and final norm (llama: nothing
    # saved for the embedding) and the other 7's logits and log_softmax output
    step = describe_step(job, ARCH)
    head = saved.outside_block_activations(job, ARCH, step.shapes, step.activations,
                                           "causal-lm")
    tokens = 2 * 2048  # the micro-batch's scored tokens (labels shifted inside the loss)
    kept = loss.kept_until_backward(job, ARCH, step.shapes, step.activations, "causal-lm")
    assert kept == step.shapes.loss_tokens * ARCH.vocab_size * (2 + 4)  # bf16 logits, fp32
    assert step.shapes.loss_tokens in (tokens, tokens - 2)
    assert reports["last"].categories["activations"] == round(
        layer_acts * 4 / 16 * 8 + 8 * head + 7 * kept)
    assert one_f_one_b["last"].categories["activations"] == round(layer_acts * 4 / 16 + head)
    h100 = get_gpu("H100-SXM")
    # the same work and the same bubble as 1F1B: the same step time
    assert predict(job, h100).step_time_s == pytest.approx(
        predict(_job(4, 8, batch_size=2), h100).step_time_s)


def test_step_time_bubble_and_sends():
    h100 = get_gpu("H100-SXM")
    job = _job(4, 8)
    perf = predict(job, h100)
    phases = {p.phase: p for p in perf.phases}
    busy = sum(phases[p].time_s * phases[p].per_step for p in ("forward", "backward"))
    # idle share (p - 1) / (m + p - 1) = 3/11 of the step: busy x (3/11) / (8/11) = busy x 3/8
    assert phases["pipeline bubble"].time_s == pytest.approx(busy * 3 / 8, rel=1e-12)
    sends = [c for c in collectives(job, ARCH, h100) if "pipeline" in c.name]
    # per micro-batch: one activation out and one gradient back, 1 x 2048 x 2048 bf16 each
    assert len(sends) == 1 and sends[0].bytes_per_gpu == 2 * 2048 * 2048 * 2
    assert sends[0].per == "micro-batch" and sends[0].link == "interconnect"
    # the interleaved schedule's bubble is half as long, with twice the sends
    inter = predict(_job(4, 8, "interleaved"), h100)
    assert {p.phase: p for p in inter.phases}["pipeline bubble"].time_s == pytest.approx(
        busy * 3 / 16, rel=1e-12)
    # each of 4 stages does a quarter of the blocks' matmuls (the last also the head)
    one = {p.phase: p for p in predict(_job(1, 8), h100).phases}
    assert phases["forward"].flops < one["forward"].flops / 2


@pytest.mark.parametrize("parallel,message,field", [
    (Parallel(num_gpus=32, pipeline_parallel=32), "only 16 blocks: use at most 16 stages",
     "parallel.pipeline_parallel"),
    # 16 blocks: 2 chunks each on 16 stages would need 32; at most 8 stages of 2
    (Parallel(num_gpus=16, pipeline_parallel=16, pipeline_schedule="interleaved"),
     "16 x pipeline_chunks=2 model chunks .* use at most 8 stages of 2 chunks",
     "parallel.pipeline_chunks"),
    # 4 stages x 64 chunks: 16 blocks hold 4 chunks per GPU
    (Parallel(num_gpus=4, pipeline_parallel=4, pipeline_schedule="interleaved",
              pipeline_chunks=64), "use at most 4 chunks per GPU", "parallel.pipeline_chunks"),
])
def test_more_stages_than_blocks_is_refused(parallel, message, field):
    with pytest.raises(JobError, match=message) as refused:
        formula.estimate(Job(model="llama-3.2-1b", parallel=parallel))
    assert refused.value.field == field  # the web page shows it beside that field


def test_pipeline_needs_a_decoder_and_the_formula():
    with pytest.raises(JobError, match="decoder-only"):
        formula.estimate(Job(model="bert-base-uncased",
                             parallel=Parallel(num_gpus=2, pipeline_parallel=2)))
    from vramplan.engines.registry import run_engine
    with pytest.raises(EngineError, match="pipeline"):
        run_engine(_job(2, 2), "trace")


def test_gpus_must_be_a_multiple_of_the_model_parallel_group():
    with pytest.raises(ValueError, match="pipeline_parallel = 4"):
        Parallel(num_gpus=6, tensor_parallel=2, pipeline_parallel=2)
    assert Parallel(num_gpus=16, tensor_parallel=2, pipeline_parallel=4,
                    strategy="fsdp").data_parallel == 2


def test_cli_pp_flags_and_bad_stages(run_cli):
    import json

    code, out, err = run_cli("estimate", "llama-3.2-1b", "-n", "4", "--pp", "4",
                             "--pp-schedule", "interleaved", "--grad-accum", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["job"]["parallel"]["pipeline_schedule"] == "interleaved"
    code, _, err = run_cli("estimate", "llama-3.2-1b", "-n", "32", "--pp", "32")
    assert code == 2 and "only 16 blocks" in err and err.count("\n") == 1


def test_planner_uses_pipeline_stages_when_tensor_parallelism_is_not_enough():
    from vramplan.planning.planner import plan

    # 70B at a global batch of 1: 8-way TP alone leaves ~140 GB of state per H100
    found = plan(Job(model="llama-3.1-70b", seq_len=2048), tokens=10**9,
                 gpus=["H100-SXM"], max_gpus=64)
    assert found.candidates
    assert all(c.job.parallel.pipeline_parallel > 1 for c in found.candidates)
    assert all("--pp" in c.flags for c in found.candidates)


def _split(pp: int, m: int, schedule: str = "1f1b", e: int = 1, h: int = 1, **changes) -> Job:
    return Job(model="llama-3.2-1b", seq_len=2048, grad_accum=m, **changes,
               parallel=Parallel(num_gpus=pp, pipeline_parallel=pp, pipeline_schedule=schedule,
                                 pipeline_embedding_layers=e, pipeline_head_layers=h))


def test_torchtitans_split_counts_the_embedding_and_the_head_as_blocks():
    """generate_llm_fqn_per_model_part: L + e + h over the chunks, the earlier taking the
    remainder, the first e fewer and the last h fewer; chunk i on rank i mod p."""
    # 16 + 1 + 1 = 18 over 8 stages: 3 3 2 2 2 2 2 2, less 1 first and last
    assert pipeline.stage_blocks(_split(8, 16), ARCH) == [2, 3, 2, 2, 2, 2, 2, 1]
    # interleaved, 2 chunks on each of 4 ranks: 18 over 8 chunks as above, rank r holds
    # chunks r and r + 4: 2+2, 3+2, 2+2, 2+1
    assert pipeline.stage_blocks(_split(4, 8, "interleaved"), ARCH) == [4, 5, 4, 3]
    # 4 ranks, 1F1B: 18 = 5 5 4 4, less 1 first and last
    assert pipeline.stage_blocks(_split(4, 8), ARCH) == [4, 5, 4, 3]
    # torchtitan's 2-and-2: 20 = 5 5 5 5
    assert pipeline.stage_blocks(_split(4, 8, e=2, h=2), ARCH) == [3, 5, 5, 3]
    # the even split: ceil(16 / 3) on every rank (the most any holds)
    assert pipeline.stage_blocks(_split(3, 8, e=0, h=0), ARCH) == [6, 6, 6]


def test_a_stage_between_that_holds_more_is_sized_and_sets_the_pace():
    job = _split(8, 16, batch_size=2)
    step = describe_step(job, ARCH)
    # rank 1: 3 blocks x 7 micro-batches in flight, more than the first's 2 x 8
    assert [(s.name, s.blocks, s.in_flight) for s in step.stages] == [
        ("first", 2, 8), ("rank 1", 3, 7), ("last", 1, 1)]
    reports, layer_acts = _stage_reports(job)
    block = ARCH.stacks[0].params_per_layer
    assert reports["rank 1"].categories["weights"] == 4 * 3 * block  # fp32, no embedding
    assert reports["rank 1"].categories["activations"] == round(layer_acts * 3 / 16 * 7)
    assert formula.estimate(job).device_total == max(r.device_total for r in reports.values())
    assert ("pipeline stage rank 1 of 8 (1f1b): 3 blocks, activations of 7 micro-batches in "
            "flight") in reports["rank 1"].notes
    # the pace: llama-3.2-1b's head weighs about 4 blocks, so its last stage (1 block and
    # the head) still sets it
    h100 = get_gpu("H100-SXM")
    assert {p.phase: p for p in predict(job, h100).phases}["forward"].flops == pytest.approx(
        _pace_flops(job, ARCH, 1 / 16, head=True))


def _pace_flops(job: Job, arch, share: float, head: bool) -> float:
    """Forward FLOPs of one micro-batch on a stage with `share` of the blocks (and the head)."""
    by = step_flops(job, arch).by_class
    return share * sum(by[c].forward for c in ("linear", "lora", "attention") if c in by) + (
        by["head"].forward if head else 0)


def test_an_uneven_split_can_move_the_pace_off_the_last_stage():
    # llama-3.1-70b, 80 blocks over 4 ranks: 82 = 21 21 20 20, less 1 first and last:
    # 20 21 20 19; rank 1's 21 blocks outweigh the last's 19 and a head of ~1.2 blocks
    arch = load_architecture("llama-3.1-70b")
    h100 = get_gpu("H100-SXM")

    def forward(e: int, h: int) -> float:
        job = Job(model="llama-3.1-70b", seq_len=2048, grad_accum=8, parallel=Parallel(
            num_gpus=4, pipeline_parallel=4, pipeline_embedding_layers=e,
            pipeline_head_layers=h))
        return job, {p.phase: p for p in predict(job, h100).phases}["forward"].flops

    job, split = forward(1, 1)
    assert pipeline.stage_blocks(job, arch) == [20, 21, 20, 19]
    assert split == pytest.approx(_pace_flops(job, arch, 21 / 80, head=False))
    job, even = forward(0, 0)  # 20 blocks on every rank, the head on the last
    assert even == pytest.approx(_pace_flops(job, arch, 20 / 80, head=True))
    assert split < even


def test_a_split_whose_ends_outweigh_a_chunk_is_refused():
    # 16 + 3 + 3 = 22 over 8 stages gives each 2: the embedding's 3 do not fit (torchtitan
    # refuses it too)
    with pytest.raises(JobError, match="gives each only 2") as refused:
        formula.estimate(_split(8, 16, e=3, h=3))
    assert refused.value.field == "parallel.pipeline_embedding_layers"

import pytest

from vramplan import Job, JobError, JobFileError, Parallel, Peft
from vramplan.job import job_from_dict, load_job_file, merge_overrides


def test_defaults_are_a_valid_job():
    job = Job()
    assert job.model == "llama-3.1-8b" and job.batch_size == 1 and job.effective_batch == 1


def test_effective_batch_counts_accumulation_and_data_parallel_ranks():
    job = Job(batch_size=4, grad_accum=8,
              parallel=Parallel(strategy="fsdp", num_gpus=16, tensor_parallel=2))
    assert job.parallel.data_parallel == 8
    assert job.effective_batch == 4 * 8 * 8


@pytest.mark.parametrize("data, fragment", [
    ({"batch_size": 0}, "batch_size: Input should be greater than or equal to 1"),
    ({"batch_size": -3}, "batch_size"),
    ({"precision": "bf17"}, "precision: must be one of 'fp32'"),
    ({"optimizer": "adamw9"}, "optimizer: must be one of"),
    ({"batchsize": 2}, "unknown key 'batchsize' (did you mean 'batch_size'?)"),
    ({"peft": {"rnk": 8}}, "unknown key 'peft.rnk' (did you mean 'rank'?)"),
    ({"parallel": {"num_gpus": 8}}, "need a strategy"),
    ({"parallel": {"num_gpus": 6, "tensor_parallel": 4, "strategy": "ddp"}}, "not a multiple"),
    ({"optimizer_in_backward": True, "grad_accum": 4}, "cannot accumulate"),
    ({"offload": {"params": True}}, "offload.params needs sharded parameters"),
    ({"peft": {"method": "qlora"}, "precision": "fp8"}, "QLoRA computes in 16-bit"),
    ({"optimizer": "lion", "optimizer_impl": "fused"}, "no fused implementation"),
])
def test_invalid_jobs_say_what_is_wrong(data, fragment):
    with pytest.raises(JobError) as error:
        job_from_dict(data, origin="job.yaml")
    assert fragment in str(error.value)
    assert str(error.value).startswith("job.yaml: ")


def test_all_problems_are_reported_together():
    with pytest.raises(JobError) as error:
        job_from_dict({"batch_size": 0, "precision": "fp7"})
    assert "batch_size" in str(error.value) and "precision" in str(error.value)


def test_with_changes_validates_again():
    job = Job(batch_size=2)
    assert job.with_changes(batch_size=8).batch_size == 8
    with pytest.raises(JobError):
        job.with_changes(batch_size=0)


def test_job_files_yaml_toml_json(tmp_path):
    (tmp_path / "a.yaml").write_text("model: gpt2\nbatch_size: 3\npeft:\n  rank: 4\n")
    (tmp_path / "b.toml").write_text('model = "gpt2"\nbatch_size = 3\n[parallel]\nnum_gpus = 1\n')
    (tmp_path / "c.json").write_text('{"model": "gpt2", "batch_size": 3}')
    for name in ("a.yaml", "b.toml", "c.json"):
        job = job_from_dict(load_job_file(tmp_path / name))
        assert (job.model, job.batch_size) == ("gpt2", 3)
    # GPT-2's attention is one c_attn linear: LoRA without targets takes it, as peft does
    assert job_from_dict(load_job_file(tmp_path / "a.yaml")).peft == Peft(
        rank=4, target_modules=("c_attn",))


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: gpt2\nbatch_size: [1, 2\nseq_len: 4\n")
    with pytest.raises(JobFileError) as error:
        load_job_file(path)
    assert "bad.yaml" in str(error.value) and "line" in str(error.value)


def test_missing_and_non_mapping_job_files(tmp_path):
    with pytest.raises(JobFileError, match="does not exist"):
        load_job_file(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(JobFileError, match="mapping"):
        load_job_file(tmp_path / "list.yaml")


def test_overrides_merge_deeply_and_skip_none():
    base = {"model": "gpt2", "peft": {"rank": 4, "alpha": 8}}
    merged = merge_overrides(base, {"model": None, "peft": {"rank": 16}})
    assert merged == {"model": "gpt2", "peft": {"rank": 16, "alpha": 8}}


# --- every API entry point raises VramplanError subclasses for bad input -----------------


@pytest.mark.parametrize("build", [
    lambda: Job(batch_size=0),
    lambda: Job(bogus=1),
    lambda: Peft(rank=0),
    lambda: Parallel(num_gpus=3, tensor_parallel=2, strategy="ddp"),
    lambda: Job.model_validate([1, 2]),
    lambda: Job.model_validate_json("{"),
    lambda: Job(target_len=10**23),
    lambda: Job(audio_seconds=float("inf")),
    lambda: Job(peft={"alpha": float("nan")}),
    lambda: Job(runtime={"cuda_context_bytes": "9" * 400}),
    lambda: Job(runtime={"cuda_context_bytes": 10**400}),
], ids=["field", "unknown-key", "peft", "parallel", "not-a-mapping", "bad-json", "target-len",
        "inf", "nan", "400-digit-size-text", "400-digit-size-int"])
def test_building_a_bad_job_raises_job_error(build):
    # pydantic's ValidationError used to escape `except VramplanError`; JobError is also a
    # ValueError, as ValidationError was
    with pytest.raises(JobError) as error:
        build()
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


def test_huge_values_give_short_messages():
    # a 50 MB value once gave a 64 MB message
    with pytest.raises(JobError) as error:
        Job(batch_size="7" * 10_000_000)
    assert len(str(error.value)) < 200
    assert len(str(JobError("x" * 10**6))) < 2100


def test_a_400_digit_size_is_refused():
    from vramplan.units import parse_bytes
    with pytest.raises(JobError, match="larger than 1 EiB"):
        parse_bytes("1" + "0" * 400 + "GB")
    assert parse_bytes("24GB") == 24 * 10**9


def test_a_model_name_longer_than_a_file_name_is_refused():
    # the file system refused the name with OSError (File name too long)
    from vramplan import ModelConfigError, estimate
    with pytest.raises(ModelConfigError, match="neither a catalog model nor a readable path"):
        estimate(Job(model="x" * 300))


BILLION_LAUGHS = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]"
       for i in range(8)]) + "\n"


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    # about 500 bytes that expand to 9**9 values; it used to run 62 s into MemoryError
    import time
    path = tmp_path / "bomb.yaml"
    path.write_text(BILLION_LAUGHS)
    start = time.perf_counter()
    with pytest.raises(JobFileError, match="bomb.yaml"):
        job_from_dict(load_job_file(path))
    assert time.perf_counter() - start < 2


def test_a_few_aliases_expanding_too_far_are_refused(tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text("a: &a [" + ", ".join(["1"] * 5000) + "]\n"
                    + "".join(f"k{i}: *a\n" for i in range(40)))
    with pytest.raises(JobFileError, match="more than 100,000 values"):
        load_job_file(path)


def test_a_huge_job_file_is_refused_with_a_short_message(tmp_path):
    # a 50 MB YAML printed a 64 MB error
    path = tmp_path / "big.yaml"
    path.write_text("model: " + "x" * 2_000_000 + "\n")
    with pytest.raises(JobFileError, match="too large for a job file") as error:
        load_job_file(path)
    assert len(str(error.value)) < 300


@pytest.mark.parametrize("name", ["estimate", "trace", "measure", "plan"])
def test_the_public_functions_refuse_what_is_not_a_job_in_one_line(name):
    """A model name where a Job belongs was an AttributeError deep in an engine."""
    import vramplan
    from vramplan.errors import JobError

    with pytest.raises(JobError, match=rf"^{name}\(\) takes a vramplan.Job, got str "
                                       rf"'llama-3.2-1b': write {name}\(Job\(model="):
        getattr(vramplan, name)("llama-3.2-1b")


def test_with_changes_lets_the_framework_decide_its_conditional_defaults_again():
    """The Trainer's QLoRA turns on peft's full checkpointing (profiles.toml value_when):
    a LoRA job changed to QLoRA gets it, and back again; a value the job set itself, or a
    change that sets it, is kept; a plain job has no profile to decide."""
    from vramplan.job import Peft

    lora = Job(model="llama-3.2-1b", framework="hf-trainer", peft={"method": "lora"})
    qlora = lora.with_changes(peft=Peft(method="qlora"))
    assert (lora.checkpointing, qlora.checkpointing) == ("none", "full")
    assert qlora.with_changes(peft=Peft(method="lora")).checkpointing == "none"
    assert qlora.with_changes(batch_size=2).checkpointing == "full"
    own = lora.with_changes(checkpointing="selective")
    assert own.with_changes(peft=Peft(method="qlora")).checkpointing == "selective"
    assert lora.with_changes(peft=Peft(method="qlora"), checkpointing="none").checkpointing \
        == "none"  # named by the change: its own
    plain = Job(model="llama-3.2-1b", peft={"method": "lora"})
    assert plain.with_changes(peft=Peft(method="qlora")).checkpointing == "none"
    # FSDP's no_sync, nested in parallel: a Trainer job on DDP switched to FSDP holds whole
    # gradients, and one that asked to sync each micro-batch keeps asking
    ddp = Job(model="gpt2", framework="hf-trainer", grad_accum=4,
              parallel={"strategy": "ddp", "num_gpus": 8})
    fsdp = ddp.with_changes(parallel={**ddp.parallel.model_dump(), "strategy": "fsdp"})
    assert (ddp.parallel.fsdp_no_sync, fsdp.parallel.fsdp_no_sync) == (False, True)
    synced = fsdp.with_changes(parallel={**fsdp.parallel.model_dump(), "fsdp_no_sync": False})
    assert not synced.with_changes(batch_size=2).parallel.fsdp_no_sync

"""Bad framework configs (issue 18), in the style of test_bad_input.py's battery: each ends
with exit code 2, one line on stderr, no traceback, within the time limit; some messages
are checked for what they must name (the key, the expected type, the docs, the fix)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cli.test_bad_input import outcome, run

DATA = Path(__file__).parents[1] / "data" / "framework_configs"
RECIPE = (DATA / "torchtune" / "llama3_2_1B_lora_single_device.yaml").read_text()
BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]"
    for i in range(8)]) + "\n"

FILES = {  # name -> content
    "no-format.yaml": "foo: 1\nbar: [1, 2]\n",
    "tt-wrong-type.yaml": RECIPE.replace("batch_size: 4", "batch_size: four"),
    "tt-unknown-builder.yaml": RECIPE.replace("lora_llama3_2_1b", "lora_mamba_7b"),
    "titan-wrong-type.toml": '[model]\nname = "llama3"\nflavor = "8B"\n[training]\n'
                             'local_batch_size = "x"\n',
    "titan-sac-3.toml": '[model]\nname = "llama3"\nflavor = "8B"\n[activation_checkpoint]\n'
                        'mode = "selective"\nselective_ac_option = "3"\n',
    "hf-wrong-type.json": json.dumps({"output_dir": "o", "per_device_train_batch_size": [1]}),
    "hf-zero3-and-fsdp.json": json.dumps({
        "output_dir": "o", "fsdp": "full_shard auto_wrap",
        "deepspeed": {"zero_optimization": {"stage": 3}}}),
    "hf-bf16-and-fp16.yaml": "output_dir: o\nbf16: true\nfp16: true\n",
    "trl-4bit-no-adapter.yaml": "model_name_or_path: Qwen/Qwen2.5-0.5B\nload_in_4bit: true\n",
    "accelerate-fsdp-and-deepspeed.yaml": "distributed_type: FSDP\nnum_processes: 2\n"
                                          "deepspeed_config:\n  zero_stage: 3\n",
    "axolotl-4bit-no-adapter.yml": "base_model: meta-llama/Llama-3.2-1B\nload_in_4bit: true\n"
                                   "micro_batch_size: 1\n",
    "lf-dpo.yaml": "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nstage: dpo\n"
                   "finetuning_type: lora\n",
    # adapters other than LoRA: read as LoRA (or as full training) they were wrong numbers
    "peft-ia3.json": json.dumps({"peft_type": "IA3", "target_modules": ["k_proj", "v_proj"],
                                 "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}),
    "axolotl-llama-adapter.yml": "base_model: meta-llama/Llama-3.2-1B\nadapter: llama-adapter\n"
                                 "micro_batch_size: 1\n",
    "bomb.yaml": BOMB,
    "not-utf8.yaml": "model:\xff\xfe",
    "list.yaml": "- 1\n- 2\n",
}


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    for name, text in FILES.items():
        (tmp / name).write_bytes(text.encode("latin-1") if name == "not-utf8.yaml"
                                 else text.encode())
    huge = tmp / "huge.yaml"
    with huge.open("wb") as f:  # 100 MB, sparse: refused by its size before any read
        f.truncate(100 * 1024 * 1024)
    (tmp / "folder").mkdir()
    out = [(f"config {name}", ["estimate", "--config", str(tmp / name)]) for name in FILES]
    out += [
        ("config huge", ["estimate", "--config", str(huge)]),
        ("config folder", ["estimate", "--config", str(tmp / "folder")]),
        ("config missing", ["estimate", "--config", str(tmp / "nope.yaml")]),
        ("config model not offline", ["estimate", "--config",
                                      str(DATA / "llama-factory" / "qwen3_full_sft.yaml")]),
        ("config 8-bit base", ["estimate", "--config",
                               str(DATA / "axolotl" / "llama-2_lora.yml")]),
        ("config and job", ["estimate", "--config", str(DATA / "hf" / "adapter_config.json"),
                            "--job", str(tmp / "no-format.yaml")]),
        ("config bogus format", ["estimate", "--config", str(DATA / "hf" /
                                 "adapter_config.json"), "--format", "bogus"]),
        ("overrides without config", ["estimate", "gpt2", "batch_size=2"]),
        ("titan override without --", ["estimate", "--config", str(DATA / "torchtitan" /
                                       "llama3_8b.toml"), "training.local_batch_size=2"]),
        ("tune override malformed", ["estimate", "--config", str(DATA / "torchtune" /
                                     "llama3_2_1B_lora_single_device.yaml"), "batch_size=x"]),
        ("check without gpu", ["check", "--config", str(DATA / "torchtune" /
                               "llama3_2_1B_lora_single_device.yaml")]),
        ("check unknown gpu", ["check", "--config", str(DATA / "torchtune" /
                               "llama3_2_1B_lora_single_device.yaml"), "--gpu", "H9000"]),
    ]
    return out


def test_bad_framework_configs(tmp_path, capsys, monkeypatch):
    bad, seen = [], {}
    for name, argv in cases(tmp_path):
        code, _, err, seconds = run(argv, capsys, monkeypatch)
        seen[name] = err
        if outcome(code, err, seconds) != "clean":
            bad.append(f"{name}: {outcome(code, err, seconds)} ({err.strip()[:160]})")
    assert not bad, "\n".join(bad)
    # the messages name what to fix
    wrong = seen["config tt-wrong-type.yaml"]
    assert "'batch_size'" in wrong and "expected int" in wrong and "https://" in wrong
    assert "expected int" in seen["config titan-wrong-type.toml"]
    assert "per_device_train_batch_size" in seen["config hf-wrong-type.json"]
    assert "conflicting settings" in seen["config hf-zero3-and-fsdp.json"]
    assert "zero3" in seen["config hf-zero3-and-fsdp.json"]
    assert "conflicting settings" in seen["config hf-bf16-and-fp16.yaml"]
    assert "without an adapter" in seen["config trl-4bit-no-adapter.yaml"]
    assert "without an adapter" in seen["config axolotl-4bit-no-adapter.yml"]
    assert "FSDP" in seen["config accelerate-fsdp-and-deepspeed.yaml"]
    assert "folder" in seen["config model not offline"] and "downloads nothing" in seen[
        "config model not offline"]
    assert "too large" in seen["config huge"] and "is a folder" in seen["config folder"]
    assert "expands to more than" in seen["config bomb.yaml"]  # the node cap, bounded
    assert "not a config of any format" in seen["config no-format.yaml"]
    assert "peft_type: IA3 is not modelled" in seen["config peft-ia3.json"]
    assert "models LORA" in seen["config peft-ia3.json"]
    assert "adapter: llama-adapter is not modelled" in seen["config axolotl-llama-adapter.yml"]
    assert "lora or qlora" in seen["config axolotl-llama-adapter.yml"]


@pytest.mark.skipif(not hasattr(os, "truncate"), reason="needs sparse files")
def test_huge_file_is_refused_before_reading(tmp_path, monkeypatch):
    """The size check comes first: reading the file is never attempted."""
    from vramplan.frameworks.configs import ConfigError, read_config

    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as f:
        f.truncate(100 * 1024 * 1024)
    monkeypatch.setattr(Path, "open", lambda *a, **k: pytest.fail("read the file"))
    with pytest.raises(ConfigError, match="too large"):
        read_config(huge)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_a_config_that_never_ends_is_read_only_up_to_the_cap():
    """/dev/zero reports size 0: the reader stops one byte past the cap, as for job files."""
    from vramplan.files import MAX_FILE_BYTES
    from vramplan.frameworks.configs import ConfigError, read_config

    with pytest.raises(ConfigError, match=f"more than {MAX_FILE_BYTES:,} bytes is too large"):
        read_config(Path("/dev/zero"))

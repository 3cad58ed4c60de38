"""track() context manager and the training-framework callbacks, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import vramplan.tracking as track_module
from vramplan.tracking import track

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module


def test_track_records_steps_losses_and_memory(tmp_path):
    path = tmp_path / "run.json"
    with track(path, samples_per_step=8, tokens_per_step=8 * 16) as tracker:
        keep = []
        for i in range(4):
            keep.append(torch.ones(64 * 1024**2 // 4))  # 64 MiB per step, kept alive
            keep[-1][::1024] = 2.0  # touch the pages so they count in RSS
            tracker.step(loss=torch.tensor(1.0 / (i + 1)))
        del keep
    data = json.loads(path.read_text())
    assert data["complete"] and data["steps"] == 4 and data["stopped"] == ""
    assert data["losses"] == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
    assert data["step_time_median_s"] > 0
    assert data["samples_per_s"] > 0 and data["tokens_per_s"] == pytest.approx(
        16 * data["samples_per_s"])
    if data["process_peak_rss"] is not None:  # Linux; RSS is coarse: memory the process
        # freed before may be reused without growing it, so only part of 256 MiB must show
        assert data["peak_rss_increase"] >= 128 * 1024**2


def test_report_is_written_when_the_loop_raises(tmp_path):
    path = tmp_path / "run.json"
    with pytest.raises(ValueError, match="boom"):
        with track(path) as tracker:
            tracker.step(loss=2.0)
            raise ValueError("boom")
    data = json.loads(path.read_text())
    assert not data["complete"] and data["stopped"] == "ValueError: boom" and data["steps"] == 1


def test_report_is_written_on_ctrl_c(tmp_path):
    path = tmp_path / "run.json"
    with pytest.raises(KeyboardInterrupt):
        with track(path) as tracker:
            tracker.step(loss=float("nan"))
            raise KeyboardInterrupt
    data = json.loads(path.read_text())
    assert data["stopped"].startswith("interrupted") and data["non_finite_losses"] == 1


def test_track_without_path_keeps_result_in_memory():
    with track() as tracker:
        tracker.step()
    assert tracker.result["steps"] == 1


def test_importing_track_does_not_import_torch():
    code = "import sys, vramplan.tracking; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_trainer_callback_tiny_training(tmp_path):
    import transformers

    from vramplan.integrations.hf_trainer import VramplanCallback

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (16, 16))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                   callbacks=[VramplanCallback(tokens_per_step=4 * 16)])
    trainer.train()
    data = json.loads((tmp_path / "vramplan-track.json").read_text())
    assert data["complete"] and data["steps"] == 4 and len(data["losses"]) == 4
    assert data["samples_per_s"] > 0 and data["tokens_per_s"] == pytest.approx(
        16 * data["samples_per_s"])


def test_lightning_callback_if_installed(tmp_path):
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning")
    from vramplan.integrations.lightning import VramplanCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    path = tmp_path / "pl.json"
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=str(tmp_path), callbacks=[VramplanCallback(path)])
    trainer.fit(Module(), loader)
    report = json.loads(path.read_text())
    assert report["steps"] == 3 and report["samples_per_s"] > 0


def test_lightning_missing_says_how_to_install():
    module = pytest.importorskip("vramplan.integrations.lightning")
    if module.Callback is not None:
        pytest.skip("Lightning is installed")
    with pytest.raises(ImportError, match="pip install lightning"):
        module.VramplanCallback()


def test_rss_helpers_tolerate_missing_proc(monkeypatch):
    monkeypatch.setattr(track_module, "_status_bytes", lambda field: None)
    with track() as tracker:
        tracker.step()
    assert tracker.result["peak_rss_increase"] is None


def test_cuda_path_with_faked_torch_cuda(monkeypatch, tmp_path):
    fake = {
        "is_available": lambda: True, "synchronize": lambda d=None: None,
        "reset_peak_memory_stats": lambda d=None: None,
        "max_memory_allocated": lambda d=None: 7_000_000,
        "max_memory_reserved": lambda d=None: 8_000_000,
        "get_device_name": lambda d=None: "Fake GPU",
        "device_memory_used": lambda d=None: 500_000_000,
        "utilization": lambda d=None: 90, "memory_usage": lambda d=None: 40,
    }
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    with track(tmp_path / "gpu.json") as tracker:
        tracker.step(loss=1.0, samples=4)
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["device"] == "cuda" and data["device_name"] == "Fake GPU"
    assert data["peak_allocated"] == 7_000_000 and data["peak_reserved"] == 8_000_000
    assert data["context_overhead"] == 492_000_000 and data["gpu_util_mean"] == 90
    assert data["mem_bandwidth_util_mean"] == 40

"""GPU catalog: data sanity, look-ups, user overrides."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import textwrap
import typing

import pytest

from vramplan.errors import UnknownNameError, VramplanError
from vramplan.hardware import GPU, catalog, get_gpu, list_gpus, load_gpus
from vramplan.hardware.gpu import Dtype

GiB, MiB = 1024**3, 1024**2

REQUIRED = [
    "L4", "T4", "A10G", "A10", "L40S", "L40", "A100-40GB", "A100-80GB", "A100-80GB-PCIe",
    "H100-PCIe", "H100-SXM", "H100-NVL", "H200", "B200", "V100-16GB", "V100-32GB",
    "RTX-3090", "RTX-4090", "RTX-5090", "RTX-A6000", "RTX-6000-Ada", "MI250X", "MI300X",
]


@pytest.fixture(autouse=True)
def _no_user_file(monkeypatch, tmp_path):
    """Tests see only the built-in catalog unless they pass a file."""
    monkeypatch.delenv(catalog.ENV_VAR, raising=False)
    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(tmp_path / "absent"))


@pytest.fixture
def gpus() -> dict[str, GPU]:
    return load_gpus()


def test_catalog_has_required_gpus(gpus):
    assert len(gpus) >= 22
    missing = [n for n in REQUIRED if n not in gpus]
    assert not missing


def test_every_gpu_has_all_fields(gpus):
    for name, g in gpus.items():
        assert g.name == name
        assert g.vendor in ("nvidia", "amd")
        assert g.memory_bytes > 0 and g.usable_bytes > 0
        assert g.memory_type
        assert g.bandwidth_bytes_s > 1e11, name  # > 100 GB/s
        assert g.interconnect and g.interconnect_bytes_s > 1e9, name
        assert "fp32" in g.tflops and "fp16" in g.tflops, name
        if g.vendor == "nvidia":
            major, minor = g.compute_capability.split(".")
            assert major.isdigit() and minor.isdigit(), name
        assert g.price_per_hour is None or 0.05 < g.price_per_hour < 50, name
        if g.usable_estimated:
            assert g.notes, f"{name}: an estimated usable figure needs its rule in notes"


def test_usable_is_a_sane_fraction_of_nominal(gpus):
    for name, g in gpus.items():
        assert g.usable_bytes <= g.memory_bytes, name
        assert g.usable_bytes >= 0.9 * g.memory_bytes, name


def test_flops_are_dense_and_ordered(gpus):
    for name, g in gpus.items():
        assert set(g.tflops) <= set(typing.get_args(Dtype)), name
        for dtype in ("tf32", "fp16", "bf16", "fp8"):
            if dtype in g.tflops:
                assert g.tflops[dtype] >= g.tflops["fp32"], (name, dtype)
        if "bf16" in g.tflops:
            assert g.tflops["bf16"] >= g.tflops["fp32"], name
        if "fp8" in g.tflops and "bf16" in g.tflops:
            assert g.tflops["fp8"] <= 2.05 * g.tflops["bf16"], name  # L40S datasheet: 733 vs 362.05
    # dense, not the 2:4-sparsity figures NVIDIA prints
    assert gpus["H100-SXM"].tflops["bf16"] == pytest.approx(989.5, rel=0.01)
    assert gpus["A100-80GB"].tflops["bf16"] == pytest.approx(312, rel=0.01)
    assert "bf16" not in gpus["T4"].tflops and "bf16" not in gpus["V100-16GB"].tflops


def test_price_dates_and_sources(gpus):
    for name, g in gpus.items():
        date = dt.date.fromisoformat(g.price_date)
        assert dt.date(2024, 1, 1) <= date <= dt.date.today(), name
        for fact in ("memory", "bandwidth", "flops"):
            assert g.sources.get(fact), (name, fact)
        if g.price_per_hour is not None:
            assert g.sources.get("price", "").startswith("https://"), name
            assert g.price_provider, name
        assert g.sources["memory"].startswith("https://"), name


def test_known_figures(gpus):
    assert gpus["L4"].memory_bytes == 24 * GiB
    assert gpus["L4"].usable_bytes == 23034 * MiB
    assert gpus["H200"].usable_bytes == 143771 * MiB
    assert gpus["H100-SXM"].bandwidth_bytes_s == pytest.approx(3.35e12)
    assert gpus["H100-SXM"].interconnect_bytes_s == pytest.approx(450e9)  # one direction
    assert gpus["MI300X"].usable_bytes == 205822885888


@pytest.mark.parametrize("text, name", [
    ("H100", "H100-SXM"), ("h100 sxm", "H100-SXM"), ("H100_SXM", "H100-SXM"),
    ("A100", "A100-80GB"), ("4090", "RTX-4090"), ("RTX4090", "RTX-4090"),
    ("rtx4090", "RTX-4090"), ("a10g", "A10G"), ("A10", "A10"), ("l40s", "L40S"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("A100-SXM4-40GB", "A100-40GB"), ("a6000", "RTX-A6000"), ("mi300x", "MI300X"),
])
def test_aliases_resolve(text, name):
    assert get_gpu(text).name == name


def test_aliases_are_unique(gpus):
    seen = {}
    for g in gpus.values():
        for label in (g.name, *g.aliases):
            assert seen.setdefault(catalog._key(label), g.name) == g.name, label


@pytest.mark.parametrize("typo, suggestion", [("H10O", "H100"), ("a100-80", "A100-80GB")])
def test_unknown_name_suggests(typo, suggestion):
    with pytest.raises(UnknownNameError) as err:
        get_gpu(typo)
    message = str(err.value)
    assert "Did you mean" in message and repr(suggestion) in message
    assert isinstance(err.value, VramplanError)


def test_list_gpus_filters_and_sorts():
    all_gpus = list_gpus()
    keys = [(g.usable_bytes, g.name) for g in all_gpus]
    assert keys == sorted(keys)
    amd = list_gpus(vendor="AMD")
    assert amd and all(g.vendor == "amd" for g in amd)
    big = list_gpus(min_memory_bytes=100 * GiB)
    assert {g.name for g in big} >= {"H200", "B200", "MI300X"}
    assert all(g.usable_bytes >= 100 * GiB for g in big)
    assert {g.name for g in list_gpus(name_contains="h100")} == {"H100-PCIe", "H100-SXM",
                                                                 "H100-NVL"}


def test_load_returns_fresh_objects():
    a = load_gpus()
    a["L4"].tflops["fp32"] = 0.0
    assert load_gpus()["L4"].tflops["fp32"] == pytest.approx(30.3)


# ---------------------------------------------------------------- user file

def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


NEW_GPU = """
[gpus.MyCard]
vendor = "nvidia"
memory = "12 GiB"
usable = "12000 MiB"
memory_type = "GDDR6X"
bandwidth_gb_s = 500
interconnect = "PCIe 4.0 x16"
interconnect_gb_s = 32
compute_capability = "8.6"
price_date = 2025-01-02
aliases = ["my card"]
[gpus.MyCard.tflops]
fp32 = 30
bf16 = 60
"""


def test_user_file_overrides_price_and_adds_gpu(tmp_path):
    user = _write(tmp_path / "gpus.toml", """
        [gpus.H100]
        price_per_hour = 1.23
        price_date = "2026-01-15"
        [gpus.L4.tflops]
        fp8 = 200
    """ + NEW_GPU)
    gpus = load_gpus(user)
    h100 = gpus["H100-SXM"]
    assert h100.price_per_hour == 1.23 and h100.price_date == "2026-01-15"
    assert h100.memory_bytes == 80 * GiB  # untouched fields stay
    assert gpus["L4"].tflops["fp8"] == 200 and gpus["L4"].tflops["bf16"] == 121
    card = gpus["MyCard"]
    assert card.usable_bytes == 12000 * MiB and card.price_per_hour is None
    assert card.price_date == "2025-01-02" and card.bandwidth_bytes_s == 500e9
    assert get_gpu("MY_CARD", gpus).name == "MyCard"
    # the built-in catalog is not changed by loading a user file
    assert load_gpus()["H100-SXM"].price_per_hour != 1.23


def test_user_file_from_env_var(tmp_path, monkeypatch):
    user = _write(tmp_path / "env.toml", "[gpus.T4]\nprice_per_hour = 0.11\n")
    monkeypatch.setenv(catalog.ENV_VAR, str(user))
    assert get_gpu("t4").price_per_hour == 0.11
    # the file is re-read when it changes
    _write(user, "[gpus.T4]\nprice_per_hour = 0.22\n")
    import os
    st = os.stat(user)
    os.utime(user, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert get_gpu("t4").price_per_hour == 0.22


def test_default_user_file(tmp_path, monkeypatch):
    (tmp_path / "config").mkdir()
    _write(tmp_path / "config" / "gpus.toml", "[gpus.L4]\nprice_per_hour = 0.33\n")
    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(tmp_path / "config"))
    assert get_gpu("L4").price_per_hour == 0.33


def test_user_config_folder_is_the_platforms_without_the_override(monkeypatch):
    from platformdirs import user_config_path

    from vramplan.config import user_config_dir
    monkeypatch.delenv("VRAMPLAN_CONFIG_DIR")
    assert user_config_dir() == user_config_path("vramplan", appauthor=False)


@pytest.mark.parametrize("text, needle", [
    ("[gpus.L4\nprice = 1", "not valid TOML"),
    ("[gpus.NewCard]\nvendor = \"nvidia\"\n", "missing required key"),
    ("[gpus.L4]\nprice_per_hr = 1.0\n", "unknown key"),
    ("[gpus.L4]\nprice_per_hour = \"cheap\"\n", "price_per_hour"),
    ("[gpus.L4]\nprice_per_hour = -1\n", "price_per_hour"),
    ("[gpus.L4]\nprice_date = \"June 2025\"\n", "price_date"),
    ("[gpus.L4]\nusable = \"30 GiB\"\n", "usable"),
    ("[gpus.L4]\nmemory = \"24 parsecs\"\n", "memory"),
    ("[gpus.L4.tflops]\nfp9 = 3\n", "fp9"),
    ("gpu = 3\n", "top-level"),
])
def test_malformed_user_file_names_file_and_entry(tmp_path, text, needle):
    user = _write(tmp_path / "bad.toml", text)
    with pytest.raises(VramplanError) as err:
        load_gpus(user)
    message = str(err.value)
    assert str(user) in message and needle in message
    if text.startswith("[gpus.L4]") or text.startswith("[gpus.NewCard]"):
        assert ("'L4'" in message) or ("'NewCard'" in message)


def test_missing_user_file_is_an_error(tmp_path, monkeypatch):
    missing = tmp_path / "nope.toml"
    with pytest.raises(VramplanError, match="nope.toml"):
        load_gpus(missing)
    monkeypatch.setenv(catalog.ENV_VAR, str(missing))
    with pytest.raises(VramplanError, match="not found"):
        load_gpus()


def test_alias_clash_is_an_error(tmp_path):
    user = _write(tmp_path / "clash.toml", NEW_GPU.replace('["my card"]', '["H-100 sxm"]'))
    with pytest.raises(VramplanError, match="H100-SXM"):
        load_gpus(user)


def test_gpu_model_fields_kept():
    names = list(GPU.model_fields)
    assert names[:14] == [
        "name", "vendor", "memory_bytes", "usable_bytes", "memory_type", "bandwidth_bytes_s",
        "tflops", "interconnect_bytes_s", "interconnect", "compute_capability",
        "price_per_hour", "price_date", "aliases", "sources",
    ]


def test_toml_is_package_data():
    from importlib import resources
    assert resources.files("vramplan.hardware").joinpath("gpus.toml").is_file()


def test_hardware_does_not_import_torch():
    # (its speed is measured by benchmarks/formula_speed.py, not timed here: shared machines)
    code = ("import sys; "
            "from vramplan.hardware import load_gpus, get_gpu; load_gpus(); get_gpu('h100'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_fit_limit_is_usable_memory_less_the_margin():
    from vramplan.fit import fits_within, limit_bytes

    assert limit_bytes(1000, 0.05) == 950 and limit_bytes(1000, 0.0) == 1000
    assert fits_within(950, 1000, 0.05) and not fits_within(951, 1000, 0.05)


def test_the_4070_ti_super_is_the_4090_scaled_by_sms_and_clock():
    """Its tensor rates are derived, not published: the RTX 4090's (Ada whitepaper, 128 SMs
    at 2.52 GHz) scaled to 66 SMs at 2.61 GHz, which reproduces NVIDIA's 706 AI TOPS."""
    small, big = get_gpu("4070 Ti SUPER"), get_gpu("RTX-4090")
    scale = 66 / 128 * 2.61 / 2.52
    for dtype in ("fp32", "tf32", "fp16", "bf16", "fp8"):
        assert small.tflops[dtype] == pytest.approx(big.tflops[dtype] * scale, abs=0.05)
    assert 4 * small.tflops["fp8"] == pytest.approx(706, abs=1)  # sparse, FP16 accumulate
    assert small.usable_bytes == 16376 * 2**20 and small.bandwidth_bytes_s == 672e9

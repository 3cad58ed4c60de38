"""Check the communication model (planning/comm.py, efficiency.toml [nccl] and the
collective efficiency) on published nccl-tests runs (benchmarks/data/nccl_tests.csv:
all_reduce_perf, all_gather_perf and reduce_scatter_perf tables, each from a public source
named in the file's header).

Each row is one collective of one message size on one machine. The model times it as
training's collectives are timed (performance.step_terms): the bytes one rank sends in a
ring (comm.ring_bytes) over the rate its link reaches (comm.link_bytes_s: the interconnect
inside a node, the group's NICs across nodes; in the node's wiring, comm.placed: a mesh's
share, NVLS's speedup of an all-reduce) x the collective efficiency, plus the
latency of one NCCL call (comm.collective_latency_s). nccl-tests' bus bandwidth is the same ratio
(ring bytes / time), so the efficiency is what a large message's bus bandwidth reaches of
the link rate.

Reported: the error of the predicted time per setup (a source at one node count) and
message-size band at the shipped efficiency; what the largest message reaches (its bus
bandwidth over the model's link rate); and the efficiency fitted on the other publications'
messages of at least LARGE bytes (an issue thread, a page or a README left out at a time),
one for every link and one per kind of link, each scored on the setups left out. The
8x RTX 4090 tables are shown, not fitted (NOT_FITTED). Writes
benchmarks/results/nccl_vs_model.md and .json.

    PYTHONPATH=. python benchmarks/nccl_vs_model.py
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, write_results  # noqa: E402

from vramplan.hardware import get_gpu, list_gpus  # noqa: E402
from vramplan.hardware.gpu import GPU  # noqa: E402
from vramplan.planning.comm import (  # noqa: E402
    Collective,
    collective_latency_s,
    link_bytes_s,
    placed,
    ring_bytes,
)
from vramplan.planning.efficiency import shipped_factors  # noqa: E402

DATA = Path(__file__).parent / "data" / "nccl_tests.csv"
KIND = {"all_reduce": "all-reduce", "all_gather": "all-gather",
        "reduce_scatter": "reduce-scatter"}
LARGE = 64 * 2**20        # bytes: training's gradient buckets, FSDP units and TP activations
BANDS = ((0, 2**16, "< 64 KiB"), (2**16, 2**24, "64 KiB - 16 MiB"),
         (2**24, math.inf, ">= 16 MiB"))
GRID = [0.30 + 0.005 * i for i in range(241)]  # efficiencies 0.30 .. 1.50
# sources not fitted on, only shown: S10 is a catalog fact already (the RTX 4090's staged
# interconnect rate, gpus.toml, derived from it and two others), S11 the same machine on a
# patched driver (tinygrad's P2P kernel modules) that the catalog does not describe
NOT_FITTED = ("S10", "S11")
RING_FORCED = "NCCL_ALGO=Ring"  # a source's settings that pin NCCL's (RCCL's) ring algorithm


def link_kind(row: dict) -> str:
    """The link a row's collective is bound by: the network across nodes, else the node's."""
    if int(row["nodes"]) > 1:
        return "network"
    return "nvlink" if row["intra"] in ("nvswitch", "nvlink_mesh") else row["intra"]


def load() -> tuple[list[dict], dict[str, str]]:
    """The rows of catalog GPUs, and each source's description (the file's `# S<k>:` lines)."""
    text = DATA.read_text().splitlines()
    sources = {}
    for line in text:
        if line.startswith("# S") and ":" in line:
            key, _, what = line[2:].partition(":")
            sources[key.strip()] = what.strip()
    rows = list(csv.DictReader(line for line in text if not line.startswith("#")))
    known = {g.name for g in list_gpus()}
    for r in rows:
        r["ring_forced"] = RING_FORCED in sources.get(r["source"], "")
    return [r for r in rows if r["gpu"] in known], sources


def publication(description: str) -> str:
    """Where a source was published (its issue, page or repository): the sources of one
    publication (one thread, one README) are left out together."""
    return description.split(",")[0].split(" (")[0].strip()


def machine(row: dict) -> GPU:
    """The catalog GPU of the row, in the row's node: its GPUs per node and P2P access."""
    gpu = get_gpu(row["gpu"])
    return gpu.model_copy(update={"gpus_per_node": int(row["gpus_per_node"]),
                                  "p2p": gpu.p2p and row["intra"] != "pcie_nop2p"})


def collective(row: dict, gpu: GPU) -> tuple[Collective, float]:
    """The row as comm.py's collective, and the network rate per GPU (bytes/s)."""
    nodes, per_node = int(row["nodes"]), int(row["gpus_per_node"])
    n = nodes * per_node
    kind = KIND[row["collective"]]
    # a source that does not print its NICs' rate: the catalog's usual node's
    network = (float(row["network_gbps_per_gpu"]) / 8 * 1e9 if row["network_gbps_per_gpu"]
               else gpu.network_bytes_s)
    link = "network" if nodes > 1 else "interconnect"
    c = Collective(row["collective"], ring_bytes(kind, float(row["size_bytes"]), n), "step",
                   "", link, n, nics=per_node if nodes > 1 else 1, kind=kind)
    # a run that forces NCCL's ring runs neither NVLS nor the NVLS tree
    return placed(c, gpu, per_node, nvls=False if row["ring_forced"] else None), network


def predicted_s(row: dict, efficiency: float) -> float:
    gpu = machine(row)
    c, network = collective(row, gpu)
    return c.bytes_per_gpu / (link_bytes_s(c, gpu, network) * efficiency) + (
        collective_latency_s(c, gpu))


def reached(row: dict) -> float:
    """Measured bus bandwidth / the model's link rate: the efficiency the row reaches."""
    gpu = machine(row)
    c, network = collective(row, gpu)
    return float(row["busbw_gb_s"]) * 1e9 / link_bytes_s(c, gpu, network)


def error(row: dict, efficiency: float) -> float:
    return predicted_s(row, efficiency) / (float(row["time_us"]) * 1e-6) - 1


def summary(errors: list[float]) -> dict:
    if not errors:
        return {"n": 0}
    a = sorted(abs(e) for e in errors)
    return {"n": len(a), "median": statistics.median(a),
            "p90": a[min(len(a) - 1, int(0.9 * len(a)))]}


def large(rows: list[dict]) -> list[dict]:
    return [r for r in rows if float(r["size_bytes"]) >= LARGE]


def fit(setups: list[list[dict]]) -> float | None:
    """The efficiency that times the setups' large messages best: the smallest median over
    setups (each weighing the same) of their median |log(predicted / measured)|."""
    setups = [large(s) for s in setups if large(s)]
    if not setups:
        return None

    def loss(e: float) -> float:
        return statistics.median(statistics.median(abs(math.log1p(error(r, e))) for r in s)
                                 for s in setups)
    return min(GRID, key=loss)


def main() -> None:
    rows, sources = load()
    shipped = shipped_factors("hopper").collective
    setups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        setups.setdefault((r["source"], int(r["nodes"])), []).append(r)
    fitted = {k: v for k, v in setups.items() if k[0] not in NOT_FITTED}

    def without(key: tuple[str, int], kind: str | None) -> list[list[dict]]:
        own = publication(sources[key[0]])
        return [s for k, s in fitted.items() if publication(sources[k[0]]) != own
                and (kind is None or link_kind(s[0]) == kind)]

    per_setup = []
    for key, rs in setups.items():
        kind = link_kind(rs[0])
        one, own_kind = fit(without(key, None)), fit(without(key, kind))
        per_setup.append({
            "source": key[0], "gpu": rs[0]["gpu"], "nodes": key[1],
            "gpus_per_node": int(rs[0]["gpus_per_node"]), "link": kind,
            "collectives": sorted({r["collective"] for r in rs}),
            "fitted": key[0] not in NOT_FITTED,
            "reached_largest": reached(max(rs, key=lambda r: float(r["size_bytes"]))),
            "bands_shipped": {label: summary([error(r, shipped) for r in rs
                                              if lo <= float(r["size_bytes"]) < hi])
                              for lo, hi, label in BANDS},
            "one_factor_without_it": one,
            "one_factor_out_of_sample": summary([error(r, one) for r in large(rs)]),
            "link_factor_without_it": own_kind,
            "link_factor_out_of_sample": summary([error(r, own_kind) for r in large(rs)])
            if own_kind else {"n": 0},
        })
    kinds = sorted({link_kind(s[0]) for s in fitted.values()})
    scored = [s for s in per_setup if s["fitted"]]

    def pooled(field: str, only: str | None = None) -> dict:
        # every fitted setup's large messages at the factor fitted without its publication:
        # the rows pooled, and the median over setups of each one's median (each setup
        # weighing the same, as the fit does; the pooled median jumps between the setups
        # the ring times well and the 2-node ones it does not)
        errors = {(s["source"], s["nodes"]): [error(r, s[field]) for r in large(
            setups[(s["source"], s["nodes"])])] for s in scored if s[field]
            and (only is None or s[only])}
        out = summary([e for v in errors.values() for e in v])
        medians = [summary(v)["median"] for v in errors.values() if v]
        return {**out, "setups": len(medians),
                "median_of_setups": statistics.median(medians) if medians else None}

    shipped_errors = {k: [error(r, shipped) for r in large(v)] for k, v in fitted.items()}
    result = {
        "machine": machine_line(), "shipped_efficiency": shipped, "large_bytes": LARGE,
        "not_fitted": NOT_FITTED,
        "fitted_all": fit(list(fitted.values())),
        "fitted_by_link": {k: fit([s for s in fitted.values() if link_kind(s[0]) == k])
                           for k in kinds},
        "large_shipped": {**summary([e for v in shipped_errors.values() for e in v]),
                          "median_of_setups": statistics.median(
                              summary(v)["median"] for v in shipped_errors.values() if v)},
        "large_one_factor_out_of_sample": pooled("one_factor_without_it"),
        "large_link_factor_out_of_sample": pooled("link_factor_without_it"),
        # the one efficiency on the setups a per-link one can be scored on (a link kind of
        # a single publication cannot be left out)
        "large_one_factor_on_link_setups": pooled("one_factor_without_it",
                                                  only="link_factor_without_it"),
        "setups": per_setup,
        "sources": sources,
    }
    write_results("nccl_vs_model", result, markdown(result))
    print(markdown(result))


def _cell(s: dict) -> str:
    return f"{s['median']:.1%} / {s['p90']:.1%} ({s['n']})" if s.get("n") else "-"


def _setups(s: dict) -> str:
    return f"{s['median_of_setups']:.1%} ({_cell(s)})"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(result: dict) -> str:
    mib = result["large_bytes"] // 2**20
    lines = [
        "# The communication model on published nccl-tests runs", "",
        f"Scored on {result['machine']} (the runs were measured by their sources: "
        "benchmarks/data/nccl_tests.csv). Error = predicted / measured time of one call - 1 "
        "(out-of-place). Cells: median / p90 of |error| (rows). *Reached*: the largest "
        "message's bus bandwidth / the model's link rate. *Out of sample*: the setup's "
        f"messages of at least {mib} MiB timed at the efficiency fitted on the other "
        "publications' setups (leave one publication out: an issue thread, a page or a "
        "README), either one efficiency for every link or one per kind of link.", "",
        f"Shipped collective efficiency: {result['shipped_efficiency']:.3f}. Fitted on every "
        f"fitted setup (in sample): {_num(result['fitted_all'])}; per link: " + ", ".join(
            f"{k} {_num(v)}" for k, v in result["fitted_by_link"].items()) + ".", "",
        f"Messages of at least {mib} MiB, every fitted setup, median over setups of each "
        "one's median |error| (rows pooled: median / p90): shipped "
        f"{_setups(result['large_shipped'])}; one efficiency, out of sample "
        f"{_setups(result['large_one_factor_out_of_sample'])}; one per link, out of sample "
        f"{_setups(result['large_link_factor_out_of_sample'])}, where one efficiency gives "
        f"{_setups(result['large_one_factor_on_link_setups'])} on the same setups.", "",
        "| source | GPU | nodes x GPUs | collective | link | reached | one factor without it "
        "| out of sample | per-link factor without it | out of sample | shipped: "
        + " | shipped: ".join(label for _, _, label in BANDS) + " |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(BANDS),
    ]
    for s in result["setups"]:
        name = s["source"] + ("" if s["fitted"] else " (not fitted)")
        lines.append(
            f"| {name} | {s['gpu']} | {s['nodes']} x {s['gpus_per_node']} | "
            f"{', '.join(s['collectives'])} | {s['link']} | {_num(s['reached_largest'])} | "
            f"{_num(s['one_factor_without_it'])} | {_cell(s['one_factor_out_of_sample'])} | "
            f"{_num(s['link_factor_without_it'])} | {_cell(s['link_factor_out_of_sample'])} | "
            + " | ".join(_cell(s["bands_shipped"][label]) for _, _, label in BANDS) + " |")
    lines += ["", "Sources:", ""] + [f"* {k}: {v}" for k, v in result["sources"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

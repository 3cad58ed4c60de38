"""A bounded load test of the web app on localhost: estimate requests from concurrent clients.

The app runs in its own process (uvicorn, one worker, as `vramplan serve` runs it); clients
are threads with one HTTP connection each. First one client alone (the latency a person
typing sees), then N concurrent clients sharing M requests. Jobs rotate over catalog models,
batch sizes and techniques. Writes benchmarks/results/web_load.json.

    python benchmarks/web_load.py [--clients 20] [--requests 5000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import QUICK, results_dir  # noqa: E402 (benchmarks/common.py)

MODELS = ["gpt2", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "gemma-2-9b",
          "llama-3.1-70b", "bert-base-uncased", "t5-base", "vit-base-patch16-224"]


def jobs():
    """An endless rotation of valid jobs (the same sequence on every run)."""
    for model, batch, peft in itertools.cycle(itertools.product(
            MODELS, (1, 2, 4, 8), (None, "lora", "qlora"))):
        job = {"model": model, "batch_size": batch}
        if peft and model not in ("bert-base-uncased", "t5-base", "vit-base-patch16-224"):
            job["peft"] = {"method": peft}
            if model == "gpt2":  # GPT-2 names its attention projection c_attn
                job["peft"]["target_modules"] = ["c_attn"]
        yield {"job": job}


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "vramplan.web.app:create_app", "--factory",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/api/v1/gpus", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start")


def run_clients(url: str, clients: int, requests: int) -> dict:
    bodies = jobs()
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    remaining = [requests]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=30) as session:
            while True:
                with lock:
                    if remaining[0] == 0:
                        return
                    remaining[0] -= 1
                    body = next(bodies)
                start = time.perf_counter()
                try:
                    response = session.post("/api/v1/estimate", json=body)
                    ok = response.status_code == 200
                    problem = "" if ok else f"{response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as error:
                    problem = f"{type(error).__name__}: {error}"
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)
                    if problem:
                        errors.append(problem)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ordered = sorted(latencies)
    return {"clients": clients, "requests": len(latencies), "errors": len(errors),
            "error_examples": errors[:5], "wall_s": round(wall, 2),
            "requests_per_s": round(len(latencies) / wall, 1),
            "p50_ms": round(1e3 * statistics.median(ordered), 2),
            "p90_ms": round(1e3 * ordered[int(0.90 * (len(ordered) - 1))], 2),
            "p99_ms": round(1e3 * ordered[int(0.99 * (len(ordered) - 1))], 2),
            "max_ms": round(1e3 * ordered[-1], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4 if QUICK else 20)
    parser.add_argument("--requests", type=int, default=200 if QUICK else 5000)
    parser.add_argument("--single", type=int, default=50 if QUICK else 300,
                        help="requests from one client")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    process, url = start_server()
    try:
        run_clients(url, 1, 50)  # warm up: catalogs loaded, connections open
        single = run_clients(url, 1, args.single)
        loaded = run_clients(url, args.clients, args.requests)
    finally:
        process.terminate()
        process.wait(10)
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "load_average_1min_before": round(load_before, 2),
                    "note": "server and clients share the machine's CPUs with other work"},
        "date": time.strftime("%Y-%m-%d"),
        "endpoint": "POST /api/v1/estimate (formula engine, JSON report with the fit table)",
        "server": "uvicorn, 1 worker process",
        "one_client": single,
        "concurrent": loaded,
    }
    results_dir().joinpath("web_load.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if loaded["errors"] or single["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

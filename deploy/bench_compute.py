"""Benchmark of the compute model alone (no Triton): AOTI package vs eager module, and a cached
prefix (8 new events) vs full recompute, for histories of 256, 1,024 and 4,096 tokens with 64
candidates, one user per call.

    .venv/bin/python deploy/bench_compute.py [--device cpu|cuda] [--repeats N] [--model-dir DIR]

The config is the default one with ``max_history_events`` raised to 4,096 (a 4,096-token history
plus 8 new events is longer than the default maximum of 2,048 events); the model folder is a
scratch folder (``/tmp/hstu-bench-compute`` by default) so the served model is never touched.
Prints a table and writes ``deploy/reports/compute-<date>-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from compute import HSTUConfig, PagedBatch, build, history_tokens, load_compiled, load_eager

logger = logging.getLogger(__name__)

HISTORY_TOKENS = (256, 1024, 4096)
NEW_EVENTS = 8
CANDIDATES = 64
REPORTS = Path(__file__).resolve().parent / "reports"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per case (median reported)")
    parser.add_argument("--model-dir", default="/tmp/hstu-bench-compute")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    config = dataclasses.replace(HSTUConfig(), max_history_events=4096)
    model_dir = Path(options.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save(model_dir)
    build_started = time.perf_counter()
    build(model_dir, options.device)
    build_s = time.perf_counter() - build_started
    runners = {"eager": load_eager(model_dir, options.device), "aoti": load_compiled(model_dir, options.device)}

    rng = np.random.default_rng(0)
    results = []
    for history in HISTORY_TOKENS:
        total_events = history // 2 + NEW_EVENTS
        items = rng.integers(1, config.item_vocab, total_events, dtype=np.int64)
        actions = rng.integers(0, config.action_vocab, total_events, dtype=np.int64)
        tokens = history_tokens(items, actions, config)  # [history + 16]
        candidates = rng.integers(1, config.item_vocab, CANDIDATES, dtype=np.int64)
        row = list(range(-(-tokens.numel() // config.page_size)))
        pool = torch.zeros(config.num_layers, len(row), 2, config.page_size, config.num_heads, config.head_dim,
                           dtype=config.torch_dtype, device=options.device)
        full = PagedBatch.from_requests([(tokens, 0, row, candidates)])
        cached = PagedBatch.from_requests([(tokens[history:], history, row, candidates)])  # 16 new tokens
        case = {"history_tokens": history, "new_tokens_cached": tokens.numel() - history, "candidates": CANDIDATES}
        for name, run in runners.items():
            case[f"{name}_full_ms"] = _median_ms(run, pool, full, options.repeats, options.device)
            case[f"{name}_cached_ms"] = _median_ms(run, pool, cached, options.repeats, options.device)
        for mode in ("full", "cached"):
            case[f"eager_over_aoti_{mode}"] = case[f"eager_{mode}_ms"] / case[f"aoti_{mode}_ms"]
        for name in runners:
            case[f"{name}_full_over_cached"] = case[f"{name}_full_ms"] / case[f"{name}_cached_ms"]
        results.append(case)
        _print_case(case)

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": options.device,
        "device_name": torch.cuda.get_device_name() if options.device == "cuda" else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "config": dataclasses.asdict(config),
        "repeats": options.repeats,
        "build_s": build_s,
        "results": results,
    }
    REPORTS.mkdir(parents=True, exist_ok=True)
    path = REPORTS / f"compute-{datetime.date.today().isoformat()}-{options.device}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def _median_ms(run, pool: torch.Tensor, batch: PagedBatch, repeats: int, device: str) -> float:
    for _ in range(2):  # warm-up
        run(pool, batch)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run(pool, batch)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _print_case(case: dict) -> None:
    print(f"history {case['history_tokens']:>5} tokens, {case['candidates']} candidates: "
          f"full  eager {case['eager_full_ms']:8.2f} ms  aoti {case['aoti_full_ms']:8.2f} ms "
          f"(eager/aoti {case['eager_over_aoti_full']:.2f}x) | "
          f"cached ({case['new_tokens_cached']} new)  eager {case['eager_cached_ms']:7.2f} ms  "
          f"aoti {case['aoti_cached_ms']:7.2f} ms (eager/aoti {case['eager_over_aoti_cached']:.2f}x) | "
          f"full/cached  eager {case['eager_full_over_cached']:.1f}x  aoti {case['aoti_full_over_cached']:.1f}x",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

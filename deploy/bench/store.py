"""Micro-benchmark of the host stores (not a test): offload (put_async + wait) and onboard
(get_async + wait) bandwidth for 1, 8, 64 and 512 pages per call, next to a plain torch copy of
the same bytes between the pool and host memory, and their ratio; each store in `--stores`, one
after the other, in one run. Two ways per size: one call at a time (each waited for: a request's
latency, fixed costs included) and streaming (every call submitted, then all waited for: the
bandwidth a loaded server gets), each against the torch copies done the same way. Each store's
bare round trip (a `ping`) is printed first: one call at a time pays two of them (the submit and
the waiting poll) on top of the server's own work, which bounds that ratio at small sizes
whatever the copy costs.

    .venv/bin/python -m deploy.bench.store [--device cpu|cuda] [--stores embedded flexkv]
        [--layers 8 --heads 4 --head-dim 64 --page-size 32 --dtype float32] [--repeats 20]

Writes deploy/reports/store-<date>-<device>.json. On a GPU host the embedded store's DRAM tier
is pinned and its copies run on their own CUDA stream; the baseline is then a pinned
device<->host copy. `flexkv` needs a CUDA pool and a FlexKV build (deploy/build_flexkv.sh).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from deploy.bench.report import write_dated_report
from kvlifecycle.pool import PagePool, PoolSpec, slots_for_pages
from kvlifecycle.store import Status, open_store
from kvlifecycle.rpc import default_endpoint
from kvlifecycle.store.processes import STORE_PROGRAM, StoreProcess, start_store_process

logger = logging.getLogger(__name__)

REPORTS = Path(__file__).resolve().parents[1] / "reports"
PAGES_PER_CALL = (1, 8, 64, 512)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--stores", nargs="+", choices=("embedded", "flexkv"), default=["embedded"])
    p.add_argument("--report-dir", type=Path, default=REPORTS)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    calls = a.repeats
    spec = PoolSpec(num_layers=a.layers, num_pages=max(PAGES_PER_CALL) * 2, page_size=a.page_size,
                    num_heads=a.heads, head_dim=a.head_dim, dtype=a.dtype, device=a.device)
    pool = PagePool.create(spec)
    pool.tensor.copy_(torch.randn(spec.shape).to(spec.torch_dtype))
    # DRAM tier big enough that offloads of distinct sequences never evict during a run.
    dram_bytes = spec.page_bytes * max(PAGES_PER_CALL) * (calls + 2)
    rows: list[dict[str, Any]] = []
    try:
        for kind in a.stores:
            proc, store = _open(kind, pool, dram_bytes)
            try:
                _warm_up(store, spec)
                round_trip_ms = _round_trip_ms(store)
                print(f"{kind:>8}: a bare round trip to the store process (ping) {round_trip_ms:.3f} ms, median of "
                      f"{ROUND_TRIPS}")
                for n in PAGES_PER_CALL:
                    rows.append({"store": kind, "round_trip_ms": round_trip_ms, **_measure(store, pool, spec, n, calls)})
                    print(_format(rows[-1]))
            finally:
                store.close()
                proc.stop()
    finally:
        pool.close()

    report = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "device": a.device,
        "host": platform.node(),
        "torch": torch.__version__,
        "spec": spec.to_dict(),
        "page_bytes": spec.page_bytes,
        "calls_per_size": calls,
        "results": rows,
    }
    write_dated_report(a.report_dir, "store", a.device, report)
    return 0


def _open(kind: str, pool: PagePool, dram_bytes: int) -> tuple[StoreProcess, Any]:
    """The store process of `kind` and a client that owns `pool` (registered)."""
    endpoint = default_endpoint("store.sock")
    program = ("-m", "kvlifecycle.store.flexkv") if kind == "flexkv" else STORE_PROGRAM
    proc = start_store_process(endpoint, dram_bytes=dram_bytes, program=program, ready_timeout_s=60)
    extra = {"owned_pool": pool} if kind == "flexkv" else {}
    store = open_store(kind, endpoint=endpoint, page_size=pool.spec.page_size, rpc_timeout_s=5.0, **extra)
    if not store.register_pool(pool.handle()):
        proc.kill()
        raise RuntimeError(f"{kind} store did not take the pool; log {proc.log_path}:\n"
                           f"{proc.log_path.read_text()[-3000:]}")
    return proc, store


def _warm_up(store: Any, spec: PoolSpec) -> None:
    """One put and one get, not timed: the store's first copies pay one-time costs (on a GPU, its
    first kernels and stream), which a mean over a few calls of the first size would carry."""
    seq = np.arange(spec.page_size, dtype=np.int64) + 999_000_000
    put = store.put_async(seq, slots_for_pages([0], spec.page_size).numpy(), "bench-warm-up")
    if store.wait([put], timeout_s=60)[put] is Status.SUCCESS:
        get = store.get_async(seq, slots_for_pages([1], spec.page_size).numpy(), "bench-warm-up",
                              np.ones(spec.page_size, dtype=bool))
        store.wait([get], timeout_s=60)


ROUND_TRIPS = 200


def _round_trip_ms(store: Any) -> float:
    """Median milliseconds of a `ping` to the store process: the floor of any call to it."""
    samples = []
    for _ in range(ROUND_TRIPS):
        t0 = time.perf_counter()
        assert store.ping(), "the store process stopped answering"
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)) * 1e3


def _measure(store: Any, pool: PagePool, spec: PoolSpec, n: int, calls: int) -> dict[str, Any]:
    nbytes = n * spec.page_bytes
    pages = list(range(n))
    slot_map = slots_for_pages(pages, spec.page_size).numpy()
    seqs = [np.arange(n * spec.page_size, dtype=np.int64) + 1_000_000 * (i + 1) for i in range(calls)]

    onboard_slots = slots_for_pages(list(range(n, 2 * n)), spec.page_size).numpy()
    mask = np.ones(n * spec.page_size, dtype=bool)
    put = lambda seq: store.put_async(seq, slot_map, "bench")  # noqa: E731
    get = lambda seq: store.get_async(seq, onboard_slots, "bench", mask)  # noqa: E731
    offload_s = _timed(store, put, seqs, "offload", streaming=False)  # distinct sequences: every call copies
    onboard_s = _timed(store, get, seqs, "onboard", streaming=False)
    assert torch.equal(pool.tensor[:, n:2 * n], pool.tensor[:, :n]), "onboarded pages differ"
    streamed = [seq + 500_000 for seq in seqs]  # not stored yet (the tier evicts the oldest to hold them)
    offload_stream_s = _timed(store, put, streamed, "offload", streaming=True)
    onboard_stream_s = _timed(store, get, streamed, "onboard", streaming=True)

    (d2h_s, h2d_s), (d2h_stream_s, h2d_stream_s) = _plain_copies(pool, n, calls)
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    return {
        "pages_per_call": n,
        "bytes_per_call": nbytes,
        "offload_gbps": gbps(offload_s),
        "onboard_gbps": gbps(onboard_s),
        "torch_pool_to_host_gbps": gbps(d2h_s),
        "torch_host_to_pool_gbps": gbps(h2d_s),
        "offload_ratio": d2h_s / offload_s,
        "onboard_ratio": h2d_s / onboard_s,
        "offload_ms_per_call": offload_s * 1e3,
        "onboard_ms_per_call": onboard_s * 1e3,
        "streaming_offload_gbps": gbps(offload_stream_s),
        "streaming_onboard_gbps": gbps(onboard_stream_s),
        "streaming_torch_pool_to_host_gbps": gbps(d2h_stream_s),
        "streaming_torch_host_to_pool_gbps": gbps(h2d_stream_s),
        "streaming_offload_ratio": d2h_stream_s / offload_stream_s,
        "streaming_onboard_ratio": h2d_stream_s / onboard_stream_s,
    }


def _timed(store: Any, submit: Callable[[np.ndarray], int], seqs: list[np.ndarray], what: str,
           streaming: bool) -> float:
    """Seconds per call of `submit(seq)` over `seqs`: each waited for, or all submitted then waited for."""
    t0 = time.perf_counter()
    if streaming:
        tasks = [submit(seq) for seq in seqs]
        statuses = store.wait(tasks, timeout_s=120)
    else:
        statuses = {}
        for seq in seqs:
            task = submit(seq)
            statuses.update(store.wait([task], timeout_s=60))
    elapsed = (time.perf_counter() - t0) / len(seqs)
    bad = {t: s for t, s in statuses.items() if s is not Status.SUCCESS}
    assert not bad, f"{what}{' (streaming)' if streaming else ''}: {len(bad)} call(s) not SUCCESS: {set(bad.values())}"
    return elapsed


def _plain_copies(pool: PagePool, n: int, calls: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Seconds per call of a plain copy of the same bytes, pool pages -> a host tensor and back:
    (each synchronized, all queued then synchronized once)."""
    src, dst = pool.tensor[:, :n], pool.tensor[:, n:2 * n]
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
    sync: Callable[[], None] = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    host.copy_(src)
    sync()

    def per_call(copy: Callable[[], Any], streaming: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            copy()
            if not streaming:
                sync()
        sync()
        return (time.perf_counter() - t0) / calls

    d2h = lambda: host.copy_(src, non_blocking=True)  # noqa: E731
    h2d = lambda: dst.copy_(host, non_blocking=True)  # noqa: E731
    return (per_call(d2h, False), per_call(h2d, False)), (per_call(d2h, True), per_call(h2d, True))


def _format(row: dict[str, Any]) -> str:
    return (f"{row['store']:>8} {row['pages_per_call']:>3} pages ({row['bytes_per_call'] / 2**20:7.2f} MiB): "
            f"offload {row['offload_gbps']:6.2f} GB/s vs torch {row['torch_pool_to_host_gbps']:6.2f} "
            f"(x{row['offload_ratio']:.2f}) | onboard {row['onboard_gbps']:6.2f} GB/s vs torch "
            f"{row['torch_host_to_pool_gbps']:6.2f} (x{row['onboard_ratio']:.2f}) | streaming: offload "
            f"{row['streaming_offload_gbps']:6.2f} (x{row['streaming_offload_ratio']:.2f}), onboard "
            f"{row['streaming_onboard_gbps']:6.2f} (x{row['streaming_onboard_ratio']:.2f})")


if __name__ == "__main__":
    raise SystemExit(main())

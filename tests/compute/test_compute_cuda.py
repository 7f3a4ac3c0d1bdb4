"""The CUDA package, checked where it runs (marked ``cuda``; skipped on machines without a GPU,
such as CI, and run on the H200 by ``deploy/gpu_run.sh``).

- the CUDA AOTI package builds, loads, and serves cached == uncached within the bf16 tolerance
  (``compute.reference.default_tolerance``), and a wrong cached prefix moves its scores beyond it:
  the tolerance is tight enough to catch one;
- a call costs its own tokens, not the pool: its time at 256 and at 32,768 pool pages is within
  1.2x, and what it allocates at its peak is under 1% of the pool (the package once copied the
  whole pool twice per call, which no CPU test could see).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from compute import HSTUConfig, PagedBatch, build, default_tolerance, load_compiled, load_reference
from deploy.bench.compute import Case, call_peak_bytes, make_batch, median_call_ms
from deploy.bench.compute import new_pool as zero_pool
from paged_helpers import (GPU_SMALL_CONFIG, PageAllocator, fill_prefix, make_user, new_pool, serve, suffix_request,
                           with_other_prefix)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by deploy/gpu_run.sh on the GPU host)"),
]



@pytest.fixture(scope="module")
def cuda_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hstu_cuda")
    HSTUConfig.load(GPU_SMALL_CONFIG).save(folder)
    build(folder, "cuda")
    return folder


@pytest.fixture(scope="module")
def cuda_runner(cuda_model_dir):
    return load_compiled(cuda_model_dir, "cuda")


def test_cuda_package_matches_the_reference(cuda_model_dir, cuda_runner):
    config = HSTUConfig.load(cuda_model_dir)
    reference = load_reference(cuda_model_dir)
    rng = np.random.default_rng(5)
    pages = PageAllocator(256, rng)
    users = [make_user(rng, config, events, 8, pages) for events in (3, 40, 300, 700)]
    pool = new_pool(config, 256).cuda()

    scores = serve(cuda_runner, pool, users).cpu().numpy()

    expected = np.concatenate([reference.score(0, u.item_ids, u.action_ids, u.candidate_ids) for u in users])
    assert np.isfinite(scores).all()
    worst = float(np.abs(scores - expected).max())
    tolerance = default_tolerance(config)
    assert worst <= tolerance, f"max abs diff {worst:.3g} vs the fp32 reference, tolerance {tolerance}"


@pytest.mark.parametrize("first_wrong_event", [0, 128], ids=["another history", "half the prefix"])
def test_a_wrong_cached_prefix_moves_scores_beyond_the_tolerance(cuda_model_dir, cuda_runner, first_wrong_event):
    """The guard of the bf16 tolerance: over a pool holding another history's K/V for the cached
    256 events (all of them, or the later half), the served scores leave the true history's
    reference by more than the tolerance, while the right prefix stays within it."""
    config = HSTUConfig.load(cuda_model_dir)
    reference = load_reference(cuda_model_dir)
    tolerance = default_tolerance(config)
    rng = np.random.default_rng(12)
    user = make_user(rng, config, 600, 16, PageAllocator(64, rng), cached_len=512)
    want = reference.score(0, user.item_ids, user.action_ids, user.candidate_ids)

    moved = {}
    for name, written in (("right", user), ("wrong", with_other_prefix(user, rng, config, first_wrong_event))):
        pool = new_pool(config, 64).cuda()
        fill_prefix(cuda_runner, pool, written)  # the pool's K/V for tokens [0, 512)
        scores = cuda_runner(pool, PagedBatch.from_requests([suffix_request(user)])).cpu().numpy()
        assert scores.shape == want.shape
        moved[name] = float(np.abs(scores - want).max())
    assert moved["right"] <= tolerance, f"right prefix: max abs diff {moved['right']:.3g}, tolerance {tolerance}"
    assert moved["wrong"] > tolerance, (f"a wrong cached prefix moved the scores by only {moved['wrong']:.3g}: the "
                                        f"tolerance {tolerance} could not tell it from bf16 rounding")


def test_call_cost_does_not_grow_with_the_pool(cuda_model_dir, cuda_runner):
    config = HSTUConfig.load(cuda_model_dir)
    case = Case("hit B=1 1024", users=1, cached=1024)
    rng = np.random.default_rng(6)
    times, peaks = {}, {}
    for pages in (256, 32768):
        pool = zero_pool(config, pages, "cuda")
        batch = make_batch(config, case, pages, rng)
        times[pages] = median_call_ms(cuda_runner, pool, batch, repeats=30)
        peaks[pages] = call_peak_bytes(cuda_runner, pool, batch)
        pool_bytes = pool.numel() * pool.element_size()
        del pool
        torch.cuda.empty_cache()
    assert times[32768] <= 1.2 * times[256], f"call time {times} ms: grows with the pool"
    assert peaks[32768] < 0.01 * pool_bytes, (f"one call allocated {peaks[32768] / 2**20:.1f} MiB at its peak, "
                                             f"the pool is {pool_bytes / 2**20:.0f} MiB: something copies the pool")


@pytest.mark.parametrize("runner_name", ["cuda_runner", "graphed_runner"])
def test_a_call_writes_only_its_new_tokens_rows(request, runner_name, cuda_model_dir):
    """Every slot outside the new tokens' positions keeps its bytes: the write is one indexed copy
    (with CUDA graphs too: the padding's tokens would land in page 0)."""
    cuda_runner = request.getfixturevalue(runner_name)
    config = HSTUConfig.load(cuda_model_dir)
    rng = np.random.default_rng(7)
    pool = torch.randn(config.num_layers, 64, 2, config.page_size, config.num_heads, config.head_dim,
                       dtype=config.torch_dtype, device="cuda")
    before = pool.clone()
    # 32 cached tokens in page 3; 40 new ones at positions 32..71: page 9 whole, page 12 offsets 0..7.
    batch = PagedBatch.from_requests([(rng.integers(1, config.vocab_size, 40, dtype=np.int64), 32, [3, 9, 12],
                                       rng.integers(1, config.item_vocab, 5, dtype=np.int64))])
    for _ in range(3):  # with graphs: direct, captured, replayed (the same rows each time)
        cuda_runner(pool, batch)

    changed = (pool != before).flatten(4).any(-1).any(0).any(1)  # [L, P, 2, S, H*D] -> [P, S]: any layer, K or V
    expected = torch.zeros_like(changed)
    expected[9, :] = True
    expected[12, :8] = True
    assert torch.equal(changed, expected), f"written slots differ: {changed.nonzero().tolist()}"


@pytest.fixture(scope="module")
def graphed_runner(cuda_model_dir):
    return load_compiled(cuda_model_dir, "cuda", cuda_graphs=8)


def test_cuda_graphs_serve_the_scores_and_writes_of_a_direct_call(cuda_model_dir, cuda_runner, graphed_runner):
    """hstu_compute's default runner: batches padded to bucketed shapes and replayed from CUDA
    graphs give the direct call's scores and pool contents, a shape's graph is captured at its
    second batch and replayed after, and page 0 (the padding's) is never written."""
    config = HSTUConfig.load(cuda_model_dir)
    rng = np.random.default_rng(9)
    pages = PageAllocator(512, rng)
    pages.free.remove(0)
    direct_pool, graphed_pool = new_pool(config, 512).cuda(), new_pool(config, 512).cuda()
    for _ in range(3):  # the same shapes: the second round captures graphs, the third replays them
        users = [make_user(rng, config, events, 8, pages, cached_len=cached)
                 for events, cached in ((3, 0), (40, 64), (90, 128))]
        want = serve(cuda_runner, direct_pool, users)
        got = serve(graphed_runner, graphed_pool, users)
        torch.testing.assert_close(got, want, rtol=0, atol=default_tolerance(config) / 4)
    written = ~torch.isnan(direct_pool)
    assert torch.equal(written, ~torch.isnan(graphed_pool)), "the graphs wrote other slots than the direct calls"
    assert torch.isnan(graphed_pool[:, 0]).all(), "a padding token was written into page 0"
    stats = graphed_runner.stats
    assert stats["compute_graph_calls"] > stats["compute_graph_captures"] > 0, stats

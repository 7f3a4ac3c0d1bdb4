"""Padding a batch to a CUDA graph's bucketed shape (``compute.graphs``) changes nothing a user
sees: checked here on the CPU with the eager module (the CUDA graphs themselves run in
``test_compute_cuda.py``, on the GPU host).

- ``bucket`` pads to a power of two, at least its minimum;
- a padded batch, its outputs cut back by ``unpad_outputs``, gives the real users' scores and
  K/V rows of the batch run as it is, and the padding's rows (page 0) are never written;
- ``GraphedForward`` (capture stood in for: ``ReplayOnCPU``) runs a shape's first batch directly,
  captures it at the second and replays it after, with the direct call's scores and pool
  writes; a failed capture, a batch past ``max_cells`` and a new pool run directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compute import PagedBatch
from compute.graphs import GraphedForward, GraphShape, _Captured, bucket, pad_batch, run_forward, unpad_outputs
from compute.model import write_new_kv
from paged_helpers import GPU_SMALL_CONFIG, PageAllocator, fill_prefix, make_user, new_pool, suffix_request


def test_bucket_is_the_next_power_of_two_past_its_minimum():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert [bucket(n, 64) for n in (0, 1, 63, 64, 65)] == [64, 64, 64, 64, 128]


@pytest.mark.parametrize("events", [(3, 40, 300), (17,), (1, 1, 1, 1, 1)], ids=["three users", "one user", "five tiny"])
def test_a_padded_batch_scores_and_writes_what_the_batch_does(eager, config, events):
    rng = np.random.default_rng(len(events))
    pages = PageAllocator(300, rng)
    pages.free.remove(0)  # page 0: never a real user's, so a write from the padding would show there
    users = [make_user(rng, config, n, 7, pages) for n in events]
    pool = new_pool(config, 300)  # NaN: any slot written shows
    for user in users:
        fill_prefix(eager, pool, user)
    batch = PagedBatch.from_requests([suffix_request(u) for u in users])
    shape = GraphShape.covering(batch, config.page_size)
    padded = pad_batch(batch, shape)
    assert padded.num_users == shape.users > batch.num_users or shape.new_tokens == int(batch.new_offsets[-1])

    plain_pool, padded_pool = pool.clone(), pool.clone()
    with torch.no_grad():
        want = run_forward(eager.graph, plain_pool, batch)
        outputs = eager.graph(*padded.graph_inputs(padded_pool, max_lens=(shape.max_new, shape.max_cand)))
        scores, rows, values = unpad_outputs(outputs, batch, shape, config.num_layers)
        write_new_kv(padded_pool, rows, values)

    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_pool, plain_pool, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(padded_pool[:, 0]).all(), "the padding's tokens were written into page 0"


def test_the_covering_shape_gives_the_padding_enough_users_and_pages(config):
    rng = np.random.default_rng(3)
    requests = [(rng.integers(1, 100, n), 0, list(range(1, 1 + -(-n // config.page_size))), rng.integers(1, 100, c))
                for n, c in ((70, 5), (33, 1), (0, 9))]
    batch = PagedBatch.from_requests(requests)
    shape = GraphShape.covering(batch, config.page_size)
    padded = pad_batch(batch, shape)
    lens = (padded.new_offsets[1:] - padded.new_offsets[:-1])
    cands = (padded.cand_offsets[1:] - padded.cand_offsets[:-1])
    assert (padded.num_users, int(padded.new_offsets[-1]), int(padded.cand_offsets[-1]), padded.page_table.shape[1]) == (
        shape.users, shape.new_tokens, shape.candidates, shape.table_width)
    assert int(lens.max()) <= shape.max_new and int(cands.max()) <= shape.max_cand
    assert padded.check(torch.empty(1, 300, 2, config.page_size, 1, 1), config.page_size, config.vocab_size,
                        config.item_vocab) is None


class ReplayOnCPU(GraphedForward):
    """``GraphedForward`` with a stand-in for CUDA graph capture, which cannot run without a GPU
    (the real capture is tested in ``test_compute_cuda.py``): "replaying" reruns the module on
    the captured input buffers and writes the captured output tensors in place, as a CUDA graph
    replay does. Everything else (buckets, padding, when to capture, which graph to keep, the
    input buffer's reload, the cut of the outputs) is the shipped code."""

    def __init__(self, *args, fail_capture: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_capture = fail_capture

    def _capture(self, kv_pool, shape, padded):
        if self.fail_capture:
            raise RuntimeError("stand-in capture failure")
        packed = padded.packed_indices(pinned=False)
        inputs = padded.graph_inputs(kv_pool, packed, max_lens=(shape.max_new, shape.max_cand))
        outputs = self.graph(*inputs)
        graph = self.graph

        class Replay:
            def replay(self) -> None:
                for static, fresh in zip(outputs, graph(*inputs)):
                    static.copy_(fresh)

        return _Captured(Replay(), packed, inputs, outputs)


def _same_shape_batches(config, rng, pages, count):
    """``count`` batches of three users whose sizes fall in the same buckets, on fresh pages."""
    batches = []
    for _ in range(count):
        requests = []
        for new, cached in ((5, 0), (20, 32), (9, 64)):
            row = pages.take(-(-(cached + new) // config.page_size))
            requests.append((rng.integers(1, 100, new), cached, row, rng.integers(1, 100, 6)))
        batches.append(PagedBatch.from_requests(requests))
    return batches


def test_a_shape_runs_directly_then_is_captured_at_its_second_batch_and_replayed(eager, config):
    rng = np.random.default_rng(11)
    pages = PageAllocator(200, rng)
    pages.free.remove(0)
    batches = _same_shape_batches(config, rng, pages, 4)
    direct_pool, graphed_pool = torch.zeros(new_pool(config, 200).shape), torch.zeros(new_pool(config, 200).shape)
    graphed = ReplayOnCPU(eager.graph, config.num_layers, config.page_size, max_graphs=4)
    with torch.no_grad():
        for i, batch in enumerate(batches):
            want = run_forward(eager.graph, direct_pool, batch)
            got = graphed(graphed_pool, batch)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"batch {i}: {m}")
    torch.testing.assert_close(graphed_pool, direct_pool, rtol=1e-5, atol=1e-5)
    assert graphed.stats == {"compute_direct_calls": 1, "compute_graph_captures": 1, "compute_graph_calls": 3}


def test_a_failed_capture_leaves_its_shape_direct_and_a_new_pool_drops_the_graphs(eager, config):
    rng = np.random.default_rng(12)
    pages = PageAllocator(200, rng)
    batches = _same_shape_batches(config, rng, pages, 3)
    pool = torch.zeros(new_pool(config, 200).shape)
    failing = ReplayOnCPU(eager.graph, config.num_layers, config.page_size, max_graphs=4, fail_capture=True)
    with torch.no_grad():
        for batch in batches:
            failing(pool, batch)
    assert failing.stats == {"compute_direct_calls": 3, "compute_graph_captures": 0, "compute_graph_calls": 0}

    graphed = ReplayOnCPU(eager.graph, config.num_layers, config.page_size, max_graphs=1)
    other_pool = pool.clone()
    with torch.no_grad():
        for batch in batches[:2]:
            graphed(pool, batch)  # direct, then captured over `pool`
        graphed(other_pool, batches[2])  # the graph reads `pool`'s address: dropped, runs direct
    assert graphed.stats == {"compute_direct_calls": 2, "compute_graph_captures": 1, "compute_graph_calls": 1}


def test_only_launch_bound_batches_are_padded_and_replayed(eager, config):
    rng = np.random.default_rng(13)
    batch = PagedBatch.from_requests([(rng.integers(1, 100, 40), 0, [1, 2], rng.integers(1, 100, 3))])
    pool = torch.zeros(new_pool(config, 8).shape)
    tight = ReplayOnCPU(eager.graph, config.num_layers, config.page_size, max_graphs=4,
                        max_cells=GraphShape.covering(batch, config.page_size).cells(config.num_layers, config.page_size) - 1)
    with torch.no_grad():
        for _ in range(3):
            tight(pool, batch)
    assert tight.stats["compute_direct_calls"] == 3 and tight.stats["compute_graph_captures"] == 0


def test_graph_shapes_counts_a_trace_without_a_gpu():
    """``python -m deploy.bench.graph_shapes``: the requests a trace sends, each batch's shape, and
    how many batches would replay (the count behind the bucket minimums)."""
    from compute import HSTUConfig
    from deploy import trace as trace_module
    from deploy.bench.graph_shapes import count_shapes, served_requests

    config = HSTUConfig.load(GPU_SMALL_CONFIG)
    trace = trace_module.generate(trace_module.TraceConfig(num_users=4, num_requests=40, initial_events_median=40))
    requests = served_requests(config, trace)
    assert [cached for _, cached, _, _ in requests[:4]].count(0) >= 1, "a user's first request is a miss"
    for (new, cached, row, _), request in zip(requests, trace):
        assert cached % config.page_size == 0 and cached + new.size == 2 * len(request.item_ids)
        assert len(row) * config.page_size >= cached + new.size
    ones = count_shapes(config, requests, batch_size=1, max_cells=1 << 40)
    assert ones["batches"] == ones["graphable"] == 40
    assert ones["replayed"] == 40 - ones["shapes"], "each shape's first batch runs directly"
    assert count_shapes(config, requests, batch_size=8, max_cells=0)["graphable"] == 0

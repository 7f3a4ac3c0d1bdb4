"""CUDA graphs of the compiled paged forward, at bucketed shapes.

On the GPU a call of the AOTI package is launch-bound up to about 8 users (``compute.batch``,
``CALL_COST``): the CPU issuing a few hundred kernels, not the GPU running them, sets its
time. A CUDA graph replays the same kernels with one launch. A graph is captured for fixed
tensor shapes and addresses, so a batch is padded up to a bucketed shape (``GraphShape``: each
size to a power of two, with minimums that let one graph serve every batch of short runs) and
its inputs are copied into the graph's own input buffer before each replay. Only launch-bound
batches are replayed (``GRAPH_MAX_CELLS``), and a shape is captured at its second batch
(``CAPTURE_AFTER``).

Padding never changes a real user's result:
- the bucket's extra users (``pad_batch``) come after the real ones, with nothing cached, page
  0 in their page rows (read for nothing: a user reads the pool only below its cached length)
  and token and item id 1. The extra new tokens and candidates are theirs;
- the forward computes each user on its own (attention never crosses users), so the real
  users' scores are what they would be alone, and the extra users' scores are dropped;
- the graph only reads the pool. Its K/V rows come back as ``2 * L`` blocks of ``T`` tokens,
  the extra users' tokens last in each block; only the real ``T`` of each block are written
  (``write_new_kv``), outside the graph, so page 0 is never written for a padding token.

Graphs share one memory pool. That is safe because one thread replays them and each replay's
outputs are consumed (scores copied, K/V written) before the next replay.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from compute.batch import PagedBatch
from compute.model import write_new_kv

logger = logging.getLogger(__name__)

__all__ = ["CUDA_GRAPHS", "GRAPH_MAX_CELLS", "GRAPH_STATS_KEYS", "GraphShape", "GraphedForward", "bucket",
           "pad_batch", "run_forward", "unpad_outputs"]

# A batch is replayed from a graph only while its padded forward is at most this many cells (one
# query x key product of one layer): a launch-bound call. Past it the GPU's work hides the
# launches, and padding only adds to it. On an H100 (small config, deploy.bench.compute, direct
# vs replayed): 1.5M cells 1.09 vs 0.60 ms, 3.0M 1.32 vs 0.84; at 6.0M it depends on the batch
# (one user of 4,096 tokens 1.12 vs 1.32, eight of 1,024 1.30 vs 1.16); 12M 1.30 vs 1.86.
GRAPH_MAX_CELLS = 4 * 1024 * 1024
# A shape is captured at its second batch: a capture costs several forwards, so a shape seen once
# (a rare mix of users) runs directly instead.
CAPTURE_AFTER = 2
# The smallest bucket of each kind of size: one graph then serves every batch of short runs. In
# a launch-bound call the padding costs nothing measurable; with finer buckets (1.5x steps, no
# minimum) the demo's trace needed a new graph for every second batch (285 captures in 555 calls
# on an H100). With these, its single requests fall in 6 shapes (python -m deploy.bench.graph_shapes).
MIN_TOKENS, MIN_CANDIDATES, MIN_PAGES = 64, 64, 32
# Graphs to keep when they are on (the compute bench's; serving takes --cuda-graphs).
CUDA_GRAPHS = 64
GRAPH_STATS_KEYS = ("compute_graph_calls", "compute_direct_calls", "compute_graph_captures")
PAD_TOKEN = 1  # a valid token id and item id for the extra users' inputs


def run_forward(graph: Callable, kv_pool: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """One call of ``graph`` (the compiled package or the module) on ``batch``, then the write of
    the new tokens' K/V rows it returns: the scores [C, num_tasks]."""
    scores, kv_rows, kv_values = graph(*batch.graph_inputs(kv_pool))
    write_new_kv(kv_pool, kv_rows, kv_values)
    return scores


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= ``n`` and >= ``minimum``."""
    return 1 << (max(n, minimum, 1) - 1).bit_length()


@dataclass(frozen=True)
class GraphShape:
    """Every size a captured forward is fixed at: users, total new tokens, total candidates, page
    table width, and the longest user's new tokens and candidates (the shape carriers)."""

    users: int
    new_tokens: int
    candidates: int
    table_width: int
    max_new: int
    max_cand: int

    @classmethod
    def covering(cls, batch: PagedBatch, page_size: int) -> "GraphShape":
        """The bucketed shape ``batch`` pads to, with enough extra users to take the padding."""
        new_lens = batch.new_offsets[1:] - batch.new_offsets[:-1]
        cand_lens = batch.cand_offsets[1:] - batch.cand_offsets[:-1]
        num_new, num_cand = int(batch.new_offsets[-1]), int(batch.cand_offsets[-1])
        max_new, max_cand = bucket(int(new_lens.max()), MIN_TOKENS), bucket(int(cand_lens.max()), MIN_CANDIDATES)
        new_tokens, candidates = bucket(num_new, MIN_TOKENS), bucket(num_cand, MIN_CANDIDATES)
        # an extra user takes up to max_new padding tokens and max_cand padding candidates
        extra = max(_ceil_div(new_tokens - num_new, max_new), _ceil_div(candidates - num_cand, max_cand))
        # its pages (all page 0) must fit the table: max_new tokens from position 0
        table_width = max(bucket(batch.page_table.shape[1], MIN_PAGES), _ceil_div(max_new, page_size))
        return cls(bucket(batch.num_users + extra), new_tokens, candidates, table_width, max_new, max_cand)

    def cells(self, num_layers: int, page_size: int) -> int:
        """The padded forward's size: users x queries x keys x layers."""
        return self.users * (self.max_new + self.max_cand) * self.table_width * page_size * num_layers


def pad_batch(batch: PagedBatch, shape: GraphShape) -> PagedBatch:
    """``batch`` with extra users appended so that its totals and page table width equal
    ``shape``'s (module docstring); no user is longer than ``shape.max_new`` or ``shape.max_cand``,
    which are given to ``graph_inputs`` as ``max_lens``."""
    num_new, num_cand = int(batch.new_offsets[-1]), int(batch.cand_offsets[-1])
    extra_users = shape.users - batch.num_users
    extra_new = _spread(shape.new_tokens - num_new, extra_users, shape.max_new)
    extra_cand = _spread(shape.candidates - num_cand, extra_users, shape.max_cand)
    page_table = torch.zeros(shape.users, shape.table_width, dtype=torch.int64)
    page_table[:batch.num_users, :batch.page_table.shape[1]] = batch.page_table
    return PagedBatch(
        new_tokens=torch.cat([batch.new_tokens, _pad_ids(shape.new_tokens - num_new)]),
        new_offsets=torch.cat([batch.new_offsets, num_new + torch.tensor(extra_new, dtype=torch.int64).cumsum(0)]),
        cached_lens=torch.cat([batch.cached_lens, torch.zeros(extra_users, dtype=torch.int64)]),
        page_table=page_table,
        candidates=torch.cat([batch.candidates, _pad_ids(shape.candidates - num_cand)]),
        cand_offsets=torch.cat([batch.cand_offsets, num_cand + torch.tensor(extra_cand, dtype=torch.int64).cumsum(0)]),
    )


def unpad_outputs(outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch: PagedBatch,
                  shape: GraphShape, num_layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's ``(scores, kv_rows, kv_values)`` on ``pad_batch(batch, shape)`` cut to
    ``batch``'s own: its candidates' scores, and of each of the ``2 * num_layers`` blocks of
    ``shape.new_tokens`` K/V rows the first ``T`` (the real users' tokens)."""
    scores, kv_rows, kv_values = outputs
    blocks, num_new, row_shape = 2 * num_layers, int(batch.new_offsets[-1]), kv_values.shape[1:]
    rows = kv_rows.view(blocks, shape.new_tokens)[:, :num_new].reshape(-1)
    values = kv_values.view(blocks, shape.new_tokens, *row_shape)[:, :num_new].reshape(-1, *row_shape)
    return scores[:int(batch.cand_offsets[-1])], rows, values


class GraphedForward:
    """``run(kv_pool, batch) -> scores`` like ``compute.runtime``'s runners (same promises), over
    a compiled graph loaded with ``run_single_threaded=True`` (capturable). A batch of at most
    ``max_cells`` padded is replayed from the graph of its bucketed shape, captured at the
    shape's ``CAPTURE_AFTER``-th batch; at most ``max_graphs`` are kept (least recently used
    dropped). Other batches, and a shape whose capture failed, call the compiled graph directly.
    One thread calls it."""

    def __init__(self, graph: Callable, num_layers: int, page_size: int, max_graphs: int,
                 max_cells: int = GRAPH_MAX_CELLS) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs: expected >= 1, got {max_graphs} (load without graphs instead)")
        self.graph = graph
        self.num_layers = num_layers
        self.page_size = page_size
        self.max_graphs = max_graphs
        self.max_cells = max_cells
        self._graphs: OrderedDict[GraphShape, _Captured] = OrderedDict()
        self._batches_seen: Counter[GraphShape] = Counter()  # of shapes not captured
        self._uncapturable: set[GraphShape] = set()
        self._pool_ptr = None  # graphs hold the pool's address: a new pool drops them
        self._memory = None  # the graphs' shared memory pool (module docstring)
        self.stats = dict.fromkeys(GRAPH_STATS_KEYS, 0)  # counters; hstu_compute publishes them

    def __call__(self, kv_pool: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        shape = GraphShape.covering(batch, self.page_size)
        launch_bound = shape.cells(self.num_layers, self.page_size) <= self.max_cells
        captured = self._graph(kv_pool, shape, batch) if launch_bound else None
        if captured is None:
            self.stats["compute_direct_calls"] += 1
            return run_forward(self.graph, kv_pool, batch)
        captured.load(pad_batch(batch, shape))
        captured.cuda_graph.replay()
        self.stats["compute_graph_calls"] += 1
        scores, kv_rows, kv_values = unpad_outputs(captured.outputs, batch, shape, self.num_layers)
        write_new_kv(kv_pool, kv_rows, kv_values)
        return scores.clone()  # the next replay overwrites the graph's own

    def _graph(self, kv_pool: torch.Tensor, shape: GraphShape, batch: PagedBatch) -> "_Captured | None":
        """The graph of ``shape``, captured now (over ``batch`` padded) if its time has come;
        ``None`` while the batch runs directly."""
        if self._pool_ptr != kv_pool.data_ptr():
            self._graphs.clear()
            self._pool_ptr = kv_pool.data_ptr()
        captured = self._graphs.get(shape)
        if captured is not None:
            self._graphs.move_to_end(shape)
            return captured
        self._batches_seen[shape] += 1
        if shape in self._uncapturable or self._batches_seen[shape] < CAPTURE_AFTER:
            return None
        try:
            captured = self._capture(kv_pool, shape, pad_batch(batch, shape))
        except Exception:
            logger.warning("CUDA graph capture failed for %s; that shape runs without a graph", shape, exc_info=True)
            self._uncapturable.add(shape)
            return None
        del self._batches_seen[shape]
        self._graphs[shape] = captured
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        self.stats["compute_graph_captures"] += 1
        logger.info("captured a CUDA graph for %s (%d kept)", shape, len(self._graphs))
        return captured

    def _capture(self, kv_pool: torch.Tensor, shape: GraphShape, padded: PagedBatch) -> "_Captured":
        packed = padded.packed_indices(pinned=True).to(kv_pool.device, non_blocking=True)  # the graph's input buffer
        inputs = padded.graph_inputs(kv_pool, packed, max_lens=(shape.max_new, shape.max_cand))
        # Warm up on a side stream first (the first calls may allocate workspaces or load
        # kernels, which a capture must not do); these calls read the pool and write nothing.
        side = torch.cuda.Stream(kv_pool.device)
        side.wait_stream(torch.cuda.current_stream(kv_pool.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.graph(*inputs)
        torch.cuda.current_stream(kv_pool.device).wait_stream(side)
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        cuda_graph = torch.cuda.CUDAGraph()
        # thread_local: the model's other threads may use CUDA meanwhile (not into this graph)
        with torch.cuda.graph(cuda_graph, pool=self._memory, capture_error_mode="thread_local"):
            outputs = self.graph(*inputs)
        return _Captured(cuda_graph, packed, inputs, outputs)


@dataclass
class _Captured:
    """One graph, the packed index buffer its inputs view, its inputs (kept alive: the graph
    reads their addresses) and the outputs it writes."""

    cuda_graph: torch.cuda.CUDAGraph
    packed: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def load(self, padded: PagedBatch) -> None:
        """Copy ``padded``'s index tensors into the graph's input buffer (one copy)."""
        self.packed.copy_(padded.packed_indices(pinned=self.packed.is_cuda), non_blocking=True)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_ids(count: int) -> torch.Tensor:
    return torch.full((count,), PAD_TOKEN, dtype=torch.int64)


def _spread(total: int, users: int, cap: int) -> list[int]:
    """``total`` split over ``users``, each at most ``cap``, filling the first ones first."""
    counts = []
    for _ in range(users):
        counts.append(min(cap, total))
        total -= counts[-1]
    assert total == 0, "GraphShape.covering gives enough extra users for its padding"
    return counts

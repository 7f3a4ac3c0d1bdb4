"""``PagedBatch``: the jagged batch of users the paged forward scores in one call.

Operations, in the order they are called:
1. ``PagedBatch.from_requests([(new_tokens, cached_len, page_row, candidate_ids), ...])``
   concatenates the users' inputs (CPU int64 tensors, ARCHITECTURE.md).
2. ``batch.check(kv_pool, config)`` returns ``None`` or a message saying what does not fit the
   pool and the model (the runners call it before every forward: an out-of-range index inside a
   compiled graph is memory corruption, not an exception).
3. ``batch.graph_inputs(kv_pool)`` is the exact argument tuple of the exported forward: the
   contract's tensors on the pool's device plus two shape carriers (empty-ish tensors whose
   LENGTH is the longest user's number of new tokens and of candidates), so the graph needs
   no data-dependent shapes. Callers never see the carriers.

This module imports only torch: a process serving the AOTI package needs no model classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["CALL_COST", "CallCost", "GRAPH_INPUT_NAMES", "PagedBatch", "Request", "plan_sub_batches"]

# The exported forward's positional arguments, in order.
GRAPH_INPUT_NAMES = ("kv_pool", "new_tokens", "new_offsets", "cached_lens", "page_table",
                     "candidates", "cand_offsets", "new_len_shape", "cand_len_shape")

_ALIGN = 16  # int64 elements (128 bytes) between the starts of the packed index tensors

_IntSeq = Union[Sequence[int], np.ndarray, torch.Tensor]
Request = tuple[_IntSeq, int, _IntSeq, _IntSeq]  # (new_tokens, cached_len, page_row, candidate_ids)


@dataclass(frozen=True)
class PagedBatch:
    """B users' work for one paged forward. All int64.

    User ``b`` has cached tokens ``[0, cached_lens[b])`` in the pool, new tokens
    ``new_tokens[new_offsets[b]:new_offsets[b+1]]`` at positions from ``cached_lens[b]`` on,
    pages ``page_table[b]`` (padded with 0 past its own row) covering cached and new tokens, and
    candidates ``candidates[cand_offsets[b]:cand_offsets[b+1]]``. Scores come back as
    [C, num_tasks] in the order of ``candidates``."""

    new_tokens: torch.Tensor  # [T]
    new_offsets: torch.Tensor  # [B+1]
    cached_lens: torch.Tensor  # [B]
    page_table: torch.Tensor  # [B, max_pages]
    candidates: torch.Tensor  # [C]
    cand_offsets: torch.Tensor  # [B+1]

    @classmethod
    def from_requests(cls, requests: Sequence[Request]) -> "PagedBatch":
        """One batch from ``(new_tokens, cached_len, page_row, candidate_ids)`` per user.
        Raises ``ValueError`` naming the user and field for a malformed entry."""
        if len(requests) == 0:
            raise ValueError("PagedBatch.from_requests: expected at least one request, got none")
        # numpy until the end: a torch op costs microseconds of dispatch, a numpy one a fraction
        tokens, cands, rows, cached = [], [], [], []
        for b, request in enumerate(requests):
            if len(request) != 4:
                raise ValueError(f"request {b}: expected (new_tokens, cached_len, page_row, candidate_ids), "
                                 f"got {len(request)} fields")
            new_tokens, cached_len, page_row, candidate_ids = request
            tokens.append(_int64_1d(new_tokens, f"request {b} new_tokens"))
            rows.append(_int64_1d(page_row, f"request {b} page_row"))
            cands.append(_int64_1d(candidate_ids, f"request {b} candidate_ids"))
            cached.append(int(cached_len))
            if cached[-1] < 0:
                raise ValueError(f"request {b} cached_len: expected >= 0, got {cached[-1]}")
            if cands[-1].size == 0:
                raise ValueError(f"request {b} candidate_ids: expected at least one candidate, got none")
        page_table = np.zeros((len(rows), max(1, max(row.size for row in rows))), dtype=np.int64)  # [B, max_pages]
        for b, row in enumerate(rows):
            page_table[b, :row.size] = row
        return cls(
            new_tokens=torch.from_numpy(np.concatenate(tokens)),
            new_offsets=_offsets([t.size for t in tokens]),
            cached_lens=torch.tensor(cached, dtype=torch.int64),
            page_table=torch.from_numpy(page_table),
            candidates=torch.from_numpy(np.concatenate(cands)),
            cand_offsets=_offsets([c.size for c in cands]),
        )

    @property
    def num_users(self) -> int:
        return self.cached_lens.shape[0]

    def check(self, kv_pool: torch.Tensor, page_size: int, vocab_size: int, item_vocab: int) -> str | None:
        """``None`` when the batch fits the pool ``[L, P, 2, S, H, D]`` and the token space,
        else a message naming the user and what is wrong. Runs on the host (a batch of CPU
        tensors), O(B + T + C), in numpy."""
        num_pages, pool_page_size = kv_pool.shape[1], kv_pool.shape[3]
        if pool_page_size != page_size:
            return f"kv_pool: expected page_size {page_size} on dim 3, got {pool_page_size}"
        if not self._rows_fit(num_pages, page_size):  # one pass over the batch; the loop names the user
            return self._row_problem(num_pages, page_size)
        new_tokens, candidates = self.new_tokens.numpy(), self.candidates.numpy()
        if new_tokens.size and (new_tokens.min() < 1 or new_tokens.max() >= vocab_size):
            return f"new_tokens: expected token ids in [1, {vocab_size - 1}]"
        if candidates.min() < 1 or candidates.max() >= item_vocab:
            return f"candidates: expected item ids in [1, {item_vocab - 1}]"
        return None

    def _rows_fit(self, num_pages: int, page_size: int) -> bool:
        """Whether every user's cached_len is whole pages and its page row covers its tokens with
        page ids of the pool."""
        cached, table = self.cached_lens.numpy(), self.page_table.numpy()
        needed = (cached + np.diff(self.new_offsets.numpy()) + page_size - 1) // page_size
        if (cached % page_size != 0).any() or needed.max() > table.shape[1]:
            return False
        used = np.arange(table.shape[1]) < needed[:, None]
        return not (used & ((table < 0) | (table >= num_pages))).any()

    def _row_problem(self, num_pages: int, page_size: int) -> str | None:
        new_lens = (self.new_offsets[1:] - self.new_offsets[:-1]).tolist()
        cached = self.cached_lens.tolist()
        for b in range(self.num_users):
            if cached[b] % page_size != 0:
                return f"user {b} cached_len: expected a multiple of page_size {page_size}, got {cached[b]}"
            needed = -(-(cached[b] + new_lens[b]) // page_size)  # pages holding cached + new tokens
            if needed > self.page_table.shape[1]:
                return (f"user {b} page_row: {cached[b] + new_lens[b]} tokens need {needed} pages, "
                        f"the page table has {self.page_table.shape[1]}")
            row = self.page_table[b, :needed]
            if needed and (int(row.min()) < 0 or int(row.max()) >= num_pages):
                return f"user {b} page_row: expected page ids in [0, {num_pages - 1}], got {row.tolist()}"
        return None

    def graph_inputs(self, kv_pool: torch.Tensor, packed: torch.Tensor | None = None,
                     max_lens: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """Arguments of the exported forward, in ``GRAPH_INPUT_NAMES`` order, on the pool's device.
        On a GPU the six index tensors travel as one packed, pinned host buffer
        (``packed_indices``) in one asynchronous copy (six pageable copies cost a synchronous
        round trip each); ``packed`` is that buffer already on the pool's device (a CUDA graph's
        input buffer), whose views the index arguments then are. ``max_lens``: the shape
        carriers' lengths (new tokens, candidates), at least the longest user's (default: exactly)."""
        device = kv_pool.device
        if max_lens is None:
            max_lens = (int((self.new_offsets[1:] - self.new_offsets[:-1]).max()),
                        int((self.cand_offsets[1:] - self.cand_offsets[:-1]).max()))
        max_new, max_cand = max_lens
        parts = self._index_parts()
        if device.type == "cpu" and packed is None:
            on_device = parts
        else:
            if packed is None:
                packed = self.packed_indices(pinned=True).to(device, non_blocking=True)
            starts = _packed_starts(parts)
            on_device = [packed[start:start + p.numel()] for p, start in zip(parts, starts)]
        new_tokens, new_offsets, cached_lens, page_table, candidates, cand_offsets = on_device
        return (
            kv_pool,
            new_tokens,
            new_offsets,
            cached_lens,
            page_table.view(self.page_table.shape),
            candidates,
            cand_offsets,
            torch.empty(max_new, dtype=torch.int8, device=device),  # shape carrier [Mn]
            torch.empty(max_cand, dtype=torch.int8, device=device),  # shape carrier [Mc]
        )

    def packed_indices(self, pinned: bool) -> torch.Tensor:
        """The six index tensors in one int64 host buffer (``pinned``: page-locked, for an
        asynchronous copy to a GPU), each starting 128 bytes past the last one's start at least
        (compiled kernels may assume their inputs aligned)."""
        parts = self._index_parts()
        starts = _packed_starts(parts)
        packed = torch.empty(starts[-1], dtype=torch.int64, pin_memory=pinned)
        for p, start in zip(parts, starts):
            packed[start:start + p.numel()] = p
        return packed

    def _index_parts(self) -> tuple[torch.Tensor, ...]:
        return (self.new_tokens, self.new_offsets, self.cached_lens, self.page_table.reshape(-1),
                self.candidates, self.cand_offsets)


@dataclass(frozen=True)
class CallCost:
    """How ``plan_sub_batches`` prices a compiled call on one device type. ``call_cells``: what a
    call costs before its work, in cells (one query x key product of one layer); ``slack``: how
    many times its members' own cells a sub-batch's padded cells may reach before a second call
    is cheaper (beyond ``call_cells``)."""

    call_cells: int
    slack: float


# On the GPU a call is launch-bound: on an H100 (small config) one user costs about 1 ms, 8 users
# 1.0-1.2 ms, a 2,048-token miss (4.5M cells) 1.4 ms, so 1 ms is about 10M cells, and padding is
# nearly free. On the CPU a call's fixed cost is small next to its arithmetic, and a padded cell
# costs what a real one does: on the 2-core CPU machine (default model, the demo's trace; `python -m
# deploy.bench.sub_batches`), batches of 3, 8 and 14 cost 1.50, 1.29 and 1.08 ms per request at
# slack 1.0 against 1.62, 1.49 and 1.31 at 1.5 (one call per user: 1.47, 1.22 and 1.15).
CALL_COST = {"cpu": CallCost(call_cells=64 * 1024, slack=1.0),
             "cuda": CallCost(call_cells=8 * 1024 * 1024, slack=1.5)}


def plan_sub_batches(shapes: Sequence[tuple[int, int]], cost: CallCost = CALL_COST["cpu"]) -> list[list[int]]:
    """Split a dynamic batch into sub-batches of similar size, as lists of request indices.

    The paged forward pads every user to the batch's longest queries (new tokens + candidates)
    and widest keys (cached + new tokens), so one long miss batched with short hits makes each
    hit cost as much as the miss. ``shapes[i]`` is request i's ``(queries, keys)``; requests are
    taken smallest first and a sub-batch grows while its padded cost ``B * max_q * max_k`` stays
    within ``cost.slack`` times the sum of its members' own costs plus ``cost.call_cells``, the
    fixed cost of a call (``CALL_COST``): padding is cheaper than a second call up to there.
    """
    order = sorted(range(len(shapes)), key=lambda i: shapes[i][0] * shapes[i][1])
    groups: list[list[int]] = []
    current: list[int] = []
    max_q = max_k = own_cost = 0
    for i in order:
        q, k = shapes[i]
        grown_q, grown_k = max(max_q, q), max(max_k, k)
        padded = (len(current) + 1) * grown_q * grown_k
        if current and padded > cost.slack * (own_cost + q * k) + cost.call_cells:
            groups.append(current)
            current, grown_q, grown_k, own_cost = [], q, k, 0
        current.append(i)
        max_q, max_k, own_cost = grown_q, grown_k, own_cost + q * k
    if current:
        groups.append(current)
    return groups


# ---------------------------------------------------------------------------------------
# helpers


def _int64_1d(values: _IntSeq, name: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        array = values.numpy(force=True)  # a view of a CPU tensor's memory
    else:
        array = np.asarray(values, dtype=np.int64)
    if array.dtype != np.int64 or array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D int64 sequence, got {array.dtype} {tuple(array.shape)}")
    return array


def _packed_starts(parts: Sequence[torch.Tensor]) -> list[int]:
    """Where each part starts in the packed buffer, then its length: ``_ALIGN``-aligned starts."""
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + -(-p.numel() // _ALIGN) * _ALIGN)
    return starts


def _offsets(lengths: list[int]) -> torch.Tensor:
    """int64 [B+1] exclusive prefix sums of ``lengths``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return torch.from_numpy(offsets)

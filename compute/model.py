"""The HSTU ranking model (Zhai et al., "Actions Speak Louder than Words", arXiv 2402.17152),
shaped like NVIDIA recsys-examples' inference ranking model.

Two forwards over the same weights:
- ``HSTUModel.forward(kv_pool, ...)``: the paged forward that is exported and served. For a
  jagged batch of users it reads each user's cached prefix K/V from the page pool, computes the
  new history tokens and scores the candidates. It never writes the pool: it returns the new
  tokens' K/V of every layer with the pool rows they belong in, and the runner
  (``compute.runtime``) writes them with one indexed copy. Inductor compiles a write into a graph
  input as a copy of the whole input (on CUDA: an out-of-place copy of the pool, then a copy
  back), which would make every call cost the pool's size instead of its own tokens.
  ``compute.batch.PagedBatch.graph_inputs`` builds its arguments.
- ``HSTUModel.reference_scores(tokens, candidates)``: a stateless forward over one user's whole
  sequence, no pages. It is the oracle the paged forward must match (ARCHITECTURE.md, invariant 1).

One HSTU layer, for the sequence ``X`` (``N`` is a constant, never the actual length)::

    U, V, Q, K = split(SiLU(f1(LayerNorm(X))))
    A          = SiLU(alpha * Q K^T + rab(i - j)) / N        masked: see below
    Y          = f2(LayerNorm(A V) * U) + X

Masking: history token ``i`` attends to history tokens ``j <= i`` (causal); each candidate
attends to the whole history and to itself, never to another candidate. Candidates sit at
position ``n`` (the history length in tokens). Because ``N`` is a constant and attention is
causal, the K/V of history token ``i`` in every layer depends only on tokens ``<= i``, so the
cached K/V of a prefix stay valid however the history grows.

What the pool holds: for each layer and history token, K and V, ``[num_heads, head_dim]`` each, in
``kv_pool[layer, page, 0 (K) | 1 (V), offset]``; the token at position ``p`` of a user whose pages
are ``page_row`` lives in page ``page_row[p // page_size]`` at offset ``p % page_size``.
Candidate K/V is never written.

Left out on purpose: contextual (user feature) tokens, absolute position embeddings and
timestamp buckets of the relative bias. Adding contextual tokens would change the token
contract of ARCHITECTURE.md, so it is not done here; ``user_id`` does not reach the model.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from compute.config import HSTUConfig

logger = logging.getLogger(__name__)

__all__ = ["HSTULayer", "HSTUModel", "TaskHead", "position_buckets", "write_new_kv"]

EXACT_DISTANCES = 16  # relative distances below this get a bucket each
NUM_BUCKETS = 32  # the rest are log-spaced up to the longest distance
# f1's random init is this many times PyTorch's default: with the large constant N, a default-init
# toy model barely reacts to its history, which would make cached == uncached checks toothless.
F1_INIT_GAIN = 3.0
ATTN_NORM_EPS = 1e-6  # LayerNorm(A V), as in generative-recommenders


class HSTUModel(nn.Module):
    """Embeddings over the token space, ``num_layers`` HSTU layers, a final LayerNorm and one
    MLP head per task over each candidate's final embedding."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_dim, padding_idx=0)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_dim)
        self.task_heads = nn.ModuleList(TaskHead(config.hidden_dim) for _ in range(config.num_tasks))
        # Relative distance d (clamped to [0, max_history_tokens]) -> bias bucket. Derived from
        # the config, so not part of the checkpoint.
        self.register_buffer("bucket_of_distance", position_buckets(config.max_history_tokens),
                             persistent=False)
        self.attention_norm = float(config.max_history_tokens)  # the constant N
        self.alpha = 1.0 / math.sqrt(config.head_dim)

    def forward(
        self,
        kv_pool: torch.Tensor,  # [L, P, 2, S, H, D], read only
        new_tokens: torch.Tensor,  # int64 [T], the users' new history tokens, concatenated
        new_offsets: torch.Tensor,  # int64 [B+1], user b's new tokens are [new_offsets[b], new_offsets[b+1])
        cached_lens: torch.Tensor,  # int64 [B], tokens already in the pool (multiple of S)
        page_table: torch.Tensor,  # int64 [B, MP], user b's pages, covering cached + new tokens
        candidates: torch.Tensor,  # int64 [C], concatenated
        cand_offsets: torch.Tensor,  # int64 [B+1]
        new_len_shape: torch.Tensor,  # [Mn]: only its shape is read, Mn = max new tokens of a user
        cand_len_shape: torch.Tensor,  # [Mc]: only its shape is read, Mc = max candidates of a user
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Paged forward: ``(scores, kv_rows, kv_values)``.

        - ``scores`` float32 [C, num_tasks] in the order of ``candidates``;
        - ``kv_values`` [2 * L * T, H, D] in the pool's dtype: K and V of every new token for
          every layer, to be written at ``kv_rows`` int64 [2 * L * T] of the pool flattened to
          [L * P * 2 * S, H, D] (``write_new_kv``).

        Promises: reads pool positions ``[0, cached_lens[b])`` of user ``b`` and never any other
        user's new pages; the rows returned are those of positions
        ``[cached_lens[b], cached_lens[b] + new_len_b)`` of every layer and nothing else. The maxima ``Mn`` and ``Mc`` arrive as shapes, so the
        graph has no data-dependent shapes (no ``.item()``)."""
        num_layers, num_pages, _, page_size, num_heads, head_dim = kv_pool.shape
        num_users = cached_lens.shape[0]
        num_new = new_tokens.shape[0]
        num_cand = candidates.shape[0]
        max_new = new_len_shape.shape[0]
        max_cand = cand_len_shape.shape[0]
        max_keys = page_table.shape[1] * page_size
        device = new_tokens.device

        new_lens = new_offsets[1:] - new_offsets[:-1]  # [B]
        hist_lens = cached_lens + new_lens  # [B]

        # Padded per-user layout [B, Mn + Mc]: new history tokens, then candidates. Padding reads
        # a sentinel token 0 appended at the end of each flat input.
        new_index = _pad_index(new_offsets, max_new, num_new)  # [B, Mn]
        cand_index = _pad_index(cand_offsets, max_cand, num_cand)  # [B, Mc]
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        new_padded = torch.cat([new_tokens, zero])[new_index]  # [B, Mn]
        cand_padded = torch.cat([candidates, zero])[cand_index]  # [B, Mc]
        x = self.embedding(torch.cat([new_padded, cand_padded], dim=1))  # [B, Q = Mn + Mc, hidden]

        new_pos = cached_lens[:, None] + torch.arange(max_new, device=device)[None, :]  # [B, Mn]
        query_pos = torch.cat([new_pos, hist_lens[:, None].expand(num_users, max_cand)], dim=1)  # [B, Q]
        # A new token sees keys at positions <= its own; a candidate sees keys < hist_len.
        is_new = torch.cat([torch.ones_like(new_pos), torch.zeros_like(cand_padded)], dim=1)  # [B, Q]
        key_pos = torch.arange(max_keys, device=device)  # [K]
        allowed = key_pos[None, None, :] < (query_pos + is_new)[:, :, None]  # [B, Q, K]
        distance = (query_pos[:, :, None] - key_pos[None, None, :]).clamp(0, self.config.max_history_tokens)
        # Where each key comes from: the pool below cached_len, this call's new tokens up to
        # hist_len (column key_pos - cached_len of the padded layout), zero past the history.
        from_pool = (key_pos[None, :] < cached_lens[:, None])[:, :, None, None]  # [B, K, 1, 1]
        from_new = (key_pos[None, :] < hist_lens[:, None])[:, :, None, None]  # [B, K, 1, 1]
        new_column = (key_pos[None, :] - cached_lens[:, None]).clamp(0, max_new)  # [B, K]; max_new is a zero row

        # Pool rows, with the pool flattened to [L * P * 2 * S, H, D].
        page_ids = page_table.clamp(0, num_pages - 1)  # padding entries may be anything
        key_page = page_ids[:, key_pos // page_size]  # [B, K]
        key_offset = (key_pos % page_size)[None, :]  # [1, K]
        token_user = torch.searchsorted(new_offsets, torch.arange(num_new, device=device), right=True) - 1  # [T]
        token_local = torch.arange(num_new, device=device) - new_offsets[token_user]  # [T]
        token_pos = cached_lens[token_user] + token_local  # [T]
        token_page = page_table[token_user, token_pos // page_size]  # [T]
        token_offset = token_pos % page_size  # [T]
        flat_pool = kv_pool.view(num_layers * num_pages * 2 * page_size, num_heads, head_dim)
        batch_index = torch.arange(num_users, device=device)[:, None]  # [B, 1]
        write_rows, written = [], []

        for layer_index, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x)  # u [B, Q, H*D]; v, q, k [B, Q, H, D]

            # Every key of the row: cached ones read from the pool, new ones from k and v.
            zero_row = torch.zeros_like(k[:, :1])  # [B, 1, H, D]
            k_new = torch.cat([k[:, :max_new], zero_row], dim=1)[batch_index, new_column]  # [B, K, H, D]
            v_new = torch.cat([v[:, :max_new], zero_row], dim=1)[batch_index, new_column]  # [B, K, H, D]
            k_pool = flat_pool[_pool_rows(layer_index, key_page, 0, key_offset, num_pages, page_size)]  # [B, K, H, D]
            v_pool = flat_pool[_pool_rows(layer_index, key_page, 1, key_offset, num_pages, page_size)]  # [B, K, H, D]
            # Stale pool contents past cached_len (even NaN) never leak: where() selects, not blends.
            k_all = torch.where(from_pool, k_pool.to(x.dtype), torch.where(from_new, k_new, 0.0))
            v_all = torch.where(from_pool, v_pool.to(x.dtype), torch.where(from_new, v_new, 0.0))
            write_rows += [_pool_rows(layer_index, token_page, 0, token_offset, num_pages, page_size),
                           _pool_rows(layer_index, token_page, 1, token_offset, num_pages, page_size)]  # [T] each
            written += [k[token_user, token_local], v[token_user, token_local]]  # [T, H, D] each

            bias_table = layer.bias_by_distance(self.bucket_of_distance)  # [H, max_distance + 1]
            bias = bias_table[:, distance]  # [H, B, Q, K]
            attended = _pointwise_attention(
                q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),  # [B, Q|K, H, D] -> [B, H, Q|K, D]
                bias.transpose(0, 1), allowed[:, None], self.alpha, self.attention_norm,  # [B, H, Q, K], [B, 1, Q, K]
            ).transpose(1, 2)  # [B, H, Q, D] -> [B, Q, H, D]

            # Each candidate also attends to itself (distance 0); new tokens already did via k_all.
            q_c, k_c, v_c = q[:, max_new:], k[:, max_new:], v[:, max_new:]  # [B, Mc, H, D]
            self_logits = (q_c * k_c).sum(-1) * self.alpha + bias_table[:, 0]  # [B, Mc, H]
            self_attended = (F.silu(self_logits) / self.attention_norm)[..., None] * v_c  # [B, Mc, H, D]
            attended = torch.cat([attended[:, :max_new], attended[:, max_new:] + self_attended], dim=1)
            x = layer.finish(attended, u, x)  # [B, Q, hidden]

        cand_user = torch.searchsorted(cand_offsets, torch.arange(num_cand, device=device), right=True) - 1  # [C]
        cand_local = torch.arange(num_cand, device=device) - cand_offsets[cand_user]  # [C]
        scores = self.score_embeddings(x[cand_user, max_new + cand_local])  # [C, num_tasks]
        return scores, torch.cat(write_rows), torch.cat(written).to(kv_pool.dtype)  # [C, tasks], [2LT], [2LT, H, D]

    def reference_scores(self, tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Stateless forward over one user's whole sequence: float32 scores [c, num_tasks].

        ``tokens`` int64 [n] are the history tokens (``compute.tokens.history_tokens``),
        ``candidates`` int64 [c] the candidate item ids. Dense attention with an explicit mask,
        no pages, no padding: the oracle the paged forward is checked against."""
        n, c = tokens.shape[0], candidates.shape[0]
        device = tokens.device
        x = self.embedding(torch.cat([tokens, candidates]))  # [n + c, hidden]
        pos = torch.cat([torch.arange(n, device=device), torch.full((c,), n, device=device)])  # [n + c]
        i = torch.arange(n + c, device=device)
        history_query = i[:, None] < n
        allowed = torch.where(history_query, i[None, :] <= i[:, None], (i[None, :] < n) | (i[None, :] == i[:, None]))
        distance = (pos[:, None] - pos[None, :]).clamp(0, self.config.max_history_tokens)  # [n + c, n + c]
        for layer in self.layers:
            u, v, q, k = layer.project(x)  # u [n + c, H*D]; v, q, k [n + c, H, D]
            bias = layer.bias_by_distance(self.bucket_of_distance)[:, distance]  # [H, n + c, n + c]
            attended = _pointwise_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [n + c, H, D] -> [H, n + c, D]
                bias, allowed[None], self.alpha, self.attention_norm,
            ).transpose(0, 1)  # [H, n + c, D] -> [n + c, H, D]
            x = layer.finish(attended, u, x)
        return self.score_embeddings(x[n:])

    def score_embeddings(self, y: torch.Tensor) -> torch.Tensor:
        """Task logits float32 [C, num_tasks] from candidates' final embeddings [C, hidden]."""
        y = self.final_norm(y)
        return torch.cat([head(y) for head in self.task_heads], dim=1).float()  # [C, num_tasks]


class HSTULayer(nn.Module):
    """One HSTU layer's weights, split into ``project`` (before attention) and ``finish``
    (after), so the paged and the reference forward share every op except attention."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        width = config.num_heads * config.head_dim
        self.input_norm = nn.LayerNorm(config.hidden_dim)
        self.uvqk = nn.Linear(config.hidden_dim, 4 * width)  # f1
        with torch.no_grad():
            self.uvqk.weight.mul_(F1_INIT_GAIN)
        self.attn_norm = nn.LayerNorm(width, eps=ATTN_NORM_EPS)
        self.output = nn.Linear(width, config.hidden_dim)  # f2
        self.rel_bias = nn.Parameter(0.1 * torch.randn(NUM_BUCKETS, config.num_heads))  # rab per bucket, head

    def bias_by_distance(self, bucket_of_distance: torch.Tensor) -> torch.Tensor:
        """Relative attention bias [H, max_distance + 1] of each distance."""
        return self.rel_bias[bucket_of_distance].t()  # [max_distance + 1, H] -> [H, max_distance + 1]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [..., hidden] -> ``u`` [..., H*D] and ``v``, ``q``, ``k`` [..., H, D]: SiLU(f1(LN(x)))."""
        width = self.num_heads * self.head_dim
        u, v, q, k = F.silu(self.uvqk(self.input_norm(x))).split(width, dim=-1)  # 4 x [..., H*D]
        heads = (self.num_heads, self.head_dim)
        return u, v.unflatten(-1, heads), q.unflatten(-1, heads), k.unflatten(-1, heads)  # [..., H*D] -> [..., H, D]

    def finish(self, attended: torch.Tensor, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``f2(LN(A V) * U) + x``; ``attended`` [..., H, D], ``u`` [..., H*D], ``x`` [..., hidden]."""
        return self.output(self.attn_norm(attended.flatten(-2)) * u) + x  # [..., H, D] -> [..., H*D]


class TaskHead(nn.Module):
    """MLP hidden -> hidden -> 1: one task's logit per candidate."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, 1))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.mlp(y)  # [C, 1]


def position_buckets(max_distance: int) -> torch.Tensor:
    """int64 [max_distance + 1]: the relative-bias bucket of each distance. Distances below
    ``EXACT_DISTANCES`` get their own bucket, longer ones ``NUM_BUCKETS - EXACT_DISTANCES``
    log-spaced buckets up to ``max_distance``. A fixed table (computed once in Python), so every
    forward and every compiled package buckets a distance the same way."""
    buckets = []
    log_span = math.log(max(max_distance, EXACT_DISTANCES + 1) / EXACT_DISTANCES)
    for d in range(max_distance + 1):
        if d < EXACT_DISTANCES:
            buckets.append(d)
        else:
            scaled = math.log(d / EXACT_DISTANCES) / log_span * (NUM_BUCKETS - EXACT_DISTANCES)
            buckets.append(min(EXACT_DISTANCES + int(scaled), NUM_BUCKETS - 1))
    return torch.tensor(buckets, dtype=torch.int64)


def write_new_kv(kv_pool: torch.Tensor, kv_rows: torch.Tensor, kv_values: torch.Tensor) -> None:
    """Write the forward's new K/V into ``kv_pool`` in place: one indexed copy of
    ``2 * L * T`` rows, nothing else of the pool touched. Runs eagerly, outside the compiled
    graph (see the module docstring for why)."""
    num_heads, head_dim = kv_pool.shape[-2:]
    kv_pool.view(-1, num_heads, head_dim).index_copy_(0, kv_rows, kv_values)  # [L * P * 2 * S, H, D]


# ---------------------------------------------------------------------------------------
# helpers


def _pointwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                         allowed: torch.Tensor, alpha: float, norm: float) -> torch.Tensor:
    """HSTU attention ``(SiLU(alpha * q k^T + bias) * allowed / norm) v``, batched over leading
    dims. q [..., Q, D], k and v [..., K, D], bias [..., Q, K], allowed bool broadcastable to it."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * alpha + bias  # [..., Q, K]
    weights = torch.where(allowed, F.silu(logits), 0.0) / norm  # [..., Q, K]
    return torch.matmul(weights, v)  # [..., Q, D]


def _pad_index(offsets: torch.Tensor, width: int, sentinel: int) -> torch.Tensor:
    """Index [B, width] into a flat jagged tensor with ``offsets`` [B+1]: row ``b``, column ``i``
    is ``offsets[b] + i`` where ``i < len_b``, else ``sentinel``."""
    lengths = offsets[1:] - offsets[:-1]  # [B]
    column = torch.arange(width, device=offsets.device)[None, :]  # [1, width]
    valid = column < lengths[:, None]  # [B, width]
    index = torch.where(valid, offsets[:-1, None] + column, sentinel)  # [B, width]
    return index


def _pool_rows(layer: int, page: torch.Tensor, kv: int, offset: torch.Tensor, num_pages: int,
               page_size: int) -> torch.Tensor:
    """Row of ``kv_pool[layer, page, kv, offset]`` in the pool flattened to [L * P * 2 * S, H, D]."""
    return ((layer * num_pages + page) * 2 + kv) * page_size + offset

"""Helpers for compute tests that play the server: run a user's cached prefix through the paged
forward first (so the pool holds its K/V), then the new suffix with its candidates.

- ``make_user(rng, config, events, candidates)`` -> ``User``; ``PageAllocator``: hands out page ids.
- ``serve(run, pool, users, split)``: prefix pass for each user, then one batched suffix call.
- ``GPU_SMALL_CONFIG``: the small GPU config's JSON (the CUDA tests, and the CPU check of its sensitivity).
- ``with_other_prefix(user, rng, config, first_event)``: the user with events
  ``[first_event, cached events)`` replaced, for proving that scores notice a wrong cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from compute import HSTUConfig, PagedBatch, history_tokens

NUM_PAGES = 640  # enough for several users of 2,048 events (128 pages each)
GPU_SMALL_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "gpu_small_bf16.json"


@dataclass
class User:
    item_ids: np.ndarray  # int64 [n]
    action_ids: np.ndarray  # int64 [n]
    candidate_ids: np.ndarray  # int64 [c]
    tokens: torch.Tensor  # int64 [2n]
    page_row: list[int]  # pages for every history token
    cached_len: int = 0  # page-aligned split: [0, cached_len) goes through the prefix pass


class PageAllocator:
    """Page ids in a fixed shuffled order, never reused within a test."""

    def __init__(self, num_pages: int, rng: np.random.Generator) -> None:
        self.free = list(rng.permutation(num_pages))

    def take(self, count: int) -> list[int]:
        assert count <= len(self.free), f"test pool too small: need {count} pages, {len(self.free)} left"
        taken, self.free = self.free[:count], self.free[count:]
        return [int(p) for p in taken]


def make_user(rng: np.random.Generator, config: HSTUConfig, events: int, candidates: int,
              pages: PageAllocator, cached_len: int | None = None) -> User:
    """A random user; ``cached_len`` defaults to a random page-aligned split of its tokens."""
    items = rng.integers(1, config.item_vocab, events, dtype=np.int64)
    actions = rng.integers(0, config.action_vocab, events, dtype=np.int64)
    cands = rng.integers(1, config.item_vocab, candidates, dtype=np.int64)
    tokens = history_tokens(items, actions, config)
    row = pages.take(-(-tokens.numel() // config.page_size))
    if cached_len is None:
        cached_len = int(rng.integers(0, tokens.numel() // config.page_size + 1)) * config.page_size
    return User(items, actions, cands, tokens, row, cached_len)


def new_pool(config: HSTUConfig, num_pages: int = NUM_PAGES) -> torch.Tensor:
    """A pool full of NaN: any read of a slot nobody wrote poisons the scores."""
    shape = (config.num_layers, num_pages, 2, config.page_size, config.num_heads, config.head_dim)
    return torch.full(shape, float("nan"), dtype=config.torch_dtype)


def fill_prefix(run, pool: torch.Tensor, user: User) -> None:
    """The server's first request for the prefix: writes K/V of tokens [0, cached_len)."""
    if user.cached_len:
        prefix = user.tokens[:user.cached_len]
        run(pool, PagedBatch.from_requests([(prefix, 0, user.page_row, user.candidate_ids[:1])]))


def suffix_request(user: User) -> tuple:
    return (user.tokens[user.cached_len:], user.cached_len, user.page_row, user.candidate_ids)


def serve(run, pool: torch.Tensor, users: list[User]) -> torch.Tensor:
    """Prefix pass per user, then every user's suffix in one batched call; scores [sum c, T]."""
    for user in users:
        fill_prefix(run, pool, user)
    return run(pool, PagedBatch.from_requests([suffix_request(u) for u in users]))




def with_other_prefix(user: User, rng: np.random.Generator, config: HSTUConfig, first_event: int) -> User:
    """``user`` with its cached events from ``first_event`` on replaced by random ones: a pool
    filled with this user's prefix holds K/V that belongs to another history."""
    cached_events = user.cached_len // 2  # two tokens per event
    items = user.item_ids.copy()
    items[first_event:cached_events] = rng.integers(1, config.item_vocab, cached_events - first_event, dtype=np.int64)
    return replace(user, item_ids=items, tokens=history_tokens(items, user.action_ids, config))

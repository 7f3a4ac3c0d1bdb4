"""Token ids of a request, and the checks that reject a bad request before it touches the cache.

The token contract (docs/ARCHITECTURE.md), built in one place, ``history_tokens``:
- a history of ``n`` events is ``2n`` tokens, interleaved ``[item_0, action_0, item_1, ...]``;
- an item token is its item id, ``1..item_vocab-1`` (0 is padding and never a valid item);
- an action token is ``item_vocab + action_id``, ``action_id`` in ``0..action_vocab-1``;
- candidates are item tokens, never cached.

Checks, each returning ``None`` when the input is good or a message naming the field:
- ``check_ids(name, ids, low, high)``: 1-D int64 ids in ``[low, high)``;
- ``check_request(item_ids, action_ids, candidate_ids, config)``: every rule of a request
  (dtypes, lengths equal, history not longer than ``max_history_events``, ``1 <= c <=
  max_candidates``, every id in range). Triton models call it first and turn a message into an
  error response for that request only.
"""

from __future__ import annotations

import logging
from typing import Sequence, Union

import numpy as np
import torch

from compute.config import HSTUConfig

logger = logging.getLogger(__name__)

__all__ = ["Ids", "check_history", "check_ids", "check_request", "history_tokens", "history_tokens_many", "ids_as_tensor",
           "ids_in_range", "looks_corrupted_in_transit"]

Ids = Union[Sequence[int], np.ndarray, torch.Tensor]


def history_tokens(item_ids: Ids, action_ids: Ids, config: HSTUConfig, checked: bool = False) -> torch.Tensor:
    """int64 tensor [2n] ``[item_0, item_vocab + action_0, item_1, ...]`` (CPU).

    Raises ``ValueError`` naming the field when the ids break the contract (see
    ``check_request``; candidates are not checked here). ``checked``: the caller validated these
    ids already (``check_request``), skip doing it again."""
    items = ids_as_tensor(item_ids, "item_ids")
    actions = ids_as_tensor(action_ids, "action_ids")
    error = None if checked else check_history(items, actions, config)
    if error is not None:
        raise ValueError(error)
    tokens = torch.stack([items, actions + config.item_vocab], dim=1)  # [n, 2]
    return tokens.reshape(-1)  # [2n], item then action per event


def history_tokens_many(histories: Sequence[tuple[torch.Tensor, torch.Tensor]], config: HSTUConfig) -> list[torch.Tensor]:
    """``history_tokens(items, actions, config, checked=True)`` of each validated ``(items,
    actions)`` pair, made in one pass over the batch (a few tensor ops in all, not per request)."""
    if not histories:
        return []
    items = torch.cat([items for items, _ in histories])
    actions = torch.cat([actions for _, actions in histories])
    tokens = torch.stack([items, actions + config.item_vocab], dim=1).reshape(-1)
    return list(torch.split(tokens, [2 * items.numel() for items, _ in histories]))


def check_request(item_ids: Ids, action_ids: Ids, candidate_ids: Ids, config: HSTUConfig) -> str | None:
    """``None`` when the request is valid, else one message naming the first bad field."""
    try:
        items = ids_as_tensor(item_ids, "item_ids")
        actions = ids_as_tensor(action_ids, "action_ids")
        candidates = ids_as_tensor(candidate_ids, "candidate_ids")
    except ValueError as e:
        return str(e)
    error = check_history(items, actions, config)
    if error is not None:
        return error
    c = candidates.numel()
    if not 1 <= c <= config.max_candidates:
        return f"candidate_ids: expected 1..{config.max_candidates} candidates, got {c}"
    return check_ids("candidate_ids", candidates, 1, config.item_vocab)


def looks_corrupted_in_transit(item_ids: torch.Tensor, action_ids: torch.Tensor, candidate_ids: torch.Tensor,
                               config: HSTUConfig) -> bool:
    """Whether a request ``check_request`` refused has only bad ids that are valid ids with their
    upper 32-bit word set to 1 or to all ones: what tritonserver 2.51's Python backend does to a
    batched model's input about once in 50,000 requests (docs/ARCHITECTURE.md, "Batching on
    tritonserver 2.51"). No client sends such ids by mistake: the server answers it as a
    retryable error, so the client resends it."""
    found = False
    for ids, low, high in ((item_ids, 1, config.item_vocab), (action_ids, 0, config.action_vocab),
                           (candidate_ids, 1, config.item_vocab)):
        bad = ids[(ids < low) | (ids >= high)]
        if bad.numel() == 0:
            continue
        upper, lower = bad >> 32, bad & 0xFFFFFFFF
        if not bool((((upper == 1) | (upper == -1)) & (lower >= low) & (lower < high)).all()):
            return False
        found = True
    return found


def ids_in_range(ids: Sequence[torch.Tensor], low: int, high: int) -> bool:
    """Whether every id of every tensor of ``ids`` is in ``[low, high)``: one min/max over all of
    them (a batch's range check; ``check_ids`` names the offender when there is one)."""
    joined = torch.cat(list(ids)) if ids else torch.empty(0, dtype=torch.int64)
    if joined.numel() == 0:
        return True
    smallest, largest = torch.aminmax(joined)
    return int(smallest) >= low and int(largest) < high


def check_ids(name: str, ids: torch.Tensor, low: int, high: int) -> str | None:
    """``None`` when every id is in ``[low, high)``, else a message naming ``name`` and the
    first offending position and value."""
    if ids.numel() == 0:
        return None
    smallest, largest = torch.aminmax(ids)  # one pass; the offender is looked for only when there is one
    if int(smallest) < low or int(largest) >= high:
        position = int(((ids < low) | (ids >= high)).nonzero()[0, 0])
        return (f"{name}: expected ids in [{low}, {high - 1}], "
                f"got {int(ids[position])} at position {position}")
    return None


def ids_as_tensor(ids: Ids, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor of ``ids``. Arrays and tensors must already be int64 (a request
    with the wrong dtype is rejected, not cast); Python sequences of ints are converted.
    Raises ``ValueError`` naming ``name``."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype != torch.int64:
            raise ValueError(f"{name}: expected dtype int64, got {ids.dtype}")
        tensor = ids.detach().cpu()
    elif isinstance(ids, np.ndarray):
        if ids.dtype != np.int64:
            raise ValueError(f"{name}: expected dtype int64, got {ids.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(ids))
    else:
        values = list(ids)
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{name}: expected integer ids")
        tensor = torch.tensor(values, dtype=torch.int64)
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {tuple(tensor.shape)}")
    return tensor


# ---------------------------------------------------------------------------------------
# helpers


def check_history(items: torch.Tensor, actions: torch.Tensor, config: HSTUConfig) -> str | None:
    """``None`` when the history ``(items, actions)`` keeps the token contract, else a message
    naming the field."""
    if items.numel() != actions.numel():
        return (f"action_ids: expected the same length as item_ids ({items.numel()}), "
                f"got {actions.numel()}")
    if items.numel() > config.max_history_events:
        return (f"item_ids: history longer than the model's maximum: expected at most "
                f"{config.max_history_events} events, got {items.numel()}")
    error = check_ids("item_ids", items, 1, config.item_vocab)
    if error is not None:
        return error
    return check_ids("action_ids", actions, 0, config.action_vocab)

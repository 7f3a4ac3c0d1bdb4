"""Test doubles for kvlifecycle unit tests. ``FakeStore`` is a FAKE of the host store API
(``kvlifecycle.store.HostStoreClient``): in-memory, synchronous, with switches to inject
failures. Never use it outside tests; the real store lives in ``kvlifecycle.store``."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from kvlifecycle.hashing import page_keys, tokens_as_int64


class FakeStore:
    """Pages keyed by chain key, copied at submit time. ``get_status`` / ``put_status`` force a
    task outcome (e.g. "TIMEOUT", "FAILED"); ``raise_on`` names methods that raise."""

    def __init__(self, pool: torch.Tensor, page_size: int) -> None:
        self.pool = pool  # [L, P, 2, S, H, D]
        self.page_size = page_size
        self.pages: dict[bytes, torch.Tensor] = {}
        self.tasks: dict[int, str] = {}
        self.cancelled: list[int] = []
        self.get_status: str | None = None
        self.put_status: str | None = None
        self.raise_on: set[str] = set()
        self._ids = itertools.count(100)

    def put_async(self, token_ids, slot_mapping, namespace, token_mask=None):
        self._maybe_raise("put_async")
        task = next(self._ids)
        for key, page in self._selected(token_ids, slot_mapping, namespace, token_mask):
            if self.put_status is None:
                self.pages[key] = self.pool[:, page].clone()
        self.tasks[task] = self.put_status or "SUCCESS"
        return task

    def get_async(self, token_ids, slot_mapping, namespace, token_mask):
        self._maybe_raise("get_async")
        task = next(self._ids)
        selected = list(self._selected(token_ids, slot_mapping, namespace, token_mask))
        if self.get_status is None and all(key in self.pages for key, _ in selected):
            for key, page in selected:
                self.pool[:, page] = self.pages[key]
            self.tasks[task] = "SUCCESS"
        else:
            self.tasks[task] = self.get_status or "NOTFOUND"
        return task

    def get_prefix_async(self, token_ids, slot_mapping, namespace, first_page):
        """The held prefix, and a ``get_async`` of its pages from ``first_page`` on (tests
        wrap ``get_async`` to see the copy asked for)."""
        self._maybe_raise("get_prefix_async")
        tokens = tokens_as_int64(token_ids)
        S = self.page_size
        held = 0
        for key in page_keys(tokens, namespace, S):
            if key not in self.pages:
                break
            held += 1
        if held <= first_page:
            return None, held
        copy = np.zeros(tokens.size, dtype=bool)
        copy[first_page * S: held * S] = True
        slots = tokens_as_int64(slot_mapping)[: (held - first_page) * S]
        return self.get_async(tokens, slots, namespace, copy), held

    def may_hold(self, keys):  # publishes no filter: every key may be held
        return len(keys)

    def wait(self, task_ids, timeout_s=1.0):
        self._maybe_raise("wait")
        return self.try_wait(task_ids)

    def try_wait(self, task_ids, wait_s=0.0):  # answers at once, as FlexKV's store does
        out = {}
        for t in task_ids:
            status = self.tasks.get(t, "FAILED")
            out[t] = status
            if status not in ("UNREADY", "TIMEOUT"):
                self.tasks.pop(t, None)
        return out

    def cancel(self, task_ids):
        self.cancelled.extend(task_ids)

    def stats(self):
        return {"errors": 0}

    def finish(self, task: int, status: str = "CANCELLED") -> None:
        """Let a task that was stuck end (test control)."""
        self.tasks[task] = status

    def _maybe_raise(self, name: str) -> None:
        if name in self.raise_on:
            raise ConnectionError(f"fake store: {name} is down")

    def _selected(self, token_ids, slot_mapping, namespace, token_mask):
        tokens = tokens_as_int64(token_ids)
        S = self.page_size
        keys = page_keys(tokens, namespace, S)
        mask = np.ones(len(keys) * S, dtype=bool) if token_mask is None else np.asarray(token_mask, dtype=bool)
        slots = tokens_as_int64(slot_mapping)
        seq_pages = [i for i in range(len(keys)) if mask[i * S:(i + 1) * S].all()]
        assert slots.size == len(seq_pages) * S, f"fake store: expected {len(seq_pages) * S} slots, got {slots.size}"
        for n, i in enumerate(seq_pages):
            yield keys[i], int(slots[n * S]) // S
